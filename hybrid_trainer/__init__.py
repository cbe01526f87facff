"""hybrid_trainer: predictive training on top of hybrid_kernels.

The trainer (HybridTrainer, HybridConfig) is built in issue #4; this package currently exposes
only its version.
"""
__version__ = "0.1.0"

"""hybrid_trainer: predictive training on top of hybrid_kernels.

    from hybrid_trainer import HybridTrainer, HybridConfig
    trainer = HybridTrainer(model, optimizer, loss_fn, config=HybridConfig())
    for batch in loader:
        result = trainer.step(batch)
    print(trainer.summary())
"""
from .combined_optimizer import CombinedOptimizer
from .config import HybridConfig
from .lowbit_adamw import LowBitAdamW
from .memory_plan import MemoryPlan
from .phases import Phase
from .trainer import HybridTrainer, StepResult

__version__ = "0.1.0"
__all__ = ["CombinedOptimizer", "HybridConfig", "HybridTrainer", "LowBitAdamW", "MemoryPlan", "Phase", "StepResult",
           "__version__"]

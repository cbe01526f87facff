"""hybrid_trainer: predictive training on top of hybrid_kernels.

    from hybrid_trainer import HybridTrainer, HybridConfig
    trainer = HybridTrainer(model, optimizer, loss_fn, config=HybridConfig())
    for batch in loader:
        result = trainer.step(batch)
    print(trainer.summary())

Events (phase changes, rollbacks, refused updates, checkpoints) are logged through the
``hybrid_trainer`` logger, which prints nothing until the application configures logging;
``HybridTrainer(..., callbacks=[...])`` acts on them (:mod:`hybrid_trainer.events`).
"""
import logging

from .combined_optimizer import CombinedOptimizer
from .config import HybridConfig
from .errors import TrainingStalledError
from .events import Callback, RefusedUpdate, Rollback, TrainedSetChange
from .lowbit_adamw import LowBitAdamW
from .memory_plan import MemoryPlan
from .phases import Phase
from .trainer import HybridTrainer, StepResult

# A library adds no handler of its own beyond this one: the application decides where records go.
logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.1.0"
__all__ = ["Callback", "CombinedOptimizer", "HybridConfig", "HybridTrainer", "LowBitAdamW", "MemoryPlan", "Phase",
           "RefusedUpdate", "Rollback", "StepResult", "TrainedSetChange", "TrainingStalledError", "__version__"]

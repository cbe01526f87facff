"""TensorBoard scalars of every step, beside the JSONL metrics (``HybridConfig.tensorboard_dir``).

Written through ``torch.utils.tensorboard.SummaryWriter``, which needs the ``tensorboard``
package (the ``tensorboard`` extra: ``pip install 'hybrid-trainer[tensorboard]'``). The writer
is a :class:`~hybrid_trainer.events.Callback`; the trainer adds it ahead of the user's
callbacks when ``tensorboard_dir`` is set (rank 0 only under DDP, as the JSONL metrics), and
``trainer.close()`` flushes and closes it.

Scalars, at global step ``result.step``:

==========================  ===========================================================
tag                         value
==========================  ===========================================================
``loss/train``              training loss of a real step (absent when not finite)
``loss/verification``       forward-only loss of a verified predicted step
``loss/expected``           the loss the forecast expected at that verification
``lr/group<i>``             learning rate of ``optimizer.param_groups[i]`` (real steps)
``grad_norm``               global gradient norm before clipping (real steps)
``phase``                   phase the step ran in: 0 WARMUP, 1 FULL, 2 PREDICT, 3 CORRECT
``steps/predicted``         predicted steps so far
``steps/predicted_kept``    predicted steps kept after verification so far
``steps/verifications``     verifications so far
``steps/verifications_accepted``  accepted verifications so far
``steps/optimizer``         real optimizer steps so far
``steps/refused``           refused updates so far
``time/step_s``             wall time of the step (seconds)
==========================  ===========================================================
"""
from __future__ import annotations

import math
import os
from typing import Any

from .events import Callback
from .phases import Phase

_PHASE_CODES = {p.value: p.code for p in Phase}


def summary_writer(log_dir: str | os.PathLike) -> Any:
    """A ``SummaryWriter`` for ``log_dir``; ImportError naming the extra when tensorboard is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ImportError("HybridConfig.tensorboard_dir: TensorBoard logging needs the tensorboard package, "
                          "which is not installed: pip install 'hybrid-trainer[tensorboard]' (or tensorboard)"
                          ) from error
    return SummaryWriter(log_dir=os.fspath(log_dir))


class TensorBoardWriter(Callback):
    """Writes each step's scalars (see the module docstring) to an event file under ``log_dir``."""

    def __init__(self, log_dir: str | os.PathLike):
        self.log_dir = os.fspath(log_dir)
        self.writer = summary_writer(self.log_dir)

    def on_step_end(self, trainer, result) -> None:
        add, step = self.writer.add_scalar, result.step
        if result.loss is not None and math.isfinite(result.loss):
            add("loss/verification" if result.verified else "loss/train", result.loss, step)
        if result.predicted_loss is not None and math.isfinite(result.predicted_loss):
            add("loss/expected", result.predicted_loss, step)
        if result.lrs is not None:
            for index, lr in enumerate(result.lrs):
                add(f"lr/group{index}", lr, step)
        if result.grad_norm is not None and math.isfinite(result.grad_norm):
            add("grad_norm", result.grad_norm, step)
        add("phase", _PHASE_CODES[result.phase], step)
        stats = trainer.stats
        add("steps/predicted", stats.predicted_steps, step)
        add("steps/predicted_kept", stats.predicted_steps_kept, step)
        add("steps/verifications", stats.verifications, step)
        add("steps/verifications_accepted", stats.verifications_accepted, step)
        add("steps/optimizer", stats.optimizer_steps, step)
        add("steps/refused", stats.skipped_steps, step)
        add("time/step_s", result.wall_time_s, step)

    def on_save(self, trainer, path) -> None:
        self.writer.flush()  # what a checkpoint resumes from is on disk in the event file too

    def close(self) -> None:
        """Flush and close the event file (idempotent)."""
        self.writer.close()

"""The trainer's checkpoint writes: :meth:`HybridTrainer.save`'s (collective under DDP, refusing
non-finite state) and the VRAM guard's emergency checkpoint (per rank, never raising).

What goes into the file is the trainer's registry (:mod:`hybrid_trainer.state_registry`); how it is
written (atomic, with a content digest) is :mod:`hybrid_trainer.checkpoint`'s.
"""
from __future__ import annotations

from . import checkpoint
from .user_warning import warn_user


def write_checkpoint(trainer, path) -> None:
    """Write ``trainer``'s full state to ``path``: rank 0 writes, with every rank's random streams
    under DDP, and all ranks return once the file exists. Raises ``ValueError`` naming the weights,
    buffers or optimizer state holding NaN or Inf instead of writing them."""
    trainer._state_home()
    bad = trainer.guard.non_finite_state()  # the same on every rank (DDP keeps them equal): all raise
    if bad:
        raise ValueError(f"save: refusing to write a checkpoint holding NaN or Inf in {', '.join(bad[:8])}"
                         f"{' and more' if len(bad) > 8 else ''} (load would refuse it); the guard restores "
                         f"the last good state at its next snapshot or refusal")
    state = trainer.state_dict()
    if trainer.ranks.active:
        state["rng_by_rank"] = trainer.ranks.gather(state["rng"])
    if trainer.ranks.is_writer:
        checkpoint.atomic_save(state, path)
    trainer.ranks.barrier()


def emergency_checkpoint(trainer, sample) -> None:
    """The VRAM guard's critical callback (bound to ``trainer``), run after the step's update and
    bookkeeping; ``sample`` is the :class:`~hybrid_trainer.memory.MemorySample` that crossed.

    A failing write (disk full, a bad path) is warned about, counted
    (``emergency_checkpoint_failures``) and recorded in the step's result, not raised: raised
    here it escaped ``step()`` after the update and ``step_count`` were applied, so a caller
    that retried trained the batch twice and the step's metrics line was lost; and a memory
    emergency is no reason to stop a run that still trains."""
    path = trainer.config.emergency_checkpoint_path
    if path is None:
        return
    try:
        if trainer.ranks.active:
            # Memory pressure is one rank's own: nothing collective may run here, so each rank
            # that hits it writes its own file (the weights are the same on every rank).
            path = f"{path}.rank{trainer.ranks.rank}"
            trainer._state_home()
            checkpoint.atomic_save(trainer.state_dict(), path)
        else:
            write_checkpoint(trainer, path)
    except Exception as error:  # the write's own failure; interrupts (KeyboardInterrupt) still propagate
        trainer.stats.emergency_checkpoint_failures += 1
        trainer._emergency_error = f"{type(error).__name__}: {error}"
        warn_user(f"emergency checkpoint to {path!r} failed ({trainer._emergency_error}); the step completed "
                  f"and training goes on without it")
        return
    trainer.events.saved(path, trainer.step_count, wrote=True, emergency=True)  # its hooks run at the step's end

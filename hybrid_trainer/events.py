"""What the trainer tells its user: log records and callback hooks for the events of a run.

Every event is logged through the ``hybrid_trainer.events`` logger, a child of the package's
``hybrid_trainer`` logger (which has only a ``NullHandler``: nothing is printed unless the
application configures logging, e.g. ``logging.basicConfig(level=logging.INFO)``):

=========================  =======  ===========================================================
event                      level    callback hook
=========================  =======  ===========================================================
phase change               INFO     ``on_phase_change(trainer, old, new)`` (:class:`Phase`)
prediction switched off    INFO     ``on_prediction_disabled(trainer, reason)``
update refused             WARNING  ``on_update_refused(trainer, event)`` (:class:`RefusedUpdate`)
rollback                   WARNING  ``on_rollback(trainer, event)`` (:class:`Rollback`)
trained set changed        INFO     ``on_trained_set_change(trainer, event)`` (:class:`TrainedSetChange`)
checkpoint written         INFO     ``on_save(trainer, path)``
checkpoint loaded          INFO     ``on_load(trainer, path)``
every step                 (none)   ``on_step_end(trainer, result)`` (:class:`StepResult`)
=========================  =======  ===========================================================

A callback is any object with some of those methods, e.g. a subclass of :class:`Callback`
(whose hooks do nothing). Hooks run at the end of ``trainer.step``, after the step's
bookkeeping (counters, phase decision, metrics), in the order of the table's rows with
``on_step_end`` last, callback by callback in the order given. So an exception a hook raises
cannot leave the trainer half-updated: the step is done and counted, the exception propagates
to the caller of ``trainer.step`` with a note naming the callback, the hook and the step, and
the hooks after it for that step are not called. ``on_save``/``on_load`` run at the end of
``trainer.save``/``trainer.load``.

Cost: with no callback, a step pays a handful of attribute compares to notice that nothing
happened; log records are formatted only when their level is enabled.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .phases import Phase
from .run_report import PendingStepResult

logger = logging.getLogger(__name__)

#: Hooks a callback may define, in the order they are called within one step.
HOOKS = ("on_update_refused", "on_rollback", "on_trained_set_change", "on_prediction_disabled",
         "on_phase_change", "on_step_end", "on_save", "on_load")


@dataclass(frozen=True)
class RefusedUpdate:
    """A real step whose update was not applied (non-finite loss or gradient, or divergence)."""

    step: int
    phase: str
    loss: float | None  # None when not finite
    grad_norm: float | None  # None when the loss was not finite (the norm was not looked at)
    reason: str  # the divergence monitor's reasons, e.g. "nan: loss is nan"
    rolled_back: bool  # the weights went back to the last good state as well


@dataclass(frozen=True)
class Rollback:
    """Weights (and, for ``"divergence"``, optimizer state) went back to an earlier point.

    ``kind``: ``"divergence"`` (a loss spike or exploding gradient after an applied update: the
    last good state, see ``HybridConfig.good_state_every``), ``"rejected_prediction"`` (a
    verification failed: the last verified point of the PREDICT phase) or
    ``"trained_set_change"`` (freezing or unfreezing during PREDICT: the predicted steps not
    verified yet are undone).
    """

    step: int
    kind: str
    reason: str
    predicted_steps_undone: int = 0  # predicted updates taken back (0 for "divergence")
    to_step: int | None = None  # "divergence": the good state is the one after this step


@dataclass(frozen=True)
class TrainedSetChange:
    """The tensors the optimizer trains changed (``requires_grad_()``, ``add_param_group``)."""

    step: int
    tensors_before: int
    tensors_after: int
    values_before: int
    values_after: int


class Callback:
    """Base class of trainer callbacks: every hook does nothing; override the ones you need.

    Subclassing is optional (any object with some of the hooks works); a hook this class does
    not define (a misspelt ``on_…`` method) is refused when the trainer is constructed."""

    def on_step_end(self, trainer, result) -> None:
        """After every ``trainer.step``; ``result`` is the :class:`StepResult` it returns."""

    def on_phase_change(self, trainer, old: Phase, new: Phase) -> None:
        """The step just finished was the last of phase ``old``; the next one runs in ``new``."""

    def on_prediction_disabled(self, trainer, reason: str) -> None:
        """Prediction is off for the rest of the run, for ``reason`` (also in ``statistics()``)."""

    def on_rollback(self, trainer, event: Rollback) -> None:
        """The weights went back to an earlier point (:class:`Rollback`)."""

    def on_update_refused(self, trainer, event: RefusedUpdate) -> None:
        """A real step's update was not applied (:class:`RefusedUpdate`)."""

    def on_trained_set_change(self, trainer, event: TrainedSetChange) -> None:
        """Freezing or unfreezing was followed at the start of this step."""

    def on_save(self, trainer, path) -> None:
        """``trainer.save(path)`` finished (on every DDP rank; rank 0 wrote the file). Also after
        the VRAM guard's emergency checkpoint."""

    def on_load(self, trainer, path) -> None:
        """``trainer.load(path)`` finished."""


def _hooks_of(callbacks: Any) -> dict[str, tuple]:
    """``hook name -> ((label, method), ...)`` for the ``callbacks`` that define it (a
    :class:`Callback`'s inherited no-ops left out, so a step calls only hooks that do
    something); ``label`` names the callback in errors."""
    if callbacks is None:
        callbacks = ()
    if not isinstance(callbacks, (list, tuple)):
        raise TypeError(f"callbacks: must be a list of callback objects, got {type(callbacks).__name__}")
    found: dict[str, list] = {name: [] for name in HOOKS}
    for index, callback in enumerate(callbacks):
        names = [n for n in dir(callback) if n.startswith("on_")]
        unknown = sorted(set(names) - set(HOOKS))
        if unknown:
            raise TypeError(f"callbacks[{index}] ({type(callback).__name__}) defines {unknown}, which no event "
                            f"calls; the hooks are {list(HOOKS)}")
        if not names:
            raise TypeError(f"callbacks[{index}] ({type(callback).__name__}) has none of the hooks {list(HOOKS)}")
        for name in names:
            method = getattr(callback, name)
            if not callable(method):
                raise TypeError(f"callbacks[{index}].{name} is not callable")
            if getattr(type(callback), name, None) is not getattr(Callback, name):  # not an inherited no-op
                found[name].append((f"callbacks[{index}] ({type(callback).__name__})", method))
    return {name: tuple(methods) for name, methods in found.items()}


class Events:
    """Logs the trainer's events and calls its callbacks' hooks.

    The trainer reports an event as it happens (:meth:`phase_changed` and the others); the
    hooks it calls are queued and run by :meth:`dispatch` once the step is complete.
    """

    def __init__(self, callbacks: Any = None):
        self.hooks = _hooks_of(callbacks)
        self.step_end = self.hooks["on_step_end"]
        self.pending: list[tuple[str, tuple]] = []  # (hook, arguments after the trainer) until dispatch

    def _queue(self, hook: str, *args: Any) -> None:
        if self.hooks[hook]:
            self.pending.append((hook, args))

    def dispatch(self, trainer: Any, result: Any = None, after: str | None = None) -> None:
        """Run the queued hooks, then ``on_step_end(trainer, result)`` when ``result`` (a
        :class:`StepResult`) is given. A hook's exception propagates with a note naming the
        hook and what had completed (``after``, or the step); the hooks after it do not run.
        A hook's own call to ``trainer.save`` runs its ``on_save`` hooks after the current ones."""
        calls, self.pending = self.pending, []
        if result is not None and self.step_end:
            calls.append(("on_step_end", (result,)))
        for hook, args in calls:
            for label, method in self.hooks[hook]:
                try:
                    method(trainer, *args)
                except Exception as error:
                    if hasattr(error, "add_note"):  # Python 3.11+
                        done = after or f"step {result.step} had completed: it is done and counted"
                        error.add_note(f"raised by {label}.{hook}; {done}")
                    raise

    # -- what a step reports ----------------------------------------------------------------
    def after_step(self, trainer: Any, result: Any, phase: Phase, disabled_before: str | None) -> None:
        """The events of a step that did something besides training: a refused update, a
        rollback, prediction switched off, a phase change. Called only when one of them
        happened (the trainer compares a few attributes first)."""
        controller = trainer.controller
        if isinstance(result, PendingStepResult):
            pass  # a deferred step's refusal and rollback are reported at its read (trainer._settle)
        elif result.skipped:
            self.step_refused(trainer, result)
        elif result.rolled_back and phase is Phase.PREDICT:  # a verification rejected the PREDICT phase
            self.rolled_back(Rollback(step=result.step, kind="rejected_prediction", reason=result.divergence,
                                      predicted_steps_undone=trainer.predict_phase.last_rollback_steps))
        elif result.rolled_back:  # a real step's good state was found non-finite where it was to be taken
            self.rolled_back(Rollback(step=result.step, kind="divergence",
                                      reason="non-finite values where the good state was to be taken",
                                      to_step=trainer.guard.good_state.step))
        if controller.disabled_reason is not disabled_before and controller.disabled_reason is not None:
            self.prediction_disabled(result.step, controller.disabled_reason)
        if controller.phase is not phase:
            self.phase_changed(result.step, phase, controller.phase, controller.length)

    def step_refused(self, trainer: Any, result: Any) -> None:
        """The events of a real step whose update was refused (and, for a spike, rolled back)."""
        self.update_refused(RefusedUpdate(step=result.step, phase=result.phase, loss=result.loss,
                                          grad_norm=result.grad_norm, reason=result.divergence,
                                          rolled_back=result.rolled_back))
        if result.rolled_back:
            self.rolled_back(Rollback(step=result.step, kind="divergence", reason=result.divergence,
                                      to_step=trainer.guard.good_state.step))

    def update_refused(self, event: RefusedUpdate) -> None:
        logger.warning("step %d: update refused (%s; loss %s, grad norm %s)%s", event.step, event.reason,
                       event.loss, event.grad_norm, "" if event.rolled_back else "; weights unchanged")
        self._queue("on_update_refused", event)

    def rolled_back(self, event: Rollback) -> None:
        if event.kind == "divergence":
            logger.warning("step %d: weights and optimizer state rolled back to the good state after step %s (%s)",
                           event.step, event.to_step, event.reason)
        else:
            logger.warning("step %d: %d predicted steps undone (%s: %s)", event.step,
                           event.predicted_steps_undone, event.kind.replace("_", " "), event.reason)
        self._queue("on_rollback", event)

    def prediction_disabled(self, step: int, reason: str) -> None:
        logger.info("step %d: prediction switched off: %s", step, reason)
        self._queue("on_prediction_disabled", reason)

    def phase_changed(self, step: int, old: Phase, new: Phase, length: int) -> None:
        logger.info("step %d: phase %s -> %s (%d steps)", step, old.value, new.value, length)
        self._queue("on_phase_change", old, new)

    def trained_set_changed(self, step: int, before: list, after: list, undone: int, old: Phase,
                            controller: Any) -> None:
        """Freezing or unfreezing followed before step ``step``: the trained tensors went from
        ``before`` to ``after``, ``undone`` unverified predicted steps were taken back and the
        phase went from ``old`` to ``controller.phase``."""
        event = TrainedSetChange(step, len(before), len(after), sum(p.numel() for p in before),
                                 sum(p.numel() for p in after))
        new, length = controller.phase, controller.length
        logger.info("step %d: trained set changed (%d -> %d tensors, %d -> %d values); its update history and "
                    "snapshots restart", event.step, event.tensors_before, event.tensors_after,
                    event.values_before, event.values_after)
        self._queue("on_trained_set_change", event)
        if undone:
            self.rolled_back(Rollback(step=event.step, kind="trained_set_change",
                                      reason="the trained set changed during PREDICT", predicted_steps_undone=undone))
        if new is not old:
            self.phase_changed(event.step, old, new, length)

    def interrupted(self, step: int, undone: int, error: BaseException) -> None:
        """``trainer.step`` raised during PREDICT: the unverified predicted steps were undone
        (logged only: the exception propagates, no hook runs)."""
        if undone:
            logger.warning("step %d raised %s during PREDICT: %d unverified predicted steps undone", step,
                           type(error).__name__, undone)

    # -- checkpoints -------------------------------------------------------------------------
    def saved(self, path: Any, step: int, wrote: bool, emergency: bool = False) -> None:
        """A checkpoint of the state after ``step`` steps; ``wrote``: this process wrote the file."""
        if wrote:
            if emergency:
                logger.warning("emergency checkpoint written to %s after %d steps (memory critical)", path, step)
            else:
                logger.info("checkpoint written to %s after %d steps", path, step)
        self._queue("on_save", path)

    def loaded(self, path: Any, step: int) -> None:
        logger.info("checkpoint loaded from %s: resuming after %d steps", path, step)
        self._queue("on_load", path)

"""The guard's checks read once every ``read_every`` steps instead of after every step.

Why: the per-step guard reads the loss and the gradient norm back from the device on every
step. On a GPU each read waits for all queued work, which the plain loop never does (nanoGPT
reads its loss once per log interval); on a CPU the reads cost nothing, but judging each step
in Python (the divergence monitor, ~20-40 µs) is a visible share of a millisecond step. With
``HybridConfig(read_every=N)``, N > 1, and prediction off, a real step instead:

* keeps its loss and gradient norm on the device, queued;
* never lets a non-finite loss or gradient reach the weights: an optimizer that can skip its
  update on the device (torch's ``fused=True`` Adam, AdamW and SGD, through the ``found_inf``
  a GradScaler uses) is told to, with no read; any other optimizer costs this step one read of
  its two values (free on a CPU; on a GPU the one read-back left) and the trainer skips it. The
  module buffers a refused forward changed are put back the same way (on the device by a
  ``where``, or from the host).

Every N steps (and before anything saves, loads or reports the run's state) the guard reads the
queued values at once and the monitor judges them in order:

* a non-finite step was skipped where it ran; it is counted (and escalates as a per-step
  refusal does);
* a spike (a finite loss or gradient norm the monitor calls critical) sends the weights,
  optimizer state and buffers back to the last good state, as a per-step check would have done
  at that step; the steps queued after it trained on from the spiked weights and are discarded
  with it (``skipped`` and ``rolled_back``);
* after a clean block the good state is snapshot when due (``good_state_every``), so a snapshot
  never holds a step that was not judged;
* from a rollback until the next good state is taken, each step is read as it comes
  (:meth:`StepGuard.defers`): refusals come in runs, and one found at a block's read costs the
  block's later steps too.

Judging a block: each value is compared with limits computed from the monitor's window as it
stood at the start of the block (:meth:`DivergenceMonitor.quiet_limits`; a block whose values
are all inside the window's cheaper bounds of a surely quiet step needs neither those limits
nor a test a value, :meth:`DivergenceMonitor.block_is_quiet`), and only a value beyond them gets
the monitor's full per-value check. Inside a block the limits do not follow the
steps already accepted in it, so a slowly falling loss is judged against a slightly higher
level than a per-step check would use; the oscillation warning is looked at once per block.

What the user sees: a step's :class:`~hybrid_trainer.run_report.PendingStepResult` reads its
loss and gradient norm when first accessed (a read the user asks for, as ``loss.item()`` in a
plain loop); its ``skipped``, ``rolled_back`` and ``divergence`` settle at the next read
(``divergence`` is ``"PENDING"`` until then), when the refused-update and rollback events are
emitted and its metrics record is written. A scheduler steps on every step, refused ones
included (as under a GradScaler).
"""
from __future__ import annotations

import math
from itertools import chain
from typing import Any

import torch

from .run_report import PendingStepResult, global_norm


class DeferredChecks:
    """The queue of steps whose checks wait for the next read, and the block judgment.

    Args:
        every: steps per read (``HybridConfig.read_every`` > 1).
    """

    def __init__(self, every: int):
        self.every = every
        # (result, the step's [loss, gradient norms...] as a list of 0-d device tensors or its read
        # (loss, norm) tuple, whether it had gradients)
        self.pending: list[tuple[PendingStepResult, Any, bool]] = []
        # The device-side skip flags: ``every`` zeros, one taken per step and zeroed again once
        # they are used up (_found_flag), and a 0-d view of each, made once.
        self._flags: torch.Tensor | None = None
        self._flag_views: tuple[torch.Tensor, ...] = ()
        self._flags_taken = 0
        self._one: torch.Tensor | None = None

    @property
    def due(self) -> bool:
        return len(self.pending) >= self.every

    def discard(self) -> None:
        """Forget the queued steps (a checkpoint replaces the state they led to)."""
        self.pending.clear()

    def launch(self, guard: Any, loss: torch.Tensor, norms: list[torch.Tensor] | None,
               result: PendingStepResult) -> None:
        """Apply this step's update unless its loss or a gradient norm is non-finite, without
        judging it yet.

        ``loss``: the step's 0-d loss; ``norms``: 0-d norms whose root sum of squares is the
        global gradient norm (``StepGuard.grad_norms``: one per gradient, in float32 where the
        gradients are 16-bit; None without gradients), on the loss's device. They are queued
        as they are, ``[loss, n_1, ..., n_k]`` (the loss in float32), and stacked once per read
        (:meth:`settle`), where a stack per step was one more launch a step; combined on the
        host at the read (:func:`global_norm`, float64). The device-side flag is GradScaler's
        own check, one multi-tensor op over those 0-d tensors, into a flag that is one of
        ``every`` zeros (:meth:`_found_flag`): zeroing one flag a step was another launch a
        step. With those two, a step with a fused optimizer issues as many ops as the plain
        fused loop (``python -m bench.host_ops``). A non-finite gradient makes its own norm
        non-finite, so the device-side flag sees it; finite norms whose squares overflow
        float32 do not read as non-finite there, and the monitor judges their global norm."""
        # ``float()`` of a float32 loss returns it, but only after a call through the dispatcher.
        values = [loss if loss.dtype is torch.float32 else loss.float(), *([] if norms is None else norms)]
        if getattr(guard.optimizer, "_step_supports_amp_scaling", False):
            update_unless_non_finite(guard, values, self._found_flag(loss.device), self._one)
            result.values_on_device(values, has_norm=norms is not None)
            self.pending.append((result, values, norms is not None))
            return
        loss_value, *norm_values = torch.stack(values).tolist()  # the read an optimizer without a device-side skip costs
        self.launch_read(guard, loss_value, global_norm(norm_values), norms is not None, result)

    def _found_flag(self, device: torch.device) -> torch.Tensor:
        """A 0-d float32 zero on ``device`` for one step's device-side skip flag: the next of
        ``every`` zeros, all zeroed again (one op) once each has been taken; their views are made
        with them, so that taking one is no op. A flag is read only by the step that takes it
        (the fused update and the buffers' ``where``, queued on the device before the zeroing
        that reuses it)."""
        flags = self._flags
        if flags is None or flags.device != device:
            flags = self._flags = torch.zeros(self.every, dtype=torch.float32, device=device)
            self._flag_views = flags.unbind()
            self._one = torch.ones((), dtype=torch.float32, device=device)
            self._flags_taken = 0
        elif self._flags_taken == self.every:
            flags.zero_()
            self._flags_taken = 0
        self._flags_taken += 1
        return self._flag_views[self._flags_taken - 1]

    def launch_read(self, guard: Any, loss_value: float, norm_value: float, has_norm: bool,
                    result: PendingStepResult) -> None:
        """:meth:`launch` with the step's loss and norm already read (``has_norm``: whether the
        step had gradients): the update is applied unless one of them is non-finite."""
        if math.isfinite(loss_value) and math.isfinite(norm_value):
            guard.step_optimizer()
        else:
            guard.buffers_before.restore()
        result.values_read(loss_value, norm_value if has_norm else None)
        self.pending.append((result, (loss_value, norm_value), has_norm))

    def settle(self, guard: Any) -> list[PendingStepResult]:
        """Read the queued values and judge them in order (module docstring); returns every
        queued result, settled, oldest first."""
        if not self.pending:
            return []
        pending, self.pending = self.pending, []
        # Queued on the device: a list of 0-d tensors (launch) or a captured step's row of them
        # (captured_step); read already: a (loss, norm) tuple. Each step's values are a slice of
        # the one read: per value, a Python loop would cost a step of a model with many tensors
        # more than all its other bookkeeping.
        on_device = [v for _, v, _ in pending if type(v) is not tuple]
        read = _stack_block(on_device).tolist() if on_device else []  # the block's one read
        values, start = [], 0
        for result, value, has_norm in pending:
            if type(value) is not tuple:  # [loss, n_1, ..., n_k]: k from the queued list or row
                end = start + len(value)
                loss_value, norm_value = read[start], global_norm(read[start + 1:end])
                start = end
            else:
                loss_value, norm_value = value
            norm_value = norm_value if has_norm and math.isfinite(loss_value) else None
            result.values_read(loss_value, norm_value)
            values.append((loss_value, norm_value))

        monitor, stats = guard.monitor, guard.stats
        quiet_block = monitor.block_is_quiet(values)  # nearly every block: no limits, no test a step
        limits = None if quiet_block else monitor.quiet_limits()
        for index, ((result, _, _), (loss_value, norm_value)) in enumerate(zip(pending, values)):
            if quiet_block or (limits is not None and limits.quiet(loss_value, norm_value)):
                monitor.observe_quiet(loss_value, norm_value)
                result.divergence = "OK"
                continue
            report = guard.check(loss_value, norm_value)
            if not report.critical:
                monitor.observe(loss_value, norm_value)
                result.divergence = report.severity.name
                continue
            result.skipped = True
            result.divergence = "; ".join(report.reasons) or report.severity.name
            stats.optimizer_steps -= 1
            # The per-step refusal's judgment: a spike goes back to the good state; a non-finite
            # step (skipped where it ran) only escalates when the state itself is non-finite or
            # refusals pile up.
            if not guard.refuse_update(loss_value, norm_value, report, result.step, judged_later=True):
                continue
            result.rolled_back = True
            for later, _, _ in pending[index + 1:]:  # trained on from the weights just abandoned
                later.skipped = later.rolled_back = True
                later.divergence = f"discarded: trained on from step {result.step}, which was refused"
                stats.skipped_steps += 1
                stats.optimizer_steps -= 1
            break
        else:
            monitor.check_oscillation_once()
            guard.snapshot_if_due(pending[-1][0].step)
        for result, _, _ in pending:
            result.settled = True
        return [result for result, _, _ in pending]


def update_unless_non_finite(guard: Any, values: list[torch.Tensor], found: torch.Tensor, one: torch.Tensor) -> None:
    """The step's update, skipped on the device if one of ``values`` (0-d float32 tensors) is not
    finite, with nothing read: GradScaler's own check sets ``found`` (a 0-d float32 zero) to 1
    in one op (the multiplication by ``one`` leaves the values as they are), the fused update
    skips itself on it, and the module buffers take back their values from before the forward
    where it is set. :meth:`DeferredChecks.launch` and the captured step
    (:mod:`~hybrid_trainer.captured_step`) issue these ops."""
    torch._amp_foreach_non_finite_check_and_unscale_(values, found, one)
    optimizer = guard.optimizer
    optimizer.found_inf = found
    try:
        guard.step_optimizer()
    finally:
        del optimizer.found_inf
    guard.buffers_before.restore_where(found)


def _stack_block(on_device: list[Any]) -> torch.Tensor:
    """The queued steps' values as one tensor, for one read: one stack of the 0-d tensors where
    every step queued a list of them (the eager deferred steps), else one ``cat`` of the rows, a
    step's list stacked into one."""
    if all(type(values) is list for values in on_device):
        return torch.stack(list(chain.from_iterable(on_device)))
    return torch.cat([values if isinstance(values, torch.Tensor) else torch.stack(values) for values in on_device])

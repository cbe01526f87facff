"""HybridTrainer: a drop-in training step that replaces some optimizer steps with verified,
in-place predicted updates.

The trainer runs the loop; its collaborators decide and compute:
:class:`~hybrid_trainer.step_guard.StepGuard` (finite checks, divergence, the last good state),
:class:`~hybrid_trainer.worth_gate.WorthGate` (worth of a predicted step, required worth, cost
clock), :class:`~hybrid_trainer.forecaster.StateForecaster` (state history, dynamics model,
confidence), :class:`~hybrid_trainer.predict_phase.PredictPhase` (predictor, anchor, verified
predicted steps), :class:`~hybrid_trainer.trained_set.TrainedSet` (what trains),
:class:`~hybrid_trainer.phases.PhaseController` (the phase machine) and
:class:`~hybrid_trainer.state_registry.StateRegistry` (the checkpoint).

Contract of ``loss_fn(model, batch) -> scalar tensor``: it runs the forward pass on ``batch``
(any structure: tensors, tuples, dicts) and returns the mean loss as a 0-d tensor attached to
the graph. The trainer calls it under ``torch.autocast`` when configured, never calls
``backward`` on anything else, and calls it under ``torch.no_grad()`` to verify predictions.

Batches consumed during PREDICT: each ``trainer.step(batch)`` in PREDICT applies one predicted
update and does **not** train on ``batch``; on verification steps the batch is used only for the
forward-only check. Those batches are skipped, not replayed: a run over N batches sees fewer
of them in backward passes, which is part of what the benchmark charges the trainer for.

The LR scheduler (optional) is stepped only after real optimizer steps, so a schedule counts
real updates; predicted steps do not advance it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, Callable

import torch

from . import checkpoint, checkpointing, grad_checkpoint, resume_check, trained_set
from .captured_step import CapturedStep, graphs_for
from .config import HybridConfig
from .distributed import RankSync, unwrap
from .divergence import Severity
from .events import Events
from .forecaster import StateForecaster
from .loss_call import checked_loss, micro_batches
from .memory import MemoryProfiler, VRAMGuard, default_reader
from .memory_plan import memory_in_use, refine_plan, setup_memory
from .metrics import MetricsLogger, plot_run
from .phases import Phase, PhaseController
from .predict_phase import PredictPhase
from .run_report import PendingStepResult, RunStatistics, StepResult, format_summary, run_statistics
from .setup_checks import (check_arguments, check_ddp_trains_only_its_module, check_dense, check_predictable,
                           check_scheduler, check_train_mode)
from .state_registry import in_current_layout, rng_of_rank, trainer_registry
from .step_guard import StepGuard
from .trained_set import TrainedSet
from .verifier import LossTrend
from .worth_gate import WorthGate


# Names of the phases and severities by member, for the steady step (:meth:`HybridTrainer._steady_step`):
# a dict lookup (~30 ns) where ``.value`` and ``.name`` run the enum's Python descriptor (~0.3 µs
# each, three per step).
_PHASE_NAMES = {phase: phase.value for phase in Phase}
_SEVERITY_NAMES = {severity: severity.name for severity in Severity}


class HybridTrainer:
    """Train ``model`` with ``optimizer`` on ``loss_fn``, predicting some updates.

    Args:
        model: any ``nn.Module``; all trainable parameters on one device. A
            ``DistributedDataParallel`` model makes every rank decide alike
            (:mod:`hybrid_trainer.distributed`); then ``save`` is collective.
        optimizer: any ``torch.optim.Optimizer`` (several over disjoint parameters, e.g. Muon
            and AdamW, as one :class:`~hybrid_trainer.CombinedOptimizer`) over (a subset of) the model's parameters, and
            any trained tensor outside the model (a loss's learned temperature). Freezing or
            unfreezing some (``requires_grad_``, ``add_param_group``) is followed at the next step.
        loss_fn: ``loss_fn(model, batch) -> 0-d tensor`` (see module docstring).
        config: :class:`HybridConfig` (defaults if None).
        scheduler: optional LR scheduler, stepped after each real optimizer step.
        example_batch: a batch like those ``step`` will get, for the memory plan's activation
            probe (one forward, no update); None: activations are not counted in the plan.
        callbacks: objects whose hooks (``on_step_end``, ``on_phase_change``, ``on_rollback``, ...:
            :mod:`hybrid_trainer.events`) run at the end of each step that has their event.

    The trainer logs its events (phase changes, rollbacks, refused updates, checkpoints)
    through the ``hybrid_trainer`` logger. It holds open files when ``metrics_path`` or
    ``tensorboard_dir`` is set: :meth:`close` them, or use it as a context manager.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], config: HybridConfig | None = None,
                 scheduler: Any | None = None, callbacks: Sequence[Any] | None = None, example_batch: Any = None):
        config = check_arguments(model, optimizer, loss_fn, config)
        check_scheduler(scheduler, optimizer)
        self.model, self.optimizer, self.loss_fn, self.config, self.scheduler = model, optimizer, loss_fn, config, scheduler

        self.trained = TrainedSet(model, optimizer)
        if len(self.params) == len(self.trained.outside_model):  # an optimizer built over another model's parameters
            raise ValueError("optimizer holds none of the model's trainable parameters")
        check_dense(model, optimizer)
        check_predictable(config, model, self.params)
        self.device = self.params[0].device
        self.ranks = RankSync(model, self.device)  # collectives that keep DDP ranks' decisions identical
        check_ddp_trains_only_its_module(self.ranks, self.trained.outside_model)
        # --- memory plan (hybrid_trainer.memory_plan): may store the weights in bf16, rebuild the
        # optimizer as LowBitAdamW over the same param groups and step inside the backward.
        memory = setup_memory(model, optimizer, self.params, loss_fn, config, example_batch)
        self.memory_plan, self.in_backward, self._plan_autocast = memory.plan, memory.in_backward, memory.autocast_dtype
        self.optimizer = self.trained.optimizer = optimizer = memory.optimizer
        if self.in_backward is not None and self.ranks.active:
            raise ValueError("HybridConfig.step_in_backward: under DistributedDataParallel a parameter's hook "
                             "fires before DDP has averaged its gradient across ranks; use step_in_backward=False")
        # --- end memory plan
        # Output paths decide nothing (and rank 0 alone writes the metrics): they may differ.
        self.ranks.check_same("config", {k: v for k, v in config.to_dict().items()
                                         if k not in ("metrics_path", "emergency_checkpoint_path", "tensorboard_dir",
                                                      "snapshot_dir")})
        self.events = Events(callbacks)  # callbacks checked before any file is opened

        # PREDICT as a nowcast jump replaces the predicted-step phases: the phase machine and the
        # state forecaster then run as with predict=False (no recording, no dynamics model).
        steps_config = dataclasses.replace(config, predict=False) if config.predictor == "nowcast" else config
        self.controller = PhaseController(steps_config)
        self.loss_trend = LossTrend()
        self.stats = RunStatistics()
        self.scaler = (torch.amp.GradScaler(self.device.type)
                       if config.autocast_dtype == "float16" else None)
        self.worth = WorthGate(config, self.device, reduce=self.ranks.mean_float)
        self.guard = StepGuard(config, optimizer, self.scaler, self.stats, self.device)
        self.forecaster = StateForecaster(steps_config, self.device, self.controller, self.loss_trend, self.worth,
                                          agree=self.ranks.from_rank0)
        self.predict_phase = PredictPhase(config, self.controller, self.stats, self.loss_trend, self.forecaster,
                                          self._verification_loss)
        self.weight_average = None
        trained_set.retarget_trainer(self, self.params, self.trained.outside_model)
        # Per-step records go to the JSONL file only: kept in memory they would grow with the run.
        # Under DDP the records agree on every rank (losses are averaged), so rank 0 writes them.
        self.metrics = (MetricsLogger(config.metrics_path, keep_records=False)
                        if config.metrics_path is not None and self.ranks.is_writer else None)
        self.tensorboard = None
        if config.tensorboard_dir is not None and self.ranks.is_writer:
            from .tensorboard_writer import TensorBoardWriter  # the tensorboard package is an optional extra
            self.tensorboard = TensorBoardWriter(config.tensorboard_dir)
            # Ahead of the user's hooks: a step one of them raises after is in the event file too.
            self.events = Events([self.tensorboard, *(callbacks or ())])

        reader = default_reader(self.device) if (config.memory_profile or config.vram_critical is not None) else None
        self.profiler = (MemoryProfiler(reader, self.device, spike_threshold=config.memory_spike_threshold,
                                        every=config.memory_every) if config.memory_profile else None)
        self.vram_guard = (VRAMGuard(config.vram_warning, config.vram_critical, reader,
                                     on_critical=functools.partial(checkpointing.emergency_checkpoint, self))
                           if config.vram_critical is not None else None)
        self.grad_checkpointing = grad_checkpoint.from_config(unwrap(model), config)

        self.step_count = 0
        self._last_update_cosine = float("nan")
        self._emergency_error: str | None = None  # the write error of this step's emergency checkpoint
        self.nowcast = None
        if config.predictor == "nowcast":  # the nowcaster's modules load only for runs that use it
            from .nowcast_jump import make_nowcast
            self.nowcast = make_nowcast(config, model, optimizer, scheduler, self.ranks)
        self.registry = trainer_registry(self)
        # Once prediction is off for good, real steps take the lean path (_steady_step) unless the
        # run uses something only the general one does.
        self._steady_allowed = (config.grad_accumulation == 1 and not self.ranks.active and self.scaler is None
                                and self.in_backward is None and self.nowcast is None
                                and self.weight_average is None and not config.offload_while_predicting
                                and self.profiler is None and self.vram_guard is None)
        # The steady step replayed from a CUDA graph (captured_step), when asked for.
        self.captured = CapturedStep(self, graphs_for(self.device)) if config.cuda_graph else None
        # memory plan: the prediction again from what the built trainer holds now
        refine_plan(self.memory_plan, memory_in_use(self.device), self._predictor_bytes())

    def _predictor_bytes(self) -> int:
        """Bytes the update predictor holds now (its buffers may be allocated lazily)."""
        return sum(t.numel() * t.element_size() for t in vars(self.predictor).values() if isinstance(t, torch.Tensor))

    # Collaborators' parts that users, benchmarks and tests read from the trainer.
    params = property(lambda self: self.trained.params, doc="Every tensor trained now (model's first).")
    predictor = property(lambda self: self.predict_phase.predictor)
    anchor = property(lambda self: self.predict_phase.anchor, doc="Last verified point of a PREDICT phase.")
    good_state = property(lambda self: self.guard.settled_good_state(), doc="Last healthy point (divergence rollback).")
    monitor = property(lambda self: self.guard.monitor)
    history = property(lambda self: self.forecaster.history)
    normalizer = property(lambda self: self.forecaster.normalizer)
    dynamics = property(lambda self: self.forecaster.dynamics)
    cost = property(lambda self: self.worth.cost)
    predicted_worth = property(lambda self: self.worth.predicted_worth, doc="See WorthGate.measure.")

    def required_worth(self) -> float:
        """Worth a predicted step needs to pay (:meth:`WorthGate.required_worth`)."""
        return self.worth.required_worth()

    # ================================================================================ step ====
    def step(self, batch: Any) -> StepResult:
        """One training step on ``batch`` (a list of ``grad_accumulation`` micro-batches when
        accumulation is configured). Returns a :class:`StepResult`."""
        controller = self.controller
        # Prediction off for good and nothing configured that only the general path handles.
        if (self._steady_allowed and not controller.prediction_enabled and controller.phase is not Phase.PREDICT
                and (not self.guard.overlap or self.guard.deferred is not None) and not self.trained.changed()):
            return self._steady_step(batch) if self.captured is None else self.captured.step(batch)
        started = time.perf_counter()
        check_train_mode(self.optimizer)
        # A good state the last steady step left due: taken before this step changes anything.
        escalated = self.guard.take_due_snapshot()
        if escalated:
            self.controller.force_full()
        disabled_before = self.controller.disabled_reason
        if self.trained.changed():
            self._settle()  # judged with the tensors they trained
            trained_set.follow_trainable_change(self)
        phase = self.controller.phase
        try:
            if phase is Phase.PREDICT:
                if self.controller.phase_step == 0 and self.offloader is not None:
                    self.offloader.offload()
                result = self.predict_phase.step(batch, self.step_count)
            else:
                self._state_home()
                result = self._real_step(batch, phase)
        except BaseException as error:
            # An error or interrupt mid-PREDICT must not leave unverified predicted deltas in the
            # weights the user goes on to save: go back to the last verified point first.
            if phase is Phase.PREDICT:
                self.events.interrupted(self.step_count, self.predict_phase.abort(), error)
            raise
        result.wall_time_s = time.perf_counter() - started
        result.rolled_back = result.rolled_back or escalated
        if self.guard.deferred is not None and self.guard.deferred.due:
            self._settle()  # the guard's read of the last read_every steps
        return self._end_step(result, phase, disabled_before)

    def _end_step(self, result: StepResult, phase: Phase, disabled_before: str | None) -> StepResult:
        """Count the finished step, advance the phase machine, log it and run its events."""
        stats, ctl, name = self.stats, self.controller, phase.value
        stats.steps_by_phase[name] += 1
        stats.time_by_phase_s[name] += result.wall_time_s
        self.step_count += 1
        if not (phase is Phase.PREDICT and result.rolled_back):
            # Once prediction is off for the run the controller never reads the margin again.
            margin = self.worth.margin() if ctl.prediction_enabled else None
            ctl.advance(self._confidence, worth_margin=margin)
        if phase is Phase.PREDICT and ctl.phase is not Phase.PREDICT:
            self.predict_phase.end_phase()
            if self.offloader is not None:
                self.offloader.prefetch()  # overlaps the copy back with whatever the caller does next
        if not ctl.prediction_enabled and (self.predict_phase.predictor.allocated
                                           or self.forecaster.dynamics is not None):
            self.predict_phase.release()  # off for good: what only prediction used goes
            self.forecaster.release()
        if self.profiler is not None:
            self.profiler.snapshot(result.step, phase.value)
        if self.vram_guard is not None:
            self._emergency_error = None
            self.vram_guard.check(result.step)
            result.emergency_checkpoint_error = self._emergency_error
        if not isinstance(result, PendingStepResult):  # those are logged when they settle
            self._log(result)
        return self._step_events(result, phase, disabled_before)

    def _end_steady_step(self, result: StepResult, phase: Phase, disabled_before: str | None) -> StepResult:
        """:meth:`_end_step` of a steady step (:meth:`_steady_step`), judged or waiting for the
        guard's read (a :class:`PendingStepResult`, logged when it settles): the same effects,
        without what that path rules out (a PREDICT phase, prediction on, the memory profiler,
        the VRAM guard). Each object the end of a step looks at costs a few µs
        on a small model, whose step streams its state through the cache
        (``python -m bench.overhead``)."""
        stats, ctl, name = self.stats, self.controller, _PHASE_NAMES[phase]
        stats.steps_by_phase[name] += 1
        stats.time_by_phase_s[name] += result.wall_time_s
        self.step_count += 1
        ctl.advance(self._confidence, worth_margin=None)  # prediction is off: no margin is read
        predict_phase = self.predict_phase
        if predict_phase.predictor.allocated or self.forecaster.dynamics is not None:
            predict_phase.release()  # off for good: what only prediction used goes
            self.forecaster.release()
        if self.metrics is not None and not isinstance(result, PendingStepResult):  # those are logged when they settle
            self._log(result)
        return self._step_events(result, phase, disabled_before)

    def _step_events(self, result: StepResult, phase: Phase, disabled_before: str | None) -> StepResult:
        """The end of every step: its events and hooks. Events are rare: a few compares tell that
        none happened. Hooks run last, so one that raises finds the step done and counted."""
        ctl, events = self.controller, self.events
        if result.skipped or result.rolled_back or ctl.phase is not phase or ctl.disabled_reason is not disabled_before:
            events.after_step(self, result, phase, disabled_before)
        if events.pending or events.step_end:
            events.dispatch(self, result)
        return result

    def _settle(self) -> None:
        """Judge the steps whose checks waited (:mod:`~hybrid_trainer.deferred_checks`): one read
        of their values; then write their metrics records and emit the events of refused ones."""
        deferred = self.guard.deferred
        if deferred is None or not deferred.pending:
            return
        settled = deferred.settle(self.guard)
        for result in settled:
            if result.skipped:
                self.events.step_refused(self, result)
            self._log(result)
        if any(result.rolled_back for result in settled):
            self.controller.force_full()

    def _confidence(self, horizon: int) -> float:
        return self.forecaster.confidence(horizon, self.predictor)

    # ------------------------------------------------------------------- memory helpers ----
    def _state_home(self) -> None:
        """Optimizer state must be on its device before anything steps or saves it."""
        if self.offloader is not None:
            if self.offloader.offloaded:
                self.offloader.prefetch()
            self.offloader.wait()

    def _micro_batches(self, batch: Any) -> Sequence[Any]:
        return micro_batches(batch, self.config.grad_accumulation)

    def _loss(self, batch: Any) -> torch.Tensor:
        # memory plan: bf16 weights run a bf16 forward
        return checked_loss(self.loss_fn, self.model, batch, self.config.autocast_dtype or self._plan_autocast,
                            self.device)

    # ----------------------------------------------------------------------- real steps ----
    def _real_step(self, batch: Any, phase: Phase) -> StepResult:
        guard, worth = self.guard, self.worth
        # Recording steps feed the cost calibration, so only they pay for a synchronised clock.
        record = self.controller.prediction_enabled and phase is not Phase.WARMUP
        started = worth.clock("core") if record else time.perf_counter()
        worth.machinery_s = 0.0  # time spent on prediction machinery during this step
        # With prediction off the guard may read this step's values later (deferred_checks).
        deferring = (guard.defers() and not self.controller.prediction_enabled
                     and self.in_backward is None and self.nowcast is None and self.weight_average is None)
        if not deferring:
            self._settle()  # steps whose checks waited are judged before this one is
        self._clear_stale_grads()
        micro = self._micro_batches(batch)
        guard.before_forward()  # a refused step puts the buffers (batch-norm statistics) back as they are now
        loss_sum = None
        for index, part in enumerate(micro):
            last = index == len(micro) - 1
            with self.ranks.micro_batch_context(self.model, last=last):
                loss = self._loss(part)
                if len(micro) > 1:  # dividing by 1 is exact but would add a node to the autograd graph
                    loss = loss / len(micro)
                loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
                if last:  # every decision below reads the mean over all ranks' data; it travels during the backward
                    mean_loss = self.ranks.start_mean(loss_sum)
                if self.in_backward is not None:  # memory plan: the update runs inside this backward
                    if not math.isfinite(float(loss.detach())):
                        continue  # a non-finite loss: no backward, so no update at all (refused below)
                    self.in_backward.arm()
                # Every micro-batch goes backward, even after a non-finite loss (the update is
                # refused below): reading the loss here would stall a GPU's queue once more per step.
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            self.stats.backward_passes += 1
        self.stats.forward_passes += len(micro)
        loss_sum = mean_loss.wait()
        lrs = tuple([float(group["lr"]) for group in self.optimizer.param_groups])
        lr = lrs[0]
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        partly_applied = False
        if deferring:
            return self._deferred_step(loss_sum, phase, lrs)
        # The guard's read waits for the device; with a skip on the device it can wait while the
        # optimizer step runs (see StepGuard.steps_on_device) instead of before it is launched.
        overlapped = guard.steps_on_device(record)
        if self.in_backward is not None:  # memory plan: the hooks measured the norm and updated (no grads left)
            in_backward_norm, partly_applied = self.in_backward.finish()
            total, grad_norm = guard.read_loss_and_norm(loss_sum, torch.tensor(in_backward_norm))
        elif overlapped:
            total, grad_norm = guard.step_then_read(loss_sum, guard.grad_norm())
        else:
            total, grad_norm = guard.read_step_values(loss_sum)
        report = guard.check(total, grad_norm)
        if report.critical:
            undone = partly_applied and guard.good_state.is_set
            if undone:  # memory plan: undo the finite updates already made
                guard.good_state.restore(self.optimizer)
                self.stats.divergence_rollbacks += 1
            # Launched before the read, or applied inside the backward: the update ran already.
            update_ran = overlapped or self.in_backward is not None
            result = self._refused_step(phase, total, grad_norm, report, lrs, update_ran=update_ran)
            result.rolled_back = result.rolled_back or undone
            return result

        predictor = self.predict_phase.predictor  # not the property: one call less per step
        if record:
            mark = worth.clock("recording")
            worth.measure(predictor, [p.grad for p in self.params], self.loss_trend)
            # Under a GradScaler the step may be skipped: the update is measured, not recomputed.
            predictor.begin_step(self.optimizer if self.scaler is None else None)
            recording_s = worth.clock("recording") - mark
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif not overlapped and self.in_backward is None:  # memory plan: already stepped inside the backward
            self.guard.step_optimizer()
        self.stats.optimizer_steps += 1
        if self.weight_average is not None:
            self.weight_average.update()
        if self.scheduler is not None:
            self.scheduler.step()
        # The gradients go before the update is recorded: the recording's bucket-sized transients
        # then take memory the gradients held, not memory on top of them (with a fused
        # optimizer, whose step has next to no transients of its own, they set the step's peak).
        self._drop_grads()
        update_norm = None
        if record:
            mark = worth.clock("recording")
            update = predictor.end_step()
            recording_s += worth.clock("recording") - mark
            worth.time("recording", recording_s)
            update_norm = update.update_norm
            if math.isfinite(update.cosine):
                self._last_update_cosine = update.cosine

        self.loss_trend.update(total)
        self.forecaster.observe(phase, self.step_count, self.stats.optimizer_steps, total, grad_norm, update_norm,
                                lr, self.optimizer)
        rolled_back = guard.accept(self.step_count, self.stats.optimizer_steps, total, grad_norm, report.severity)
        if rolled_back:  # a non-finite state found at the snapshot: back to the good state
            self.controller.force_full()
        if self.nowcast is not None:  # PREDICT as a nowcast jump: snapshot, jump or verdict when due
            if self.nowcast.after_step(self.step_count, total) in ("jump", "rolled_back"):
                # A far jump first makes the loss worse by design and is judged by its own verdict;
                # the divergence monitor's window describes the trajectory before it, and would
                # take the jump's transient for a divergence (and roll the weights back itself).
                guard.monitor.reset_window()
        if record:
            worth.time("core", worth.clock("core") - started - worth.machinery_s)
        return StepResult(step=self.step_count, phase=phase.value, loss=total, backward_done=True,
                          divergence=report.severity.name, grad_norm=grad_norm, lr=lr, lrs=lrs,
                          rolled_back=rolled_back)

    def _refused_step(self, phase: Phase, total: float, grad_norm: float | None, report: Any,
                      lrs: tuple[float, ...], update_ran: bool = False) -> StepResult:
        """A real step whose update the guard refused (:meth:`StepGuard.refuse_update`;
        ``update_ran``: the update ran before the read, launched first
        (:meth:`StepGuard.steps_on_device`) or inside the backward)."""
        rolled_back = self.guard.refuse_update(total, grad_norm, report, self.step_count, update_ran=update_ran)
        self.controller.force_full()
        return StepResult(step=self.step_count, phase=phase.value, loss=total if math.isfinite(total) else None,
                          backward_done=self.stats.backward_passes > 0 and math.isfinite(total), skipped=True,
                          rolled_back=rolled_back, divergence="; ".join(report.reasons) or report.severity.name,
                          grad_norm=grad_norm, lr=lrs[0], lrs=lrs)

    def _steady_step(self, batch: Any) -> StepResult:
        """A whole real step once prediction is off for good, the trainer's state where it cannot
        help: forward, backward, the guard's read and check (or, with ``read_every`` > 1, the
        update launched with its checks queued), the update, the good state.

        The same decisions and state as :meth:`_real_step` with the end of :meth:`step` (held
        equal, bit for bit, by tests/test_steady_step.py), without what only prediction,
        micro-batches, DDP, a GradScaler, a step inside the backward, a weight average, the
        memory profiler or a GPU's overlapped per-step read need (the trainer sends those runs
        down the general path). Each of those is a check or an object per step; on a 1 ms step
        they added up to more than the guard itself (``python -m bench.overhead``)."""
        started = time.perf_counter()
        optimizer, guard, stats, controller = self.optimizer, self.guard, self.stats, self.controller
        check_train_mode(optimizer)
        # The good state the last step left due, its file written behind this step's forward and
        # backward (StepGuard.accept).
        writing = guard.snapshot_due is not None  # only then is a write in flight until the update
        escalated = guard.take_due_snapshot(background=True) if writing else False
        if escalated:  # a non-finite value where it was to be taken: back to the last good state
            controller.force_full()
        phase, disabled_before = controller.phase, controller.disabled_reason
        deferred = guard.deferred
        deferring = deferred is not None and guard.defers()
        if deferred is not None and not deferring:
            self._settle()  # steps whose checks waited are judged before this one is
        try:
            self._clear_stale_grads()
            guard.before_forward(gram=True)  # one forward, one backward: large layers' norms from Grams
            loss = self._loss(batch)
            loss.backward()
            guard.after_backward(loss)
        finally:
            if writing:  # from here on the step may change what the good state's write reads
                guard.wait_for_snapshot()
        stats.backward_passes += 1
        stats.forward_passes += 1
        lrs = tuple([float(group["lr"]) for group in optimizer.param_groups])
        if deferring:  # nothing read back: the update launched, its checks queued (deferred_checks)
            result = self._deferred_step(loss.detach(), phase, lrs)
            result.wall_time_s = time.perf_counter() - started
            if deferred.due:
                self._settle()  # the guard's read of the last read_every steps
            return self._end_steady_step(result, phase, disabled_before)
        total, grad_norm = guard.read_step_values(loss)  # sync point: one read per step, as loss.item()
        report = guard.monitor.check(total, grad_norm)  # guard.check without a GradScaler (none here)
        if report.critical:
            result = self._refused_step(phase, total, grad_norm, report, lrs)
        else:
            guard.step_optimizer()
            stats.optimizer_steps += 1
            if self.scheduler is not None:
                self.scheduler.step()
            self._drop_grads()
            self.loss_trend.update(total)
            rolled_back = guard.accept(self.step_count, stats.optimizer_steps, total, grad_norm, report.severity,
                                       defer_snapshot=True)
            if rolled_back:  # a non-finite state found at the snapshot: back to the good state
                controller.force_full()
            result = StepResult(step=self.step_count, phase=_PHASE_NAMES[phase], loss=total, backward_done=True,
                                divergence=_SEVERITY_NAMES[report.severity], grad_norm=grad_norm, lr=lrs[0], lrs=lrs,
                                rolled_back=rolled_back)
        result.rolled_back = result.rolled_back or escalated
        result.wall_time_s = time.perf_counter() - started
        return self._end_steady_step(result, phase, disabled_before)

    def _captured_step(self, captured: CapturedStep, leaves: list[Any]) -> StepResult:
        """A steady step as one replay of the captured graph (:mod:`~hybrid_trainer.captured_step`):
        the ops of :meth:`_steady_step`'s deferred branch, launched at once; its checks wait for
        the guard's read like theirs. ``leaves``: the batch flattened."""
        started = time.perf_counter()
        stats, controller = self.stats, self.controller
        check_train_mode(self.optimizer)
        phase, disabled_before = controller.phase, controller.disabled_reason
        lrs = tuple([float(group["lr"]) for group in self.optimizer.param_groups])
        result = PendingStepResult(step=self.step_count, phase=_PHASE_NAMES[phase], loss=None, backward_done=True,
                                   divergence="PENDING", lr=lrs[0], lrs=lrs)
        captured.replay(leaves, result)  # forward, backward, the guard's device ops, the update
        stats.backward_passes += 1
        stats.forward_passes += 1
        stats.optimizer_steps += 1  # taken back at the read if the step was refused
        if self.scheduler is not None:
            self.scheduler.step()
        result.wall_time_s = time.perf_counter() - started
        if self.guard.deferred.due:
            self._settle()  # the guard's read of the last read_every steps
        return self._end_steady_step(result, phase, disabled_before)

    def _drop_grads(self) -> None:
        """What ``zero_grad(set_to_none=True)`` does, without its profiler scope: ~25 µs per step
        on the digits MLP, 2% of its step."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None

    def _clear_stale_grads(self) -> None:
        """Every step ends by setting the gradients to None, so only gradients left by someone
        else (the caller's own backward, a step that raised) need clearing; a zero_grad with
        nothing to clear still costs 30-45 µs per step (its profiler scope) on the MLP benchmarks.
        A loop, not any() over a generator: 0.4 µs less a step for six tensors, 1.2 for forty
        (timeit, the two interleaved on one core)."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.optimizer.zero_grad(set_to_none=True)
                    return

    def _deferred_step(self, loss: torch.Tensor, phase: Phase, lrs: tuple[float, ...]) -> PendingStepResult:
        """The rest of a real step whose checks wait for the guard's next read: the update is
        applied unless the loss or gradients are non-finite (decided on the device with a fused
        optimizer, nothing read back; else from the two values, read now)."""
        guard, optimizer = self.guard, self.optimizer
        result = PendingStepResult(step=self.step_count, phase=_PHASE_NAMES[phase], loss=None, backward_done=True,
                                   divergence="PENDING", lr=lrs[0], lrs=lrs)
        if guard.reads_free and not getattr(optimizer, "_step_supports_amp_scaling", False):
            # Reads cost nothing here: the per-step guard's own read (one op on the gradients).
            has_norm = any(p.grad is not None for p in guard.params)
            loss_value, norm_value = guard.read_step_values(loss)
            guard.deferred.launch_read(guard, loss_value, 0.0 if norm_value is None else norm_value, has_norm, result)
        else:
            guard.deferred.launch(guard, loss, guard.grad_norms(), result)
        self.stats.optimizer_steps += 1  # taken back at the read if the step was refused
        if self.scheduler is not None:
            self.scheduler.step()
        self._drop_grads()
        return result

    def _verification_loss(self, batch: Any) -> tuple[float, int]:
        """Mean loss of ``batch`` without gradients, averaged over ranks (the verdict must be the
        same on every rank), and the forward passes it took."""
        with torch.no_grad():
            micro = self._micro_batches(batch)
            loss = sum(float(self._loss(part)) for part in micro) / len(micro)
        return self.ranks.mean_float(loss), len(micro)

    # ============================================================================ reporting ====
    def _log(self, result: StepResult) -> None:
        if self.metrics is None:
            return
        record = asdict(result)
        record["next_phase"] = self.controller.phase.value
        self.metrics.log(record)

    def averaged_weights(self):
        """Context manager: inside it the model's trained parameters hold their lag-corrected
        average (:mod:`hybrid_trainer.averaging`), for evaluation or export; after it, exactly
        the trained values again. Buffers (e.g. batch-norm statistics) are not averaged. Needs
        ``HybridConfig(weight_average=True)``::

            with trainer.averaged_weights():
                val_loss = evaluate(model)
        """
        if self.weight_average is None:
            raise ValueError("HybridConfig.weight_average is False: set it to True to keep a weight average")
        return self.weight_average.swapped_in()

    def plot(self, path, title: str | None = None) -> None:
        """PNG of the loss over steps with phases shaded, from the metrics file (needs ``metrics_path``)."""
        if self.config.metrics_path is None:
            raise ValueError("HybridConfig.metrics_path is None: set it to record the per-step metrics to plot")
        plot_run(self.config.metrics_path, path, title=title)

    def statistics(self) -> dict[str, Any]:
        """Counters of the run so far (plain Python types; :func:`~hybrid_trainer.run_report.run_statistics`)."""
        self._settle()  # a refusal still waiting to be read would be missing from the counts
        return run_statistics(self)

    def summary(self) -> str:
        """A short human-readable report of the run."""
        return format_summary(self.statistics())

    # =========================================================================== checkpoint ====
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: the state of every part registered in
        :func:`~hybrid_trainer.state_registry.trainer_registry` (model, optimizer, scheduler, predictor, snapshots, dynamics model,
        histories, controller, monitors, counters, RNG), one key each."""
        self._settle()  # the saved state is a judged one (deferred_checks)
        state = self.registry.state_dict()
        state["memory_plan"] = {"techniques": list(self.memory_plan.techniques)}  # what resume must plan alike
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = in_current_layout(state)
        resume_check.check_loadable(self, state)  # everything, before anything is restored
        saved_plan = state.get("memory_plan")
        if saved_plan is not None and saved_plan["techniques"] != self.memory_plan.techniques:
            raise ValueError(f"checkpoint: saved by a run with memory techniques {saved_plan['techniques']}, this "
                             f"trainer planned {self.memory_plan.techniques}; set optimizer_state_bits, "
                             f"step_in_backward and weight_dtype to the saved run's to resume it")
        self.registry.load_state_dict(state)
        if self.captured is not None:
            self.captured.drop()  # the loaded optimizer state is new tensors
        if self.guard.deferred is not None:
            self.guard.deferred.discard()  # the steps waiting led to the state just replaced
        checkpoint.restore_rng(rng_of_rank(state, self.ranks))

    def save(self, path) -> None:
        """Write the full state atomically (temporary file, fsync, rename).

        Under DDP every rank must call it (it is collective): rank 0 writes one file holding the
        shared state and every rank's random streams, and all ranks return once it exists.

        Refuses (``ValueError`` naming them) to write weights, buffers or optimizer state holding
        NaN or Inf: ``load`` would refuse the file, and a NaN from outside the guard's view (a
        batch-norm statistic, between good-state snapshots) must not outlive the run in it. So
        does the emergency checkpoint (warned about, see
        :func:`~hybrid_trainer.checkpointing.emergency_checkpoint`)."""
        checkpointing.write_checkpoint(self, path)
        self.events.saved(path, self.step_count, wrote=self.ranks.is_writer)
        self.events.dispatch(self, after=f"trainer.save({str(path)!r}) had completed")

    def load(self, path) -> None:
        # Onto the CPU, not this trainer's device: the random streams (torch's, the dynamics
        # sampler's) are restored only from CPU byte tensors, forecasts live on the CPU, and every
        # loader copies what it restores onto its own tensors' device (this rank's GPU).
        self.load_state_dict(checkpoint.load(path, map_location="cpu"))
        self.events.loaded(path, self.step_count)
        self.events.dispatch(self, after=f"trainer.load({str(path)!r}) had completed")

    # ============================================================================= outputs ====
    def close(self) -> None:
        """Flush and close the files the trainer writes (JSONL metrics, TensorBoard event file)
        and take the guard's hooks off the model (:mod:`~hybrid_trainer.gram_norm`; a step after
        this reads every gradient); idempotent. Call it when training is done (or use ``with
        HybridTrainer(...) as trainer``)."""
        self._settle()  # the last steps' checks and metrics records
        self.guard.close()  # its hooks off the model
        if self.captured is not None:
            self.captured.drop()  # the graph's memory goes back
        if self.metrics is not None:
            self.metrics.close()
        if self.tensorboard is not None:
            self.tensorboard.close()

    def __enter__(self) -> HybridTrainer:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.close()

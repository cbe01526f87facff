"""HybridTrainer: a drop-in training step that replaces some optimizer steps with verified,
in-place predicted updates.

The trainer orchestrates; the parts compute: :class:`~hybrid_trainer.predictor.DeltaPredictor`
(update history, direction, scales, in-place application), :class:`~hybrid_trainer.anchor.WeightAnchor`
(exact rollback), :class:`~hybrid_trainer.dynamics.DynamicsModel` (loss forecasts, confidence),
:mod:`~hybrid_trainer.verifier` (noise-aware acceptance), :class:`~hybrid_trainer.phases.PhaseController`
(the phase machine) and :class:`~hybrid_trainer.divergence.DivergenceMonitor`.

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

import inspect
import math
import time
import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

import hybrid_kernels as hk
from hybrid_kernels.encode_state import NUM_FEATURES
from hybrid_kernels.int8_quant import FLOAT_DTYPES

from . import checkpoint
from .anchor import WeightAnchor, buffer_slots
from .averaging import WeightAverage
from .config import HybridConfig
from .cost import PredictionCost, real_steps_per_predicted
from .distributed import RankSync, unwrap
from .divergence import DivergenceMonitor, Severity
from .dynamics import DynamicsModel
from .memory import MemoryProfiler, VRAMGuard, default_reader
from .memory_plan import memory_in_use, refine_plan, setup_memory
from .metrics import MetricsLogger, plot_run
from .offload import StateOffloader
from .normalizer import RunningNormalizer
from .phases import Phase, PhaseController
from .predictor import DeltaPredictor
from .verifier import LossTrend, verify

CHECKPOINT_VERSION = 1
WORTH_BETA = 0.9  # EMA factor of the predicted step's first-order gain


def grad_norm_tensor(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """Global L2 norm of ``grads`` as a 0-d tensor on the first grad's device (None for no
    grads); non-finite if any entry is. The same ops as ``torch.nn.utils.get_total_norm`` when
    all grads share a device and dtype, without its per-call grouping, which cost ~40 µs per step
    on a 4-tensor MLP (half of the norm)."""
    if not grads:
        return None
    first = grads[0]
    if all(g.device == first.device and g.dtype == first.dtype for g in grads):
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    return torch.nn.utils.get_total_norm(grads)


def _without_ddp_prefix(weights: dict[str, Any], module: torch.nn.Module) -> dict[str, Any]:
    """``weights`` keyed as ``module`` expects: checkpoints written before the trainer saved the
    unwrapped module's keys hold a DDP wrapper's (``module.`` before every key)."""
    prefix = "module."
    if weights and all(k.startswith(prefix) for k in weights) and \
            not any(k.startswith(prefix) for k in module.state_dict()):
        return {k[len(prefix):]: v for k, v in weights.items()}
    return weights


def _reads_are_free(device: torch.device) -> bool:
    """Whether reading a value from ``device`` waits for nothing: a CPU op has finished when it
    returns, so there each read costs ~0.3 µs and merging two costs a stack (~7 µs)."""
    return device.type == "cpu"


@dataclass
class StepResult:
    """What one ``trainer.step`` did."""

    step: int
    phase: str
    loss: float | None  # training loss (real steps) or verification loss (verified predicted steps)
    backward_done: bool
    predicted_loss: float | None = None  # loss the trajectory forecast expected at a verification
    verified: bool = False
    accepted: bool | None = None  # outcome of the verification, None if none happened
    rolled_back: bool = False
    skipped: bool = False  # a real step whose update was refused (non-finite or divergent)
    divergence: str = "OK"
    grad_norm: float | None = None
    lr: float | None = None
    confidence: float | None = None
    wall_time_s: float = 0.0


@dataclass
class RunStatistics:
    steps_by_phase: dict[str, int] = field(default_factory=lambda: {p.value: 0 for p in Phase})
    time_by_phase_s: dict[str, float] = field(default_factory=lambda: {p.value: 0.0 for p in Phase})
    backward_passes: int = 0
    forward_passes: int = 0
    optimizer_steps: int = 0
    predicted_steps: int = 0
    predicted_steps_kept: int = 0
    predicted_steps_rolled_back: int = 0
    verifications: int = 0
    verifications_accepted: int = 0
    predict_phases: int = 0
    predict_phases_rejected: int = 0
    divergence_rollbacks: int = 0
    skipped_steps: int = 0
    trained_set_changes: int = 0  # freezing / unfreezing followed (see _follow_trainable_change)


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
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], config: HybridConfig | None = None,
                 scheduler: Any | None = None, example_batch: Any = None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        closure = inspect.signature(optimizer.step).parameters.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:  # LBFGS
            raise TypeError(f"optimizer: {type(optimizer).__name__}.step needs a closure (it re-evaluates the "
                            f"loss itself), and the trainer steps after its own backward; use a first-order "
                            f"optimizer such as Adam")
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable as loss_fn(model, batch) -> scalar tensor")
        config = HybridConfig() if config is None else config
        if not isinstance(config, HybridConfig):
            raise TypeError(f"config must be a HybridConfig, got {type(config).__name__}")
        config.validate()
        self._check_scheduler(scheduler, optimizer)
        self.model, self.optimizer, self.loss_fn, self.config, self.scheduler = model, optimizer, loss_fn, config, scheduler

        self.params, self._outside_model = self._trained_tensors()
        if len(self.params) == len(self._outside_model):  # an optimizer built over another model's parameters
            raise ValueError("optimizer holds none of the model's trainable parameters")
        self._check_dense(model, optimizer)
        self._check_predictable(self.params)
        self.device = self.params[0].device
        self.ranks = RankSync(model, self.device)  # collectives that keep DDP ranks' decisions identical
        if self.ranks.active and self._outside_model:
            # DDP averages the gradients of its module's parameters only: such a tensor would take
            # a different update on each rank, and with it a different gradient norm and verdict.
            raise ValueError(f"optimizer: trains {len(self._outside_model)} tensor(s) outside the "
                             f"DistributedDataParallel model, whose gradients DDP does not average across "
                             f"ranks; make them parameters of the wrapped module")
        # Output paths decide nothing (and rank 0 alone writes the metrics): they may differ.
        self.ranks.check_same("config", {k: v for k, v in config.to_dict().items()
                                         if k not in ("metrics_path", "emergency_checkpoint_path")})

        # --- memory plan (hybrid_trainer.memory_plan): may store the weights in bf16, rebuild the
        # optimizer as LowBitAdamW over the same param groups and step inside the backward.
        memory = setup_memory(model, optimizer, self.params, loss_fn, config, example_batch)
        self.memory_plan, self.optimizer, self.in_backward = memory.plan, memory.optimizer, memory.in_backward
        self._plan_autocast = memory.autocast_dtype
        if self.in_backward is not None and self.ranks.active:
            raise ValueError("HybridConfig.step_in_backward: under DistributedDataParallel a parameter's hook "
                             "fires before DDP has averaged its gradient across ranks; use step_in_backward=False")
        # --- end memory plan
        self.weight_average = None
        self._track(self.params, self._outside_model)
        self.history = hk.StateHistory(device=self.device)
        self.normalizer = RunningNormalizer(NUM_FEATURES)
        self.dynamics = DynamicsModel(n_features=NUM_FEATURES, hidden=config.dynamics_hidden,
                                      ensemble=config.dynamics_ensemble, horizon=config.horizon,
                                      window=config.dynamics_window, lr=config.dynamics_lr,
                                      batch=config.dynamics_batch, seed=config.seed, device=self.device)
        self.monitor = DivergenceMonitor(**config.divergence)
        self.controller = PhaseController(config)
        self.loss_trend = LossTrend()
        self.cost = (PredictionCost(real_steps_per_predicted(config), reduce=self.ranks.mean_float)
                     if config.cost_aware else None)
        # Per-step records go to the JSONL file only: kept in memory they would grow with the run.
        # Under DDP the records agree on every rank (losses are averaged), so rank 0 writes them.
        self.metrics = (MetricsLogger(config.metrics_path, keep_records=False)
                        if config.metrics_path is not None and self.ranks.is_writer else None)
        self.stats = RunStatistics()
        self.scaler = (torch.amp.GradScaler(self.device.type)
                       if config.autocast_dtype == "float16" else None)

        reader = default_reader(self.device) if (config.memory_profile or config.vram_critical is not None) else None
        self.profiler = (MemoryProfiler(reader, self.device, spike_threshold=config.memory_spike_threshold,
                                        every=config.memory_every) if config.memory_profile else None)
        self.vram_guard = (VRAMGuard(config.vram_warning, config.vram_critical, reader,
                                     on_critical=self._emergency_checkpoint)
                           if config.vram_critical is not None else None)
        self.grad_checkpointing = self._make_grad_checkpointing(unwrap(model), config)

        self.step_count = 0
        self._machinery_s = 0.0  # prediction machinery time within the current real step
        self._forecast: dict[str, torch.Tensor] | None = None
        self._last_update_cosine = float("nan")
        self.predicted_worth: float | None = None  # see _measure_worth
        self._predicted_gain: float | None = None
        # State of the PREDICT phase in progress.
        self._predict_base_loss: float | None = None
        self._last_verified_loss: float | None = None
        self._last_verified_single_batch = False
        self._unverified_steps = 0
        self._host_values: torch.Tensor | None = None  # pinned landing place of the guard's read (CUDA)
        # Where a read waits for nothing there is nothing to overlap: the device-side skip's extra
        # ops would only add work to every step (a CPU's sub-millisecond MLP steps notice it).
        self._overlap_guard = not _reads_are_free(self.device)
        # memory plan: the prediction again from what the built trainer holds now
        refine_plan(self.memory_plan, memory_in_use(self.device), self.predictor.buffer_bytes()
                    if hasattr(self.predictor, "buffer_bytes") else
                    sum(t.numel() * t.element_size() for t in vars(self.predictor).values() if isinstance(t, torch.Tensor)))

    # ================================================================================ step ====
    def step(self, batch: Any) -> StepResult:
        """One training step on ``batch`` (a list of ``grad_accumulation`` micro-batches when
        accumulation is configured). Returns a :class:`StepResult`."""
        started = time.perf_counter()
        self._check_train_mode()
        self._follow_trainable_change()
        phase = self.controller.phase
        try:
            if phase is Phase.PREDICT:
                result = self._predict_step(batch)
            else:
                self._state_home()
                result = self._real_step(batch, phase)
        except BaseException:
            # An error or interrupt mid-PREDICT must not leave unverified predicted deltas in the
            # weights the user goes on to save: go back to the last verified point first.
            if phase is Phase.PREDICT and self._unverified_steps and self.anchor.is_set:
                self.anchor.restore()
                self._unverified_steps = 0
            raise
        result.wall_time_s = time.perf_counter() - started
        self.stats.steps_by_phase[phase.value] += 1
        self.stats.time_by_phase_s[phase.value] += result.wall_time_s
        self.step_count += 1
        if not (phase is Phase.PREDICT and result.rolled_back):
            # Once prediction is off for the run the controller never reads the margin again.
            margin = self._worth_margin() if self.controller.prediction_enabled else None
            self.controller.advance(self._confidence, worth_margin=margin)
        if phase is Phase.PREDICT and self.controller.phase is not Phase.PREDICT and self.offloader is not None:
            self.offloader.prefetch()  # overlaps the copy back with whatever the caller does next
        if self.profiler is not None:
            self.profiler.snapshot(result.step, phase.value)
        if self.vram_guard is not None:
            self.vram_guard.check(result.step)
        self._log(result)
        return result

    def _check_train_mode(self) -> None:
        """A schedule-free optimizer (``schedulefree``'s) holds the weights at its averaged point
        after ``optimizer.eval()``: a step, real or predicted, would move that point instead of the
        one its gradients belong at. Its own ``step()`` refuses only after the forward, backward
        and guard of the step have run; this refuses before anything runs."""
        # Every group: a CombinedOptimizer may hold the schedule-free part second.
        if not all(group.get("train_mode", True) for group in self.optimizer.param_groups):
            raise RuntimeError(f"optimizer: {type(self.optimizer).__name__} is in eval mode (optimizer.eval() was "
                               "called, so the weights are its averaged ones); call optimizer.train() before "
                               "trainer.step()")

    @staticmethod
    def _check_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
        """The trainer calls ``scheduler.step()`` with no argument after each real optimizer step."""
        if scheduler is None:
            return
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError("scheduler: ReduceLROnPlateau steps on a metric (usually a validation loss) and "
                            "the trainer steps its scheduler with none; leave it out and call "
                            "scheduler.step(val_loss) yourself, the trainer's optimizer takes the new lr")
        if not callable(getattr(scheduler, "step", None)):
            raise TypeError(f"scheduler must have a step() method (an LR scheduler), got {type(scheduler).__name__}")
        if getattr(scheduler, "optimizer", optimizer) is not optimizer:
            raise ValueError("scheduler: built over another optimizer than the trainer's, so stepping it "
                             "would leave the trainer's learning rate unchanged")

    @staticmethod
    def _check_dense(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Sparse gradients have no norm the guard can take (torch has no sparse vector norm)
        and no dense update the predictor can record."""
        for name, module in unwrap(model).named_modules():
            if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse \
                    and module.weight.requires_grad:
                raise ValueError(f"model: {type(module).__name__} {name!r} has sparse=True, and the trainer "
                                 f"needs dense gradients (its NaN guard takes their norm); use sparse=False "
                                 f"with a dense optimizer (e.g. Adam instead of SparseAdam)")
        if isinstance(optimizer, torch.optim.SparseAdam):
            raise ValueError("optimizer: SparseAdam takes sparse gradients only, and the trainer needs dense "
                             "ones; use Adam or AdamW")

    def _trained_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(params, outside)``: every tensor the optimizer trains now, the model's parameters
        first in model order, and those of them outside the model. All of them are guarded,
        snapshotted and predicted: a trained tensor outside the model (a learned loss weight or
        temperature) would otherwise take a NaN update and keep it through a rollback. Those
        outside are in no model ``state_dict``, so the checkpoint holds their values itself."""
        optimized = [p for group in self.optimizer.param_groups for p in group["params"]]
        ids, in_model = {id(p) for p in optimized}, {id(p) for p in self.model.parameters()}
        params = [p for p in self.model.parameters() if p.requires_grad and id(p) in ids]
        outside = [p for p in optimized if p.requires_grad and id(p) not in in_model]
        return params + outside, outside

    def _check_predictable(self, params: list[torch.Tensor]) -> None:
        """Checked when a tensor starts training: the first predicted step comes many steps
        later, inside the kernel."""
        wide = next((p for p in params if p.dtype not in FLOAT_DTYPES), None) if self.config.predict else None
        if wide is not None:
            name = next((repr(n) for n, p in unwrap(self.model).named_parameters() if p is wide), "outside the model")
            raise TypeError(f"model: parameter {name} is {wide.dtype}, and predicted steps "
                            f"update float32, float16 or bfloat16 weights; train it with "
                            f"HybridConfig(predict=False) (the safety layer alone) or in float32")

    def _track(self, params: list[torch.Tensor], outside: list[torch.Tensor]) -> None:
        """(Re)build everything kept per trained tensor: the predictor's update history, both
        snapshots, the weight average (carried over, see :meth:`WeightAverage.retarget`) and the
        offloader's extra tensors."""
        cfg = self.config
        self.params, self._outside_model = params, outside
        self.predictor = DeltaPredictor(params, cfg.direction, cfg.ema_beta, cfg.history_size,
                                        cfg.scale_beta, cfg.scale_max)
        buffers = buffer_slots(unwrap(self.model))  # e.g. batch-norm statistics: forwards change them too
        self.anchor = WeightAnchor(params, buffers=buffers)  # last verified point of a PREDICT phase
        self.good_state = WeightAnchor(params, buffers=buffers)  # last healthy point (divergence rollback)
        if cfg.weight_average:
            self.weight_average = (WeightAverage(params) if self.weight_average is None
                                   else self.weight_average.retarget(params))
        # The int8 update history ("linear" direction) is not read while predicting either.
        self.offloader = (StateOffloader(self.optimizer, extra=self.predictor.history_tensors)
                          if cfg.offload_while_predicting else None)
        tracked = {id(p) for p in params}
        self._untracked = [p for group in self.optimizer.param_groups for p in group["params"]
                           if id(p) not in tracked]  # frozen now: watched for unfreezing
        self._param_groups = len(self.optimizer.param_groups)

    def _follow_trainable_change(self) -> None:
        """Follow a change of which tensors train (``requires_grad_()``, ``add_param_group``:
        gradual unfreezing, or freezing), before it reaches any weight: the NaN guard, both
        snapshots and predicted steps must cover exactly what trains, or an unfrozen layer would
        take a NaN update unchecked and keep its update through a rollback, and a frozen one would
        go on moving with predicted steps. The update history restarts (a FULL phase follows);
        the weight average carries over."""
        if len(self.optimizer.param_groups) == self._param_groups and \
                not any(p.requires_grad for p in self._untracked) and all(p.requires_grad for p in self.params):
            return
        if self.ranks.active:
            raise ValueError("optimizer: the tensors that train changed under DistributedDataParallel, which "
                             "fixes the parameters whose gradients it averages when it is constructed; wrap "
                             "the model again after freezing or unfreezing, and construct a new HybridTrainer")
        params, outside = self._trained_tensors()
        if not params:
            raise ValueError("optimizer: no tensor trains any more (every parameter frozen)")
        self._check_predictable(params)
        if self.controller.phase is Phase.PREDICT and self._unverified_steps and self.anchor.is_set:
            self.anchor.restore()  # predicted for the old set: only verified steps stay
            self.stats.predicted_steps_rolled_back += self._unverified_steps
            self._unverified_steps = 0
        self._state_home()
        self._track(params, outside)
        self.predicted_worth = self._predicted_gain = None  # measured along the old direction
        self.controller.force_full()
        self.stats.trained_set_changes += 1

    # ------------------------------------------------------------------- memory helpers ----
    @staticmethod
    def _make_grad_checkpointing(model: torch.nn.Module, config: HybridConfig):
        if config.checkpoint_modules is None and config.checkpoint_module_type is None:
            return None
        from .grad_checkpoint import GradientCheckpointing

        module_type = None
        if config.checkpoint_module_type is not None:
            types = {type(m) for m in model.modules() if type(m).__name__ == config.checkpoint_module_type}
            if not types:
                names = sorted({type(m).__name__ for m in model.modules()})
                raise ValueError(f"HybridConfig.checkpoint_module_type={config.checkpoint_module_type!r}: no submodule "
                                 f"of that class; the model has {names[:12]}")
            module_type = tuple(types)
        return GradientCheckpointing(model, modules=config.checkpoint_modules,
                                     every_nth=config.checkpoint_every_nth, module_type=module_type)

    def _state_home(self) -> None:
        """Optimizer state must be on its device before anything steps or saves it."""
        if self.offloader is not None:
            if self.offloader.offloaded:
                self.offloader.prefetch()
            self.offloader.wait()

    def _emergency_checkpoint(self, sample) -> None:
        path = self.config.emergency_checkpoint_path
        if path is None:
            return
        if self.ranks.active:
            # Memory pressure is one rank's own: nothing collective may run here, so each rank
            # that hits it writes its own file (the weights are the same on every rank).
            self._state_home()
            checkpoint.atomic_save(self.state_dict(), f"{path}.rank{self.ranks.rank}")
        else:
            self.save(path)

    def _micro_batches(self, batch: Any) -> Sequence[Any]:
        k = self.config.grad_accumulation
        if k == 1:
            return [batch]
        # A list, not any sequence: a (inputs, targets) tuple is one batch, never two micro-batches.
        if not isinstance(batch, list) or len(batch) != k:
            raise ValueError(f"batch: with grad_accumulation={k}, pass a list of {k} micro-batches, "
                             f"got {type(batch).__name__}")
        return batch

    def _autocast(self):
        dtype = self.config.autocast_dtype or self._plan_autocast  # bf16 weights run a bf16 forward
        if dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=getattr(torch, dtype))

    def _loss(self, batch: Any) -> torch.Tensor:
        with self._autocast():
            loss = self.loss_fn(self.model, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                            f"{'' if not isinstance(loss, torch.Tensor) else ' of shape ' + str(tuple(loss.shape))}")
        if torch.is_grad_enabled() and not loss.requires_grad:  # torch's own error names no culprit
            raise TypeError("loss_fn returned a loss detached from the model's parameters (no grad_fn): "
                            "return the tensor itself, not loss.item(), loss.detach() or one computed "
                            "under torch.no_grad()")
        # A view of a 0-d loss would only add a node to the autograd graph (~15 µs forward and
        # backward per step, a large share of a 1 ms step).
        return loss if loss.dim() == 0 else loss.reshape(())

    # ----------------------------------------------------------------------- real steps ----
    def _real_step(self, batch: Any, phase: Phase) -> StepResult:
        cfg = self.config
        # Recording steps feed the cost calibration, so only they pay for a synchronised clock.
        record = self.controller.prediction_enabled and phase is not Phase.WARMUP
        started = self._clock("core") if record else time.perf_counter()
        self._machinery_s = 0.0  # time spent on prediction machinery during this step
        # Every step ends by setting the gradients to None, so only gradients left by someone else
        # (the caller's own backward, a step that raised) need clearing; a zero_grad with nothing
        # to clear still costs 30-45 µs per step (its profiler scope) on the MLP benchmarks.
        if any(p.grad is not None for group in self.optimizer.param_groups for p in group["params"]):
            self.optimizer.zero_grad(set_to_none=True)
        micro = self._micro_batches(batch)
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
        lr = float(self.optimizer.param_groups[0]["lr"])
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = self._grad_norm()
        partly_applied = False
        if self.in_backward is not None:  # memory plan: the hooks measured the norm and updated
            in_backward_norm, partly_applied = self.in_backward.finish()
            norm = torch.tensor(in_backward_norm)
        # The guard's read waits for the device; with a skip on the device it can wait while the
        # optimizer step runs (see _guarded_on_device) instead of before it is launched.
        overlapped = self._guarded_on_device(record)
        if overlapped:
            total, grad_norm = self._step_then_read(loss_sum, norm)
        else:
            total, grad_norm = self._read_loss_and_norm(loss_sum, norm)
        if self.scaler is not None and grad_norm is not None and not math.isfinite(grad_norm):
            grad_for_check = None  # fp16 overflow: the GradScaler skips this step by itself
        else:
            grad_for_check = grad_norm
        report = self.monitor.check(total, grad_for_check)
        if report.critical:
            if partly_applied and self.good_state.is_set:  # memory plan: undo the finite updates already made
                self.good_state.restore(self.optimizer)
                self.stats.divergence_rollbacks += 1
            return self._refuse_update(phase, total, grad_norm, lr, report)

        if record:
            mark = self._clock("recording")
            self._measure_worth()
            self.predictor.begin_step()
            recording_s = self._clock("recording") - mark
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif not overlapped and self.in_backward is None:  # memory plan: already stepped inside the backward
            self.optimizer.step()
        self.stats.optimizer_steps += 1
        if self.weight_average is not None:
            self.weight_average.update()
        if self.scheduler is not None:
            self.scheduler.step()
        update_norm = None
        if record:
            mark = self._clock("recording")
            update = self.predictor.end_step()
            recording_s += self._clock("recording") - mark
            self._time("recording", recording_s)
            update_norm = update.update_norm
            if math.isfinite(update.cosine):
                self._last_update_cosine = update.cosine
        # What zero_grad(set_to_none=True) does, without its profiler scope: ~25 µs per step on
        # the digits MLP, 2% of its step.
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None

        self.monitor.observe(total, grad_norm)
        self.loss_trend.update(total)
        self._observe_state(phase, total, grad_norm, update_norm, lr)
        real_steps = self.stats.optimizer_steps
        if cfg.good_state_every and (real_steps % cfg.good_state_every == 1 or not self.good_state.is_set) \
                and report.severity is Severity.OK:
            self.good_state.save(self.step_count, self.optimizer)
        if record:
            self._time("core", self._clock("core") - started - self._machinery_s)
        return StepResult(step=self.step_count, phase=phase.value, loss=total, backward_done=True,
                          divergence=report.severity.name, grad_norm=grad_norm, lr=lr)

    def _grad_norm(self) -> torch.Tensor | None:
        """Global gradient norm as a 0-d device tensor (before clipping, which it applies when
        ``grad_clip`` is set); None without gradients."""
        if self.config.grad_clip is None:  # measure only: clip_grad_norm_(inf) would also rescale every grad by 1
            return grad_norm_tensor([p.grad for p in self.params if p.grad is not None])
        return torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip)

    def _guarded_on_device(self, record: bool) -> bool:
        """Whether this step launches its optimizer step before reading the guard's values.

        A fused optimizer (``fused=True``: torch's Adam, AdamW, SGD) skips its update on the
        device when told the gradients are not finite (the ``found_inf`` GradScaler uses), so a
        non-finite step is refused without the host having looked; a finite step the monitor
        refuses (a spike) restores the last good state, which overwrites the update either way.
        Not while recording (the predictor brackets the step and needs the read first), under
        a GradScaler (it has its own skip), before a good state exists (nothing to restore), or
        on a CPU (``_overlap_guard``: its reads wait for nothing).
        """
        return (self._overlap_guard and not record and self.scaler is None and self.good_state.is_set
                and getattr(self.optimizer, "_step_supports_amp_scaling", False))

    def _step_then_read(self, loss: torch.Tensor, norm: torch.Tensor | None) -> tuple[float, float | None]:
        """Queue the loss and norm's copy to the host, launch the optimizer step with a
        device-side skip for non-finite values, then wait for the copy only: on a GPU the host
        runs the monitor while the device runs the update, where the plain guard left the device
        idle until the host had read, checked and launched."""
        values = torch.stack([loss.float(), torch.zeros_like(loss, dtype=torch.float32) if norm is None
                              else norm.to(loss.device, torch.float32)])
        non_finite = (~torch.isfinite(values).all()).float()
        if values.device.type == "cuda":
            if self._host_values is None:  # pinned, so the copy is asynchronous; reused every step
                self._host_values = torch.empty(2, dtype=torch.float32, pin_memory=True)
            host = self._host_values
            host.copy_(values, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        else:
            host, copied = values, None
        self.optimizer.found_inf = non_finite
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf
        if copied is not None:
            copied.synchronize()
        total, grad_norm = host.tolist()
        if norm is None:
            grad_norm = 0.0
        return total, (grad_norm if math.isfinite(total) else None)

    def _read_loss_and_norm(self, loss: torch.Tensor, norm: torch.Tensor | None) -> tuple[float, float | None]:
        """The step's loss and global gradient norm as floats, read from the device together:
        on a GPU each host read waits for all queued work, which the plain loop never does. The
        norm is None when the loss is not finite (the update is refused on the loss alone)."""
        if norm is None:
            total, grad_norm = loss.item(), 0.0
        elif _reads_are_free(loss.device) and _reads_are_free(norm.device):
            total, grad_norm = loss.item(), norm.item()  # two reads cost less than a stack here
        else:
            total, grad_norm = torch.stack([loss.float(), norm.to(loss.device, torch.float32)]).tolist()
        return total, (grad_norm if math.isfinite(total) else None)

    def _measure_worth(self) -> None:
        """Worth of a predicted step in units of a real one: the EMA of its first-order loss
        decrease on fresh gradients, divided by the measured loss decrease per real step (the
        slope of recent real-step losses). Why not the real update's own first-order gain: on
        the char-LM it is negative on average after ~100 steps (repeating an Adam step from where
        it landed climbs back up the valley it crossed) although the loss keeps falling
        (``python -m bench.predictors``)."""
        gain = self.predictor.predicted_gain([p.grad for p in self.params])
        slope = self.loss_trend.slope()
        if gain is None or not math.isfinite(gain) or slope is None:
            return
        self._predicted_gain = gain if self._predicted_gain is None else \
            WORTH_BETA * self._predicted_gain + (1 - WORTH_BETA) * gain
        self.predicted_worth = self._predicted_gain / -slope if slope < 0 else 0.0

    def _refuse_update(self, phase: Phase, loss: float, grad_norm: float | None, lr: float, report) -> StepResult:
        """A critical divergence: the update is not applied; weights go back to the last good
        state if they are already off (a loss spike), and the run continues in FULL."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            # unscale_ ran this step; without an update() the next step's unscale_ would raise.
            # The update also backs the scale off when the gradients overflowed.
            self.scaler.update()
        self.stats.skipped_steps += 1
        rolled_back = False
        non_finite = not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm))
        if not non_finite and self.good_state.is_set:
            self.good_state.restore(self.optimizer)
            self.stats.divergence_rollbacks += 1
            rolled_back = True
        self.monitor.reset_window() if rolled_back else None
        self.controller.force_full()
        return StepResult(step=self.step_count, phase=phase.value, loss=loss if math.isfinite(loss) else None,
                          backward_done=self.stats.backward_passes > 0 and math.isfinite(loss), skipped=True,
                          rolled_back=rolled_back, divergence="; ".join(report.reasons) or report.severity.name,
                          grad_norm=grad_norm, lr=lr)

    def _observe_state(self, phase: Phase, loss: float, grad_norm: float | None, update_norm: float | None,
                       lr: float) -> None:
        """Feed the 64-feature state encoder and the dynamics model with a real step."""
        if not self.controller.prediction_enabled:
            return  # the rings below only feed the encoder, which will not run again in this run
        cfg = self.config
        h = self.history
        h.push_loss(loss)
        if grad_norm is not None and math.isfinite(grad_norm):
            h.push_grad_norm(grad_norm)
        if update_norm is not None:
            h.push_update_norm(update_norm)
        if phase is Phase.WARMUP or not self._worth_passes():
            # The encoder and the dynamics model decide when and how long to predict, which is
            # moot while a predicted step is not worth it; on small models they cost as much as
            # the step itself, so they wait for the gate (the rings above keep filling).
            return
        mark = self._clock("forecasting")
        h.lr, h.step, h.phase, h.phase_step = lr, self.step_count, phase.code, self.controller.phase_step
        h.acceptance_rate = self.controller.acceptance_estimate()
        errors = self.dynamics.error_report()
        h.prediction_error = errors.get(1, 0.0) / max(self.loss_trend.noise_std, 1e-12) if errors else 0.0
        features = hk.encode_state(h, optimizer_state=self.optimizer)
        self.normalizer.update(features)
        self.dynamics.observe(self.normalizer.normalize(features), loss)
        self._time("forecasting", self._clock("forecasting") - mark)
        if self.stats.optimizer_steps % cfg.dynamics_train_every == 0 and self.dynamics.ready():
            mark = self._clock("dynamics_training")
            self.dynamics.train_step()
            self._forecast = self.dynamics.forecast(agree=self.ranks.from_rank0)
            self._time("dynamics_training", (self._clock("dynamics_training") - mark) / cfg.dynamics_train_every)

    def _clock(self, part: str) -> float:
        """``time.perf_counter()`` for timing ``part``. While that part is being calibrated on a
        GPU, read after a synchronize: otherwise the device work queued before the mark (the
        backward, the optimizer step) finishes inside whichever part next reads a value from the
        device, and is charged to the prediction machinery instead of the core step. After
        calibration no timing is used, so no synchronize is added."""
        if self.device.type == "cuda" and self.cost is not None and self.cost.calibrating(part):
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _time(self, part: str, seconds: float) -> None:
        """Feed the cost calibration (wall-clock seconds, read with :meth:`_clock`)."""
        if part != "core":
            self._machinery_s += seconds
        if self.cost is not None:
            self.cost.observe(part, seconds)

    # ------------------------------------------------------------------- predicted steps ----
    def _worth_margin(self) -> float | None:
        """Measured worth of a predicted step minus the required worth; None before it is measured."""
        return None if self.predicted_worth is None else self.predicted_worth - self.required_worth()

    def _worth_passes(self) -> bool:
        margin = self._worth_margin()
        return margin is not None and margin >= 0

    def required_worth(self) -> float:
        """Worth a predicted step needs to pay: ``min_predicted_worth`` plus, when ``cost_aware``,
        the measured cost of recording and forecasting per real step (:mod:`hybrid_trainer.cost`)."""
        base = self.config.min_predicted_worth
        return base if self.cost is None else self.cost.required_worth(base)

    def _confidence(self, horizon: int) -> float:
        """Confidence that a predict phase of ``horizon`` steps is accepted: geometric mean of the
        measured acceptance estimate and the dynamics model's confidence at that horizon."""
        if self.predictor.n_scale_fits == 0 or not self.loss_trend.count or not self._worth_passes():
            return 0.0
        model_conf = self.dynamics.confidence(self._forecast, horizon, self.loss_trend.noise_std)
        return math.sqrt(self.controller.acceptance_estimate() * model_conf)

    def _predict_step(self, batch: Any) -> StepResult:
        cfg = self.config
        ctl = self.controller
        if ctl.phase_step == 0:
            if self.offloader is not None:
                self.offloader.offload()
            self.anchor.save(self.step_count)
            self._predict_base_loss = self.loss_trend.mean
            self._last_verified_loss = self.loss_trend.mean
            self._last_verified_single_batch = False
            self._unverified_steps = 0
            self.stats.predict_phases += 1
        self.predictor.apply_predicted_step()
        self.stats.predicted_steps += 1
        self._unverified_steps += 1
        horizon = ctl.phase_step + 1
        result = StepResult(step=self.step_count, phase=Phase.PREDICT.value, loss=None, backward_done=False,
                            confidence=None)
        if horizon % cfg.verify_every != 0 and horizon < ctl.length:
            return result

        with torch.no_grad():
            micro = self._micro_batches(batch)
            loss = sum(float(self._loss(part)) for part in micro) / len(micro)
        loss = self.ranks.mean_float(loss)  # the verdict must be the same on every rank
        self.stats.forward_passes += len(micro)
        self.stats.verifications += 1
        expected = None
        if self._forecast is not None and self._predict_base_loss is not None:
            expected = self._predict_base_loss + float(self._forecast["mean"][min(horizon, self.dynamics.horizon) - 1])
        verdict = verify(loss, expected, self._last_verified_loss, self._last_verified_single_batch,
                         self.loss_trend.noise_std, cfg.loss_tolerance, cfg.noise_z)
        ctl.record_verification(verdict.accepted)
        result.loss, result.predicted_loss, result.verified, result.accepted = (
            loss if math.isfinite(loss) else None, expected, True, verdict.accepted)
        if verdict.accepted:
            self.stats.verifications_accepted += 1
            self.stats.predicted_steps_kept += self._unverified_steps
            self.anchor.save(self.step_count)
            self._last_verified_loss, self._last_verified_single_batch = loss, True
            self._unverified_steps = 0
            if horizon >= ctl.length:
                self._finish_bandit_round(loss)
        else:
            self.anchor.restore()
            self.stats.predicted_steps_rolled_back += self._unverified_steps
            self.stats.predict_phases_rejected += 1
            self._unverified_steps = 0
            result.rolled_back = True
            result.divergence = verdict.reason
            self._finish_bandit_round(self._last_verified_loss)
            ctl.reject_predict_phase()
        return result

    def _finish_bandit_round(self, end_loss: float | None) -> None:
        """Bandit reward: loss progress of the phase in units of batch noise, per verification."""
        if self.controller.bandit is None or self._predict_base_loss is None or end_loss is None:
            return
        progress = (self._predict_base_loss - end_loss) / max(self.loss_trend.noise_std, 1e-12)
        verifications = max(1, math.ceil(self.controller.length / self.config.verify_every))
        self.controller.finish_bandit_round(progress / verifications)

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
        """Counters of the run so far (plain Python types)."""
        s = asdict(self.stats)
        real_steps = s["steps_by_phase"]["WARMUP"] + s["steps_by_phase"]["FULL"] + s["steps_by_phase"]["CORRECT"]
        s.update(
            steps=self.step_count,
            real_steps=real_steps,
            backward_passes_saved=self.stats.predicted_steps * self.config.grad_accumulation,
            backward_saved_fraction=(self.stats.predicted_steps / self.step_count) if self.step_count else 0.0,
            acceptance_rate=(self.stats.verifications_accepted / self.stats.verifications)
            if self.stats.verifications else None,
            prediction_enabled=self.controller.prediction_enabled,
            prediction_disabled_reason=self.controller.disabled_reason,
            dynamics_error_by_horizon=self.dynamics.error_report(),
            dynamics_train_steps=self.dynamics.train_steps,
            loss_noise_std=self.loss_trend.noise_std,
            divergence_events=dict(self.monitor.counts),
            predicted_scale_mean=float(self.predictor.scales.mean()),
            last_update_cosine=self._last_update_cosine,
            predicted_step_worth=self.predicted_worth,
            required_worth=self.required_worth(),
            prediction_overhead=None if self.cost is None else self.cost.overhead,
        )
        return s

    def summary(self) -> str:
        """A short human-readable report of the run."""
        s = self.statistics()
        lines = [
            f"steps {s['steps']}: " + ", ".join(f"{k} {v}" for k, v in s["steps_by_phase"].items()),
            f"backward passes {s['backward_passes']} done, {s['backward_passes_saved']} saved "
            f"({100 * s['backward_saved_fraction']:.1f}% of steps predicted)",
            f"predicted steps {s['predicted_steps']}: {s['predicted_steps_kept']} kept, "
            f"{s['predicted_steps_rolled_back']} rolled back; verifications {s['verifications']} "
            f"({s['verifications_accepted']} accepted); predict phases {s['predict_phases']} "
            f"({s['predict_phases_rejected']} rejected)",
            f"divergence rollbacks {s['divergence_rollbacks']}, skipped updates {s['skipped_steps']}",
            "time per phase: " + ", ".join(f"{k} {v:.2f}s" for k, v in s["time_by_phase_s"].items()),
        ]
        if s["dynamics_error_by_horizon"]:
            errs = s["dynamics_error_by_horizon"]
            shown = {h: errs[h] for h in sorted(errs) if h in (1, 2, 4, 8, 16, 32) or h == max(errs)}
            lines.append("dynamics |error| by horizon (loss units): "
                         + ", ".join(f"h{h} {v:.3g}" for h, v in shown.items())
                         + f"; batch noise {s['loss_noise_std']:.3g}")
        if not s["prediction_enabled"]:
            lines.append(f"prediction disabled: {s['prediction_disabled_reason']}")
        return "\n".join(lines)

    # =========================================================================== checkpoint ====
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (model, optimizer, scheduler, predictor, anchors,
        dynamics model, histories, controller, monitors, counters, RNG)."""
        return {
            "version": CHECKPOINT_VERSION,
            "config": self.config.to_dict(),
            # The wrapped module's own keys: a DDP run resumes in a single process and back.
            "model": unwrap(self.model).state_dict(),
            "outside_model": [p.detach().clone() for p in self._outside_model],
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "predictor": self.predictor.state_dict(),
            "anchor": self.anchor.state_dict(),
            "good_state": self.good_state.state_dict(),
            "weight_average": None if self.weight_average is None else self.weight_average.state_dict(),
            "history": self.history.state_dict(),
            "normalizer": self.normalizer.state_dict(),
            "dynamics": self.dynamics.full_state_dict(),
            "monitor": self.monitor.state_dict(),
            "controller": self.controller.state_dict(),
            "loss_trend": self.loss_trend.state_dict(),
            "cost": None if self.cost is None else self.cost.state_dict(),
            "stats": asdict(self.stats),
            "trainer": {
                "step_count": self.step_count,
                "forecast": self._forecast,
                "last_update_cosine": self._last_update_cosine,
                "predicted_worth": self.predicted_worth,
                "predicted_gain": self._predicted_gain,
                "predict_base_loss": self._predict_base_loss,
                "last_verified_loss": self._last_verified_loss,
                "last_verified_single_batch": self._last_verified_single_batch,
                "unverified_steps": self._unverified_steps,
            },
            "rng": checkpoint.capture_rng(),
            "memory_plan": {"techniques": list(self.memory_plan.techniques)},  # what resume must plan alike
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != CHECKPOINT_VERSION:
            raise ValueError(f"checkpoint version {state.get('version')!r} is not {CHECKPOINT_VERSION}")
        # Checked before anything loads: the predictor and anchors hold one slot per trained tensor.
        saved = (len(state["predictor"]["scales"]), state["predictor"]["ema"].numel())
        here = (len(self.params), sum(p.numel() for p in self.params))
        if saved != here:
            raise ValueError(f"checkpoint: saved by a trainer training {saved[0]} parameter tensors ({saved[1]} "
                             f"values), this one trains {here[0]} ({here[1]}): freeze and unfreeze as the saved "
                             f"run had before constructing the trainer that loads it")
        saved_plan = state.get("memory_plan")
        if saved_plan is not None and saved_plan["techniques"] != self.memory_plan.techniques:
            raise ValueError(f"checkpoint: saved by a run with memory techniques {saved_plan['techniques']}, this "
                             f"trainer planned {self.memory_plan.techniques}; set optimizer_state_bits, "
                             f"step_in_backward and weight_dtype to the saved run's to resume it")
        module = unwrap(self.model)
        module.load_state_dict(_without_ddp_prefix(state["model"], module))
        with torch.no_grad():
            for p, saved in zip(self._outside_model, state.get("outside_model", [])):
                p.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.predictor.load_state_dict(state["predictor"])
        self.anchor.load_state_dict(state["anchor"])
        self.good_state.load_state_dict(state["good_state"])
        if self.weight_average is not None:
            if state.get("weight_average") is None:  # saved without one: start it at the loaded weights
                self.weight_average = WeightAverage(self.params)
            else:
                self.weight_average.load_state_dict(state["weight_average"])
        self.history.load_state_dict(state["history"])
        self.normalizer.load_state_dict(state["normalizer"])
        self.dynamics.load_full_state_dict(state["dynamics"])
        self.monitor.load_state_dict(state["monitor"])
        self.controller.load_state_dict(state["controller"])
        self.loss_trend.load_state_dict(state["loss_trend"])
        if self.cost is not None and state.get("cost") is not None:
            self.cost.load_state_dict(state["cost"])
        self.stats = RunStatistics(**state["stats"])
        t = state["trainer"]
        self.step_count, self._forecast = t["step_count"], t["forecast"]
        self._last_update_cosine = t["last_update_cosine"]
        self.predicted_worth = t["predicted_worth"]
        self._predicted_gain = t["predicted_gain"]
        self._predict_base_loss, self._last_verified_loss = t["predict_base_loss"], t["last_verified_loss"]
        self._last_verified_single_batch, self._unverified_steps = t["last_verified_single_batch"], t["unverified_steps"]
        checkpoint.restore_rng(self._own_rng(state))

    def _own_rng(self, state: dict[str, Any]) -> dict:
        """This rank's random streams from a checkpoint: written by :meth:`save` under DDP, it
        holds every rank's (``rng_by_rank``); otherwise the one process's."""
        by_rank = state.get("rng_by_rank")
        if by_rank is None:
            if self.ranks.active:
                warnings.warn(f"checkpoint written by one process, resumed on {self.ranks.world_size} ranks: every "
                              "rank takes its random streams, so the ranks draw the same dropout masks",
                              stacklevel=3)
            return state["rng"]
        if len(by_rank) != self.ranks.world_size:
            warnings.warn(f"checkpoint written by {len(by_rank)} ranks, resumed on {self.ranks.world_size}: "
                          "every rank takes rank 0's random streams, so data order and dropout will not "
                          "repeat the saved run's", stacklevel=3)
            return by_rank[0]
        return by_rank[self.ranks.rank]

    def save(self, path) -> None:
        """Write the full state atomically (temporary file, fsync, rename).

        Under DDP every rank must call it (it is collective): rank 0 writes one file holding the
        shared state and every rank's random streams, and all ranks return once it exists."""
        self._state_home()
        state = self.state_dict()
        if self.ranks.active:
            state["rng_by_rank"] = self.ranks.gather(state["rng"])
        if self.ranks.is_writer:
            checkpoint.atomic_save(state, path)
        self.ranks.barrier()

    def load(self, path) -> None:
        # Onto the CPU, not this trainer's device: the random streams (torch's, the dynamics
        # sampler's) are restored only from CPU byte tensors, forecasts live on the CPU, and every
        # loader copies what it restores onto its own tensors' device (this rank's GPU).
        self.load_state_dict(checkpoint.load(path, map_location="cpu"))

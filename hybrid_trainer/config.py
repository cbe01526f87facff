"""HybridConfig: every knob of the trainer, validated, with JSON round trip and two presets."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from .divergence import DivergenceMonitor

DIRECTIONS = ("ema", "linear")
AUTOCAST_DTYPES = (None, "bfloat16", "float16")
GOOD_STATE_STORAGES = ("auto", "host", "file", "device")
# Upper bounds of sizes that become allocations: a value past them failed deep inside the
# trainer (predict_lengths=(2**40,) asked for petabytes for the dynamics model's forecast head).
MAX_PREDICT_LENGTH = 1024  # the head holds ensemble x hidden x 2 x max(predict_lengths) weights
MAX_DYNAMICS_BATCH = 4096  # windows per ensemble member per minibatch
MAX_DYNAMICS_WINDOW = 256  # unrolled states; the model replays its last 512 real steps
MAX_SEED = 2**63 - 1  # int64, what torch.Generator.manual_seed and NumPy take everywhere


@dataclass
class HybridConfig:
    """Configuration of :class:`~hybrid_trainer.HybridTrainer`. Steps count ``trainer.step`` calls.

    Phase schedule
        predict: False never predicts: every step is a real step with the safety layer (NaN/Inf
            refusal, divergence rollback, exact checkpoints, memory guard) and nothing is
            recorded for prediction. For runs where prediction is known not to pay, and the
            reference arm that measures what the safety layer alone costs (``bench.e2e``).
        warmup_steps: plain steps before anything is recorded for prediction.
        full_steps: real steps in a FULL phase before a PREDICT phase may start.
        correct_steps: real steps after each PREDICT phase (residuals, recalibration).
        predict_lengths: candidate PREDICT lengths (steps, each at most 1024); the controller or
            bandit picks one.
        max_consecutive_predict: PREDICT→CORRECT cycles before a FULL phase is forced.
        confidence_threshold: minimum confidence (0..1) to enter PREDICT.
        max_consecutive_rejections: rejected PREDICT phases in a row after which prediction is
            switched off for the rest of the run (each rejection also doubles the FULL cool-down).
        min_predicted_worth: a PREDICT phase starts only if a predicted step is measured to be
            worth at least this fraction of a real step: its first-order loss decrease
            ``−<g, s∘d>`` on fresh batches (EMA) over the measured loss decrease per real step.
            Below it predicting cannot pay for its verification.
        max_consecutive_declines: phase decisions in a row that declined to predict for low
            worth after which prediction is switched off for the run, so the trainer stops
            recording; from the 3rd such decision on it is switched off as soon as the shortfall
            is significant (mean of ``worth − required`` plus two standard errors below zero).
        max_decisions_without_predict: phase decisions in a row that started no PREDICT phase,
            for whatever reason (a worth too low, or a forecaster never confident enough), after
            which prediction is switched off for the run: the bound on how long the trainer
            records updates to find out whether prediction pays (20 steps each by default).
        cost_aware: raise that threshold by the measured cost of the prediction machinery
            (recording, state encoder, dynamics model) per real step, times the real steps per
            predicted step of the schedule (:mod:`hybrid_trainer.cost`): on a model whose step
            takes less time than the machinery, no worth repays it and prediction switches off.
            Each cost is timed on its first few runs and then fixed, so decisions are
            reproducible from a checkpoint; False: the threshold is ``min_predicted_worth``.
        use_bandit, bandit_alpha: LinUCB over ``predict_lengths`` (reward: loss progress per
            unit of compute) instead of the confidence rule.

    Predicted deltas
        direction: ``"ema"`` (EMA of real updates) or ``"linear"`` (least-squares slope of the
            weight trajectory over the last ``history_size`` updates, kept in int8).
        ema_beta: EMA factor of the update direction.
        history_size: updates kept (int8, per-row scales) for ``"linear"``.
        scale_beta: EMA factor of the per-tensor scale fit ``<u, d> / <d, d>``.
        scale_max: upper clamp of a per-tensor scale.
        verify_every: predicted steps between forward-only verifications (the last predicted
            step of a phase is always verified).
        loss_tolerance: relative slack on the verified loss.
        noise_z: slack in units of the measured batch-to-batch loss noise.

    Dynamics model (RSSM-lite)
        dynamics_hidden, dynamics_ensemble, dynamics_lr, dynamics_train_every,
        dynamics_batch, dynamics_window: GRU hidden size, members, Adam lr, train every N real
        steps, minibatch size (at most 4096) and unrolled window (at most 256) of the online
        training.

    Step mechanics
        grad_clip: max gradient norm (None: no clipping; the norm is still measured).
        grad_accumulation: micro-batches per step (``trainer.step`` then takes a list of that
            many batches; losses are averaged).
        autocast_dtype: None, "bfloat16" or "float16" (float16 uses a GradScaler).
        good_state_every: real steps between snapshots of the last good state (divergence
            rollback); 0 disables divergence rollback snapshots.
        good_state_storage: where that snapshot (weights, module buffers, optimizer state) lives:
            ``"auto"`` (page-locked host memory on a GPU, an unlinked temporary file on a CPU,
            where host memory is the training memory), ``"host"``, ``"file"`` or ``"device"``
            (beside the weights: the fastest, and three copies of them with AdamW). A rollback
            restores the same bits from any of them (:class:`~hybrid_trainer.anchor.WeightAnchor`).
        snapshot_dir: folder of the ``"file"`` snapshot (None: the system's temporary folder).
        read_every: real steps between the guard's reads of the loss and gradient norm once
            prediction is off (1: read and judge every step; None: 16 on a GPU, where each read
            waits for the device, and 1 elsewhere, where reads cost nothing). With N > 1 a step reads nothing
            back from the device with a fused optimizer (``fused=True`` Adam, AdamW, SGD: a
            non-finite gradient is skipped on the device) and the divergence monitor judges N
            steps at once; a spike found then rolls back to the last good state as a per-step
            check would have (:mod:`~hybrid_trainer.deferred_checks`). A ``StepResult``'s loss
            is then read when first accessed and its verdict settles at the next read. On a CPU
            N = 16 saves the per-step judgment (10-25 µs a step in ``python -m bench.overhead``)
            at that price.
        cuda_graph: on a CUDA device, once prediction is off, capture the steady step (forward,
            backward, the guard's device-side checks and a fused optimizer's update) in one CUDA
            graph and replay it, so that the host launches one graph a step instead of every op
            (:mod:`~hybrid_trainer.captured_step`: what it needs of the run, the model and the
            batches; where it cannot be used the trainer warns once and steps eagerly).
        divergence: keyword arguments for :class:`~hybrid_trainer.divergence.DivergenceMonitor`,
            checked by ``validate()`` with the monitor's own checks.
        memory_profile: record a memory snapshot (NVML/torch.cuda on GPU, RSS on CPU) every
            ``memory_every`` steps (``trainer.profiler``: per-phase stats, peaks, spikes, CSV/JSON).
        memory_spike_threshold: a snapshot above (1 + this) × the recent median is a spike.
        vram_warning, vram_critical: VRAM guard thresholds (fractions in (0, 1] of device memory,
            or bytes > 1); None disables the guard. Critical → emergency checkpoint to
            ``emergency_checkpoint_path`` (if set), then ``torch.cuda.empty_cache()``.
        offload_while_predicting: move optimizer state to (pinned) CPU memory during PREDICT
            (nothing steps the optimizer then) and prefetch it back before the next real step.
            Acts on CUDA state only; a no-op on CPU.
        checkpoint_modules: qualified submodule names to run under gradient checkpointing
            (``torch.utils.checkpoint``) during real steps; None: off.
        checkpoint_module_type, checkpoint_every_nth: alternatively, checkpoint every n-th
            submodule whose class name is ``checkpoint_module_type`` (e.g. ``"GPTBlock"``).
        metrics_path: JSONL file receiving one record per step (None: no per-step records;
            ``trainer.plot`` needs it).
        tensorboard_dir: folder receiving a TensorBoard event file with every step's scalars
            (loss, lr per group, grad norm, phase, predicted and verified counts:
            :mod:`hybrid_trainer.tensorboard_writer`); needs the ``tensorboard`` extra. None: off.
        weight_average: keep a lag-corrected average of the weights
            (:class:`~hybrid_trainer.averaging.WeightAverage`: two more copies of the parameters,
            a third once it is first swapped in, two passes over them per real step) for evaluation and export through
            ``trainer.averaged_weights()``; training never uses it. Evaluated at the average, a
            larger learning rate can pay (docs/trainer.md): re-tune it with this on.
        seed: seed of the trainer's own random draws (dynamics replay sampling), in [0, 2**63 - 1].

    PREDICT as a nowcast jump (opt-in; :mod:`hybrid_trainer.nowcast_jump`, docs/nowcaster.md)
        predictor: ``"steps"`` (the predicted-step PREDICT phases above) or ``"nowcast"``: every
            step is a real step, and every ``nowcast_call_every`` steps the learned nowcaster
            jumps the weights ahead; the jump is judged after ``nowcast_recovery_steps`` real
            steps against the pre-jump loss trend (``nowcast_trend_steps``) and rolled back
            bit-exactly when it does not beat it by ``nowcast_margin`` standard errors.
        nowcast_spacing: real steps between the nowcaster's snapshots.
        nowcast_max_horizon: cap (in spacings) on NiNo's horizon schedule 40, 33, 26, 21, 16,
            11, 8, 5, 3, 1: the shipped nowcaster beats predicting no movement up to 16 spacings
            and not beyond 32, and capping softens the first, destructive jumps (docs/nowcaster.md).
        nowcast_moments: ``"keep"`` or ``"reset"`` the optimizer state at a jump.
        nowcast_weights: path of nowcaster weights (None: the ones shipped with the package).

    Memory (:mod:`hybrid_trainer.memory_plan`, docs/memory.md)
        memory_budget: peak memory a step may use, bytes or a string with a unit ("20GiB",
            "1.5GB"); None: no planning beyond the knobs below. The trainer predicts the peak at
            construction (an activation probe when given ``example_batch``), chooses the cheapest
            techniques that fit ("auto" knobs), exposes ``trainer.memory_plan`` and raises
            ``ValueError`` naming the shortfall when nothing fits.
        optimizer_state_bits: 8 or 4 (AdamW moments block-wise quantized: 2.03 or 1.06 bytes/param
            instead of 8; a small quality cost, measured in docs/memory.md), None (fp32 moments),
            or "auto" (the planner's choice; plain fp32 without a budget). Adam/AdamW only.
        step_in_backward: update each parameter inside the backward pass and free its gradient
            at once (no gradient tensors kept: −4 bytes/param in fp32); needs grad_clip=None,
            grad_accumulation=1 and predict=False; None: the planner's choice.
        weight_dtype: "bfloat16" (weights stored bf16, updated in fp32 and rounded
            stochastically: −2 bytes/param for weights and gradients each; the forward runs
            under bf16 autocast), "float32" (as the model is), or "auto" (the planner's choice).
    """

    predict: bool = True
    warmup_steps: int = 20
    full_steps: int = 20
    correct_steps: int = 4
    predict_lengths: tuple[int, ...] = (4, 8, 16)
    max_consecutive_predict: int = 4
    confidence_threshold: float = 0.5
    max_consecutive_rejections: int = 4
    min_predicted_worth: float = 0.1
    max_consecutive_declines: int = 5
    max_decisions_without_predict: int = 10
    cost_aware: bool = True
    use_bandit: bool = False
    bandit_alpha: float = 1.0

    direction: str = "ema"
    ema_beta: float = 0.98
    history_size: int = 4
    scale_beta: float = 0.9
    scale_max: float = 4.0
    verify_every: int = 4
    loss_tolerance: float = 0.01
    noise_z: float = 1.0

    dynamics_hidden: int = 256
    dynamics_ensemble: int = 3
    dynamics_lr: float = 1e-3
    dynamics_train_every: int = 16
    dynamics_batch: int = 16
    dynamics_window: int = 8

    grad_clip: float | None = None
    grad_accumulation: int = 1
    autocast_dtype: str | None = None
    good_state_every: int = 50
    good_state_storage: str = "auto"
    snapshot_dir: str | None = None
    read_every: int | None = None
    cuda_graph: bool = False
    divergence: dict[str, Any] = field(default_factory=dict)
    memory_profile: bool = False
    memory_every: int = 1
    memory_spike_threshold: float = 0.25
    vram_warning: float | None = None
    vram_critical: float | None = None
    emergency_checkpoint_path: str | None = None
    offload_while_predicting: bool = False
    checkpoint_modules: list[str] | None = None
    checkpoint_module_type: str | None = None
    checkpoint_every_nth: int = 1
    metrics_path: str | None = None
    tensorboard_dir: str | None = None
    weight_average: bool = False
    seed: int = 0
    memory_budget: int | str | None = None
    optimizer_state_bits: int | str | None = "auto"
    step_in_backward: bool | None = None
    weight_dtype: str = "auto"

    predictor: str = "steps"
    nowcast_spacing: int = 50
    nowcast_max_horizon: int = 16
    nowcast_call_every: int = 300
    nowcast_recovery_steps: int = 100
    nowcast_trend_steps: int = 100
    nowcast_moments: str = "keep"
    nowcast_margin: float = 0.0
    nowcast_weights: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.predict_lengths, (list, range)):  # JSON gives a list; anything else is validated as is
            self.predict_lengths = tuple(self.predict_lengths)
        self.validate()

    # -- validation --------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field outside its allowed range."""
        def need(name: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise ValueError(f"HybridConfig.{name}={getattr(self, name)!r}: must be {allowed}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        need("predict", isinstance(self.predict, bool), "a bool")
        need("warmup_steps", is_int(self.warmup_steps) and self.warmup_steps >= 0, "an int >= 0")
        need("full_steps", is_int(self.full_steps) and self.full_steps >= 1, "an int >= 1")
        need("correct_steps", is_int(self.correct_steps) and self.correct_steps >= 1, "an int >= 1")
        need("predict_lengths", isinstance(self.predict_lengths, tuple) and len(self.predict_lengths) >= 1
             and all(is_int(n) and 1 <= n <= MAX_PREDICT_LENGTH for n in self.predict_lengths)
             and len(set(self.predict_lengths)) == len(self.predict_lengths),
             f"a non-empty tuple (or list) of distinct ints in [1, {MAX_PREDICT_LENGTH}]")
        need("max_consecutive_predict", is_int(self.max_consecutive_predict) and self.max_consecutive_predict >= 1,
             "an int >= 1")
        need("confidence_threshold", is_num(self.confidence_threshold) and 0 <= self.confidence_threshold <= 1,
             "a float in [0, 1]")
        need("max_consecutive_rejections", is_int(self.max_consecutive_rejections)
             and self.max_consecutive_rejections >= 1, "an int >= 1")
        need("min_predicted_worth", is_num(self.min_predicted_worth) and -1 <= self.min_predicted_worth <= 10,
             "a float in [-1, 10]")
        need("max_consecutive_declines", is_int(self.max_consecutive_declines) and self.max_consecutive_declines >= 1,
             "an int >= 1")
        need("max_decisions_without_predict",
             is_int(self.max_decisions_without_predict) and self.max_decisions_without_predict >= 1, "an int >= 1")
        need("cost_aware", isinstance(self.cost_aware, bool), "a bool")
        need("use_bandit", isinstance(self.use_bandit, bool), "a bool")
        need("bandit_alpha", is_num(self.bandit_alpha) and self.bandit_alpha >= 0, "a float >= 0")
        need("direction", self.direction in DIRECTIONS, f"one of {DIRECTIONS}")
        need("ema_beta", is_num(self.ema_beta) and 0 < self.ema_beta < 1, "a float in (0, 1)")
        need("history_size", is_int(self.history_size) and 2 <= self.history_size <= 64, "an int in [2, 64]")
        need("scale_beta", is_num(self.scale_beta) and 0 <= self.scale_beta < 1, "a float in [0, 1)")
        need("scale_max", is_num(self.scale_max) and self.scale_max > 0, "a float > 0")
        need("verify_every", is_int(self.verify_every) and self.verify_every >= 1, "an int >= 1")
        need("loss_tolerance", is_num(self.loss_tolerance) and 0 <= self.loss_tolerance <= 1, "a float in [0, 1]")
        need("noise_z", is_num(self.noise_z) and self.noise_z >= 0, "a float >= 0")
        need("dynamics_hidden", is_int(self.dynamics_hidden) and 1 <= self.dynamics_hidden <= 4096,
             "an int in [1, 4096]")
        need("dynamics_ensemble", is_int(self.dynamics_ensemble) and 1 <= self.dynamics_ensemble <= 16,
             "an int in [1, 16]")
        need("dynamics_lr", is_num(self.dynamics_lr) and self.dynamics_lr > 0, "a float > 0")
        need("dynamics_train_every", is_int(self.dynamics_train_every) and self.dynamics_train_every >= 1,
             "an int >= 1")
        need("dynamics_batch", is_int(self.dynamics_batch) and 1 <= self.dynamics_batch <= MAX_DYNAMICS_BATCH,
             f"an int in [1, {MAX_DYNAMICS_BATCH}]")
        need("dynamics_window", is_int(self.dynamics_window) and 1 <= self.dynamics_window <= MAX_DYNAMICS_WINDOW,
             f"an int in [1, {MAX_DYNAMICS_WINDOW}]")
        need("grad_clip", self.grad_clip is None or (is_num(self.grad_clip) and self.grad_clip > 0),
             "None or a float > 0")
        need("grad_accumulation", is_int(self.grad_accumulation) and self.grad_accumulation >= 1, "an int >= 1")
        need("autocast_dtype", self.autocast_dtype in AUTOCAST_DTYPES, f"one of {AUTOCAST_DTYPES}")
        need("good_state_every", is_int(self.good_state_every) and self.good_state_every >= 0, "an int >= 0")
        need("good_state_storage", self.good_state_storage in GOOD_STATE_STORAGES, f"one of {GOOD_STATE_STORAGES}")
        need("read_every", self.read_every is None or (is_int(self.read_every) and self.read_every >= 1),
             "None or an int >= 1")
        need("cuda_graph", isinstance(self.cuda_graph, bool), "True or False")
        need("snapshot_dir", self.snapshot_dir is None or (isinstance(self.snapshot_dir, str) and self.snapshot_dir),
             "None or a folder path (str)")
        need("divergence", isinstance(self.divergence, dict), "a dict of DivergenceMonitor keyword arguments")
        try:  # the monitor's own checks, so a bad key or value fails here, not when a trainer is built
            DivergenceMonitor(**self.divergence)
        except (TypeError, ValueError) as error:
            raise ValueError(f"HybridConfig.divergence={self.divergence!r}: not valid DivergenceMonitor "
                             f"keyword arguments: {error}") from error
        need("memory_profile", isinstance(self.memory_profile, bool), "a bool")
        need("memory_every", is_int(self.memory_every) and self.memory_every >= 1, "an int >= 1")
        need("memory_spike_threshold", is_num(self.memory_spike_threshold) and self.memory_spike_threshold > 0,
             "a float > 0")
        for name in ("vram_warning", "vram_critical"):
            value = getattr(self, name)
            need(name, value is None or (is_num(value) and value > 0),
                 "None, a fraction in (0, 1] of device memory, or a byte count > 1")
        need("vram_critical", (self.vram_warning is None) == (self.vram_critical is None),
             "set together with vram_warning (both or neither)")
        if self.vram_warning is not None:
            need("vram_critical", (self.vram_warning <= 1) == (self.vram_critical <= 1)
                 and self.vram_warning < self.vram_critical,
                 f"above vram_warning={self.vram_warning!r} and of the same kind (both fractions or both bytes)")
        need("emergency_checkpoint_path", self.emergency_checkpoint_path is None
             or isinstance(self.emergency_checkpoint_path, str), "None or a str path")
        need("offload_while_predicting", isinstance(self.offload_while_predicting, bool), "a bool")
        need("checkpoint_modules", self.checkpoint_modules is None or (
            isinstance(self.checkpoint_modules, (list, tuple)) and len(self.checkpoint_modules) > 0
            and all(isinstance(m, str) for m in self.checkpoint_modules)), "None or a non-empty list of module names")
        need("checkpoint_module_type", self.checkpoint_module_type is None
             or (isinstance(self.checkpoint_module_type, str) and self.checkpoint_module_type), "None or a class name")
        need("checkpoint_module_type", self.checkpoint_modules is None or self.checkpoint_module_type is None,
             "None when checkpoint_modules is set (choose modules by name or by type, not both)")
        need("checkpoint_every_nth", is_int(self.checkpoint_every_nth) and self.checkpoint_every_nth >= 1, "an int >= 1")
        need("metrics_path", self.metrics_path is None or isinstance(self.metrics_path, str), "None or a str path")
        need("tensorboard_dir", self.tensorboard_dir is None or (isinstance(self.tensorboard_dir, str)
                                                                 and self.tensorboard_dir), "None or a folder path (str)")
        need("weight_average", isinstance(self.weight_average, bool), "a bool")
        need("seed", is_int(self.seed) and 0 <= self.seed <= MAX_SEED, "an int in [0, 2**63 - 1]")
        need("predictor", self.predictor in ("steps", "nowcast"), "'steps' or 'nowcast'")
        for name in ("nowcast_spacing", "nowcast_max_horizon", "nowcast_call_every", "nowcast_recovery_steps",
                     "nowcast_trend_steps"):
            need(name, is_int(getattr(self, name)) and getattr(self, name) >= 1, "an int >= 1")
        need("nowcast_recovery_steps", self.nowcast_recovery_steps < self.nowcast_call_every,
             "< nowcast_call_every")
        need("nowcast_moments", self.nowcast_moments in ("keep", "reset"), "'keep' or 'reset'")
        need("nowcast_margin", isinstance(self.nowcast_margin, (int, float)) and math.isfinite(self.nowcast_margin),
             "a finite number")
        need("nowcast_weights", self.nowcast_weights is None or isinstance(self.nowcast_weights, str),
             "None or a path")
        if self.memory_budget is not None:
            from .memory_plan import parse_bytes
            parse_bytes(self.memory_budget)
        need("optimizer_state_bits", self.optimizer_state_bits in (8, 4, None, "auto")
             and not isinstance(self.optimizer_state_bits, bool), "8, 4, None or 'auto'")
        need("step_in_backward", self.step_in_backward in (None, True, False), "None, True or False")
        need("weight_dtype", self.weight_dtype in ("auto", "float32", "bfloat16"), "'auto', 'float32' or 'bfloat16'")
        if self.step_in_backward:
            for name, ok, why in (("grad_clip", self.grad_clip is None, "None: global clipping needs the global "
                                   "norm before any update, and the step inside the backward updates as it goes"),
                                  ("grad_accumulation", self.grad_accumulation == 1, "1: the step inside the "
                                   "backward frees each gradient at once, so none is kept between micro-batches"),
                                  ("predict", self.predict is False, "False: predicted steps record each update "
                                   "around optimizer.step(), which the step inside the backward replaces")):
                need(name, ok, f"{why} (step_in_backward=True)")

    @property
    def horizon(self) -> int:
        """Longest predict length: the dynamics model's loss-trajectory horizon."""
        return max(self.predict_lengths)

    # -- serialisation -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["predict_lengths"] = list(self.predict_lengths)
        if self.checkpoint_modules is not None:
            data["checkpoint_modules"] = list(self.checkpoint_modules)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "HybridConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"HybridConfig has no field(s) {unknown}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "HybridConfig":
        return cls.from_dict(json.loads(text))

    def replace(self, **changes: Any) -> "HybridConfig":
        return dataclasses.replace(self, **changes)

    # -- presets -----------------------------------------------------------------------------
    @classmethod
    def conservative(cls, **overrides: Any) -> "HybridConfig":
        """Longer FULL phases, short predictions verified often, tight tolerance."""
        base = dict(full_steps=40, predict_lengths=(2, 4, 8), verify_every=2, confidence_threshold=0.7,
                    loss_tolerance=0.005, noise_z=0.5, max_consecutive_predict=2, max_consecutive_rejections=3)
        return cls(**{**base, **overrides})

    @classmethod
    def aggressive(cls, **overrides: Any) -> "HybridConfig":
        """Short FULL phases, long predictions, loose verification, bandit over lengths."""
        base = dict(warmup_steps=10, full_steps=10, predict_lengths=(8, 16, 32), verify_every=8,
                    confidence_threshold=0.3, loss_tolerance=0.02, noise_z=2.0, max_consecutive_predict=8,
                    max_consecutive_rejections=6, use_bandit=True)
        return cls(**{**base, **overrides})

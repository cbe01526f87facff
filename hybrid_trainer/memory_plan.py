"""The memory planner: the peak memory of a training step for a model, optimizer and batch,
and the cheapest combination of memory techniques that fits a budget.

``HybridConfig(memory_budget="20GiB")`` makes the trainer call :func:`plan_memory` at
construction; the result is ``trainer.memory_plan`` (:class:`MemoryPlan`), logged, and a
``ValueError`` naming the shortfall when nothing fits. Without a budget the plan is still
made, for the techniques the config names, as a prediction of the peak.

Prediction (bytes; ``N`` trained parameters, ``W`` their bytes now):

    peak = in_use_now − W + weights + persistent + max(activations + backward_grads, step_grads + update_temp)

* ``in_use_now``: process RSS on a CPU (``torch.cuda.memory_allocated`` on a GPU) at planning
  time: the runtime, the data and the model as it stands.
* ``weights``: ``N × 4`` (fp32) or ``N × 2`` (bf16 weights).
* ``persistent``: optimizer state (fp32 Adam 8 B/param; low-bit 2 + 8/256 or 1 + 8/128; other
  optimizers from :data:`OPTIMIZER_STATE_BYTES`) plus the trainer's own buffers (good state:
  a copy of the weights and optimizer state when ``good_state_every > 0``; the predictor's
  two fp32 vectors and the anchor's weight copy when ``predict=True``).
* ``activations``: measured by a probe (``example_batch`` given to the trainer): one forward
  whose saved tensors are counted through ``torch.autograd.graph.saved_tensors_hooks``
  (tensor storages other than parameters, each once). Without a batch: 0, and the plan says
  it is not counted.
* ``backward_grads`` / ``step_grads``: all gradients (weight dtype) at the optimizer step; with
  the step inside the backward, two of the largest parameter's gradients.
* ``update_temp``: torch's Adam on CUDA (multi-tensor, foreach) allocates about one fp32 copy
  of all parameters during its step, on a CPU (one tensor at a time) two of the largest
  parameter; the chunked low-bit update a few MB.

Techniques, cheapest first (least step-time and quality cost; the measured factors are
:data:`STEP_TIME_FACTOR`, the quality cost in ``docs/memory.md``): step inside the backward
(no quality cost), 8-bit state, bf16 weights with stochastic rounding, 4-bit state. Only
Adam and AdamW can be converted by the trainer (to :class:`~hybrid_trainer.lowbit_adamw.LowBitAdamW`);
for any other optimizer the plan can only report.
"""
from __future__ import annotations

import logging
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from hybrid_kernels.adamw_lowbit import CHUNK_ELEMENTS, DEFAULT_BLOCK

from .lowbit_adamw import compiles_by_default

__all__ = ["MemoryPlan", "parse_bytes", "plan_memory", "measure_activation_bytes", "convertible",
           "STEP_TIME_FACTOR", "OPTIMIZER_STATE_BYTES"]

logger = logging.getLogger("hybrid_trainer.memory_plan")

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3,
          "t": 1000 ** 4, "tb": 1000 ** 4, "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "tib": 1024 ** 4}

# Step time of a setting over the plain fp32 AdamW step: the sweep of
# ``python -m bench.capacity --part sweep`` (docs/results/capacity.json, "fits" → "step_time_factor",
# the 31.7M-parameter Llama-shaped model, batch 1 × 64 tokens, on a shared 2-core CPU: noisy).
# A combination not measured is the product of its parts.
STEP_TIME_FACTOR: dict[str, float] = {
    "": 1.0,
    "in_backward": 0.99,
    "bits8": 1.25,
    "bits4": 1.39,
    "bf16": 5.36,  # fp32 moments with bf16 weights: the eager chunked path
    "in_backward+bits8+bf16": 2.75,
    "in_backward+bits4+bf16": 1.96,
}

# Optimizer state bytes per parameter of optimizers the trainer cannot convert, by class name.
OPTIMIZER_STATE_BYTES: dict[str, float] = {
    "Adam": 8.0, "AdamW": 8.0, "NAdam": 8.0, "RAdam": 8.0, "Adamax": 8.0, "Adagrad": 4.0, "RMSprop": 4.0,
    "SGD": 4.0, "AdamW8bit": 2.0 + 8 / 256, "AdamW4bit": 1.0 + 8 / 128, "LowBitAdamW": 8.0,
}


def parse_bytes(value: Any, name: str = "memory_budget") -> int:
    """``value`` as bytes: an int (bytes) or a string with a unit (``"20GiB"``, ``"1.5 GB"``,
    ``"512MiB"``; decimal units are powers of 1000, binary ones of 1024). Raises ``ValueError``
    naming ``name`` otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"HybridConfig.{name}={value!r}: must be bytes (an int > 0) or a string such as '20GiB'")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"HybridConfig.{name}={value!r}: must be > 0 bytes")
        return value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if match and match.group(2).lower() in _UNITS:
            result = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
            if result > 0:
                return result
    raise ValueError(f"HybridConfig.{name}={value!r}: must be bytes (an int > 0) or a number with a unit "
                     f"such as '20GiB', '1.5GB' or '512MiB' (units: {', '.join(u for u in _UNITS if u)})")


@dataclass
class MemoryPlan:
    """What the planner chose and why (bytes unless named otherwise)."""

    techniques: list[str]
    optimizer_state_bits: int | None
    step_in_backward: bool
    weight_dtype: str  # "float32" or "bfloat16"
    predicted_peak_bytes: int
    budget_bytes: int | None
    parameters: int
    bytes_per_param: float  # training state per parameter: weights + gradients + optimizer state + buffers
    step_time_factor: float  # over the plain fp32 AdamW step (STEP_TIME_FACTOR)
    breakdown: dict[str, int] = field(default_factory=dict)
    guarantees_given_up: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        gib = 1024 ** 3
        budget = "no budget" if self.budget_bytes is None else f"budget {self.budget_bytes / gib:.2f} GiB"
        text = (f"memory plan: {', '.join(self.techniques) or 'plain'}; predicted peak "
                f"{self.predicted_peak_bytes / gib:.2f} GiB ({budget}); {self.parameters / 1e6:.1f}M parameters at "
                f"{self.bytes_per_param:.2f} bytes/param; step time x{self.step_time_factor:.2f}")
        for line in self.guarantees_given_up:
            text += f"\n  gives up: {line}"
        for line in self.notes:
            text += f"\n  note: {line}"
        return text


def convertible(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the trainer can rebuild ``optimizer`` as a LowBitAdamW with the same
    hyperparameters: torch's Adam or AdamW without amsgrad/maximize, or a LowBitAdamW."""
    from .lowbit_adamw import LowBitAdamW

    if isinstance(optimizer, LowBitAdamW):
        return True
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    return not any(g.get("amsgrad") or g.get("maximize") for g in optimizer.param_groups)


def measure_activation_bytes(model: torch.nn.Module, loss_fn: Callable, batch: Any, autocast=None) -> int:
    """Bytes of the tensors one forward of ``loss_fn(model, batch)`` saves for backward
    (parameters excluded, each storage once): the activation memory a step holds at the start
    of its backward. The graph is dropped without a backward; no weight changes."""
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    kept: list[torch.Tensor] = []  # alive until the count is done, so no address is reused meanwhile

    def pack(t: torch.Tensor) -> int:
        # An index, not the tensor: a graph holding its own saved outputs through a pack hook
        # forms a reference cycle through C++ autograd nodes that is never freed (measured: the
        # probe's activations and the weights it saved stayed resident after the probe).
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in param_storages and ptr not in seen:
            seen[ptr] = storage.nbytes()
        kept.append(t)
        return len(kept) - 1

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda i: kept[i]):
        with (autocast if autocast is not None else torch.autocast("cpu", enabled=False)):
            loss = loss_fn(model, batch)
    del loss
    kept.clear()
    return sum(seen.values())


def _state_bytes_per_param(bits: int | None, optimizer: torch.optim.Optimizer, as_lowbit: bool) -> float:
    if as_lowbit:
        if bits is None:
            return 8.0
        return (2.0 if bits == 8 else 1.0) + 8.0 / DEFAULT_BLOCK[bits]
    name = type(optimizer).__name__
    per = OPTIMIZER_STATE_BYTES.get(name, 8.0)
    if name in ("Adam", "AdamW") and any(g.get("amsgrad") for g in optimizer.param_groups):
        per += 4.0
    if name == "SGD" and not any(g.get("momentum") for g in optimizer.param_groups):
        per = 0.0
    return per


@dataclass
class _Setting:
    step_in_backward: bool
    bits: int | None
    bf16: bool

    @property
    def techniques(self) -> list[str]:
        out = []
        if self.step_in_backward:
            out.append("step_in_backward")
        if self.bits is not None:
            out.append(f"optimizer_state_bits={self.bits}")
        if self.bf16:
            out.append("weight_dtype=bfloat16 (stochastic rounding)")
        return out

    @property
    def time_factor(self) -> float:
        parts = [name for name, on in (("in_backward", self.step_in_backward),
                                       (f"bits{self.bits}", self.bits is not None), ("bf16", self.bf16)) if on]
        key = "+".join(parts)
        if key in STEP_TIME_FACTOR:
            return STEP_TIME_FACTOR[key]
        return math.prod(STEP_TIME_FACTOR[part] for part in parts)


# Cheapest first: the step inside the backward costs no quality; 8-bit state costs little; bf16
# weights with stochastic rounding some; 4-bit state the most (docs/memory.md, loss parity).
_ORDER = [(False, None, False), (True, None, False), (False, 8, False), (True, 8, False), (True, 8, True),
          (False, 8, True), (True, 4, False), (True, 4, True), (False, 4, False), (False, 4, True),
          # bf16 weights with fp32 moments: never smaller than an earlier setting, there for the knobs
          (False, None, True), (True, None, True)]


def predictor_allocates_eagerly() -> bool:
    """Whether the trainer's update predictor allocates its two fp32 vectors at construction
    (then they cost 8 bytes/param even with ``predict=False``) or only once it records."""
    from .predictor import DeltaPredictor

    probe = DeltaPredictor([torch.zeros(4, requires_grad=True)])
    return getattr(probe, "_ema_flat", None) is not None


# The trainer's fixed buffers (dynamics model, history rings, counters), measured on the CPU as
# the RSS its construction adds besides the predictor's vectors: ~25 MiB.
TRAINER_FIXED_BYTES = 32 * 1024 ** 2
# What torch.compile's first call leaves resident (inductor's modules and compiled code) when the
# low-bit update compiles (models of COMPILE_MIN_NUMEL parameters and more): measured 67 MiB on a
# 33M-parameter model (``python -m bench.capacity --part planner``).
COMPILE_OVERHEAD_BYTES = 80 * 1024 ** 2


def plan_memory(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, config, *,
                in_use_bytes: int, activation_bytes: int | None, predictor_eager: bool = False) -> MemoryPlan:
    """Choose techniques for ``config`` (its explicit knobs are kept; with ``memory_budget`` the
    cheapest setting in ``_ORDER`` that fits is chosen among those compatible with them).
    ``in_use_bytes``: memory in use now; ``activation_bytes``: from
    :func:`measure_activation_bytes`, or None when not measured."""
    n = sum(p.numel() for p in params)
    device_type = params[0].device.type if params else "cpu"
    weights_now = sum(p.numel() * p.element_size() for p in params)
    largest = max((p.numel() for p in params), default=0)
    can_convert = convertible(optimizer)
    budget = None if config.memory_budget is None else parse_bytes(config.memory_budget)
    notes: list[str] = []
    blocked: list[str] = []
    if not can_convert:
        notes.append(f"optimizer {type(optimizer).__name__} cannot be converted to low-bit state, bf16 weights or "
                     f"the step inside the backward (only torch Adam/AdamW without amsgrad/maximize): planned as is")
    if config.grad_clip is not None:
        blocked.append("step_in_backward: grad_clip needs the global norm before any update")
    if config.grad_accumulation > 1:
        blocked.append("step_in_backward: grad_accumulation keeps gradients between micro-batches")
    if config.predict:
        blocked.append("step_in_backward: predict=True records each update around optimizer.step()")
    if activation_bytes is None:
        notes.append("activations not measured (no example_batch): the prediction counts none")
    acts = activation_bytes or 0

    def fixed(setting: _Setting) -> bool:
        if config.step_in_backward is not None and setting.step_in_backward != config.step_in_backward:
            return False
        if config.optimizer_state_bits != "auto" and setting.bits != config.optimizer_state_bits:
            return False
        want_bf16 = config.weight_dtype == "bfloat16"
        if config.weight_dtype != "auto" and setting.bf16 != want_bf16:
            return False
        return True

    def allowed(setting: _Setting) -> bool:
        if not can_convert and (setting.step_in_backward or setting.bits is not None or setting.bf16):
            return False
        if setting.step_in_backward and blocked:
            return False
        return True

    def predict(setting: _Setting) -> tuple[int, dict[str, int]]:
        as_lowbit = can_convert and (setting.step_in_backward or setting.bits is not None or setting.bf16
                                     or type(optimizer).__name__ == "LowBitAdamW")
        wbytes = 2 if setting.bf16 else 4
        weights = n * wbytes
        state = int(n * _state_bytes_per_param(setting.bits, optimizer, as_lowbit))
        good_state = weights + state if config.good_state_every else 0
        predictor = 8 * n if (config.predict or predictor_eager) else 0
        anchor = weights if config.predict else 0
        average = 8 * n if config.weight_average else 0
        compiles = as_lowbit and setting.bits is not None and compiles_by_default(n) and largest >= CHUNK_ELEMENTS
        runtime = COMPILE_OVERHEAD_BYTES if compiles else 0
        trainer = good_state + predictor + anchor + average + TRAINER_FIXED_BYTES
        grads_all = n * wbytes
        if setting.step_in_backward:
            backward_grads = step_grads = 2 * largest * wbytes
            update_temp = 0
        else:
            backward_grads, step_grads = 0, grads_all
            # torch's Adam steps CUDA tensors multi-tensor (foreach: about one fp32 copy of all
            # parameters in temporaries) and CPU tensors one at a time (temporaries of the largest)
            update_temp = 0 if as_lowbit else (4 * n if device_type == "cuda" else 2 * 4 * largest)
        transient = max(acts + backward_grads, step_grads + update_temp)
        peak = in_use_bytes - weights_now + weights + state + trainer + transient + runtime
        breakdown = dict(in_use_at_planning=in_use_bytes, weights=weights, weights_before=weights_now,
                         optimizer_state=state, trainer_buffers=trainer, good_state=good_state,
                         predictor=predictor, anchor=anchor, weight_average=average, transient=transient,
                         compile_runtime=runtime,
                         activations=acts,
                         gradients_at_peak=backward_grads if acts + backward_grads >= step_grads + update_temp
                         else step_grads, update_temporaries=update_temp)
        return peak, breakdown

    candidates = [_Setting(*s) for s in _ORDER]
    candidates = [s for s in candidates if fixed(s)]
    if not candidates:
        raise ValueError("HybridConfig: no setting matches optimizer_state_bits, step_in_backward and weight_dtype")
    usable = [s for s in candidates if allowed(s)]
    if not usable:
        raise ValueError(f"HybridConfig: the requested techniques cannot be used here: "
                         f"{'; '.join(blocked + notes) or 'optimizer not convertible'}")
    chosen = None
    if budget is None:
        chosen = usable[0]
    else:
        for s in usable:
            if predict(s)[0] <= budget:
                chosen = s
                break
        if chosen is None:
            best = min(usable, key=lambda s: predict(s)[0])
            peak, parts = predict(best)
            gib = 1024 ** 3
            raise ValueError(
                f"HybridConfig.memory_budget={config.memory_budget!r}: nothing fits; the smallest setting "
                f"({', '.join(best.techniques) or 'plain'}) needs a predicted {peak / gib:.2f} GiB, "
                f"{(peak - budget) / gib:.2f} GiB over the budget ({', '.join(f'{k} {v / gib:.2f}' for k, v in parts.items())} GiB)"
                + (f"; not usable here: {'; '.join(blocked)}" if blocked else "")
                + (f"; {'; '.join(notes)}" if notes else ""))
    peak, parts = predict(chosen)
    given_up = []
    if chosen.step_in_backward and not config.good_state_every:
        given_up.append("a step with a non-finite gradient may stay partly applied (finite updates only: "
                        "NaN/Inf still never reaches the weights) because good_state_every=0 keeps no state "
                        "to undo it from")
    if not config.good_state_every:
        given_up.append("divergence rollback (good_state_every=0 keeps no last good state)")
    if chosen.bf16:
        given_up.append("bit-identical results to an fp32 run (weights are bf16, rounded stochastically; "
                        "resume stays bit-exact)")
    per_param = (parts["weights"] + parts["optimizer_state"] + parts["trainer_buffers"] - TRAINER_FIXED_BYTES
                 + (0 if chosen.step_in_backward else n * (2 if chosen.bf16 else 4))) / max(n, 1)
    plan = MemoryPlan(techniques=chosen.techniques, optimizer_state_bits=chosen.bits,
                      step_in_backward=chosen.step_in_backward, weight_dtype="bfloat16" if chosen.bf16 else "float32",
                      predicted_peak_bytes=int(peak), budget_bytes=budget, parameters=n, bytes_per_param=per_param,
                      step_time_factor=chosen.time_factor, breakdown=parts, guarantees_given_up=given_up,
                      notes=notes + [f"not usable here: {b}" for b in blocked])
    logger.log(_log_level(plan), plan.summary())
    return plan


def _log_level(plan: MemoryPlan) -> int:
    """INFO when the user asked for planning or a technique is on; DEBUG for the plain run every
    trainer without a budget plans (a line per construction would only be noise)."""
    return logging.INFO if plan.budget_bytes is not None or plan.optimizer_state_bits or plan.step_in_backward \
        or plan.weight_dtype == "bfloat16" else logging.DEBUG


def refine_plan(plan: MemoryPlan, in_use_bytes: int, predictor_bytes_present: int) -> MemoryPlan:
    """The predicted peak again, from the memory in use once the trainer is built (weights
    converted, its fixed buffers allocated): what is still to come is the optimizer state, the
    lazily allocated snapshots and the step's transient memory. The choice stays."""
    b = plan.breakdown
    b["in_use_after_construction"] = in_use_bytes
    b["estimate_at_planning"] = plan.predicted_peak_bytes
    plan.predicted_peak_bytes = int(in_use_bytes + b["optimizer_state"] + b["good_state"] + b["anchor"]
                                    + b["weight_average"] + max(0, b["predictor"] - predictor_bytes_present)
                                    + b["transient"] + b["compile_runtime"])
    logger.log(_log_level(plan), "memory plan refined after construction: predicted peak %.3f GiB",
               plan.predicted_peak_bytes / 1024 ** 3)
    return plan


def memory_in_use(device: torch.device) -> int:
    """Bytes in use now: this process's RSS on a CPU, allocated tensors on a GPU."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    import psutil

    return int(psutil.Process().memory_info().rss)


@dataclass
class MemorySetup:
    """What the trainer runs with after planning."""

    plan: MemoryPlan
    optimizer: torch.optim.Optimizer
    in_backward: Any  # StepInBackward or None
    autocast_dtype: str | None  # forced by bf16 weights when the config sets none


def setup_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
                 loss_fn: Callable, config, example_batch: Any = None) -> MemorySetup:
    """Plan (:func:`plan_memory`) and apply the plan: bf16 weights (in place, the same
    Parameter objects), the optimizer rebuilt as a LowBitAdamW over the same param-group dicts
    (so an LR scheduler built over the original keeps driving it), and the backward hooks."""
    from .in_backward import StepInBackward
    from .lowbit_adamw import LowBitAdamW

    device = params[0].device
    autocast = None
    if config.autocast_dtype is not None:
        autocast = torch.autocast(device.type, dtype=getattr(torch, config.autocast_dtype))
    acts = None
    if example_batch is not None:
        acts = measure_activation_bytes(model, loss_fn, example_batch, autocast)
    plan = plan_memory(params, optimizer, config, in_use_bytes=memory_in_use(device), activation_bytes=acts,
                       predictor_eager=predictor_allocates_eagerly())
    needs_lowbit = plan.step_in_backward or plan.optimizer_state_bits is not None or plan.weight_dtype == "bfloat16"
    if needs_lowbit or (isinstance(optimizer, LowBitAdamW) and optimizer.defaults["state_bits"]
                        != plan.optimizer_state_bits):
        if any(optimizer.state.get(p) for p in params):
            raise ValueError(f"optimizer: {type(optimizer).__name__} has already stepped; the memory plan "
                             f"rebuilds it with low-bit state, so pass it before its first step")
        defaults, original = optimizer.defaults, optimizer
        optimizer = LowBitAdamW(optimizer.param_groups, lr=defaults["lr"], betas=defaults["betas"],
                                eps=defaults["eps"], weight_decay=defaults["weight_decay"],
                                state_bits=plan.optimizer_state_bits,
                                decoupled_weight_decay=bool(defaults.get("decoupled_weight_decay",
                                                                          isinstance(optimizer, torch.optim.AdamW))),
                                seed=config.seed)
        optimizer.stands_in_for = original
        for group in optimizer.param_groups:  # the plan's bits for every group, also ones that carried others
            group["state_bits"] = plan.optimizer_state_bits
            group["block_size"] = DEFAULT_BLOCK[plan.optimizer_state_bits] if plan.optimizer_state_bits else 256
    if plan.weight_dtype == "bfloat16":
        with torch.no_grad():
            for p in params:
                if p.dtype != torch.bfloat16:
                    p.data = p.data.to(torch.bfloat16)
    stepper = StepInBackward(params, optimizer) if plan.step_in_backward else None
    forced = "bfloat16" if plan.weight_dtype == "bfloat16" and config.autocast_dtype is None else None
    return MemorySetup(plan=plan, optimizer=optimizer, in_backward=stepper, autocast_dtype=forced)

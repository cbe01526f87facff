"""Training-state encoding: ring-buffer histories + optimizer moments → 64 float32 features.

``encode_state(history, optimizer_state)`` turns a :class:`StateHistory` (ring buffers of recent
losses, gradient norms and update norms, plus the trainer's scalars) and, optionally, the
optimizer's moment tensors into the fixed 64-slot vector the dynamics model reads. Every slot is
listed, with its formula and units, in :data:`FEATURE_TABLE` below; nothing is padding.

Two reductions do the work:

* **Window statistics** (a few hundred floats, latency-bound): one Triton program reads the three
  rings (stored back to back in one float32 buffer), computes every window statistic and the
  scalar features, and writes the 64 slots: one launch per call.
* **Optimizer moments** (every element of every ``exp_avg`` / ``exp_avg_sq``, bandwidth-bound):
  one launch per (device, dtype pair) group. Tensors are addressed as int64 *element offsets from
  the group's lowest-addressed tensor* (the interpreter cannot dereference a loaded pointer table,
  see :mod:`hybrid_kernels.apply_delta`), and a chunk table splits big tensors across programs.
  Each program writes fp32 partial sums (count, Σ|m|, Σm², Σ|v|, Σv²) of its chunk; the partials
  are added in float64 by one ``torch.sum`` (fixed order, no atomics: deterministic).

Conventions
-----------
* **Windows.** A ring holds the last ``capacity`` pushed values. Statistics use the *filled* part
  only; the time coordinate of an entry is its push index, so slopes are "per push" (per training
  step when the trainer pushes once per step). "Recent" statistics use the last 16 pushes (loss)
  or 8 pushes (norms), or fewer when fewer were made.
* **EMAs** are bias-corrected (Adam-style) exponential averages over the finite entries of the
  window: ``Σ w_k x_k / Σ w_k`` with ``w_k = (1 - α) ** age_k`` (age 0 = newest). They need no
  extra state, so a restored history gives bit-identical EMAs; the window forgets entries older
  than ``capacity`` (weight ≤ (3/4)^256, (15/16)^256, (63/64)^256 ≈ 0.018 for the slowest loss EMA).
* **Slope** is the least-squares line over the finite entries (units per push). **Curvature** is
  the second derivative ``2c`` of the least-squares parabola ``a + b t + c t²`` (units per push²),
  computed by Gram–Schmidt on a centred, scaled time axis so fp32 stays well conditioned.
  Fewer than 2 (slope) or 3 (curvature) finite entries give 0.
* **Std** is the population standard deviation (divide by n).

NaN / Inf policy
----------------
* Values pushed into a ring are **stored as given** (no host sync is needed to push a CUDA
  tensor). Every statistic **ignores non-finite entries**, and slots 19, 32 and 45 count the
  non-finite entries currently in each window, so a divergence stays visible.
* Optimizer-moment elements where ``m`` or ``v`` is non-finite are excluded from the moment
  statistics; slot 53 gives their fraction of all elements.
* Scalars (lr, step, phase, ...) are validated when set: a non-finite or out-of-range value
  raises ``ValueError`` (it is a trainer bug, not data).
* An empty window (or one with no finite entry) gives 0 for each of its statistics; its fill and
  non-finite slots say why. Logs use documented floors. The output is always finite: as a last
  guard (reached only by overflow, e.g. pushed values near 1e38) NaN becomes 0 and values are
  clamped to ±1e30.

Optimizer state
---------------
``optimizer_state`` may be ``None``, a ``torch.optim.Optimizer`` or a sequence of
``(exp_avg, exp_avg_sq)`` tensor pairs. From an optimizer, Adam-like state (``exp_avg`` and
``exp_avg_sq``: Adam, AdamW, NAdam, RAdam, ...) gives moment source 2; otherwise SGD's
``momentum_buffer`` gives source 1 (first-moment slots filled, second-moment slots 0); an optimizer
with neither (plain SGD, Adagrad, ...) or before its first step gives source 0 and zeros.
Statistics are over all elements of all tensors (element-weighted, not per-tensor averages).
Precision: sums of one chunk (≤ 8192 elements) in fp32, across chunks and tensors in float64;
``var = E[x²] - E[x]²`` in float64, so the relative error of a std is about
``1e-7 · (mean / std)²``, negligible for moment distributions (coefficient of variation ~1).

Why no ``torch.library`` op
---------------------------
The input is a Python object whose scalars change every step: as op arguments they would force a
recompile per step under ``torch.compile``, and the op runs in the trainer's control code, never
inside a compiled model. ``encode_state`` is therefore wrapped in ``torch.compiler.disable``: a
compiled caller gets a clean graph break instead of tracing kernel launches.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ._dispatch import choose_backend, record
from ._multi_tensor import cached_layout
from ._triton_compat import INTERPRET, tl, triton

NUM_FEATURES = 64
PHASES = ("warmup", "full", "predict", "correct")  # phase code = index

# Window parameters (shared by the kernel and the eager reference).
LOSS_RECENT = 16
NORM_RECENT = 8
LOSS_EMA_ALPHAS = (1.0 / 4.0, 1.0 / 16.0, 1.0 / 64.0)
NORM_EMA_ALPHA = 1.0 / 8.0
MAX_CAPACITY = 4096  # one program holds a whole ring in registers

# Floors that keep divisions and logs finite (documented in the table).
RATIO_EPS = 1e-12
LOSS_SCALE_EPS = 1e-8
LOG_FLOOR_NORM = 1e-12
LOG_FLOOR_LR = 1e-12
LOG_FLOOR_V = 1e-30
OUTPUT_LIMIT = 1e30

# fmt: off
#: The layout. (index, name, formula, units). "window" = finite entries of the ring.
FEATURE_TABLE: tuple[tuple[int, str, str, str], ...] = (
    # -- loss ring (capacity 256 by default) ------------------------------------------------
    (0, "loss_last", "newest finite loss in the window", "loss"),
    (1, "loss_mean", "mean over the window", "loss"),
    (2, "loss_std", "population std over the window", "loss"),
    (3, "loss_min", "min over the window", "loss"),
    (4, "loss_max", "max over the window", "loss"),
    (5, "loss_slope", "least-squares slope over the window", "loss/step"),
    (6, "loss_curvature", "2c of the least-squares parabola a+bt+ct² over the window", "loss/step²"),
    (7, "loss_ema_fast", "bias-corrected EMA, alpha 1/4, over the window", "loss"),
    (8, "loss_ema_mid", "bias-corrected EMA, alpha 1/16, over the window", "loss"),
    (9, "loss_ema_slow", "bias-corrected EMA, alpha 1/64, over the window", "loss"),
    (10, "loss_recent_mean", "mean over the last 16 pushes", "loss"),
    (11, "loss_recent_std", "population std over the last 16 pushes", "loss"),
    (12, "loss_recent_slope", "least-squares slope over the last 16 pushes", "loss/step"),
    (13, "loss_detrended_std", "std of the residuals of the window's least-squares line (noise)", "loss"),
    (14, "loss_symlog_last", "sign(x)·ln(1+|x|) of loss_last", "ln loss"),
    (15, "loss_last_zscore", "(loss_last - loss_mean) / max(loss_std, 1e-12)", "std units"),
    (16, "loss_trend_ratio", "(ema_slow - ema_fast) / max(|ema_slow|, 1e-8); > 0 while improving", "ratio"),
    (17, "loss_steps_since_min", "age of the newest occurrence of the window minimum", "steps"),
    (18, "loss_fill", "finite entries / capacity", "fraction"),
    (19, "loss_nonfinite", "non-finite entries in the window", "count"),
    # -- gradient-norm ring (capacity 64) ---------------------------------------------------
    (20, "grad_norm_last", "newest finite gradient norm", "norm"),
    (21, "grad_norm_mean", "mean over the window", "norm"),
    (22, "grad_norm_std", "population std over the window", "norm"),
    (23, "grad_norm_min", "min over the window", "norm"),
    (24, "grad_norm_max", "max over the window", "norm"),
    (25, "grad_norm_slope", "least-squares slope over the window", "norm/step"),
    (26, "grad_norm_ema", "bias-corrected EMA, alpha 1/8, over the window", "norm"),
    (27, "grad_norm_recent_mean", "mean over the last 8 pushes", "norm"),
    (28, "grad_norm_recent_std", "population std over the last 8 pushes", "norm"),
    (29, "grad_norm_log10_last", "log10(max(grad_norm_last, 1e-12)); 0 if the window is empty", "log10 norm"),
    (30, "grad_norm_cv", "grad_norm_std / max(grad_norm_mean, 1e-12)", "ratio"),
    (31, "grad_norm_spike", "grad_norm_last / max(grad_norm_mean, 1e-12)", "ratio"),
    (32, "grad_norm_nonfinite", "non-finite entries in the window", "count"),
    # -- update-norm ring (capacity 64): ||θ_{t+1} - θ_t|| ------------------------------------
    (33, "update_norm_last", "newest finite update norm", "norm"),
    (34, "update_norm_mean", "mean over the window", "norm"),
    (35, "update_norm_std", "population std over the window", "norm"),
    (36, "update_norm_min", "min over the window", "norm"),
    (37, "update_norm_max", "max over the window", "norm"),
    (38, "update_norm_slope", "least-squares slope over the window", "norm/step"),
    (39, "update_norm_ema", "bias-corrected EMA, alpha 1/8, over the window", "norm"),
    (40, "update_norm_recent_mean", "mean over the last 8 pushes", "norm"),
    (41, "update_norm_log10_last", "log10(max(update_norm_last, 1e-12)); 0 if the window is empty", "log10 norm"),
    (42, "update_norm_cv", "update_norm_std / max(update_norm_mean, 1e-12)", "ratio"),
    (43, "update_to_grad_last", "update_norm_last / max(grad_norm_last, 1e-12)", "ratio"),
    (44, "update_to_grad_mean", "update_norm_mean / max(grad_norm_mean, 1e-12)", "ratio"),
    (45, "update_norm_nonfinite", "non-finite entries in the window", "count"),
    # -- optimizer moments over every element of every parameter's state -----------------------
    (46, "moment_source", "0 none, 1 first moment only (SGD momentum_buffer), 2 exp_avg + exp_avg_sq", "code"),
    (47, "m_abs_mean", "mean of |exp_avg| (or |momentum_buffer|) over all elements", "grad units"),
    (48, "m_abs_std", "population std of |exp_avg| over all elements", "grad units"),
    (49, "v_mean", "mean of exp_avg_sq over all elements; 0 unless source 2", "grad units²"),
    (50, "v_std", "population std of exp_avg_sq over all elements; 0 unless source 2", "grad units²"),
    (51, "v_log10_mean", "log10(max(v_mean, 1e-30)); 0 unless source 2", "log10 grad units²"),
    (52, "moment_snr", "m_abs_mean / sqrt(v_mean); 0 unless source 2 and v_mean > 0", "ratio"),
    (53, "moment_nonfinite_fraction", "elements with non-finite m or v / all elements", "fraction"),
    # -- trainer scalars --------------------------------------------------------------------------
    (54, "lr", "learning rate of the first parameter group (as set on the history)", "lr"),
    (55, "log10_lr", "log10(max(lr, 1e-12))", "log10 lr"),
    (56, "log10_step", "log10(1 + step)", "log10 steps"),
    (57, "phase_warmup", "1 if phase == WARMUP else 0", "one-hot"),
    (58, "phase_full", "1 if phase == FULL else 0", "one-hot"),
    (59, "phase_predict", "1 if phase == PREDICT else 0", "one-hot"),
    (60, "phase_correct", "1 if phase == CORRECT else 0", "one-hot"),
    (61, "phase_step", "steps since the current phase began", "steps"),
    (62, "prediction_error", "recent prediction error as set by the trainer", "trainer-defined (>= 0)"),
    (63, "acceptance_rate", "recent fraction of accepted predictions", "fraction"),
)
# fmt: on
FEATURE_NAMES: tuple[str, ...] = tuple(name for _, name, _, _ in FEATURE_TABLE)
FEATURE_INDEX: dict[str, int] = {name: i for i, name in enumerate(FEATURE_NAMES)}

#: The moment summary passed from the multi-tensor reduction to the window kernel.
MOMENT_STAT_NAMES = ("moment_source", "m_abs_mean", "m_abs_std", "v_mean", "v_std", "moment_nonfinite_fraction")

# Multi-tensor reduction: a program reduces BLOCK * ITERS elements of one tensor.
_MOMENT_BLOCK = 8192 if INTERPRET else 1024
_MOMENT_ITERS = 1 if INTERPRET else 8
_N_PARTIALS = 5  # count, Σ|m|, Σm², Σ|v|, Σv²

_launches: dict[str, int] = {"window": 0, "moments": 0}


def kernel_launches() -> dict[str, int]:
    """Triton launches made so far by encode_state, by kernel ("window", "moments")."""
    return dict(_launches)


# --------------------------------------------------------------------------------------------
# History container
# --------------------------------------------------------------------------------------------
_RINGS = ("loss", "grad_norm", "update_norm")


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def _check_float(name: str, value: Any, low: float | None = None, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


class StateHistory:
    """Ring buffers of recent losses, gradient norms and update norms, and the trainer's scalars.

    The three rings live back to back in one float32 tensor ``buffer`` of
    ``loss_capacity + grad_norm_capacity + update_norm_capacity`` elements on ``device`` (the
    window kernel reads them in one program). Ring ``r`` occupies ``buffer[offset_r :
    offset_r + capacity_r]``; after ``pushes_r`` pushes the next value goes to slot
    ``pushes_r % capacity_r`` and the window holds the last ``min(pushes_r, capacity_r)``
    values. Values are stored as float32, non-finite ones included (see the module docstring's
    NaN policy). A push of a tensor on ``device`` is a device-side copy (no host sync).

    Scalars (validated on assignment; ``ValueError``/``TypeError`` name the field):
        lr: float >= 0, finite. step: int >= 0. phase: int code in 0..3 (``PHASES``).
        phase_step: int >= 0. prediction_error: float >= 0, finite. acceptance_rate: float in [0, 1].
    """

    def __init__(self, loss_capacity: int = 256, grad_norm_capacity: int = 64,
                 update_norm_capacity: int = 64, device: torch.device | str = "cpu"):
        caps = (
            _check_int("loss_capacity", loss_capacity, 1, MAX_CAPACITY),
            _check_int("grad_norm_capacity", grad_norm_capacity, 1, MAX_CAPACITY),
            _check_int("update_norm_capacity", update_norm_capacity, 1, MAX_CAPACITY),
        )
        self._capacity = dict(zip(_RINGS, caps))
        self._offset = dict(zip(_RINGS, (0, caps[0], caps[0] + caps[1])))
        self._pushes = dict.fromkeys(_RINGS, 0)
        self.buffer = torch.zeros(sum(caps), dtype=torch.float32, device=device)
        self._lr = 0.0
        self._step = 0
        self._phase = 0
        self._phase_step = 0
        self._prediction_error = 0.0
        self._acceptance_rate = 0.0

    # -- rings ----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def capacity(self, ring: str) -> int:
        return self._capacity[self._ring(ring)]

    def pushes(self, ring: str) -> int:
        """Values pushed into ``ring`` since creation (not capped by the capacity)."""
        return self._pushes[self._ring(ring)]

    def count(self, ring: str) -> int:
        """Values currently held by ``ring`` (finite or not)."""
        ring = self._ring(ring)
        return min(self._pushes[ring], self._capacity[ring])

    def head(self, ring: str) -> int:
        """Slot the next push of ``ring`` writes to."""
        ring = self._ring(ring)
        return self._pushes[ring] % self._capacity[ring]

    def values(self, ring: str) -> torch.Tensor:
        """The held values of ``ring``, oldest first: float32 ``[count]`` (a copy)."""
        ring = self._ring(ring)
        cap, n = self._capacity[ring], self.count(ring)
        slots = (torch.arange(n) + self.head(ring) - n) % cap + self._offset[ring]
        return self.buffer[slots.to(self.device)].clone()

    def push_loss(self, loss: float | torch.Tensor) -> None:
        """Append one loss (Python number or one-element tensor; any float dtype/device)."""
        self._push("loss", loss, "loss")

    def push_grad_norm(self, grad_norm: float | torch.Tensor) -> None:
        """Append one global gradient L2 norm (taken before clipping)."""
        self._push("grad_norm", grad_norm, "grad_norm")

    def push_update_norm(self, update_norm: float | torch.Tensor) -> None:
        """Append one update L2 norm ||θ_{t+1} - θ_t|| (optimizer step or applied prediction)."""
        self._push("update_norm", update_norm, "update_norm")

    def _ring(self, ring: str) -> str:
        if ring not in self._capacity:
            raise ValueError(f"ring must be one of {_RINGS}, got {ring!r}")
        return ring

    def _push(self, ring: str, value: Any, arg: str) -> None:
        slot = self._offset[ring] + self._pushes[ring] % self._capacity[ring]
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"{arg} must be a number or a one-element tensor, got shape {tuple(value.shape)}")
            if not (value.dtype.is_floating_point or value.dtype in (torch.int32, torch.int64)):
                raise TypeError(f"{arg} must be a real number tensor, got {value.dtype}")
            self.buffer[slot:slot + 1].copy_(value.detach().reshape(1), non_blocking=True)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            self.buffer[slot] = float(value)
        else:
            raise TypeError(f"{arg} must be a float or a one-element tensor, got {type(value).__name__}")
        self._pushes[ring] += 1

    # -- scalars ----------------------------------------------------------------------------
    @property
    def lr(self) -> float:
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._lr = _check_float("lr", value, low=0.0)

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = _check_int("step", value, 0)

    @property
    def phase(self) -> int:
        return self._phase

    @phase.setter
    def phase(self, value: int) -> None:
        # IntEnum members (the trainer's Phase enum) are ints; int() drops the enum type.
        self._phase = int(_check_int("phase", value, 0, len(PHASES) - 1))

    @property
    def phase_step(self) -> int:
        return self._phase_step

    @phase_step.setter
    def phase_step(self, value: int) -> None:
        self._phase_step = _check_int("phase_step", value, 0)

    @property
    def prediction_error(self) -> float:
        return self._prediction_error

    @prediction_error.setter
    def prediction_error(self, value: float) -> None:
        self._prediction_error = _check_float("prediction_error", value, low=0.0)

    @property
    def acceptance_rate(self) -> float:
        return self._acceptance_rate

    @acceptance_rate.setter
    def acceptance_rate(self, value: float) -> None:
        self._acceptance_rate = _check_float("acceptance_rate", value, low=0.0, high=1.0)

    # -- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-exactly; the buffer is a CPU copy."""
        return {
            "version": 1,
            "capacities": dict(self._capacity),
            "pushes": dict(self._pushes),
            "buffer": self.buffer.detach().to("cpu", copy=True),
            "scalars": {"lr": self._lr, "step": self._step, "phase": self._phase, "phase_step": self._phase_step,
                        "prediction_error": self._prediction_error, "acceptance_rate": self._acceptance_rate},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`. Capacities must match this history's."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        missing = {"version", "capacities", "pushes", "buffer", "scalars"} - set(state)
        if missing:
            raise ValueError(f"state is missing keys {sorted(missing)}")
        if state["version"] != 1:
            raise ValueError(f"state has unsupported version {state['version']!r}")
        if dict(state["capacities"]) != self._capacity:
            raise ValueError(f"state has capacities {dict(state['capacities'])} but this history has {self._capacity}")
        buffer = state["buffer"]
        if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.float32 or buffer.shape != self.buffer.shape:
            raise ValueError(f"state['buffer'] must be a float32 tensor of shape {tuple(self.buffer.shape)}")
        pushes = {ring: _check_int(f"state['pushes'][{ring!r}]", state["pushes"][ring], 0) for ring in _RINGS}
        scalars = state["scalars"]
        # Validate everything before mutating anything.
        probe = StateHistory.__new__(StateHistory)
        for name in ("lr", "step", "phase", "phase_step", "prediction_error", "acceptance_rate"):
            setattr(probe, name, scalars[name])
        self.buffer.copy_(buffer)
        self._pushes = pushes
        for name in ("lr", "step", "phase", "phase_step", "prediction_error", "acceptance_rate"):
            setattr(self, f"_{name}", getattr(probe, f"_{name}"))

    def __repr__(self) -> str:
        fill = ", ".join(f"{r}={self.count(r)}/{self._capacity[r]}" for r in _RINGS)
        return (f"StateHistory({fill}, lr={self._lr:g}, step={self._step}, phase={PHASES[self._phase]}, "
                f"phase_step={self._phase_step}, device={self.device})")


# --------------------------------------------------------------------------------------------
# Triton kernels: window statistics
# --------------------------------------------------------------------------------------------
# The three rings are rows 0 (loss), 1 (grad_norm), 2 (update_norm) of one [4, BLOCK] tile (row 3
# is empty padding): every statistic is computed once for all rings, and the interpreter (whose
# cost is per op and per helper call, not per element) runs one pass instead of three.
@triton.jit
def _masked_mean_std(x, mask):
    """Row-wise n, mean, population std of x over mask ([R, B] → [R, 1]); zeros when n == 0."""
    n = tl.sum(mask.to(tl.float32), axis=1, keep_dims=True)
    safe_n = tl.maximum(n, 1.0)
    mean = tl.sum(tl.where(mask, x, 0.0), axis=1, keep_dims=True) / safe_n
    dev = tl.where(mask, x - mean, 0.0)
    return n, mean, tl.sqrt(tl.sum(dev * dev, axis=1, keep_dims=True) / safe_n)


@triton.jit
def _masked_fit(x, t, mask, n, mean):
    """Row-wise least squares over mask: slope of a line, 2c of a parabola, residual std of the line.

    Time is centred on the masked mean and scaled to [-1, 1] (u) so the normal equations stay
    well conditioned in fp32; the parabola coefficient is the regression of x on the part of u²
    orthogonal to (1, u), which equals the full fit's coefficient (Frisch–Waugh–Lovell)."""
    safe_n = tl.maximum(n, 1.0)
    t_mean = tl.sum(tl.where(mask, t, 0.0), axis=1, keep_dims=True) / safe_n
    dt = tl.where(mask, t - t_mean, 0.0)
    scale = tl.maximum(tl.max(tl.abs(dt), axis=1, keep_dims=True), 1.0)
    u = dt / scale
    dx = tl.where(mask, x - mean, 0.0)
    s_uu = tl.sum(u * u, axis=1, keep_dims=True)
    s_uuu = tl.sum(u * u * u, axis=1, keep_dims=True)
    s_xu = tl.sum(u * dx, axis=1, keep_dims=True)
    s_xx = tl.sum(dx * dx, axis=1, keep_dims=True)
    b_u = tl.where((n >= 2.0) & (s_uu > 0.0), s_xu / tl.maximum(s_uu, 1e-30), 0.0)
    q = tl.where(mask, u * u - s_uu / safe_n - (s_uuu / tl.maximum(s_uu, 1e-30)) * u, 0.0)
    s_qq = tl.sum(q * q, axis=1, keep_dims=True)
    c_u = tl.where((n >= 3.0) & (s_qq > 1e-12),
                   tl.sum(q * dx, axis=1, keep_dims=True) / tl.maximum(s_qq, 1e-30), 0.0)
    residual = tl.maximum(s_xx - b_u * s_xu, 0.0) / safe_n
    return b_u / scale, 2.0 * c_u / (scale * scale), tl.sqrt(residual)


@triton.jit
def _encode_window_kernel(buf_ptr, moments_ptr, out_ptr,
                          loss_off, loss_cap, loss_head, loss_count,
                          grad_off, grad_cap, grad_head, grad_count,
                          upd_off, upd_cap, upd_head, upd_count,
                          loss_decay_a, loss_decay_b, loss_decay_c, norm_decay,
                          lr, step, phase, phase_step, prediction_error, acceptance_rate,
                          LOSS_RECENT_N: tl.constexpr, NORM_RECENT_N: tl.constexpr, BLOCK: tl.constexpr):
    """One program writes all 64 slots (layout: FEATURE_TABLE). ``*_decay`` = log2(1 - alpha)."""
    LOG10_2: tl.constexpr = 0.30102999566398120
    rows = tl.arange(0, 4)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    is_loss = rows == 0
    is_grad = rows == 1
    is_upd = rows == 2
    offset = tl.where(is_loss, loss_off, tl.where(is_grad, grad_off, upd_off))
    cap = tl.where(is_loss, loss_cap, tl.where(is_grad, grad_cap, tl.where(is_upd, upd_cap, 0)))
    head = tl.where(is_loss, loss_head, tl.where(is_grad, grad_head, upd_head))
    count = tl.where(is_loss, loss_count, tl.where(is_grad, grad_count, tl.where(is_upd, upd_count, 0)))
    in_ring = cols < cap
    # age 0 = newest. head-1-col+cap >= 0 on in-ring lanes, so % is the same on GPU and CPU.
    age_i = tl.where(in_ring, (head - 1 - cols + cap) % tl.maximum(cap, 1), 0)
    filled = in_ring & (age_i < count)
    raw = tl.load(buf_ptr + offset + cols, mask=filled, other=0.0)
    finite = filled & ((raw - raw) == 0.0)  # inf - inf and nan - nan are nan
    x = tl.where(finite, raw, 0.0)
    age = age_i.to(tl.float32)

    n_filled = tl.sum(filled.to(tl.float32), axis=1, keep_dims=True)
    n, mean, std = _masked_mean_std(x, finite)
    has = n > 0.0
    lo = tl.where(has, tl.min(tl.where(finite, x, float("inf")), axis=1, keep_dims=True), 0.0)
    hi = tl.where(has, tl.max(tl.where(finite, x, float("-inf")), axis=1, keep_dims=True), 0.0)
    newest = tl.min(tl.where(finite, age, 1e9), axis=1, keep_dims=True)
    last = tl.sum(tl.where(finite & (age == newest), x, 0.0), axis=1, keep_dims=True)
    since_min = tl.min(tl.where(finite & (x == lo), age, 1e9), axis=1, keep_dims=True)
    since_min = tl.where(has, since_min, 0.0)
    slope, curvature, detrended = _masked_fit(x, -age, finite, n, mean)
    w_a = tl.where(finite, tl.exp2(age * tl.where(is_loss, loss_decay_a, norm_decay)), 0.0)
    ema_a = tl.sum(w_a * x, axis=1, keep_dims=True) / tl.maximum(tl.sum(w_a, axis=1, keep_dims=True), 1e-30)
    w_b = tl.where(finite, tl.exp2(age * loss_decay_b), 0.0)  # used for the loss row only
    ema_b = tl.sum(w_b * x, axis=1, keep_dims=True) / tl.maximum(tl.sum(w_b, axis=1, keep_dims=True), 1e-30)
    w_c = tl.where(finite, tl.exp2(age * loss_decay_c), 0.0)
    ema_c = tl.sum(w_c * x, axis=1, keep_dims=True) / tl.maximum(tl.sum(w_c, axis=1, keep_dims=True), 1e-30)
    recent = finite & (age_i < tl.where(is_loss, LOSS_RECENT_N, NORM_RECENT_N))
    r_n, r_mean, r_std = _masked_mean_std(x, recent)
    r_slope, _r_curvature, _r_residual = _masked_fit(x, -age, recent, r_n, r_mean)

    # Statistics every ring has: one vector store each, at the ring's slot (-1 = not stored).
    ring_row = rows < 3
    tl.store(out_ptr + tl.where(is_loss, 0, tl.where(is_grad, 20, 33)), last, mask=ring_row)
    tl.store(out_ptr + tl.where(is_loss, 1, tl.where(is_grad, 21, 34)), mean, mask=ring_row)
    tl.store(out_ptr + tl.where(is_loss, 2, tl.where(is_grad, 22, 35)), std, mask=ring_row)
    tl.store(out_ptr + tl.where(is_loss, 3, tl.where(is_grad, 23, 36)), lo, mask=ring_row)
    tl.store(out_ptr + tl.where(is_loss, 4, tl.where(is_grad, 24, 37)), hi, mask=ring_row)
    tl.store(out_ptr + tl.where(is_loss, 5, tl.where(is_grad, 25, 38)), slope, mask=ring_row)
    tl.store(out_ptr + tl.where(is_loss, 7, tl.where(is_grad, 26, 39)), ema_a, mask=ring_row)
    tl.store(out_ptr + tl.where(is_loss, 10, tl.where(is_grad, 27, 40)), r_mean, mask=ring_row)
    tl.store(out_ptr + tl.where(is_loss, 19, tl.where(is_grad, 32, 45)), n_filled - n, mask=ring_row)
    tl.store(out_ptr + tl.where(is_loss, 11, 28), r_std, mask=is_loss | is_grad)
    log10_last = tl.where(has, tl.log2(tl.maximum(last, 1e-12)) * LOG10_2, 0.0)
    tl.store(out_ptr + tl.where(is_grad, 29, 41), log10_last, mask=is_grad | is_upd)
    tl.store(out_ptr + tl.where(is_grad, 30, 42), std / tl.maximum(mean, 1e-12), mask=is_grad | is_upd)
    tl.store(out_ptr + 31 + rows * 0, last / tl.maximum(mean, 1e-12), mask=is_grad)
    # Loss-only statistics.
    tl.store(out_ptr + 6 + rows * 0, curvature, mask=is_loss)
    tl.store(out_ptr + 8 + rows * 0, ema_b, mask=is_loss)
    tl.store(out_ptr + 9 + rows * 0, ema_c, mask=is_loss)
    tl.store(out_ptr + 12 + rows * 0, r_slope, mask=is_loss)
    tl.store(out_ptr + 13 + rows * 0, detrended, mask=is_loss)
    symlog = tl.log(1.0 + tl.abs(last))
    tl.store(out_ptr + 14 + rows * 0, tl.where(last < 0.0, -symlog, symlog), mask=is_loss)
    tl.store(out_ptr + 15 + rows * 0, (last - mean) / tl.maximum(std, 1e-12), mask=is_loss)
    tl.store(out_ptr + 16 + rows * 0, (ema_c - ema_a) / tl.maximum(tl.abs(ema_c), 1e-8), mask=is_loss)
    tl.store(out_ptr + 17 + rows * 0, since_min, mask=is_loss)
    tl.store(out_ptr + 18 + rows * 0, n / tl.maximum(cap, 1).to(tl.float32), mask=is_loss)
    # Update-to-gradient ratios read the gradient row.
    g_last = tl.sum(tl.where(is_grad, last, 0.0))
    g_mean = tl.sum(tl.where(is_grad, mean, 0.0))
    tl.store(out_ptr + 43 + rows * 0, last / tl.maximum(g_last, 1e-12), mask=is_upd)
    tl.store(out_ptr + 44 + rows * 0, mean / tl.maximum(g_mean, 1e-12), mask=is_upd)

    source = tl.load(moments_ptr + 0)
    m_mean = tl.load(moments_ptr + 1)
    v_mean = tl.load(moments_ptr + 3)
    second = source == 2.0
    tl.store(out_ptr + 46, source)
    tl.store(out_ptr + 47, m_mean)
    tl.store(out_ptr + 48, tl.load(moments_ptr + 2))
    tl.store(out_ptr + 49, v_mean)
    tl.store(out_ptr + 50, tl.load(moments_ptr + 4))
    tl.store(out_ptr + 51, tl.where(second, tl.log2(tl.maximum(v_mean, 1e-30)) * LOG10_2, 0.0))
    snr = m_mean / tl.sqrt(tl.maximum(v_mean, 1e-30))
    tl.store(out_ptr + 52, tl.where(second & (v_mean > 0.0), snr, 0.0))
    tl.store(out_ptr + 53, tl.load(moments_ptr + 5))

    tl.store(out_ptr + 54, lr)
    tl.store(out_ptr + 55, tl.log2(tl.maximum(lr, 1e-12)) * LOG10_2)
    tl.store(out_ptr + 56, tl.log2(1.0 + step) * LOG10_2)
    tl.store(out_ptr + 57 + rows, tl.where(rows == phase, 1.0, 0.0))  # one-hot, slots 57..60
    tl.store(out_ptr + 61, phase_step)
    tl.store(out_ptr + 62, prediction_error)
    tl.store(out_ptr + 63, acceptance_rate)


# --------------------------------------------------------------------------------------------
# Triton kernel: optimizer-moment partial sums over many tensors
# --------------------------------------------------------------------------------------------
@triton.jit
def _moment_span(m_ptr, v_ptr, idx, numel, cnt, s_m, s_mm, s_v, s_vv,
                 HAS_V: tl.constexpr, MASKED: tl.constexpr):
    if MASKED:
        inside = idx < numel
        m = tl.load(m_ptr + idx, mask=inside, other=0.0).to(tl.float32)
    else:
        inside = idx >= 0
        m = tl.load(m_ptr + idx).to(tl.float32)
    ok = inside & ((m - m) == 0.0)
    if HAS_V:
        if MASKED:
            v = tl.load(v_ptr + idx, mask=inside, other=0.0).to(tl.float32)
        else:
            v = tl.load(v_ptr + idx).to(tl.float32)
        ok = ok & ((v - v) == 0.0)
        v = tl.where(ok, tl.abs(v), 0.0)
        s_v += v
        s_vv += v * v
    m = tl.where(ok, tl.abs(m), 0.0)
    cnt += ok.to(tl.float32)
    s_m += m
    s_mm += m * m
    return cnt, s_m, s_mm, s_v, s_vv


@triton.jit
def _moment_partials_kernel(m_base, v_base, chunk_tensor_ptr, chunk_start_ptr, meta_ptr, partial_ptr,
                            HAS_V: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
                            ITERS: tl.constexpr):
    """Program pid reduces elements [start, start + BLOCK*ITERS) of tensor t into 5 fp32 sums."""
    pid = tl.program_id(0)
    t = tl.load(chunk_tensor_ptr + pid)
    start = tl.load(chunk_start_ptr + pid)
    m_off = tl.load(meta_ptr + t * 3)
    v_off = tl.load(meta_ptr + t * 3 + 1)
    numel = tl.load(meta_ptr + t * 3 + 2)
    if ALIGNED:
        m_off = tl.multiple_of(m_off, 16)
        v_off = tl.multiple_of(v_off, 16)
    m_ptr = m_base + m_off
    v_ptr = v_base + v_off
    offs = tl.arange(0, BLOCK)
    cnt = tl.zeros([BLOCK], dtype=tl.float32)
    s_m = tl.zeros([BLOCK], dtype=tl.float32)
    s_mm = tl.zeros([BLOCK], dtype=tl.float32)
    s_v = tl.zeros([BLOCK], dtype=tl.float32)
    s_vv = tl.zeros([BLOCK], dtype=tl.float32)
    if start + BLOCK * ITERS <= numel:  # full chunk: unmasked loads
        for i in range(ITERS):
            cnt, s_m, s_mm, s_v, s_vv = _moment_span(m_ptr, v_ptr, start + i * BLOCK + offs, numel,
                                                     cnt, s_m, s_mm, s_v, s_vv, HAS_V, False)
    else:
        for i in range(ITERS):
            cnt, s_m, s_mm, s_v, s_vv = _moment_span(m_ptr, v_ptr, start + i * BLOCK + offs, numel,
                                                     cnt, s_m, s_mm, s_v, s_vv, HAS_V, True)
    out = partial_ptr + pid * 5
    tl.store(out + 0, tl.sum(cnt, axis=0))
    tl.store(out + 1, tl.sum(s_m, axis=0))
    tl.store(out + 2, tl.sum(s_mm, axis=0))
    tl.store(out + 3, tl.sum(s_v, axis=0))
    tl.store(out + 4, tl.sum(s_vv, axis=0))


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
def _log2_decay(alpha: float) -> float:
    return math.log2(1.0 - alpha)


def _ring_args(history: StateHistory, ring: str) -> tuple[int, int, int, int]:
    return history._offset[ring], history.capacity(ring), history.head(ring), history.count(ring)


def _encode_window_triton(history: StateHistory, moments: torch.Tensor) -> torch.Tensor:
    out = torch.empty(NUM_FEATURES, dtype=torch.float32, device=history.device)
    block = max(16, triton.next_power_of_2(max(history.capacity(r) for r in _RINGS)))
    _encode_window_kernel[(1,)](
        history.buffer, moments, out,
        *_ring_args(history, "loss"), *_ring_args(history, "grad_norm"), *_ring_args(history, "update_norm"),
        *(_log2_decay(a) for a in LOSS_EMA_ALPHAS), _log2_decay(NORM_EMA_ALPHA),
        float(history.lr), float(history.step), int(history.phase), float(history.phase_step),
        float(history.prediction_error), float(history.acceptance_rate),
        LOSS_RECENT_N=LOSS_RECENT, NORM_RECENT_N=NORM_RECENT, BLOCK=block)
    _launches["window"] += 1
    return out


def _moment_sums_triton_group(ms: list[torch.Tensor], vs: list[torch.Tensor] | None) -> torch.Tensor:
    """One launch for tensors sharing device and dtypes: float64 [5] sums on their device."""
    device = ms[0].device
    has_v = vs is not None
    lists = [ms, vs if has_v else ms]  # the second pointer is unused when there is no second moment
    layout = cached_layout(lists, _MOMENT_BLOCK * _MOMENT_ITERS)
    base_m, base_v = layout.bases(lists)
    partial = torch.empty((layout.n_chunks, _N_PARTIALS), dtype=torch.float32, device=device)
    _moment_partials_kernel[(layout.n_chunks,)](
        base_m, base_v, layout.chunk_tensor, layout.chunk_start,
        layout.meta, partial, HAS_V=has_v, ALIGNED=layout.aligned, BLOCK=_MOMENT_BLOCK, ITERS=_MOMENT_ITERS)
    _launches["moments"] += 1
    return partial.sum(dim=0, dtype=torch.float64)


def _flat_addressable(ts: list[torch.Tensor]) -> list[bool]:
    """Tensors the kernel can read as flat memory at a whole-element offset from the group base."""
    base = min(t.data_ptr() for t in ts)
    return [t.is_contiguous() and (t.data_ptr() - base) % t.element_size() == 0 for t in ts]


# --------------------------------------------------------------------------------------------
# Eager references (the CPU path and the test oracle)
# --------------------------------------------------------------------------------------------
def _abs_power_sums(ts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tensor (Σ|t|, Σt²) as two float64 ``[len(ts)]`` tensors.

    fp32 ``torch.sum`` (blocked, pairwise accumulation: 2e-8 relative error on 25M elements,
    measured) rather than ``vector_norm``, which accumulates sequentially in fp32 and lost ~5% on
    a 25M-element tensor, or float64 reductions, which convert the input and ran 2.6x slower."""
    l1, l2 = [], []
    for t in ts:
        magnitude = t.abs()
        l1.append(magnitude.sum())
        l2.append(magnitude.square_().sum())
    return torch.stack(l1).double(), torch.stack(l2).double()


def _moment_sums_eager(ms: list[torch.Tensor], vs: list[torch.Tensor] | None) -> torch.Tensor:
    """float64 [5] sums (count, Σ|m|, Σm², Σ|v|, Σv²) on ms[0].device over finite element pairs.

    Fast path: fp32 blocked sums per tensor. A tensor whose sums come out non-finite holds a
    non-finite element and is redone with an explicit finiteness mask."""
    device = ms[0].device
    detached_m = [m.detach() for m in ms]
    columns = [torch.tensor([float(m.numel()) for m in ms], dtype=torch.float64), *_abs_power_sums(detached_m)]
    if vs is not None:
        columns += _abs_power_sums([v.detach() for v in vs])
    sums = torch.stack([c.to(device) for c in columns], dim=1)
    for i in (~torch.isfinite(sums).all(dim=1)).nonzero().flatten().tolist():  # one check for all tensors
        m = ms[i].detach()
        ok = torch.isfinite(m)
        if vs is not None:
            ok &= torch.isfinite(vs[i])
        m_ok = torch.where(ok, m.abs(), 0).double()
        row = [ok.sum(dtype=torch.float64), m_ok.sum(), m_ok.square().sum()]
        if vs is not None:
            v_ok = torch.where(ok, vs[i].detach().abs(), 0).double()
            row += [v_ok.sum(), v_ok.square().sum()]
        sums[i] = torch.stack(row).to(device)
    total = torch.zeros(_N_PARTIALS, dtype=torch.float64, device=device)
    total[: sums.shape[1]] = sums.sum(dim=0)
    return total


def _ring_stats_eager(history: StateHistory, ring: str, recent: int, alphas: tuple[float, float, float]) -> dict:
    """Window statistics of one ring in float64 (same definitions as ``_ring_stats``). NumPy, not
    torch: a window holds at most a few hundred floats, where each torch op's dispatch (~5 µs)
    costs far more than its arithmetic; with torch ops the encoding took ~4 ms per step."""
    x_all = history.values(ring).detach().cpu().double().numpy()
    count = x_all.size
    age_all = np.arange(count - 1, -1, -1, dtype=np.float64)
    finite = np.isfinite(x_all)
    x, age = x_all[finite], age_all[finite]
    n = x.size
    zero = 0.0
    stats = {"n": float(n), "bad": float(count - n), "capacity": float(history.capacity(ring))}
    if n == 0:
        stats.update(last=zero, mean=zero, std=zero, min=zero, max=zero, slope=zero, curvature=zero,
                     detrended=zero, ema=[zero] * 3, recent_mean=zero, recent_std=zero, recent_slope=zero,
                     since_min=zero)
        return stats
    slope, curvature, detrended = _fit_eager(x, -age)
    lo = x.min()
    emas = []
    for alpha in alphas:
        w = np.exp2(age * _log2_decay(alpha))
        emas.append(float((w * x).sum() / w.sum()))
    recent_mask = age < recent
    xr, ar = x[recent_mask], age[recent_mask]
    if xr.size:
        r_mean, r_std = float(xr.mean()), float(xr.std())
        r_slope = _fit_eager(xr, -ar)[0]
    else:
        r_mean = r_std = r_slope = zero
    stats.update(last=float(x[-1]), mean=float(x.mean()), std=float(x.std()), min=float(lo), max=float(x.max()),
                 slope=slope, curvature=curvature, detrended=detrended, ema=emas, recent_mean=r_mean,
                 recent_std=r_std, recent_slope=r_slope, since_min=float(age[x == lo].min()))
    return stats


def _fit_eager(x: np.ndarray, t: np.ndarray) -> tuple[float, float, float]:
    """Least-squares slope, curvature (orthogonal quadratic term) and residual RMS of ``x`` over
    times ``t`` (float64 arrays), in units of ``t``."""
    n = x.size
    dt = t - t.mean()
    scale = max(float(np.abs(dt).max()), 1.0)
    u = dt / scale
    dx = x - x.mean()
    s_uu, s_uuu, s_xu = float((u * u).sum()), float((u * u * u).sum()), float((u * dx).sum())
    b_u = s_xu / s_uu if n >= 2 and s_uu > 0 else 0.0
    q = u * u - s_uu / n - (s_uuu / s_uu if s_uu > 0 else 0.0) * u
    s_qq = float((q * q).sum())
    c_u = float((q * dx).sum()) / s_qq if n >= 3 and s_qq > 1e-12 else 0.0
    residual = max(float((dx * dx).sum()) - b_u * s_xu, 0.0) / n
    return b_u / scale, 2.0 * c_u / scale ** 2, math.sqrt(residual)


def _log10_floor(x: float, floor: float) -> float:
    return math.log10(max(x, floor))


def _encode_window_eager(history: StateHistory, moments: torch.Tensor) -> torch.Tensor:
    """The 64 slots in float64 from plain PyTorch ops, returned as float32 on history.device."""
    loss = _ring_stats_eager(history, "loss", LOSS_RECENT, LOSS_EMA_ALPHAS)
    grad = _ring_stats_eager(history, "grad_norm", NORM_RECENT, (NORM_EMA_ALPHA,) * 3)
    upd = _ring_stats_eager(history, "update_norm", NORM_RECENT, (NORM_EMA_ALPHA,) * 3)
    source, m_mean, m_std, v_mean, v_std, nonfinite = [float(v) for v in moments.tolist()]
    second = source == 2.0
    last = loss["last"]
    f = [
        last, loss["mean"], loss["std"], loss["min"], loss["max"], loss["slope"], loss["curvature"],
        *loss["ema"], loss["recent_mean"], loss["recent_std"], loss["recent_slope"], loss["detrended"],
        math.copysign(math.log1p(abs(last)), last),
        (last - loss["mean"]) / max(loss["std"], RATIO_EPS),
        (loss["ema"][2] - loss["ema"][0]) / max(abs(loss["ema"][2]), LOSS_SCALE_EPS),
        loss["since_min"], loss["n"] / loss["capacity"], loss["bad"],
        grad["last"], grad["mean"], grad["std"], grad["min"], grad["max"], grad["slope"], grad["ema"][0],
        grad["recent_mean"], grad["recent_std"],
        _log10_floor(grad["last"], LOG_FLOOR_NORM) if grad["n"] else 0.0,
        grad["std"] / max(grad["mean"], RATIO_EPS), grad["last"] / max(grad["mean"], RATIO_EPS), grad["bad"],
        upd["last"], upd["mean"], upd["std"], upd["min"], upd["max"], upd["slope"], upd["ema"][0],
        upd["recent_mean"],
        _log10_floor(upd["last"], LOG_FLOOR_NORM) if upd["n"] else 0.0,
        upd["std"] / max(upd["mean"], RATIO_EPS),
        upd["last"] / max(grad["last"], RATIO_EPS), upd["mean"] / max(grad["mean"], RATIO_EPS), upd["bad"],
        source, m_mean, m_std, v_mean, v_std,
        _log10_floor(v_mean, LOG_FLOOR_V) if second else 0.0,
        m_mean / math.sqrt(v_mean) if second and v_mean > 0 else 0.0,
        nonfinite,
        history.lr, _log10_floor(history.lr, LOG_FLOOR_LR), math.log10(1.0 + history.step),
        *[1.0 if history.phase == k else 0.0 for k in range(len(PHASES))],
        float(history.phase_step), history.prediction_error, history.acceptance_rate,
    ]
    assert len(f) == NUM_FEATURES
    return torch.tensor(f, dtype=torch.float64).to(torch.float32).to(history.device)


# --------------------------------------------------------------------------------------------
# Optimizer-state parsing and the moment summary
# --------------------------------------------------------------------------------------------
def _collect_moments(optimizer_state: Any) -> tuple[int, list[torch.Tensor], list[torch.Tensor] | None]:
    """(source, first moments, second moments or None), validated. Empty tensors are dropped."""
    if optimizer_state is None:
        return 0, [], None
    if isinstance(optimizer_state, torch.optim.Optimizer):
        pairs, momenta = [], []
        for group in optimizer_state.param_groups:
            for p in group["params"]:
                st = optimizer_state.state.get(p)
                if not st:
                    continue
                if isinstance(st.get("exp_avg"), torch.Tensor) and isinstance(st.get("exp_avg_sq"), torch.Tensor):
                    pairs.append((_dequantized(st["exp_avg"]), _dequantized(st["exp_avg_sq"])))
                elif isinstance(st.get("momentum_buffer"), torch.Tensor):
                    momenta.append(st["momentum_buffer"])
        if pairs:
            return 2, *_check_pairs(pairs, lambda i: f"optimizer_state (state of parameter {i})")
        if momenta:
            for i, m in enumerate(momenta):
                _check_moment_tensor(m, f"optimizer_state (momentum_buffer of parameter {i})")
            return 1, [m for m in momenta if m.numel()], None
        return 0, [], None
    if isinstance(optimizer_state, (torch.Tensor, str, bytes)) or not isinstance(optimizer_state, Sequence):
        raise TypeError("optimizer_state must be None, a torch.optim.Optimizer or a sequence of "
                        f"(exp_avg, exp_avg_sq) tensor pairs, got {type(optimizer_state).__name__}")
    for i, pair in enumerate(optimizer_state):
        if isinstance(pair, torch.Tensor) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise TypeError(f"optimizer_state[{i}] must be an (exp_avg, exp_avg_sq) pair of tensors, "
                            f"got {type(pair).__name__}")
    if not optimizer_state:
        return 0, [], None
    return 2, *_check_pairs(list(optimizer_state), lambda i: f"optimizer_state[{i}]")


def _dequantized(t: torch.Tensor) -> torch.Tensor:
    """A moment kept in a quantizing tensor subclass (torchao's 8/4-bit ``OptimState``, which
    implements almost no operators) as the plain fp32 tensor its ``dequantize()`` gives (a
    transient copy); any other tensor as it is."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return t
    dequantize = getattr(t, "dequantize", None)
    return dequantize() if callable(dequantize) else t


def _check_moment_tensor(t: Any, where: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where} must be a tensor, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{where} must be a real floating-point tensor, got {t.dtype}")
    if t.device.type == "meta":
        raise ValueError(f"{where} is on the meta device and holds no data")


def _check_pairs(pairs: list, name) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Validate (exp_avg, exp_avg_sq) pairs; ``name(i)`` says where pair i came from."""
    ms, vs = [], []
    for i, (m, v) in enumerate(pairs):
        _check_moment_tensor(m, f"{name(i)} exp_avg")
        _check_moment_tensor(v, f"{name(i)} exp_avg_sq")
        if m.shape != v.shape:
            raise ValueError(f"{name(i)}: exp_avg has shape {tuple(m.shape)} but exp_avg_sq has "
                             f"shape {tuple(v.shape)}")
        if m.device != v.device:
            raise ValueError(f"{name(i)}: exp_avg is on {m.device} but exp_avg_sq is on {v.device}")
        if m.numel():
            ms.append(m)
            vs.append(v)
    return ms, vs


def _moment_summary(optimizer_state: Any, device: torch.device) -> tuple[torch.Tensor, bool]:
    """float32 [6] (MOMENT_STAT_NAMES) on ``device`` and whether every group ran on Triton."""
    source, ms, vs = _collect_moments(optimizer_state)
    all_triton = True
    if not ms:
        return torch.tensor([float(source), 0, 0, 0, 0, 0], dtype=torch.float32, device=device), all_triton
    groups: dict[tuple, list[int]] = {}
    for i, m in enumerate(ms):
        groups.setdefault((m.device, m.dtype, None if vs is None else vs[i].dtype), []).append(i)
    total = torch.zeros(_N_PARTIALS, dtype=torch.float64, device=device)
    with torch.no_grad():
        for (group_device, _, _), idx in groups.items():
            g_ms = [ms[i].detach() for i in idx]
            g_vs = None if vs is None else [vs[i].detach() for i in idx]
            backend = choose_backend("encode_state", group_device)
            if backend == "triton":
                flat = _flat_addressable(g_ms)
                if g_vs is not None:
                    flat = [a and b for a, b in zip(flat, _flat_addressable(g_vs))]
                on_kernel = [k for k, ok in enumerate(flat) if ok]
                on_eager = [k for k, ok in enumerate(flat) if not ok]
                if on_kernel:
                    total += _moment_sums_triton_group([g_ms[k] for k in on_kernel],
                                                       None if g_vs is None else [g_vs[k] for k in on_kernel]).to(device)
                if on_eager:  # a view the kernel cannot address as flat memory
                    total += _moment_sums_eager([g_ms[k] for k in on_eager],
                                                None if g_vs is None else [g_vs[k] for k in on_eager]).to(device)
            else:
                all_triton = False
                total += _moment_sums_eager(g_ms, g_vs).to(device)
    return _finalize_moments(total, sum(m.numel() for m in ms), source), all_triton


def _finalize_moments(sums: torch.Tensor, numel: int, source: int) -> torch.Tensor:
    """float64 sums (count, Σ|m|, Σm², Σ|v|, Σv²) → float32 MOMENT_STAT_NAMES values."""
    count = sums[0]
    safe = count.clamp(min=1.0)
    m_mean = sums[1] / safe
    m_std = (sums[2] / safe - m_mean.square()).clamp(min=0.0).sqrt()
    v_mean = sums[3] / safe
    v_std = (sums[4] / safe - v_mean.square()).clamp(min=0.0).sqrt()
    if source < 2:
        v_mean, v_std = torch.zeros_like(v_mean), torch.zeros_like(v_std)
    nonfinite = (numel - count) / max(numel, 1)
    stats = torch.stack([torch.full_like(count, float(source)), m_mean, m_std, v_mean, v_std, nonfinite])
    return stats.float()


def moment_statistics(optimizer_state: Any, device: torch.device | str | None = None) -> torch.Tensor:
    """Statistics of optimizer moments over every element of every parameter's state.

    Args:
        optimizer_state: ``None``, a ``torch.optim.Optimizer`` or a sequence of
            ``(exp_avg, exp_avg_sq)`` pairs (float tensors, each pair same shape and device).
        device: where the result goes (default: the first moment's device, else CPU).

    Returns:
        float32 ``[6]``: ``MOMENT_STAT_NAMES`` = (source code, mean |m|, std |m|, mean |v|,
        std |v|, fraction of non-finite elements). Slots 46-50 and 53 of ``encode_state``.
    """
    if device is None:
        _, ms, _ = _collect_moments(optimizer_state)
        device = ms[0].device if ms else torch.device("cpu")
    stats, all_triton = _moment_summary(optimizer_state, torch.device(device))
    record("encode_state", "triton" if all_triton and choose_backend("encode_state", torch.device(device)) == "triton"
           else "eager")
    return stats


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------
def _sanitize(features: torch.Tensor) -> torch.Tensor:
    """Last guard of the output contract (finite); only overflow reaches it (module docstring)."""
    return torch.nan_to_num(features, nan=0.0, posinf=OUTPUT_LIMIT, neginf=-OUTPUT_LIMIT).clamp_(
        -OUTPUT_LIMIT, OUTPUT_LIMIT)


@torch.compiler.disable
def encode_state(history: StateHistory, optimizer_state: Any = None) -> torch.Tensor:
    """Encode the training state as 64 float32 features (layout: :data:`FEATURE_TABLE`).

    Args:
        history: the :class:`StateHistory` holding the loss / gradient-norm / update-norm rings and
            the trainer's scalars (lr, step, phase, phase_step, prediction_error, acceptance_rate).
        optimizer_state: ``None``; a ``torch.optim.Optimizer`` (Adam-like ``exp_avg`` /
            ``exp_avg_sq`` state, or SGD ``momentum_buffer``); or a sequence of
            ``(exp_avg, exp_avg_sq)`` tensor pairs of any float dtypes, shapes and devices.

    Returns:
        float32 tensor of shape ``[64]`` on ``history.device``, always finite (raw values:
        normalise them with ``hybrid_trainer.normalizer.RunningNormalizer``).

    Raises:
        TypeError / ValueError naming the argument (and pair index) for a wrong type, dtype,
        shape or device.
    """
    if not isinstance(history, StateHistory):
        raise TypeError(f"history must be a StateHistory, got {type(history).__name__}")
    device = history.device
    backend = choose_backend("encode_state", device)
    moments, moments_on_triton = _moment_summary(optimizer_state, device)
    if backend == "triton":
        features = _encode_window_triton(history, moments)
    else:
        features = _encode_window_eager(history, moments)
    record("encode_state", "triton" if backend == "triton" and moments_on_triton else "eager")
    return _sanitize(features)


__all__ = [
    "FEATURE_INDEX",
    "FEATURE_NAMES",
    "FEATURE_TABLE",
    "MOMENT_STAT_NAMES",
    "NUM_FEATURES",
    "PHASES",
    "StateHistory",
    "encode_state",
    "kernel_launches",
    "moment_statistics",
]

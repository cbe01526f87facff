"""PREDICT as a nowcast jump: compact snapshots, an in-place jump, a judgement after a recovery
window, and an exact rollback of the jumps that did not help.

A learned far-horizon jump (:mod:`hybrid_trainer.nowcaster`) first makes the model *worse* and is
ahead of plain training only some steps later (measured with NiNo: batch loss 0.35 -> 1.75 right
after a 40-spacing jump, ahead of the plain run within 200 steps). A forward check at once would
reject every good jump, so a jump here is judged after ``recovery_steps`` real steps, against the
trajectory it replaced: the training loss's pre-jump trend extrapolated to the end of the window.

Life of a jump (:class:`NowcastJump`, driven by one :meth:`~NowcastJump.after_step` call per real
step with that step's training loss):

1. every ``spacing`` steps a snapshot: the first one kept in fp32, each later one as the int8
   difference to the previous (:func:`hybrid_kernels.quantize_int8`, per-block scales), so the
   window costs 4 + ``context`` bytes per weight instead of 4 x (``context`` + 1);
2. at a call step (every ``call_every`` steps, once ``context + 1`` snapshots exist) the
   pre-jump weights and optimizer state are kept (exact copies), the nowcaster predicts the
   displacement ``horizon`` spacings ahead (the horizon from a NiNo-like shrinking schedule) and
   :func:`hybrid_kernels.apply_delta_` adds it in place; Adam's moments are kept (``moments="keep"``)
   or cleared (``"reset"``);
3. after ``recovery_steps`` real steps the mean training loss over the second half of the window
   is compared with the pre-jump trend (a least-squares line through the last ``trend_steps``
   pre-jump losses) at the same steps: kept when it is lower by at least ``margin`` times the
   pre-jump noise's standard error, else weights and optimizer state are restored bit-exactly
   (the recovery window's steps are discarded: that is the cost of a rejected jump, plus one copy
   of the weights and the optimizer state held during the window).

Non-finite predictions are refused before they touch the weights.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

import hybrid_kernels as hk
from hybrid_trainer import nowcaster as nc

NINO_SCHEDULE = (40, 33, 26, 21, 16, 11, 8, 5, 3, 1)


class SnapshotWindow:
    """The last ``context + 1`` snapshots of ``params``: the newest in fp32, the differences
    between consecutive ones in int8 (block scales). Lives on ``device`` (the host by default).
    """

    def __init__(self, params: list[torch.Tensor], context: int = nc.DEFAULT_CONTEXT,
                 device: str | torch.device = "cpu", block_size: int = 256):
        if context < 1:
            raise ValueError(f"context must be >= 1, got {context}")
        self.params, self.context, self.device, self.block_size = params, context, torch.device(device), block_size
        self.newest: torch.Tensor | None = None
        self.diffs: list[tuple[torch.Tensor, torch.Tensor]] = []  # oldest first, (int8 codes, scales)

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float() for p in self.params]).to(self.device)

    def take(self) -> None:
        flat = self._flat()
        if self.newest is not None:
            self.diffs.append(hk.quantize_int8(flat - self.newest, "block", self.block_size))
            self.diffs = self.diffs[-self.context:]
        self.newest = flat

    def clear(self) -> None:
        self.newest, self.diffs = None, []

    @property
    def ready(self) -> bool:
        return self.newest is not None and len(self.diffs) == self.context

    def window(self) -> torch.Tensor:
        """``[context + 1, P]`` fp32, oldest first; the newest row is exact."""
        if not self.ready:
            raise RuntimeError(f"the window has {len(self.diffs) + (self.newest is not None)} of "
                               f"{self.context + 1} snapshots")
        rows = [self.newest]
        for q, s in reversed(self.diffs):
            rows.append(rows[-1] - hk.dequantize_int8(q, s, "block", self.block_size))
        return torch.stack(rows[::-1])

    def nbytes(self) -> int:
        n = 0 if self.newest is None else self.newest.numel() * 4
        return n + sum(q.numel() + s.numel() * 4 for q, s in self.diffs)

    def state_dict(self) -> dict[str, Any]:
        return dict(newest=None if self.newest is None else self.newest.clone(),
                    diffs=[(q.clone(), s.clone()) for q, s in self.diffs])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.newest = None if state["newest"] is None else state["newest"].to(self.device)
        self.diffs = [(q.to(self.device), s.to(self.device)) for q, s in state["diffs"]]


def trend_at(losses: list[float], ahead: list[int]) -> tuple[list[float], float]:
    """Least-squares line through ``losses`` (one per step, the last at offset 0) evaluated
    ``ahead`` steps after the last, and the residual standard deviation."""
    n = len(losses)
    if n < 3:
        raise ValueError(f"need at least 3 losses for a trend, got {n}")
    xs = [i - (n - 1) for i in range(n)]
    mx, my = sum(xs) / n, sum(losses) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, losses)) / sxx
    resid = [y - (my + slope * (x - mx)) for x, y in zip(xs, losses)]
    sd = math.sqrt(sum(r * r for r in resid) / max(1, n - 2))
    return [my + slope * (a - mx) for a in ahead], sd


@dataclass
class JumpRecord:
    step: int
    horizon: float
    rel_norm: float
    kept: bool | None = None  # None until judged
    post_mean: float | None = None
    trend_mean: float | None = None
    seconds: float = 0.0


@dataclass
class NowcastJump:
    """The jump controller. ``after_step(step, loss)`` once per real step (``step`` counted from 0,
    after the optimizer step), with that step's training loss.

    Args:
        model, optimizer: what is trained; the parameters jumped are the optimizer's.
        caster: the nowcaster (default: the shipped one).
        spacing, call_every, recovery_steps, trend_steps: real steps between snapshots, between
            calls, of the recovery window, and of the pre-jump loss trend.
        schedule: horizon (in spacings) of each successive call; calls stop after the last.
        moments: ``"keep"`` or ``"reset"`` (clear the optimizer state at a jump).
        margin: standard errors by which the recovery window must beat the trend.
        scheduler: an LR scheduler restored with the rest on a rollback (optional).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    caster: nc.Nowcaster | None = None
    spacing: int = nc.DEFAULT_SPACING
    call_every: int = 300
    recovery_steps: int = 100
    trend_steps: int = 100
    schedule: tuple[float, ...] = NINO_SCHEDULE
    moments: str = "keep"
    margin: float = 0.0
    scheduler: Any = None
    snapshot_device: str | torch.device = "cpu"
    records: list[JumpRecord] = field(default_factory=list)

    def __post_init__(self):
        if self.moments not in ("keep", "reset"):
            raise ValueError(f"moments must be 'keep' or 'reset', got {self.moments!r}")
        for name in ("spacing", "call_every", "recovery_steps", "trend_steps"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.recovery_steps >= self.call_every:
            raise ValueError(f"recovery_steps ({self.recovery_steps}) must be < call_every ({self.call_every})")
        if self.caster is None:
            self.caster = nc.load_nowcaster()
        self.params = [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]
        model_params = [p for p in self.model.parameters() if p.requires_grad]
        if {id(p) for p in model_params} != {id(p) for p in self.params}:
            raise ValueError("the optimizer must train exactly the model's trainable parameters "
                             "(the nowcaster reads the whole network's neuron graph)")
        self.params = model_params  # the model's order: the layout's
        self.layout = nc.describe_model(self.model)
        self.window = SnapshotWindow(self.params, self.caster.context, self.snapshot_device)
        self.losses: list[float] = []  # recent per-step training losses
        self.calls = 0
        self.pending: dict[str, Any] | None = None  # the pre-jump state while a jump is judged
        self.since_call = 0

    # ------------------------------------------------------------------ stepping ----
    def after_step(self, step: int, loss: float) -> str | None:
        """Record ``loss``; take a snapshot, jump, or judge when due. Returns ``"jump"``,
        ``"kept"``, ``"rolled_back"`` or None."""
        self.losses.append(float(loss))
        self.losses = self.losses[-max(self.trend_steps, self.recovery_steps):]
        self.since_call += 1
        if self.pending is not None:
            self.pending["post"].append(float(loss))
            if len(self.pending["post"]) >= self.recovery_steps:
                return self._judge()
            return None
        if (step + 1) % self.spacing == 0:
            self.window.take()
        if (self.since_call >= self.call_every and self.window.ready and self.calls < len(self.schedule)
                and len(self.losses) >= self.trend_steps):
            return self.jump(self.schedule[self.calls])
        return None

    @torch.no_grad()
    def jump(self, horizon: float) -> str | None:
        t0 = time.perf_counter()
        self.since_call = 0
        window = self.window.window()
        delta = self.caster.predict(window.to(self.params[0].device), self.layout, horizon)
        self.calls += 1
        if not bool(torch.isfinite(delta).all()):
            self.window.clear()
            self.records.append(JumpRecord(step=-1, horizon=horizon, rel_norm=math.nan, kept=False,
                                           seconds=time.perf_counter() - t0))
            return None
        self.pending = dict(weights=[p.detach().clone() for p in self.params],
                            optimizer=copy.deepcopy(self.optimizer.state_dict()),
                            scheduler=None if self.scheduler is None else copy.deepcopy(self.scheduler.state_dict()),
                            trend=list(self.losses[-self.trend_steps:]), post=[])
        deltas = list(torch.split(delta.to(self.params[0].dtype), [p.numel() for p in self.params]))
        hk.apply_delta_(self.params, [d.view_as(p) for d, p in zip(deltas, self.params)], 1.0)
        if self.moments == "reset":
            self.optimizer.state.clear()
        w_norm = float(torch.cat([w.reshape(-1) for w in self.pending["weights"]]).norm().clamp_min(1e-12))
        self.records.append(JumpRecord(step=len(self.records), horizon=horizon,
                                       rel_norm=float(delta.norm()) / w_norm, seconds=time.perf_counter() - t0))
        self.window.clear()
        return "jump"

    def _judge(self) -> str:
        pending, record = self.pending, self.records[-1]
        post = pending["post"]
        half = post[len(post) // 2:]
        ahead = list(range(len(post) - len(half) + 1, len(post) + 1))
        trend, sd = trend_at(pending["trend"], ahead)
        record.post_mean, record.trend_mean = sum(half) / len(half), sum(trend) / len(trend)
        record.kept = record.post_mean <= record.trend_mean - self.margin * sd / math.sqrt(len(half))
        self.pending = None
        if record.kept:
            return "kept"
        self.rollback(pending)
        return "rolled_back"

    @torch.no_grad()
    def rollback(self, pending: dict[str, Any]) -> None:
        """Restore the pre-jump weights, optimizer (and scheduler) state bit-exactly."""
        for p, w in zip(self.params, pending["weights"]):
            p.copy_(w)
        self.optimizer.load_state_dict(pending["optimizer"])
        if self.scheduler is not None and pending["scheduler"] is not None:
            self.scheduler.load_state_dict(pending["scheduler"])
        self.window.clear()

    # ----------------------------------------------------------------- checkpoint ----
    def state_dict(self) -> dict[str, Any]:
        return dict(window=self.window.state_dict(), losses=list(self.losses), calls=self.calls,
                    since_call=self.since_call, pending=copy.deepcopy(self.pending),
                    records=[dict(r.__dict__) for r in self.records])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window.load_state_dict(state["window"])
        self.losses, self.calls, self.since_call = list(state["losses"]), state["calls"], state["since_call"]
        self.pending = copy.deepcopy(state["pending"])
        self.records = [JumpRecord(**r) for r in state["records"]]

    @property
    def nowcaster_seconds(self) -> float:
        return sum(r.seconds for r in self.records)


def make_nowcast(config, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any | None,
                 ranks) -> NowcastJump | None:
    """The trainer's nowcast-jump controller when ``config.predictor == "nowcast"``, else None.

    ``model`` may be DDP-wrapped (``ranks``, the trainer's :class:`~hybrid_trainer.distributed.RankSync`,
    says whether it is): nowcast jumps are refused there. Horizons follow :data:`NINO_SCHEDULE`, capped
    at ``config.nowcast_max_horizon``."""
    if config.predictor != "nowcast":
        return None
    from .distributed import unwrap

    if ranks.active:
        raise ValueError("predictor: 'nowcast' is not supported under DistributedDataParallel yet")
    return NowcastJump(unwrap(model), optimizer, caster=nc.load_nowcaster(config.nowcast_weights),
                       spacing=config.nowcast_spacing, call_every=config.nowcast_call_every,
                       recovery_steps=config.nowcast_recovery_steps, trend_steps=config.nowcast_trend_steps,
                       moments=config.nowcast_moments, margin=config.nowcast_margin, scheduler=scheduler,
                       schedule=tuple(min(k, config.nowcast_max_horizon) for k in NINO_SCHEDULE))

"""Running per-slot normalisation of feature vectors (the 64-slot state encoding).

Method: Welford / Chan running mean and variance in float64, updated one row or a batch of rows
at a time. By default it is exact: after any sequence of updates, ``mean`` and ``var`` equal the
population mean and variance of every row seen (up to float64 rounding). With ``max_count=N``
the count used to weight new data stops growing at N, so each new row gets weight at least
``1/N``: an exponential forgetting with time constant ~N rows, which follows the drift of
training features (losses fall, learning rates decay) instead of averaging over the whole run.

``normalize(x) = clamp((x - mean) / scale, -clip, clip)`` with
``scale = max(sqrt(var), rel_floor * |mean|, abs_floor)`` (defaults 1e-5 and 1e-8: a slot
whose spread is below float32 rounding of its mean is treated as constant):

* a slot that has been constant so far (var 0) maps its usual value to exactly 0, and a change to
  ±clip (a large, bounded signal) instead of dividing by zero;
* before any update the output is all zeros (nothing is known yet);
* non-finite inputs to ``normalize`` map to 0 (NaN) or ±clip (±Inf): the output is always finite.
  ``update`` rejects non-finite rows with ``ValueError``: statistics are never poisoned.
"""
from __future__ import annotations

from typing import Any

import torch


class RunningNormalizer:
    """Per-slot running mean/variance and clipped standardisation.

    Args:
        num_features: slots per row (64 for ``hybrid_kernels.encode_state``).
        clip: output bound (> 0).
        max_count: ``None`` for exact statistics of all data seen, or an int >= 1 that caps the
            weight of the past (forgetting; see the module docstring).
        rel_floor, abs_floor: lower bounds of the scale (``rel_floor * |mean|`` and ``abs_floor``).
        device: where the float64 statistics live (put them next to the features).
    """

    def __init__(self, num_features: int = 64, clip: float = 5.0, max_count: int | None = None,
                 rel_floor: float = 1e-5, abs_floor: float = 1e-8, device: torch.device | str = "cpu"):
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"num_features must be a positive int, got {num_features!r}")
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not (0 < clip < float("inf")):
            raise ValueError(f"clip must be a positive finite float, got {clip!r}")
        if max_count is not None and (isinstance(max_count, bool) or not isinstance(max_count, int)
                                      or max_count < 1):
            raise ValueError(f"max_count must be None or a positive int, got {max_count!r}")
        for name, value in (("rel_floor", rel_floor), ("abs_floor", abs_floor)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < float("inf")):
                raise ValueError(f"{name} must be a finite float >= 0, got {value!r}")
        self.num_features = num_features
        self.clip = float(clip)
        self.max_count = max_count
        self.rel_floor = float(rel_floor)
        self.abs_floor = float(abs_floor)
        self.count = 0  # rows seen (not capped)
        self.mean = torch.zeros(num_features, dtype=torch.float64, device=device)
        self._m2 = torch.zeros(num_features, dtype=torch.float64, device=device)  # Σ (x - mean)², weighted

    @property
    def weight(self) -> int:
        """Weight of the past in the next update: ``count``, capped at ``max_count``."""
        return self.count if self.max_count is None else min(self.count, self.max_count)

    @property
    def var(self) -> torch.Tensor:
        """Population variance per slot (float64 ``[num_features]``); 0 before any update."""
        return self._m2 / max(self.weight, 1)

    def _rows(self, x: Any, name: str) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not (x.dtype.is_floating_point or x.dtype in (torch.int32, torch.int64)):
            raise TypeError(f"{name} must be a real tensor, got {x.dtype}")
        if x.dim() not in (1, 2) or x.shape[-1] != self.num_features:
            raise ValueError(f"{name} must have shape [{self.num_features}] or [B, {self.num_features}], "
                             f"got {tuple(x.shape)}")
        return x.detach().reshape(-1, self.num_features).to(self.mean.device, torch.float64)

    def update(self, x: torch.Tensor) -> None:
        """Fold one row ``[F]`` or a batch ``[B, F]`` into the statistics (Chan's parallel merge)."""
        rows = self._rows(x, "x")
        if rows.shape[0] == 0:
            return
        if not bool(torch.isfinite(rows).all()):
            raise ValueError("x contains non-finite values; the running statistics would be poisoned")
        n_old, n_new = float(self.weight), float(rows.shape[0])
        batch_mean = rows.mean(dim=0)
        batch_m2 = (rows - batch_mean).square().sum(dim=0)
        total = n_old + n_new
        delta = batch_mean - self.mean
        self.mean += delta * (n_new / total)
        self._m2 += batch_m2 + delta.square() * (n_old * n_new / total)
        self.count += rows.shape[0]
        if self.max_count is not None and total > self.max_count:
            # Forget: rescale the accumulated sum of squares to max_count rows' worth.
            self._m2 *= self.max_count / total

    def scale(self) -> torch.Tensor:
        """The divisor per slot: max(std, rel_floor·|mean|, abs_floor) (float64)."""
        return torch.maximum(self.var.sqrt(), self.mean.abs() * self.rel_floor).clamp(min=self.abs_floor)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """``clamp((x - mean) / scale, -clip, clip)`` as float32 with the shape of ``x``; finite."""
        rows = self._rows(x, "x")
        if self.count == 0:
            return torch.zeros(x.shape, dtype=torch.float32, device=self.mean.device)
        z = (rows - self.mean) / self.scale()
        z = torch.nan_to_num(z, nan=0.0, posinf=self.clip, neginf=-self.clip).clamp_(-self.clip, self.clip)
        return z.to(torch.float32).reshape(x.shape)

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "num_features": self.num_features, "count": self.count,
                "mean": self.mean.detach().cpu().clone(), "m2": self._m2.detach().cpu().clone(),
                "clip": self.clip, "max_count": self.max_count, "rel_floor": self.rel_floor,
                "abs_floor": self.abs_floor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        if state.get("version") != 1:
            raise ValueError(f"state has unsupported version {state.get('version')!r}")
        if state.get("num_features") != self.num_features:
            raise ValueError(f"state has num_features={state.get('num_features')} but this normalizer has "
                             f"{self.num_features}")
        for key in ("mean", "m2"):
            t = state.get(key)
            if not isinstance(t, torch.Tensor) or t.shape != (self.num_features,):
                raise ValueError(f"state[{key!r}] must be a tensor of shape ({self.num_features},)")
        count = state.get("count")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"state['count'] must be an int >= 0, got {count!r}")
        self.mean.copy_(state["mean"])
        self._m2.copy_(state["m2"])
        self.count = count
        self.clip, self.max_count = float(state["clip"]), state["max_count"]
        self.rel_floor, self.abs_floor = float(state["rel_floor"]), float(state["abs_floor"])


__all__ = ["RunningNormalizer"]

"""Noise-aware verification of predicted steps.

A verification compares a forward-only loss on the current batch with two references: the
loss real training was expected to reach by now (the dynamics model's band) and the last
verified loss. Batch-to-batch loss noise is larger than the gain of a few predicted steps
(an early feasibility probe: a raw comparison of two noisy numbers rejected ~100%), so the slack is
``max(loss_tolerance · |reference|, noise_z · σ_batch)`` where ``σ_batch`` is the measured
standard deviation of real-step losses around their trend.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


class LossTrend:
    """EMA trend of real-step losses, the noise of single-batch losses around it, and the
    least-squares slope of the last ``window`` losses (loss change per real step)."""

    def __init__(self, beta: float = 0.9, window: int = 64):
        self.beta = beta
        self.window = window
        self.mean: float | None = None
        self.noise_var = 0.0
        self.count = 0
        self.recent: deque[float] = deque(maxlen=window)

    def slope(self) -> float | None:
        """Loss change per real step over the recent window (None with fewer than 8 losses)."""
        n = len(self.recent)
        if n < 8:
            return None
        mean_x, mean_y = (n - 1) / 2, sum(self.recent) / n
        num = sum((i - mean_x) * (y - mean_y) for i, y in enumerate(self.recent))
        return num / (n * (n * n - 1) / 12)

    def update(self, loss: float) -> None:
        if not math.isfinite(loss):
            return
        self.recent.append(loss)
        if self.mean is None:
            self.mean = loss
        else:
            residual = loss - self.mean
            self.noise_var = self.beta * self.noise_var + (1 - self.beta) * residual * residual if self.count > 1 \
                else residual * residual
            self.mean = self.beta * self.mean + (1 - self.beta) * loss
        self.count += 1

    @property
    def noise_std(self) -> float:
        return math.sqrt(self.noise_var)

    def state_dict(self) -> dict:
        return {"beta": self.beta, "mean": self.mean, "noise_var": self.noise_var, "count": self.count,
                "recent": list(self.recent)}

    def load_state_dict(self, state: dict) -> None:
        self.beta, self.mean = state["beta"], state["mean"]
        self.noise_var, self.count = state["noise_var"], state["count"]
        self.recent = deque(state["recent"], maxlen=self.window)


@dataclass
class Verdict:
    accepted: bool
    loss: float
    upper_bound: float  # the largest loss that would have been accepted
    reason: str


def verify(loss: float, expected: float | None, last_verified: float, last_verified_is_single_batch: bool,
           noise_std: float, loss_tolerance: float, noise_z: float) -> Verdict:
    """Accept ``loss`` if it is within both bands: ``reference + max(tol·|reference|, z·σ)``.

    Args:
        loss: forward-only loss after the predicted steps (one batch).
        expected: loss real training was expected to reach by now (None: no forecast).
        last_verified: loss at the last verified point (the rollback anchor).
        last_verified_is_single_batch: the anchor loss is itself one noisy batch (its band is
            √2 wider: the difference of two noisy measurements), not a smoothed trend.
        noise_std: standard deviation of single-batch losses around their trend.
        loss_tolerance: relative slack; noise_z: slack in units of ``noise_std``.
    """
    if not math.isfinite(loss):
        return Verdict(False, loss, float("nan"), f"verification loss is {loss}")
    noise_last = noise_std * (math.sqrt(2.0) if last_verified_is_single_batch else 1.0)
    bounds = {"last verified loss": (last_verified, max(loss_tolerance * abs(last_verified), noise_z * noise_last))}
    if expected is not None and math.isfinite(expected):
        bounds["expected trajectory"] = (expected, max(loss_tolerance * abs(expected), noise_z * noise_std))
    which, (reference, slack) = min(bounds.items(), key=lambda kv: kv[1][0] + kv[1][1])
    bound = reference + slack
    if loss <= bound:
        return Verdict(True, loss, bound, "within band")
    return Verdict(False, loss, bound, f"loss {loss:.4g} > {bound:.4g} ({which} {reference:.4g} + slack {slack:.3g})")

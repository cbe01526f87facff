"""Lag-corrected weight average: where the de-noised weight trajectory is now.

At a tuned learning rate the AdamW iterate oscillates across the valley and jitters with the
batch noise; an exponential average of the weights removes both but lags behind the trajectory
it follows. Two averages at different rates measure that trajectory's drift, and moving the
faster one forward by its lag gives an estimate of where the smoothed trajectory is *now*
(Holt's linear trend, applied to every weight):

    fast = EMA_0.9(θ),  slow = EMA_0.98(θ),  lag(β) = β / (1 − β)   (9 and 49 steps)
    drift = (fast − slow) / (lag_slow − lag_fast)
    estimate = fast + lag_fast · drift

``python -m bench.nowcast`` measured it (docs/results/nowcast.md): evaluating plain AdamW at this
estimate, training going on from the iterate, reached the target validation loss 1.19× sooner in
steps on Fashion-MNIST and 1.06× on the char-LM, with the lowest final loss of every arm; moving
the *training* iterate there did not help. So the estimate is for evaluation and export
(:meth:`WeightAverage.swapped_in`), and training never sees it.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from .anchor import WeightAnchor

FAST_BETA, SLOW_BETA = 0.9, 0.98
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def lag(beta: float) -> float:
    """Steps an EMA with factor ``beta`` trails a point that moves at a constant rate."""
    return beta / (1 - beta)


class WeightAverage:
    """Fast and slow EMAs of ``params`` and their lag-corrected combination.

    Args:
        params: the trained tensors, in a fixed order (float dtypes; fp16/bf16 ones are averaged
            in fp32, since a 0.02 lerp step is below their resolution).

    Memory: two copies of ``params`` (fp32 for low-precision ones), and a third, in their own
    dtypes, from the first :meth:`swapped_in` on (the trained values it puts back); cost: two
    passes over them per :meth:`update`.
    """

    def __init__(self, params: list[torch.Tensor]):
        if not params:
            raise ValueError("params must hold at least one tensor")
        bad = [i for i, p in enumerate(params) if not p.is_floating_point()]
        if bad:
            raise TypeError(f"params[{bad[0]}] has dtype {params[bad[0]].dtype}: only floating-point tensors can be averaged")
        self.params = params
        self._fast = [self._averaging_copy(p) for p in params]
        self._slow = [self._averaging_copy(p) for p in params]
        self._same_dtype = all(a.dtype == p.dtype for a, p in zip(self._fast, params))
        self.updates = 0
        self._anchor = WeightAnchor(params)

    @staticmethod
    def _averaging_copy(p: torch.Tensor) -> torch.Tensor:
        dtype = torch.float32 if p.dtype in _LOW_PRECISION else p.dtype
        return p.detach().to(dtype=dtype, copy=True)

    @torch.no_grad()
    def update(self) -> None:
        """Fold the current weights into both averages (call after each real optimizer step)."""
        current = [p.detach() for p in self.params]
        if not self._same_dtype:
            current = [c.to(a.dtype) for c, a in zip(current, self._fast)]
        torch._foreach_lerp_(self._fast, current, 1 - FAST_BETA)
        torch._foreach_lerp_(self._slow, current, 1 - SLOW_BETA)
        self.updates += 1

    @torch.no_grad()
    def estimate(self) -> list[torch.Tensor]:
        """New tensors (the averages' dtypes, params' shapes): the lag-corrected average."""
        drift = torch._foreach_sub(self._fast, self._slow)
        torch._foreach_mul_(drift, lag(FAST_BETA) / (lag(SLOW_BETA) - lag(FAST_BETA)))
        return torch._foreach_add(self._fast, drift)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Put the estimate into ``params`` for the block, then the exact trained values back
        (even if the block raises). Do not step the optimizer inside it."""
        self._anchor.save(step=self.updates)
        try:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.estimate())
            yield
        finally:
            self._anchor.restore()

    @torch.no_grad()
    def retarget(self, params: list[torch.Tensor]) -> WeightAverage:
        """The average over ``params``, another set of trained tensors (after freezing or
        unfreezing some): a tensor in both keeps its averages; a newly trained one starts at its
        value, which is its exact average, since it did not move while it was frozen."""
        average = WeightAverage(params)
        kept = {id(p): i for i, p in enumerate(self.params)}
        for j, p in enumerate(params):
            i = kept.get(id(p))
            if i is not None:
                average._fast[j].copy_(self._fast[i])
                average._slow[j].copy_(self._slow[i])
        average.updates = self.updates
        return average

    def state_dict(self) -> dict:
        """The averages as CPU copies: a checkpoint (the emergency one under memory pressure
        included) must not need more device memory than the run holds."""
        cpu = lambda t: t.to("cpu", copy=True)  # noqa: E731
        return {"fast": [cpu(t) for t in self._fast], "slow": [cpu(t) for t in self._slow],
                "updates": self.updates}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for key in ("fast", "slow"):
            tensors = state.get(key)
            if not isinstance(tensors, list) or len(tensors) != len(self.params):
                raise ValueError(f"state[{key!r}] must be a list of {len(self.params)} tensors")
            for i, (mine, saved) in enumerate(zip(getattr(self, f"_{key}"), tensors)):
                if tuple(saved.shape) != tuple(mine.shape):
                    raise ValueError(f"state[{key!r}][{i}] has shape {tuple(saved.shape)}, "
                                     f"expected {tuple(mine.shape)}")
                mine.copy_(saved)
        self.updates = int(state.get("updates", 0))

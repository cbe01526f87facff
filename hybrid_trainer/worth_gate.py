"""The worth gate: is a predicted step worth what the prediction machinery costs?

It owns the measured worth of a predicted step (in units of a real step's loss decrease), the
worth required of it (``min_predicted_worth`` plus, when ``cost_aware``, the measured cost of
recording and forecasting, :mod:`hybrid_trainer.cost`) and the clock that times that cost.
"""
from __future__ import annotations

import math
import time
from typing import Any

import torch

from .config import HybridConfig
from .cost import PredictionCost, real_steps_per_predicted

WORTH_BETA = 0.9  # EMA factor of the predicted step's first-order gain


class WorthGate:
    """Measured against required worth of a predicted step, and the cost clock.

    Args:
        config: the run's :class:`HybridConfig` (``cost_aware``, ``min_predicted_worth``).
        device: the trained tensors' device (a CUDA clock synchronises while calibrating).
        reduce: mean of a float over DDP ranks (the cost must agree on every rank).
    """

    def __init__(self, config: HybridConfig, device: torch.device, reduce):
        self.config, self.device = config, device
        self.cost = PredictionCost(real_steps_per_predicted(config), reduce=reduce) if config.cost_aware else None
        self.predicted_worth: float | None = None  # see measure
        self.predicted_gain: float | None = None
        self.machinery_s = 0.0  # prediction machinery time within the current real step

    def forget(self) -> None:
        """Worth measured along a direction that no longer applies (the trained set changed)."""
        self.predicted_worth = self.predicted_gain = None

    def measure(self, predictor, grads: list[torch.Tensor], loss_trend) -> None:
        """Worth of a predicted step in units of a real one: the EMA of its first-order loss
        decrease on fresh gradients, divided by the measured loss decrease per real step (the
        slope of recent real-step losses). Why not the real update's own first-order gain: on
        the char-LM it is negative on average after ~100 steps (repeating an Adam step from where
        it landed climbs back up the valley it crossed) although the loss keeps falling
        (``python -m bench.predictors``)."""
        gain = predictor.predicted_gain(grads)
        slope = loss_trend.slope()
        if gain is None or not math.isfinite(gain) or slope is None:
            return
        self.predicted_gain = gain if self.predicted_gain is None else \
            WORTH_BETA * self.predicted_gain + (1 - WORTH_BETA) * gain
        self.predicted_worth = self.predicted_gain / -slope if slope < 0 else 0.0

    def required_worth(self) -> float:
        """Worth a predicted step needs to pay: ``min_predicted_worth`` plus, when ``cost_aware``,
        the measured cost of recording and forecasting per real step (:mod:`hybrid_trainer.cost`)."""
        base = self.config.min_predicted_worth
        return base if self.cost is None else self.cost.required_worth(base)

    def margin(self) -> float | None:
        """Measured worth of a predicted step minus the required worth; None before it is measured."""
        return None if self.predicted_worth is None else self.predicted_worth - self.required_worth()

    def passes(self) -> bool:
        margin = self.margin()
        return margin is not None and margin >= 0

    def clock(self, part: str) -> float:
        """``time.perf_counter()`` for timing ``part``. While that part is being calibrated on a
        GPU, read after a synchronize: otherwise the device work queued before the mark (the
        backward, the optimizer step) finishes inside whichever part next reads a value from the
        device, and is charged to the prediction machinery instead of the core step. After
        calibration no timing is used, so no synchronize is added."""
        if self.device.type == "cuda" and self.cost is not None and self.cost.calibrating(part):
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def time(self, part: str, seconds: float) -> None:
        """Feed the cost calibration (wall-clock seconds, read with :meth:`clock`)."""
        if part != "core":
            self.machinery_s += seconds
        if self.cost is not None:
            self.cost.observe(part, seconds)

    def state_dict(self) -> dict[str, Any]:
        return {"predicted_worth": self.predicted_worth, "predicted_gain": self.predicted_gain}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.predicted_worth, self.predicted_gain = state["predicted_worth"], state["predicted_gain"]

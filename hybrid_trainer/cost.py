"""What the prediction machinery costs, measured, and the worth a predicted step needs to repay it.

Per real step the trainer spends time on the step itself (forward, backward, optimizer: the
*core*), on *recording* (the update history and the worth measurement) and, while the worth gate
is open, on *forecasting* (the 64-feature state encoder and the dynamics model's observation) and
*dynamics training* (every ``dynamics_train_every`` steps; counted per real step). Over a cycle of
``R`` real and ``P`` predicted steps, predicted steps of worth ``w`` (in real steps of progress,
see the trainer) each costing ``c`` core-step units pay only if

    R + P·w  >  R·(1 + overhead) + P·c      ⇔      w  >  c + overhead · R / P

with ``overhead = (recording + forecasting + dynamics training) / core``. ``c`` is the configured
``min_predicted_worth``; ``R / P`` comes from the phase schedule (the most favourable case: the
longest predict length). On a large model the overhead is a few percent and the gate is
``min_predicted_worth``; on a sub-millisecond model the encoder and dynamics model cost several
real steps and no measured worth repays them, so prediction switches itself off.
"""
from __future__ import annotations

from collections.abc import Callable

from .config import HybridConfig

CALIBRATION_STEPS = {"core": 8, "recording": 8, "forecasting": 8, "dynamics_training": 3}
# timed samples per part; their median is then kept for the run. Dynamics training runs only
# every ``dynamics_train_every`` steps, so it gets fewer samples (each already amortised).


def real_steps_per_predicted(config: HybridConfig) -> float:
    """R / P of the phase schedule: a CORRECT phase after each PREDICT phase and a FULL phase
    every ``max_consecutive_predict`` cycles, with PREDICT phases of the longest length."""
    per_cycle = config.correct_steps + config.full_steps / config.max_consecutive_predict
    return per_cycle / max(config.predict_lengths)


class PredictionCost:
    """Seconds per real step of the core step, recording and forecasting, each calibrated once.

    Each part is timed on its first ``CALIBRATION_STEPS`` runs and the median is kept for the
    rest of the run (and in checkpoints): decisions then no longer depend on the clock, so a run
    resumed from a checkpoint makes the same decisions as the uninterrupted one. Forecasting runs
    only while the worth gate is open, so it is calibrated the first time the gate opens; a gate
    that its measured cost shuts stays shut.
    """

    PARTS = tuple(CALIBRATION_STEPS)

    def __init__(self, real_per_predicted: float, reduce: Callable[[float], float] | None = None):
        if real_per_predicted < 0:
            raise ValueError(f"real_per_predicted must be >= 0, got {real_per_predicted}")
        self.real_per_predicted = real_per_predicted
        # Applied to each calibrated median: under DDP the mean over ranks, since each rank's
        # clock differs and a rank with another threshold would take another path.
        self.reduce = reduce
        self.samples: dict[str, list[float]] = {part: [] for part in self.PARTS}
        self.seconds: dict[str, float | None] = {part: None for part in self.PARTS}

    def observe(self, part: str, seconds: float) -> None:
        """One timing (seconds per real step) of ``part``; ignored once the part is calibrated."""
        if self.seconds[part] is not None:
            return
        self.samples[part].append(seconds)
        if len(self.samples[part]) == CALIBRATION_STEPS[part]:
            ordered = sorted(self.samples[part])
            n = len(ordered)
            median = 0.5 * (ordered[(n - 1) // 2] + ordered[n // 2])
            self.seconds[part] = median if self.reduce is None else self.reduce(median)
            self.samples[part] = []

    def calibrating(self, part: str) -> bool:
        """Whether timings of ``part`` are still being collected."""
        return self.seconds[part] is None

    @property
    def calibrated(self) -> dict[str, bool]:
        return {part: value is not None for part, value in self.seconds.items()}

    @property
    def overhead(self) -> float:
        """Prediction machinery / core step, for the parts calibrated so far (0 before the core is)."""
        core = self.seconds["core"]
        if not core:
            return 0.0
        return sum(v for part, v in self.seconds.items() if part != "core" and v is not None) / core

    def required_worth(self, base: float) -> float:
        """Break-even worth of a predicted step: ``base + overhead · R / P``."""
        return base + self.overhead * self.real_per_predicted

    def state_dict(self) -> dict:
        return {"samples": {k: list(v) for k, v in self.samples.items()}, "seconds": dict(self.seconds)}

    def load_state_dict(self, state: dict) -> None:
        self.samples = {k: list(v) for k, v in state["samples"].items()}
        self.seconds = dict(state["seconds"])

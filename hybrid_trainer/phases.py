"""The phase machine: WARMUP → FULL → (PREDICT → CORRECT)×n → FULL → …

The controller only decides; the trainer measures and acts. Decisions use the confidence the
trainer reports (dynamics model agreement and realised error, combined with the measured
acceptance of earlier verifications), a rejection back-off, and optionally a LinUCB bandit.
"""
from __future__ import annotations

import enum
import math
import statistics
from collections import deque
from typing import Callable

from .bandit import LinUCBBandit
from .config import HybridConfig

MAX_BACKOFF = 64
# Early switch-off: after at least this many declined decisions in a row, stop predicting once the
# worth's shortfall is significant, mean(worth − required) + EARLY_OFF_Z · standard error < 0.
# Each decision's worth is an EMA over its own FULL phase, so decisions are roughly independent
# samples; clear cases then stop recording after 3 decisions instead of max_consecutive_declines.
EARLY_OFF_MIN_DECLINES = 3
EARLY_OFF_Z = 2.0
PREDICT_OFF_REASON = "HybridConfig.predict=False: every step is a real step"


class Phase(str, enum.Enum):
    WARMUP = "WARMUP"
    FULL = "FULL"
    PREDICT = "PREDICT"
    CORRECT = "CORRECT"

    @property
    def code(self) -> int:
        return list(Phase).index(self)


class PhaseController:
    """Decides the phase of each step.

    ``confidence(h)`` (supplied by the trainer) returns the confidence in [0, 1] that a predict
    phase of ``h`` steps will be accepted.
    """

    def __init__(self, config: HybridConfig):
        self.config = config
        self.phase = Phase.WARMUP if config.warmup_steps > 0 else Phase.FULL
        self.phase_step = 0
        self.length = config.warmup_steps if config.warmup_steps > 0 else config.full_steps
        self.cycles = 0  # PREDICT→CORRECT cycles since the last FULL phase
        self.consecutive_rejections = 0
        self.consecutive_declines = 0
        self.decline_margins: list[float] = []  # worth − required at each of those declines (when measured)
        # FULL-phase steps since the worth was last judged. A divergence rollback restarts the
        # FULL phase (force_full); rollbacks closer together than a phase would otherwise keep the
        # worth from ever being judged, and the recording from ever stopping (it did on
        # bench.overhead's 51M MLP, whose gradient norm spiked every few steps).
        self.steps_since_decision = 0
        # Decisions in a row that started no PREDICT phase (max_decisions_without_predict): a
        # forecaster that never grows confident would otherwise keep the recording on for good
        # while the worth passes (it did on bench.overhead's 51M MLP once the rollbacks above
        # no longer kept the decisions from being made).
        self.decisions_without_predict = 0
        self.backoff = 1
        self.last_predict_rejected = False
        self.disabled_reason: str | None = None if config.predict else PREDICT_OFF_REASON
        self.outcomes: deque[bool] = deque(maxlen=20)  # recent verification outcomes
        self.bandit = (LinUCBBandit(list(config.predict_lengths), n_features=4, alpha=config.bandit_alpha,
                                    seed=config.seed) if config.use_bandit else None)
        self.bandit_context: list[float] | None = None
        self.bandit_arm: int | None = None

    # -- information -----------------------------------------------------------------------
    @property
    def prediction_enabled(self) -> bool:
        return self.disabled_reason is None

    def acceptance_estimate(self) -> float:
        """Posterior mean of the acceptance probability of a verification (Beta(1, 1) prior)."""
        return (sum(self.outcomes) + 1) / (len(self.outcomes) + 2)

    # -- events from the trainer -------------------------------------------------------------
    def record_verification(self, accepted: bool) -> None:
        self.outcomes.append(accepted)

    def reject_predict_phase(self) -> None:
        """A verification failed and the weights were rolled back: go to CORRECT, back off."""
        self.consecutive_rejections += 1
        self.backoff = min(self.backoff * 2, MAX_BACKOFF)
        self.last_predict_rejected = True
        if self.consecutive_rejections >= self.config.max_consecutive_rejections:
            self.disabled_reason = (f"{self.consecutive_rejections} predict phases in a row were rejected; "
                                    "prediction is off for the rest of the run")
        self._enter(Phase.CORRECT, self.config.correct_steps)
        self.cycles += 1

    def force_full(self) -> None:
        """After a divergence: real steps only, for a full phase."""
        self.cycles = 0
        self._enter(Phase.FULL, self.config.full_steps * self.backoff)

    def finish_bandit_round(self, reward: float) -> None:
        if self.bandit is not None and self.bandit_arm is not None and self.bandit_context is not None:
            self.bandit.update(self.bandit_arm, self.bandit_context, reward)
        self.bandit_arm = self.bandit_context = None

    # -- the step clock ----------------------------------------------------------------------
    def advance(self, confidence: Callable[[int], float], worth_margin: float | None) -> None:
        """Count one finished step; at the end of a phase choose the next one.

        ``worth_margin``: the measured worth of a predicted step minus the worth it must reach
        (None before the first measurement, which counts as not reaching it). Only decisions
        declined for low worth count towards switching prediction off (a dynamics model that is
        not confident yet delays prediction without ending it), and a run of declines whose
        margins are significantly negative switches it off early."""
        self.phase_step += 1
        judging = self.phase is Phase.FULL and self.disabled_reason is None  # the worth is judged in FULL phases
        if judging:
            self.steps_since_decision += 1
        if self.phase_step < self.length:
            if judging and self.steps_since_decision >= self.config.full_steps * self.backoff:
                # Rollbacks restarted this FULL phase before it could end: the worth is judged all
                # the same, but no PREDICT phase starts so soon after a divergence.
                self._judge_worth(worth_margin, predicting=False)
            return
        cfg = self.config
        worth_ok = worth_margin is not None and worth_margin >= 0
        if self.phase is Phase.PREDICT:  # completed without a rejection
            self.consecutive_rejections = 0
            self.backoff = 1
            self.last_predict_rejected = False
            self.cycles += 1
            self._enter(Phase.CORRECT, cfg.correct_steps)
            return
        if self.phase is Phase.CORRECT and (self.last_predict_rejected or self.cycles >= cfg.max_consecutive_predict):
            self.cycles = 0
            self.last_predict_rejected = False
            self._enter(Phase.FULL, cfg.full_steps * self.backoff)
            return
        if self.phase is Phase.WARMUP:
            self._enter(Phase.FULL, cfg.full_steps)
            return
        length = self._choose_length(confidence) if self.prediction_enabled and worth_ok else None
        if length is None:
            if self.prediction_enabled or worth_ok:
                self._judge_worth(worth_margin, predicting=False)
            self.cycles = 0
            self._enter(Phase.FULL, cfg.full_steps * self.backoff)
        else:
            self._enter(Phase.PREDICT, length)
            self._judge_worth(worth_margin, predicting=True)

    def _judge_worth(self, worth_margin: float | None, predicting: bool = False) -> None:
        """One judgment of the worth at a phase decision (``predicting``: it starts a PREDICT
        phase). A passing worth resets the evidence of declines; a failing one (or one not
        measured yet) is a decline. Enough declines, significantly negative margins, or
        ``max_decisions_without_predict`` decisions in a row that started no PREDICT phase
        switch prediction off for the run."""
        self.steps_since_decision = 0
        self.decisions_without_predict = 0 if predicting else self.decisions_without_predict + 1
        if worth_margin is not None and worth_margin >= 0:
            self.consecutive_declines = 0
            self.decline_margins = []
        else:
            self.consecutive_declines += 1
            if worth_margin is not None:
                self.decline_margins.append(float(worth_margin))
        self.disabled_reason = self.disabled_reason or self._switch_off_reason()

    def _switch_off_reason(self) -> str | None:
        """Why prediction goes off for the run after this decision, or None."""
        cfg = self.config
        early = self.consecutive_declines > 0 and self._shortfall_is_significant()
        if early or self.consecutive_declines >= cfg.max_consecutive_declines:
            shortfall = (f" (by {-statistics.fmean(self.decline_margins):.2f} on average, "
                         f"beyond {EARLY_OFF_Z:g} standard errors)" if early else "")
            return (f"{self.consecutive_declines} phase decisions in a row found a predicted step worth less than "
                    "it costs (min_predicted_worth plus the measured cost of the prediction machinery)"
                    f"{shortfall}; prediction is off for the rest of the run")
        if self.decisions_without_predict >= cfg.max_decisions_without_predict:
            return (f"{self.decisions_without_predict} phase decisions in a row started no PREDICT phase (a predicted "
                    "step not worth its cost, or the forecaster's confidence below confidence_threshold); "
                    "prediction is off for the rest of the run")
        return None

    def _shortfall_is_significant(self) -> bool:
        margins = self.decline_margins
        if len(margins) < EARLY_OFF_MIN_DECLINES:
            return False
        standard_error = statistics.stdev(margins) / math.sqrt(len(margins))
        return statistics.fmean(margins) + EARLY_OFF_Z * standard_error < 0

    def _choose_length(self, confidence: Callable[[int], float]) -> int | None:
        cfg = self.config
        lengths = sorted(cfg.predict_lengths)
        if self.bandit is not None:
            base = confidence(lengths[0])
            if base < cfg.confidence_threshold:
                return None
            self.bandit_context = [1.0, base, self.acceptance_estimate(), min(self.cycles, 8) / 8]
            self.bandit_arm = self.bandit.select(self.bandit_context)
            return self.bandit_arm
        chosen = None
        for length in lengths:  # the longest horizon that is still confident enough
            if confidence(length) >= cfg.confidence_threshold:
                chosen = length
            else:
                break
        return chosen

    def _enter(self, phase: Phase, length: int) -> None:
        if phase is Phase.FULL and self.phase is not Phase.FULL:
            self.steps_since_decision = 0  # counted from the first step of FULL phases in a row
        self.phase, self.phase_step, self.length = phase, 0, max(1, int(length))

    # -- checkpoint --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "phase": self.phase.value, "phase_step": self.phase_step, "length": self.length,
            "cycles": self.cycles, "consecutive_rejections": self.consecutive_rejections,
            "consecutive_declines": self.consecutive_declines, "decline_margins": list(self.decline_margins),
            "steps_since_decision": self.steps_since_decision,
            "decisions_without_predict": self.decisions_without_predict,
            "backoff": self.backoff, "last_predict_rejected": self.last_predict_rejected,
            "disabled_reason": self.disabled_reason, "outcomes": list(self.outcomes),
            "bandit": None if self.bandit is None else self.bandit.state_dict(),
            "bandit_context": self.bandit_context, "bandit_arm": self.bandit_arm,
        }

    def load_state_dict(self, state: dict) -> None:
        self.phase = Phase(state["phase"])
        self.phase_step, self.length = state["phase_step"], state["length"]
        self.cycles, self.consecutive_rejections = state["cycles"], state["consecutive_rejections"]
        self.consecutive_declines = state["consecutive_declines"]
        self.decline_margins = list(state.get("decline_margins", []))  # absent in checkpoints before it existed
        # Absent before rollbacks stopped postponing the worth's judgment: the phase's own count.
        self.steps_since_decision = state.get("steps_since_decision",
                                              state["phase_step"] if state["phase"] == Phase.FULL.value else 0)
        self.decisions_without_predict = state.get("decisions_without_predict", 0)  # absent before it existed
        self.backoff, self.last_predict_rejected = state["backoff"], state["last_predict_rejected"]
        # The resuming run's config has the last word on whether to predict at all; a switch-off
        # the earlier run measured (worth, rejections) stays.
        reason = state["disabled_reason"]
        if not self.config.predict:
            reason = PREDICT_OFF_REASON
        elif reason == PREDICT_OFF_REASON:
            reason = None
        self.disabled_reason = reason
        self.outcomes = deque(state["outcomes"], maxlen=20)
        if self.bandit is not None and state["bandit"] is not None:
            self.bandit.load_state_dict(state["bandit"])
        self.bandit_context, self.bandit_arm = state["bandit_context"], state["bandit_arm"]

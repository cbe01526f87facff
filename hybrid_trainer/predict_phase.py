"""The predict phase: predicted updates applied in place, verified, kept or rolled back.

It owns the prediction buffers (the :class:`~hybrid_trainer.predictor.DeltaPredictor`'s update
history and the :class:`~hybrid_trainer.anchor.WeightAnchor` at the last verified point, both
made in :meth:`PredictPhase.retarget` only, holding memory only while they can serve: the
predictor's buffers from its first recorded step, the anchor during a phase, both freed by
:meth:`PredictPhase.release` once prediction is off for good), the state of the PREDICT phase in progress (its
base loss, last verified loss, unverified steps), each predicted step with its verification
(:func:`~hybrid_trainer.verifier.verify`), the rollback when one fails or an error interrupts
the phase, and the bandit's reward at the end of a phase.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from .anchor import WeightAnchor
from .config import HybridConfig
from .phases import Phase
from .predictor import DeltaPredictor
from .run_report import StepResult
from .verifier import verify


# The EMA direction is stored in int8 blocks (a quarter of fp32's memory; averaged in fp32 a bucket
# at a time all the same), the "linear" direction's EMA in bf16 (it reads a float one). What the
# trainer decides barely moves: python -m bench.direction_worth (docs/trainer.md has the figures).
DIRECTION_DTYPE = torch.int8
LINEAR_DIRECTION_DTYPE = torch.bfloat16


class PredictPhase:
    """Predicted steps of the PREDICT phase and their verification.

    Args:
        config: the run's :class:`HybridConfig` (``verify_every``, tolerances, predictor settings).
        controller: the :class:`~hybrid_trainer.phases.PhaseController`.
        stats: the trainer's run counters.
        loss_trend: the real-step :class:`~hybrid_trainer.verifier.LossTrend`.
        forecaster: the :class:`~hybrid_trainer.forecaster.StateForecaster` (expected loss).
        verification_loss: ``verification_loss(batch) -> (mean loss, forward passes)`` without
            gradients, the same on every DDP rank.
    """

    def __init__(self, config: HybridConfig, controller, stats, loss_trend, forecaster,
                 verification_loss: Callable[[Any], tuple[float, int]]):
        self.config, self.controller, self.stats, self.loss_trend, self.forecaster = \
            config, controller, stats, loss_trend, forecaster
        self.verification_loss = verification_loss
        self.predictor: DeltaPredictor | None = None
        self.anchor: WeightAnchor | None = None
        self.base_loss: float | None = None
        self.last_verified_loss: float | None = None
        self.last_verified_single_batch = False
        self.unverified_steps = 0
        self.last_rollback_steps = 0  # predicted steps the last rejected verification undid

    def retarget(self, params: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
        """(Re)make the prediction buffers for ``params``: the update history restarts."""
        cfg = self.config
        self.predictor = DeltaPredictor(params, cfg.direction, cfg.ema_beta, cfg.history_size,
                                        cfg.scale_beta, cfg.scale_max,
                                        direction_dtype=DIRECTION_DTYPE if cfg.direction == "ema" else LINEAR_DIRECTION_DTYPE)
        # Buffers (e.g. batch-norm statistics): the verification forwards change them too.
        self.anchor = WeightAnchor(params, buffers=buffers)

    def end_phase(self) -> None:
        """The PREDICT phase is over: its anchor's copy of the weights goes (taken again at the
        next phase's first step). During a phase no gradients exist, so the anchor stays under a
        real step's peak; between phases it would only add to it."""
        self.anchor.release()

    def release(self) -> None:
        """Prediction is off for the rest of the run: free the update direction and the anchor."""
        self.predictor.release()
        self.anchor.release()

    def abort(self) -> int:
        """Undo the predicted steps not verified yet (the weights go back to the last verified
        point); returns how many there were."""
        undone = self.unverified_steps
        if undone and self.anchor.is_set:
            self.anchor.restore()
            self.unverified_steps = 0
            return undone
        return 0

    def step(self, batch: Any, step: int) -> StepResult:
        """One predicted step (``step``: the trainer's step count); verifies it every
        ``verify_every`` steps and at the end of the phase."""
        cfg = self.config
        ctl = self.controller
        if ctl.phase_step == 0:
            self.anchor.save(step)
            self.base_loss = self.loss_trend.mean
            self.last_verified_loss = self.loss_trend.mean
            self.last_verified_single_batch = False
            self.unverified_steps = 0
            self.stats.predict_phases += 1
        self.predictor.apply_predicted_step()
        self.stats.predicted_steps += 1
        self.unverified_steps += 1
        horizon = ctl.phase_step + 1
        result = StepResult(step=step, phase=Phase.PREDICT.value, loss=None, backward_done=False, confidence=None)
        if horizon % cfg.verify_every != 0 and horizon < ctl.length:
            return result

        loss, forwards = self.verification_loss(batch)
        self.stats.forward_passes += forwards
        self.stats.verifications += 1
        expected = self.forecaster.expected_loss(self.base_loss, horizon)
        verdict = verify(loss, expected, self.last_verified_loss, self.last_verified_single_batch,
                         self.loss_trend.noise_std, cfg.loss_tolerance, cfg.noise_z)
        ctl.record_verification(verdict.accepted)
        result.loss, result.predicted_loss, result.verified, result.accepted = (
            loss if math.isfinite(loss) else None, expected, True, verdict.accepted)
        if verdict.accepted:
            self.stats.verifications_accepted += 1
            self.stats.predicted_steps_kept += self.unverified_steps
            self.anchor.save(step)
            self.last_verified_loss, self.last_verified_single_batch = loss, True
            self.unverified_steps = 0
            if horizon >= ctl.length:
                self.finish_bandit_round(loss)
        else:
            self.anchor.restore()
            self.stats.predicted_steps_rolled_back += self.unverified_steps
            self.last_rollback_steps = self.unverified_steps  # for the rollback event
            self.stats.predict_phases_rejected += 1
            self.unverified_steps = 0
            result.rolled_back = True
            result.divergence = verdict.reason
            self.finish_bandit_round(self.last_verified_loss)
            ctl.reject_predict_phase()
        return result

    def finish_bandit_round(self, end_loss: float | None) -> None:
        """Bandit reward: loss progress of the phase in units of batch noise, per verification."""
        if self.controller.bandit is None or self.base_loss is None or end_loss is None:
            return
        progress = (self.base_loss - end_loss) / max(self.loss_trend.noise_std, 1e-12)
        verifications = max(1, math.ceil(self.controller.length / self.config.verify_every))
        self.controller.finish_bandit_round(progress / verifications)

    def state_dict(self) -> dict[str, Any]:
        return {"predict_base_loss": self.base_loss, "last_verified_loss": self.last_verified_loss,
                "last_verified_single_batch": self.last_verified_single_batch,
                "unverified_steps": self.unverified_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base_loss, self.last_verified_loss = state["predict_base_loss"], state["last_verified_loss"]
        self.last_verified_single_batch = state["last_verified_single_batch"]
        self.unverified_steps = state["unverified_steps"]

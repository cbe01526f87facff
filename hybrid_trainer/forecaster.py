"""The state forecaster: what the loss will do over the next steps if they are predicted.

It owns the training-state history (:class:`hybrid_kernels.StateHistory`, the 64-feature
encoder's rings), the running feature normaliser, the :class:`~hybrid_trainer.dynamics.DynamicsModel`
trained online on real steps, its latest loss forecast, and the confidence that a predict phase
of a given length is accepted.
"""
from __future__ import annotations

import math

import torch

import hybrid_kernels as hk
from hybrid_kernels.encode_state import NUM_FEATURES

from .config import HybridConfig
from .dynamics import DynamicsModel
from .normalizer import RunningNormalizer
from .phases import Phase


class StateForecaster:
    """History, normaliser, dynamics model and forecast of one run.

    Args:
        config: the run's :class:`HybridConfig` (``dynamics_*``, ``horizon``, ``seed``).
        device: the trained tensors' device.
        controller: the :class:`~hybrid_trainer.phases.PhaseController` (phase step, acceptance).
        loss_trend: the real-step :class:`~hybrid_trainer.verifier.LossTrend` (batch noise).
        worth: the :class:`~hybrid_trainer.worth_gate.WorthGate` (gate and cost clock).
        agree: makes a forecast the same on every DDP rank (rank 0's).
    """

    def __init__(self, config: HybridConfig, device: torch.device, controller, loss_trend, worth, agree):
        self.config, self.controller, self.loss_trend, self.worth, self.agree = \
            config, controller, loss_trend, worth, agree
        self.history = hk.StateHistory(device=device)
        self.normalizer = RunningNormalizer(NUM_FEATURES)
        self.dynamics = DynamicsModel(n_features=NUM_FEATURES, hidden=config.dynamics_hidden,
                                      ensemble=config.dynamics_ensemble, horizon=config.horizon,
                                      window=config.dynamics_window, lr=config.dynamics_lr,
                                      batch=config.dynamics_batch, seed=config.seed, device=device)
        self.forecast: dict[str, torch.Tensor] | None = None

    def observe(self, phase: Phase, step: int, real_steps: int, loss: float, grad_norm: float | None,
                update_norm: float | None, lr: float, optimizer: torch.optim.Optimizer) -> None:
        """Feed the 64-feature state encoder and the dynamics model with a real step (``step``:
        the trainer's step count, ``real_steps``: optimizer steps so far)."""
        if not self.controller.prediction_enabled:
            return  # the rings below only feed the encoder, which will not run again in this run
        cfg = self.config
        h = self.history
        h.push_loss(loss)
        if grad_norm is not None and math.isfinite(grad_norm):
            h.push_grad_norm(grad_norm)
        if update_norm is not None:
            h.push_update_norm(update_norm)
        worth = self.worth
        if phase is Phase.WARMUP or not worth.passes():
            # The encoder and the dynamics model decide when and how long to predict, which is
            # moot while a predicted step is not worth it; on small models they cost as much as
            # the step itself, so they wait for the gate (the rings above keep filling).
            return
        mark = worth.clock("forecasting")
        h.lr, h.step, h.phase, h.phase_step = lr, step, phase.code, self.controller.phase_step
        h.acceptance_rate = self.controller.acceptance_estimate()
        errors = self.dynamics.error_report()
        h.prediction_error = errors.get(1, 0.0) / max(self.loss_trend.noise_std, 1e-12) if errors else 0.0
        features = hk.encode_state(h, optimizer_state=optimizer)
        self.normalizer.update(features)
        self.dynamics.observe(self.normalizer.normalize(features), loss)
        worth.time("forecasting", worth.clock("forecasting") - mark)
        if real_steps % cfg.dynamics_train_every == 0 and self.dynamics.ready():
            mark = worth.clock("dynamics_training")
            self.dynamics.train_step()
            self.forecast = self.dynamics.forecast(agree=self.agree)
            worth.time("dynamics_training", (worth.clock("dynamics_training") - mark) / cfg.dynamics_train_every)

    def expected_loss(self, base_loss: float | None, horizon: int) -> float | None:
        """Loss the forecast expects ``horizon`` predicted steps after ``base_loss``; None without one."""
        if self.forecast is None or base_loss is None:
            return None
        return base_loss + float(self.forecast["mean"][min(horizon, self.dynamics.horizon) - 1])

    def confidence(self, horizon: int, predictor) -> float:
        """Confidence that a predict phase of ``horizon`` steps is accepted: geometric mean of the
        measured acceptance estimate and the dynamics model's confidence at that horizon."""
        if predictor.n_scale_fits == 0 or not self.loss_trend.count or not self.worth.passes():
            return 0.0
        model_conf = self.dynamics.confidence(self.forecast, horizon, self.loss_trend.noise_std)
        return math.sqrt(self.controller.acceptance_estimate() * model_conf)

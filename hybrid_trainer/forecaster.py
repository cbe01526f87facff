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
        self.device = device
        self.history = hk.StateHistory(device=device)
        self.normalizer = RunningNormalizer(NUM_FEATURES)
        # Built the first time the worth gate lets the forecaster run (see observe), not here,
        # and its GRU networks only at its first training step: only prediction reads the
        # forecast, and a run whose gate never opens, or opens only long enough to time the
        # forecaster (the small models), would hold an ensemble of GRUs (~3 MB of weights at the
        # default width, ~12 MB once it trains with its Adam state) for nothing. Until then the
        # model is what a fresh one would be (no forecast, no errors, no training steps), so
        # building it late changes no decision: its own seeded generators, not torch's, draw its
        # weights and replay.
        self.dynamics: DynamicsModel | None = None
        self.forecast: dict[str, torch.Tensor] | None = None
        self._released_report: tuple[dict[int, float], int] = ({}, 0)  # the model's last figures, once freed

    def error_report(self) -> dict[int, float]:
        """The dynamics model's realised error by horizon (its last one once released)."""
        return self._released_report[0] if self.dynamics is None else self.dynamics.error_report()

    @property
    def train_steps(self) -> int:
        return self._released_report[1] if self.dynamics is None else self.dynamics.train_steps

    def new_dynamics(self) -> DynamicsModel:
        """A fresh dynamics model of this run's configuration (not kept: :meth:`observe` builds
        the run's own; a checkpoint check loads into one)."""
        cfg = self.config
        return DynamicsModel(n_features=NUM_FEATURES, hidden=cfg.dynamics_hidden, ensemble=cfg.dynamics_ensemble,
                             horizon=cfg.horizon, window=cfg.dynamics_window, lr=cfg.dynamics_lr,
                             batch=cfg.dynamics_batch, seed=cfg.seed, device=self.device)

    def _built_dynamics(self) -> DynamicsModel:
        """The dynamics model, built at its first use."""
        if self.dynamics is None:
            self.dynamics = self.new_dynamics()
        return self.dynamics

    def dynamics_state(self) -> dict | None:
        """The dynamics model's checkpoint state; None while it is not built (or released)."""
        return None if self.dynamics is None else self.dynamics.full_state_dict()

    def load_dynamics_state(self, state: dict | None) -> None:
        """Restore :meth:`dynamics_state`: a saved model is built and loaded, a saved absence
        leaves none here either (a run that predicts builds it when it is first needed)."""
        if state is None or not self.config.predict:
            self.dynamics = None
            return
        self._built_dynamics().load_full_state_dict(state)

    def release(self) -> None:
        """Prediction is off for the rest of the run: free the dynamics model (its networks,
        their Adam state, the replay), keeping the figures the run's statistics report."""
        if self.dynamics is not None:
            self._released_report = (self.dynamics.error_report(), self.dynamics.train_steps)
            self.dynamics = None
        self.forecast = None

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
        dynamics = self._built_dynamics()
        h.lr, h.step, h.phase, h.phase_step = lr, step, phase.code, self.controller.phase_step
        h.acceptance_rate = self.controller.acceptance_estimate()
        errors = dynamics.error_report()
        h.prediction_error = errors.get(1, 0.0) / max(self.loss_trend.noise_std, 1e-12) if errors else 0.0
        features = hk.encode_state(h, optimizer_state=optimizer)
        self.normalizer.update(features)
        dynamics.observe(self.normalizer.normalize(features), loss)
        worth.time("forecasting", worth.clock("forecasting") - mark)
        if real_steps % cfg.dynamics_train_every == 0 and dynamics.ready():
            mark = worth.clock("dynamics_training")
            dynamics.train_step()
            self.forecast = dynamics.forecast(agree=self.agree)
            worth.time("dynamics_training", (worth.clock("dynamics_training") - mark) / cfg.dynamics_train_every)

    def expected_loss(self, base_loss: float | None, horizon: int) -> float | None:
        """Loss the forecast expects ``horizon`` predicted steps after ``base_loss``; None without one."""
        if self.forecast is None or base_loss is None or self.dynamics is None:
            return None
        return base_loss + float(self.forecast["mean"][min(horizon, self.dynamics.horizon) - 1])

    def confidence(self, horizon: int, predictor) -> float:
        """Confidence that a predict phase of ``horizon`` steps is accepted: geometric mean of the
        measured acceptance estimate and the dynamics model's confidence at that horizon."""
        if predictor.n_scale_fits == 0 or not self.loss_trend.count or not self.worth.passes():
            return 0.0
        if self.dynamics is None:  # not built yet: a fresh model has no forecast, whose confidence is 0
            return 0.0
        model_conf = self.dynamics.confidence(self.forecast, horizon, self.loss_trend.noise_std)
        return math.sqrt(self.controller.acceptance_estimate() * model_conf)

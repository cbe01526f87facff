"""RSSM-lite dynamics model: an ensemble of GRU cells that forecasts the loss trajectory.

Input: the normalised 64-feature training state of each real step. Each ensemble member runs
:func:`hybrid_kernels.gru_cell` over a window of recent states (all members in one call) and
predicts, for every horizon h = 1..H, the loss change ``loss[t+h] − loss[t]`` (mean and
log-variance, in units of the typical one-step loss change so the targets are O(1)).

* Trained online on real (WARMUP/FULL/CORRECT) steps, a few minibatches at a time, through
  the GRU op's backward. Each member draws its own minibatch (bootstrap) so members disagree
  where data is thin: their spread is the epistemic part of the confidence.
* Targets a few steps old are only partly known: unknown horizons are masked, not guessed.
* No stochastic latent: the targets are a scalar trajectory, a deterministic state plus a
  Gaussian head (aleatoric band) plus the ensemble (epistemic) covers what we use, and the
  predecessor's "stochastic" state was a deterministic one in disguise. Not faking one.
* Its realised error is tracked per horizon on real data and reported.
"""
from __future__ import annotations

import copy
import math

import torch
from torch import nn

import hybrid_kernels as hk

NOISE_FLOOR = 2.0 / math.sqrt(math.pi)  # E|N(0, 2)| : error of a perfect forecast, in units of σ


class DynamicsModel(nn.Module):
    """Ensemble GRU loss-trajectory forecaster.

    Args:
        n_features: size of one state vector (64).
        hidden: GRU hidden size. ensemble: members E. horizon: H steps forecast.
        window: states unrolled per forecast. capacity: real steps kept for replay.
        lr: Adam learning rate. batch: minibatch per member. seed: replay sampling seed.
    """

    def __init__(self, n_features: int = 64, hidden: int = 256, ensemble: int = 3, horizon: int = 16,
                 window: int = 8, capacity: int = 512, lr: float = 1e-3, batch: int = 16, seed: int = 0,
                 device: torch.device | str = "cpu"):
        super().__init__()
        self.n_features, self.hidden, self.ensemble, self.horizon = n_features, hidden, ensemble, horizon
        self.window, self.capacity, self.batch = window, capacity, batch
        self._seed, self._lr, self._device = seed, lr, device
        # The networks and their Adam state are built by the first train_step (or forecast, or a
        # load of trained ones): the replay below is all observing needs, and a run whose worth
        # gate opens only to time the forecaster never trains them (~3 MB of weights, ~12 MB
        # training, at the default width). Their own seeded generator draws the same weights
        # whenever they are built.
        self.optimizer: torch.optim.Adam | None = None
        self.sampler = torch.Generator().manual_seed(seed + 1)

        # Replay of real steps: states and losses, in order (a ring).
        # Grown as steps arrive (doubling, up to ``capacity`` rows): a forecaster that runs a few
        # steps to be timed and is then shut off keeps a few rows, not 512.
        self.states = torch.zeros(0, n_features, device=device)
        self.losses = torch.zeros(capacity, dtype=torch.float64)
        self.count = 0  # steps observed in total
        self.loss_unit = 1.0  # typical |loss[t+1] - loss[t]|: targets are divided by it
        self.train_steps = 0
        self.last_train_loss = float("nan")
        # Realised error per horizon: EMA of |forecast − actual| (loss units) and counts.
        self.error_by_horizon = torch.zeros(horizon, dtype=torch.float64)
        self.error_counts = torch.zeros(horizon, dtype=torch.long)
        self._pending: dict[int, torch.Tensor] = {}  # step index → forecast mean [H] (loss units)

    # -- data ------------------------------------------------------------------------------
    def observe(self, state: torch.Tensor, loss: float) -> None:
        """Record a real step (normalised state [n_features], its loss) and score old forecasts."""
        slot = self.count % self.capacity
        if slot >= self.states.shape[0]:  # (indices stay below count, so no row beyond is read)
            grown = self.states.new_zeros(min(self.capacity, max(16, 2 * self.states.shape[0])), self.n_features)
            grown[:self.states.shape[0]] = self.states
            self.states = grown
        self.states[slot] = state.to(self.states.device, torch.float32)
        self.losses[slot] = loss
        t = self.count
        for start, forecast in list(self._pending.items()):
            h = t - start  # forecast made at `start` for horizons 1..H
            if 1 <= h <= self.horizon:
                actual = loss - float(self.losses[start % self.capacity])
                err = abs(float(forecast[h - 1]) - actual)
                n = int(self.error_counts[h - 1])
                beta = max(1.0 / (n + 1), 0.05)
                self.error_by_horizon[h - 1] = (1 - beta) * self.error_by_horizon[h - 1] + beta * err
                self.error_counts[h - 1] += 1
            if h >= self.horizon:
                del self._pending[start]
        self.count += 1
        if self.count >= 3:
            known = min(self.count, self.capacity)
            recent = self._ordered_losses(known)
            diffs = (recent[1:] - recent[:-1]).abs()
            self.loss_unit = max(float(diffs.mean()), 1e-8)

    def _ordered_losses(self, n: int) -> torch.Tensor:
        idx = torch.arange(self.count - n, self.count) % self.capacity
        return self.losses[idx]

    # -- model -----------------------------------------------------------------------------
    @property
    def built(self) -> bool:
        """Whether the networks (and their Adam state) exist yet."""
        return self.optimizer is not None

    def _build(self) -> None:
        if self.built:
            return
        ensemble, hidden, horizon = self.ensemble, self.hidden, self.horizon
        gen = torch.Generator().manual_seed(self._seed)
        bound = 1.0 / math.sqrt(hidden)

        def uniform(*shape):  # in place: the same values without two temporaries of each weight's size
            return nn.Parameter(torch.rand(*shape, generator=gen).mul_(2).sub_(1).mul_(bound))

        self.w_ih = uniform(ensemble, 3 * hidden, self.n_features)
        self.w_hh = uniform(ensemble, 3 * hidden, hidden)
        self.b_ih = uniform(ensemble, 3 * hidden)
        self.b_hh = uniform(ensemble, 3 * hidden)
        self.head_w = nn.Parameter(torch.zeros(ensemble, hidden, 2 * horizon))
        self.head_b = nn.Parameter(torch.zeros(ensemble, 1, 2 * horizon))
        self.to(self._device)
        self.optimizer = torch.optim.Adam(self.parameters(), lr=self._lr)

    def _rollout(self, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """windows [E, B, W, F] → (mean, logvar), each [E, B, H] in loss units."""
        e, b = windows.shape[:2]
        h = windows.new_zeros(e, b, self.hidden)
        for step in range(windows.shape[2]):
            h = hk.gru_cell(windows[:, :, step], h, self.w_ih, self.w_hh, self.b_ih, self.b_hh)
        out = torch.baddbmm(self.head_b, h, self.head_w)
        mean, logvar = out[..., : self.horizon], out[..., self.horizon:].clamp(-8.0, 8.0)
        return mean, logvar

    def _window_at(self, ends: torch.Tensor) -> torch.Tensor:
        """States of the `window` steps ending at each absolute index in ``ends`` → [N, W, F]."""
        offsets = torch.arange(-self.window + 1, 1)
        idx = (ends[:, None] + offsets[None, :]).clamp_min(0) % self.capacity
        return self.states[idx.to(self.states.device)]

    def ready(self) -> bool:
        return self.count >= self.window + 2

    def train_step(self, minibatches: int = 1) -> float:
        """A few Adam steps on replayed real steps; returns the last Gaussian NLL (or NaN)."""
        if not self.ready():
            return float("nan")
        self._build()
        oldest = max(self.window - 1, self.count - self.capacity + self.window)
        newest = self.count - 2  # needs at least the 1-step target
        if newest < oldest:
            return float("nan")
        for _ in range(minibatches):
            ends = torch.randint(oldest, newest + 1, (self.ensemble, self.batch), generator=self.sampler)
            windows = self._window_at(ends.reshape(-1)).view(self.ensemble, self.batch, self.window, -1)
            horizons = torch.arange(1, self.horizon + 1)
            future = ends[..., None] + horizons  # [E, B, H]
            known = future < self.count
            base = self.losses[ends % self.capacity]
            target = (self.losses[future.clamp_max(self.count - 1) % self.capacity] - base[..., None]) / self.loss_unit
            target = torch.where(known, target, torch.zeros_like(target)).to(windows.device, torch.float32)
            mask = known.to(windows.device, torch.float32)
            mean, logvar = self._rollout(windows)
            nll = 0.5 * (logvar + (target - mean) ** 2 * torch.exp(-logvar))
            loss = (nll * mask).sum() / mask.sum().clamp_min(1.0)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.parameters(), 5.0)
            self.optimizer.step()
            self.train_steps += 1
            self.last_train_loss = float(loss.detach())
        return self.last_train_loss

    @torch.no_grad()
    def forecast(self, score: bool = True, agree=None) -> dict[str, torch.Tensor] | None:
        """Forecast from the latest state: loss change per horizon (loss units, float64 [H], on the CPU):
        ``mean`` over members, ``epistemic`` (member spread) and ``aleatoric`` (predicted std).
        With ``score``, the forecast is compared with the real losses as they arrive. ``agree``
        (a ``[3, H]`` tensor to the same on every rank, e.g. rank 0's) is applied before both, so
        ranks whose models drifted apart by nondeterministic kernels still decide alike."""
        if not self.ready():
            return None
        self._build()
        ends = torch.tensor([self.count - 1])
        windows = self._window_at(ends).unsqueeze(0).expand(self.ensemble, 1, self.window, self.n_features)
        mean, logvar = self._rollout(windows.contiguous())
        mean = mean[:, 0].double() * self.loss_unit
        aleatoric = torch.exp(0.5 * logvar[:, 0].double()).mean(0) * self.loss_unit
        # Moved to the host in one read: only host logic (scoring, confidence, verification)
        # consumes it, and each float() of a GPU tensor would wait for the device.
        summary = torch.stack([mean.mean(0), mean.std(0, unbiased=False), aleatoric]).cpu()
        if agree is not None:
            summary = agree(summary)
        result = {"mean": summary[0], "epistemic": summary[1], "aleatoric": summary[2]}
        if score:
            self._pending[self.count - 1] = result["mean"].clone()
        return result

    def confidence(self, forecast: dict[str, torch.Tensor] | None, horizon: int, noise_std: float) -> float:
        """1 / (1 + d² + e²) at ``horizon``: d = member spread of ``forecast`` in units of the batch
        loss noise σ; e = realised error beyond what noise alone causes. A forecast of the loss
        change between two single-batch losses is off by E|N(0, 2σ²)| ≈ 1.13σ even when perfect,
        so e = max(0, error / (1.13σ) − 1). 0 when nothing is known yet."""
        if forecast is None or int(self.error_counts[horizon - 1]) == 0:
            return 0.0
        scale = max(noise_std, 1e-12)
        d = float(forecast["epistemic"][horizon - 1]) / scale
        e = max(0.0, float(self.error_by_horizon[horizon - 1]) / (NOISE_FLOOR * scale) - 1.0)
        return 1.0 / (1.0 + d * d + e * e)

    def error_report(self) -> dict[int, float]:
        """Realised mean |forecast − actual| loss change per horizon (only horizons with data)."""
        errors, counts = self.error_by_horizon.tolist(), self.error_counts.tolist()  # two reads, not 2 per horizon
        return {h + 1: errors[h] for h in range(self.horizon) if counts[h] > 0}

    # -- checkpoint ------------------------------------------------------------------------
    def full_state_dict(self) -> dict:
        return {
            # Empty and None while the networks are not built.
            "params": {k: v.clone() for k, v in self.state_dict().items()},
            # A copy: Optimizer.load_state_dict keeps same-device tensors as they are, so a state
            # passed in memory would otherwise share Adam moments between two models.
            "optimizer": copy.deepcopy(self.optimizer.state_dict()) if self.built else None,
            "sampler": self.sampler.get_state(),
            "states": self.states.clone(), "losses": self.losses.clone(), "count": self.count,
            "loss_unit": self.loss_unit, "train_steps": self.train_steps, "last_train_loss": self.last_train_loss,
            "error_by_horizon": self.error_by_horizon.clone(), "error_counts": self.error_counts.clone(),
            "pending": {k: v.clone() for k, v in self._pending.items()},
        }

    def load_full_state_dict(self, state: dict) -> None:
        if state["params"]:  # saved with its networks: build them here to load into
            self._build()
            self.load_state_dict(state["params"])
            self.optimizer.load_state_dict(state["optimizer"])
        elif self.built:  # saved before they were built: none here either
            for name in list(self._parameters):
                delattr(self, name)
            self.optimizer = None
        self.sampler.set_state(state["sampler"])
        self.states = state["states"].to(self.states.device, torch.float32, copy=True)  # the rows saved
        self.losses.copy_(state["losses"])
        self.count, self.loss_unit = state["count"], state["loss_unit"]
        self.train_steps, self.last_train_loss = state["train_steps"], state["last_train_loss"]
        self.error_by_horizon.copy_(state["error_by_horizon"])
        self.error_counts.copy_(state["error_counts"])
        self._pending = {int(k): v.clone() for k, v in state["pending"].items()}

"""Weight nowcasting: predict where each weight will be ``h`` snapshots from now.

Every ``every`` real steps a :class:`SnapshotHistory` keeps a flat fp32 copy of the weights; the
last ``context + 1`` copies give, per weight element, its ``context`` most recent displacements
``d_1 (newest) … d_k``. A :class:`Nowcaster` maps them, normalised by the element's own recent
step size ``s = mean_j |d_j|``, to the element's displacement over the next ``h`` snapshot
intervals (in units of ``s``). It runs element-wise, so one small model serves any architecture;
it is trained on trajectories recorded from *other* tasks (``python -m experiments.nowcast train``,
weights in ``experiments/results/nowcaster.pt``). Measured not to pay (experiments/results/nowcast_*.json), so
it lives with the benchmark as evidence, not in the trainer.

Rule-based nowcasts share the interface, so the benchmark compares like with like:
``drift_nowcast`` (the mean displacement continued for ``h`` intervals) and ``dmd_nowcast``
(cross-parameter: a low-rank linear map of all weights' displacements, iterated ahead).
``secant_nowcast`` is not a nowcast of the trajectory but a quasi-Newton step in the span of its
recent displacements, with the curvature fitted from how the optimizer's smoothed gradient
changed along them.

Features per element (all dimensionless): ``d_j / s`` for j = 1..k, and
``log(s / S)`` where ``S`` is the mean of ``s`` over the element's tensor, which tells a weight
that moves much less than its neighbours (nearly converged) from one that leads.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

ASSET = Path(__file__).resolve().parent / "results" / "nowcaster.pt"
_CHUNK = 1 << 18  # elements per MLP evaluation: bounds the temporary activations
_TINY = 1e-12


class SnapshotHistory:
    """The last ``context + 1`` snapshots of ``params`` (flat fp32), one every ``every`` real steps.

    Args:
        params: parameters (any float dtype), all on one device.
        context: displacements the nowcaster sees (snapshots kept = context + 1).
        every: real steps between snapshots.
    """

    def __init__(self, params: list[torch.Tensor], context: int, every: int):
        if context < 1 or every < 1:
            raise ValueError(f"context and every must be >= 1, got context={context}, every={every}")
        self.params, self.context, self.every = params, context, every
        self.sizes = [p.numel() for p in params]
        total = sum(self.sizes)
        self._ring = torch.zeros(context + 1, total, dtype=torch.float32, device=params[0].device)
        self.count = 0  # snapshots taken since the last reset
        self.steps_since = 0  # real steps since the last snapshot

    @property
    def ready(self) -> bool:
        return self.count >= self.context + 1

    @torch.no_grad()
    def _take(self) -> None:
        row = self._ring[self.count % (self.context + 1)]
        torch.cat([p.detach().reshape(-1).float() for p in self.params], out=row)
        self.count += 1
        self.steps_since = 0

    def reset(self) -> None:
        """Forget the trajectory (after a jump) and start it again from the current weights."""
        self.count = 0
        self._take()

    def observe_real_step(self) -> None:
        """Call after every real optimizer step."""
        if self.count == 0:
            self._take()
            return
        self.steps_since += 1
        if self.steps_since >= self.every:
            self._take()

    def displacements(self) -> torch.Tensor:
        """[context, N] fp32, newest first: d_j = θ(t−j+1) − θ(t−j) in snapshot intervals."""
        if not self.ready:
            raise RuntimeError(f"{self.count} snapshots taken, {self.context + 1} needed")
        n = self.context + 1
        order = [(self.count - 1 - j) % n for j in range(n)]  # newest first
        snaps = self._ring[order]
        return snaps[:-1] - snaps[1:]


def element_features(disp: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Features of every element from its displacements.

    Args:
        disp: [k, N] fp32 displacements, newest first.
        sizes: element counts of the tensors that ``N`` concatenates (for the tensor-level scale).
    Returns:
        x: [N, k + 1] fp32 features; s: [N] fp32 step size of each element (parameter units).
    """
    s = disp.abs().mean(0)
    tensor_scale = torch.cat([part.mean().expand(part.numel()) for part in s.split(sizes)])
    s_safe = s.clamp_min(_TINY)
    x = torch.cat([(disp / s_safe).t(), torch.log((s_safe / tensor_scale.clamp_min(_TINY)).clamp_min(1e-6))[:, None]],
                  dim=1)
    return x, s


class Nowcaster(nn.Module):
    """Element-wise MLP: features [N, k+1] → normalised displacement over each horizon [N, H].

    The output is a linear map of the features plus an MLP correction, so the drift rule
    (``h · mean_j d_j / s``) is one of the functions it can represent exactly.

    Args:
        context: k, displacements per element.
        horizons: snapshot intervals predicted ahead (one output each).
        hidden: MLP width.
    """

    def __init__(self, context: int = 4, horizons: tuple[int, ...] = (1, 2, 4), hidden: int = 32):
        super().__init__()
        self.context, self.horizons = context, tuple(horizons)
        n_in, n_out = context + 1, len(self.horizons)
        self.linear = nn.Linear(n_in, n_out)
        self.mlp = nn.Sequential(nn.Linear(n_in, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, n_out))
        nn.init.zeros_(self.mlp[-1].weight)
        nn.init.zeros_(self.mlp[-1].bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.mlp(x)

    @torch.no_grad()
    def predict(self, disp: torch.Tensor, sizes: list[int], horizon: int) -> torch.Tensor:
        """Displacement [N] fp32 (parameter units) of every element ``horizon`` snapshots ahead."""
        if horizon not in self.horizons:
            raise ValueError(f"horizon must be one of {self.horizons}, got {horizon}")
        if disp.shape[0] != self.context:
            raise ValueError(f"disp: expected {self.context} displacements, got shape {tuple(disp.shape)}")
        column = self.horizons.index(horizon)
        x, s = element_features(disp, sizes)
        out = torch.empty_like(s)
        for start in range(0, len(s), _CHUNK):
            part = slice(start, start + _CHUNK)
            out[part] = self(x[part])[:, column]
        return out.mul_(s)

    def save(self, path: Path | str, meta: dict | None = None) -> None:
        torch.save({"context": self.context, "horizons": list(self.horizons), "hidden": self.mlp[0].out_features,
                    "state_dict": self.state_dict(), "meta": meta or {}}, path)

    @classmethod
    def load(cls, path: Path | str = ASSET, device: torch.device | str = "cpu") -> "Nowcaster":
        blob = torch.load(path, map_location=device, weights_only=True)
        model = cls(blob["context"], tuple(blob["horizons"]), blob["hidden"]).to(device)
        model.load_state_dict(blob["state_dict"])
        model.meta = blob.get("meta", {})
        return model.eval()


def drift_nowcast(disp: torch.Tensor, horizon: int) -> torch.Tensor:
    """Rule-based nowcast: the mean displacement over the context, continued ``horizon`` intervals."""
    return disp.mean(0).mul_(horizon)


def dmd_nowcast(disp: torch.Tensor, ahead: int, rank: int = 8) -> torch.Tensor:
    """Dynamic-mode-decomposition nowcast: the displacement over the next ``ahead`` intervals.

    Unlike the element-wise rules above it is cross-parameter: it fits one linear map ``A`` with
    ``d(t+1) = A d(t)`` to the last displacements of *all* weights, restricted to their ``rank``
    leading directions, and sums ``A d, A² d, …, A^ahead d`` from the newest one. Eigenvalues near
    1 are the trajectory's drift (continued), near −1 the iterate's oscillation (summing to about
    nothing), inside the unit disk transients (summing to where they settle). Moduli above 1 are
    clipped to 1, so a fit on noise cannot extrapolate to a blow-up.

    Args:
        disp: [k, N] displacements between consecutive snapshots, newest first (k >= 3).
        ahead: snapshot intervals to predict (>= 1).
        rank: number of leading directions of the displacements kept (<= k − 1).
    Returns:
        [N] predicted displacement, same dtype as ``disp``.
    """
    if disp.dim() != 2 or disp.shape[0] < 3:
        raise ValueError(f"disp must be [k >= 3, N], got shape {tuple(disp.shape)}")
    if ahead < 1 or rank < 1:
        raise ValueError(f"ahead and rank must be >= 1, got ahead={ahead}, rank={rank}")
    d = disp.flip(0).double()  # oldest first; double: the Gram matrix squares the condition number
    before, after = d[:-1], d[1:]  # [k-1, N]: d(t) and d(t+1)
    # Leading directions from the small Gram matrix instead of an SVD of the tall [N, k-1] one.
    evals, evecs = torch.linalg.eigh(before @ before.T)
    evals, evecs = evals.flip(0), evecs.flip(1)
    keep = int(min(rank, int((evals > evals[0] * 1e-10).sum())))
    sigma = evals[:keep].clamp_min(0).sqrt()
    basis = (evecs[:, :keep].T @ before) / sigma[:, None]  # [r, N] orthonormal rows (U^T)
    reduced = basis @ after.T @ evecs[:, :keep] / sigma  # [r, r]: U^T A U
    lam, modes = torch.linalg.eig(reduced)
    lam = torch.where(lam.abs() > 1, lam / lam.abs(), lam)
    amplitudes = torch.linalg.solve(modes, (basis @ d[-1]).to(modes.dtype))
    # lam + lam² + … + lam^ahead; the closed form divides by 1 − lam, so lam = 1 takes the limit.
    near_one = (lam - 1).abs() < 1e-9
    geometric = torch.where(near_one, torch.full_like(lam, ahead),
                            lam * (1 - lam ** ahead) / torch.where(near_one, torch.ones_like(lam), 1 - lam))
    return (basis.T @ (modes @ (geometric * amplitudes)).real).to(disp.dtype)


def secant_nowcast(points: torch.Tensor, grads: torch.Tensor, rank: int = 8, max_ratio: float = 2.0) -> torch.Tensor:
    """Quasi-Newton step in the span of recent displacements, curvature fitted by secants.

    For a quadratic loss with Hessian ``H``, the optimizer's first moment (an EMA of gradients,
    ``β₁`` = 0.9 for Adam) equals ``H θ̄ + b`` at the EMA of the weights with the same β, up to
    the smoothed batch noise. So pairs (``θ̄_j``, ``m_j``) taken along the run are secant pairs:
    with ``P`` the displacements ``θ̄_j − θ̄_now`` and ``Y`` the gradient changes ``m_j − m_now``,
    ``H`` restricted to the span of ``P`` is fitted by least squares (``Y ≈ H P`` in the
    ``rank`` leading directions of ``P``, symmetrised), and the step minimises the fitted
    quadratic there. Directions of curvature below 1e-3 of the largest are left alone (a fit on
    noise must not send the weights far along a flat or concave direction), and the step is
    shortened to at most ``max_ratio`` times the largest displacement in the window.

    Args:
        points: [k+1, N] averaged weights ``θ̄_j``, oldest first, the last the current one (k >= 2).
        grads: [k+1, N] smoothed gradients ``m_j`` at those points (Adam's bias-corrected first moment).
        rank: directions of the displacements kept (>= 1).
        max_ratio: cap on the step's norm, in units of the window's largest displacement (> 0).
    Returns:
        [N] step from ``points[-1]``, same dtype as ``points``.
    """
    if points.dim() != 2 or points.shape[0] < 3 or grads.shape != points.shape:
        raise ValueError(f"points and grads must both be [k+1 >= 3, N], got {tuple(points.shape)} and "
                         f"{tuple(grads.shape)}")
    if rank < 1 or not max_ratio > 0:
        raise ValueError(f"rank must be >= 1 and max_ratio > 0, got rank={rank}, max_ratio={max_ratio}")
    x, g = points.double(), grads.double()
    disp, dgrad = x[:-1] - x[-1], g[:-1] - g[-1]  # [k, N]
    # Leading directions from the small Gram matrix (k × k) rather than an SVD of [k, N].
    evals, evecs = torch.linalg.eigh(disp @ disp.T)
    evals, evecs = evals.flip(0), evecs.flip(1)
    keep = int(min(rank, int((evals > evals[0] * 1e-10).sum())))
    sigma = evals[:keep].clamp_min(0).sqrt()
    basis = (evecs[:, :keep].T @ disp) / sigma[:, None]  # [r, N] orthonormal rows
    coords, gcoords = disp @ basis.T, dgrad @ basis.T  # [k, r] each: Y_j = B R_j
    b = torch.linalg.lstsq(coords, gcoords).solution.T  # [r, r]
    curvature, axes = torch.linalg.eigh((b + b.T) / 2)
    along = axes.T @ (basis @ g[-1])  # current smoothed gradient on the curvature axes
    usable = curvature > 1e-3 * curvature.abs().max()
    step_coords = torch.where(usable, -along / torch.where(usable, curvature, torch.ones_like(curvature)),
                              torch.zeros_like(along))
    step = basis.T @ (axes @ step_coords)
    limit = max_ratio * disp.norm(dim=1).max()
    if step.norm() > limit:
        step *= limit / step.norm()
    return step.to(points.dtype)

"""LinUCB contextual bandit over discrete choices such as predict-phase lengths.

Disjoint linear models (Li, Chu, Langford, Schapire 2010, "A contextual-bandit approach to personalized news
article recommendation", algorithm 1): each arm a keeps

    A_a = ridge * I + sum_t x_t x_t^T        (n_features x n_features)
    b_a = sum_t r_t x_t                       (n_features)

and scores a context x with the upper confidence bound

    p_a(x) = theta_a . x + alpha * sqrt(x^T A_a^{-1} x),   theta_a = A_a^{-1} b_a.

The full matrix A is kept (the predecessor's diagonal approximation ignored feature correlations, so its
confidence widths were wrong for correlated context features). A and b are the sufficient statistics: they
are stored exactly, and theta is solved fresh with ``np.linalg.solve`` at each call rather than updating an
inverse incrementally, so a resumed bandit carries no accumulated rounding drift and its choices are a pure
function of (A, b, RNG state). With a handful of arms and tens of features a solve costs microseconds.

Rewards are in whatever unit the caller chooses (e.g. backward passes saved per step, minus a penalty for
rejected predictions); only their ordering across arms matters. Contexts should be roughly unit-scaled, and
a constant 1.0 feature gives each arm an intercept.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np

__all__ = ["LinUCBBandit"]

_STATE_VERSION = 1
# Scores this close (relative) are treated as a tie and broken by the seeded RNG: at the start every arm
# scores exactly the same, and a fixed "first arm wins" rule would bias the early exploration.
_TIE_RELATIVE_TOLERANCE = 1e-12


def _finite_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        if hasattr(value, "item"):  # 0-d numpy array / torch tensor
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


class LinUCBBandit:
    """Chooses one arm value per decision from a context vector and learns from the reward it gets back.

    Args:
        arms: the distinct integer arm values (e.g. predict lengths in steps); ``select`` returns one of them.
        n_features: length of every context vector (>= 1).
        alpha: exploration weight on the confidence width (>= 0; 0 is greedy).
        ridge: L2 regulariser; each A_a starts as ridge * I (> 0).
        seed: seed of the RNG that breaks exact ties between arms.
    """

    def __init__(self, arms: Sequence[int], n_features: int, alpha: float = 1.0, ridge: float = 1.0, seed: int = 0):
        arm_list = list(arms) if not isinstance(arms, (str, bytes)) else None
        if not arm_list or not all(isinstance(a, numbers.Integral) and not isinstance(a, bool) for a in arm_list):
            raise ValueError(f"arms must be a non-empty sequence of integers, got {arms!r}")
        arm_list = [int(a) for a in arm_list]
        if len(set(arm_list)) != len(arm_list):
            raise ValueError(f"arms must be distinct, got {arm_list}")
        if not isinstance(n_features, numbers.Integral) or isinstance(n_features, bool) or n_features < 1:
            raise ValueError(f"n_features must be an integer >= 1, got {n_features!r}")
        alpha = _finite_float("alpha", alpha)
        if alpha < 0:
            raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")
        ridge = _finite_float("ridge", ridge)
        if ridge <= 0:
            raise ValueError(f"ridge must be a finite number > 0, got {ridge!r}")
        if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")

        self.arms: list[int] = arm_list
        self.n_features = int(n_features)
        self.alpha = alpha
        self.ridge = ridge
        self.seed = int(seed)
        self._arm_index = {arm: i for i, arm in enumerate(arm_list)}
        n_arms = len(arm_list)
        self._A = np.tile(np.eye(self.n_features) * ridge, (n_arms, 1, 1))  # (arms, features, features)
        self._b = np.zeros((n_arms, self.n_features))  # (arms, features)
        self.pulls = np.zeros(n_arms, dtype=np.int64)  # updates received per arm, for logging
        self._rng = np.random.default_rng(self.seed)

    # ------------------------------------------------------------------ helpers
    def _context(self, context) -> np.ndarray:
        try:
            x = np.asarray(context, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"context must be a 1-D array-like of {self.n_features} real numbers") from exc
        if x.shape != (self.n_features,):
            raise ValueError(f"context must have shape ({self.n_features},), got {x.shape}")
        if not np.all(np.isfinite(x)):
            raise ValueError(f"context must be finite, got {x.tolist()}")
        return x

    def _arm(self, arm) -> int:
        if isinstance(arm, bool) or not isinstance(arm, numbers.Integral) or int(arm) not in self._arm_index:
            raise ValueError(f"arm must be one of {self.arms}, got {arm!r}")
        return self._arm_index[int(arm)]

    def _estimates(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Point estimate theta_a . x and confidence width sqrt(x^T A_a^{-1} x) for every arm."""
        # One batched solve for theta_a = A_a^{-1} b_a and A_a^{-1} x together.
        rhs = np.stack([self._b, np.broadcast_to(x, self._b.shape)], axis=-1)  # (arms, features, 2)
        solved = np.linalg.solve(self._A, rhs)
        theta, a_inv_x = solved[..., 0], solved[..., 1]
        means = theta @ x
        # A_a is symmetric positive definite, so x^T A^{-1} x >= 0 up to rounding; clip the rounding away.
        widths = np.sqrt(np.maximum(a_inv_x @ x, 0.0))
        return means, widths

    # ------------------------------------------------------------------ public API
    def upper_confidence_bounds(self, context) -> dict[int, float]:
        """UCB score per arm value for ``context`` (what ``select`` maximises)."""
        means, widths = self._estimates(self._context(context))
        return {arm: float(m + self.alpha * w) for arm, m, w in zip(self.arms, means, widths)}

    def expected_rewards(self, context) -> dict[int, float]:
        """Point estimate theta_a . x of the reward per arm value (no exploration bonus), for logging."""
        means, _ = self._estimates(self._context(context))
        return {arm: float(m) for arm, m in zip(self.arms, means)}

    def select(self, context) -> int:
        """Return the arm value with the highest upper confidence bound; exact ties go to the seeded RNG."""
        means, widths = self._estimates(self._context(context))
        scores = means + self.alpha * widths
        best = float(np.max(scores))
        tolerance = _TIE_RELATIVE_TOLERANCE * max(1.0, abs(best))
        tied = np.flatnonzero(scores >= best - tolerance)
        # Draw only when there is a real tie, so the RNG stream (and thus resumption) depends on ties alone.
        choice = int(tied[0]) if len(tied) == 1 else int(self._rng.choice(tied))
        return self.arms[choice]

    def update(self, arm: int, context, reward: float) -> None:
        """Record that ``arm`` (an arm value from ``select``) earned ``reward`` in ``context``."""
        index = self._arm(arm)
        x = self._context(context)
        reward = _finite_float("reward", reward)
        self._A[index] += np.outer(x, x)
        self._b[index] += reward * x
        self.pulls[index] += 1

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict:
        """JSON-able snapshot (nested lists of Python floats, which round-trip float64 exactly)."""
        return {
            "version": _STATE_VERSION,
            "arms": list(self.arms),
            "n_features": self.n_features,
            "alpha": self.alpha,
            "ridge": self.ridge,
            "seed": self.seed,
            "A": self._A.tolist(),
            "b": self._b.tolist(),
            "pulls": self.pulls.tolist(),
            "rng_state": self._rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`; later ``select`` calls then match the uninterrupted run exactly.

        The arms and n_features must match this bandit's (the statistics are meaningless otherwise); alpha
        and ridge are taken from the state so that the restored bandit behaves exactly like the saved one.
        """
        if not isinstance(state, dict):
            raise ValueError(f"state must be a dict from LinUCBBandit.state_dict(), got {type(state).__name__}")
        required = {"version", "arms", "n_features", "alpha", "ridge", "seed", "A", "b", "pulls", "rng_state"}
        missing = required - state.keys()
        if missing:
            raise ValueError(f"state is missing keys {sorted(missing)}")
        if state["version"] != _STATE_VERSION:
            raise ValueError(f"state version {state['version']!r} is not supported (expected {_STATE_VERSION})")
        if list(state["arms"]) != self.arms:
            raise ValueError(f"state arms {state['arms']} do not match this bandit's arms {self.arms}")
        if state["n_features"] != self.n_features:
            raise ValueError(f"state n_features {state['n_features']} does not match {self.n_features}")
        n_arms = len(self.arms)
        A = np.asarray(state["A"], dtype=np.float64)
        b = np.asarray(state["b"], dtype=np.float64)
        pulls = np.asarray(state["pulls"], dtype=np.int64)
        if A.shape != (n_arms, self.n_features, self.n_features) or not np.all(np.isfinite(A)):
            raise ValueError(f"state['A'] must be finite with shape {(n_arms, self.n_features, self.n_features)}")
        if b.shape != (n_arms, self.n_features) or not np.all(np.isfinite(b)):
            raise ValueError(f"state['b'] must be finite with shape {(n_arms, self.n_features)}")
        if pulls.shape != (n_arms,):
            raise ValueError(f"state['pulls'] must have shape ({n_arms},)")
        rng = np.random.default_rng()
        try:
            rng.bit_generator.state = state["rng_state"]
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError("state['rng_state'] is not a valid numpy bit-generator state") from exc

        self.alpha = _finite_float("state['alpha']", state["alpha"])
        self.ridge = _finite_float("state['ridge']", state["ridge"])
        self.seed = int(state["seed"])
        self._A = A.copy()
        self._b = b.copy()
        self.pulls = pulls.copy()
        self._rng = rng

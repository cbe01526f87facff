"""LinUCBBandit: learns the best arm per context, resumes exactly, validates its inputs."""
import json

import numpy as np
import pytest

from hybrid_trainer.bandit import LinUCBBandit

ARMS = [4, 8, 16, 32]
# True linear reward per arm over the context [1, x1, x2]: arm 8 wins when x1 is high, arm 32 when x2 is
# high, arms 4 and 16 never win. Gaps at the contexts drawn below are >= 0.3, noise std 0.1.
TRUE_THETA = {
    4: np.array([0.2, 0.0, 0.0]),
    8: np.array([0.0, 1.0, 0.0]),
    16: np.array([0.1, 0.3, 0.3]),
    32: np.array([0.0, 0.0, 1.0]),
}


def draw_context(rng) -> np.ndarray:
    high = rng.integers(2)  # which of the two features is the strong one this round
    x = rng.uniform(0.0, 0.2, 2)
    x[high] = rng.uniform(0.8, 1.0)
    return np.array([1.0, x[0], x[1]])


def best_arm(context) -> int:
    return max(ARMS, key=lambda arm: float(TRUE_THETA[arm] @ context))


def run_rounds(bandit, rounds, rng):
    picks = []
    for _ in range(rounds):
        context = draw_context(rng)
        arm = bandit.select(context)
        reward = float(TRUE_THETA[arm] @ context + rng.normal(0.0, 0.1))
        bandit.update(arm, context, reward)
        picks.append((arm, best_arm(context)))
    return picks


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_converges_to_best_arm_per_context(seed):
    rng = np.random.default_rng(seed)
    bandit = LinUCBBandit(ARMS, n_features=3, alpha=1.0, seed=seed)
    picks = run_rounds(bandit, 300, rng)
    last = picks[-100:]
    correct = sum(chosen == best for chosen, best in last) / len(last)
    assert correct > 0.8, correct
    # Both context types occur, so this is contextual learning, not one globally best arm.
    assert {best for _, best in last} == {8, 32}
    expected = bandit.expected_rewards(np.array([1.0, 0.9, 0.1]))
    assert max(expected, key=expected.get) == 8
    assert expected[8] == pytest.approx(0.9, abs=0.15)


def test_select_returns_arm_values_and_explores_every_arm_first():
    bandit = LinUCBBandit([10, 20, 40], n_features=2, alpha=1.0, seed=0)
    context = [1.0, 0.5]
    chosen = []
    for _ in range(3):
        arm = bandit.select(context)
        assert arm in (10, 20, 40)
        chosen.append(arm)
        bandit.update(arm, context, 0.0)
    # With equal rewards, the untried arms keep the widest confidence bound and win.
    assert sorted(chosen) == [10, 20, 40]


def test_greedy_bandit_exploits_known_best_arm():
    bandit = LinUCBBandit([1, 2], n_features=1, alpha=0.0)
    for _ in range(5):
        bandit.update(1, [1.0], 0.2)
        bandit.update(2, [1.0], 0.9)
    assert bandit.select([1.0]) == 2
    rewards = bandit.expected_rewards([1.0])
    # Ridge 1 shrinks the mean of 5 equal rewards r to 5r/6.
    assert rewards == pytest.approx({1: 0.2 * 5 / 6, 2: 0.9 * 5 / 6})


def test_ucb_matches_closed_form():
    bandit = LinUCBBandit([3], n_features=2, alpha=0.7, ridge=2.0)
    contexts = [np.array([1.0, 0.3]), np.array([1.0, -0.4]), np.array([0.5, 0.9])]
    rewards = [0.5, -0.2, 1.1]
    for x, r in zip(contexts, rewards):
        bandit.update(3, x, r)
    A = 2.0 * np.eye(2) + sum(np.outer(x, x) for x in contexts)
    b = sum(r * x for x, r in zip(contexts, rewards))
    x = np.array([0.2, 1.0])
    theta = np.linalg.inv(A) @ b
    expected = theta @ x + 0.7 * np.sqrt(x @ np.linalg.inv(A) @ x)
    assert bandit.upper_confidence_bounds(x)[3] == pytest.approx(expected, rel=1e-12)


def test_state_round_trip_reproduces_future_choices():
    rng = np.random.default_rng(7)
    bandit = LinUCBBandit(ARMS, n_features=3, alpha=1.5, seed=3)
    run_rounds(bandit, 60, rng)

    state = json.loads(json.dumps(bandit.state_dict()))  # must survive strict JSON
    resumed = LinUCBBandit(ARMS, n_features=3, alpha=1.5, seed=3)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == bandit.state_dict()

    future_rng = np.random.default_rng(11)
    contexts = [draw_context(future_rng) for _ in range(80)]
    rewards = future_rng.normal(0.0, 1.0, 80)
    original_choices, resumed_choices = [], []
    for context, reward in zip(contexts, rewards):
        for b, out in ((bandit, original_choices), (resumed, resumed_choices)):
            arm = b.select(context)
            b.update(arm, context, float(reward))
            out.append(arm)
    assert original_choices == resumed_choices
    assert len(set(original_choices)) > 1  # the comparison covered more than one trivial choice


def test_ties_are_broken_by_the_seeded_rng():
    def first_choices(seed):
        bandit = LinUCBBandit(list(range(8)), n_features=1, seed=seed)
        return [bandit.select([1.0]) for _ in range(20)]  # no updates: every call is an 8-way tie

    assert first_choices(0) == first_choices(0)
    assert len(set(first_choices(0))) > 1  # not "always the first arm"
    assert first_choices(0) != first_choices(1)


def test_load_state_dict_rejects_mismatched_bandit():
    state = LinUCBBandit([1, 2], n_features=2).state_dict()
    with pytest.raises(ValueError, match="arms"):
        LinUCBBandit([1, 3], n_features=2).load_state_dict(state)
    with pytest.raises(ValueError, match="n_features"):
        LinUCBBandit([1, 2], n_features=3).load_state_dict(state)
    with pytest.raises(ValueError, match="missing keys"):
        LinUCBBandit([1, 2], n_features=2).load_state_dict({"version": 1})


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"arms": []}, "arms"),
        ({"arms": [1, 1]}, "arms"),
        ({"arms": [1.5, 2]}, "arms"),
        ({"n_features": 0}, "n_features"),
        ({"alpha": -0.1}, "alpha"),
        ({"alpha": float("inf")}, "alpha"),
        ({"ridge": 0.0}, "ridge"),
        ({"seed": -1}, "seed"),
    ],
)
def test_constructor_validation(kwargs, name):
    arguments = {"arms": [1, 2], "n_features": 2, **kwargs}
    with pytest.raises(ValueError, match=name):
        LinUCBBandit(**arguments)


def test_input_validation_names_the_bad_argument():
    bandit = LinUCBBandit([1, 2], n_features=2)
    with pytest.raises(ValueError, match="context"):
        bandit.select([1.0, float("nan")])
    with pytest.raises(ValueError, match="context"):
        bandit.select([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="context"):
        bandit.update(1, [float("inf"), 0.0], 1.0)
    with pytest.raises(ValueError, match="reward"):
        bandit.update(1, [1.0, 0.0], float("nan"))
    with pytest.raises(ValueError, match="arm"):
        bandit.update(3, [1.0, 0.0], 1.0)
    # A rejected update leaves the statistics untouched.
    assert bandit.state_dict()["pulls"] == [0, 0]

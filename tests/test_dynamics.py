"""DynamicsModel: learns a predictable loss trajectory online; error by horizon is real."""
import math

import pytest
import torch

from hybrid_trainer.dynamics import DynamicsModel


@pytest.fixture(autouse=True)
def eager(monkeypatch):
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", "eager")


def trajectory(t: int) -> float:
    return 0.5 + 2.0 * math.exp(-t / 60.0)


def state(t: int) -> torch.Tensor:
    x = torch.zeros(64)
    loss = trajectory(t)
    x[0], x[1], x[2] = loss - 1.0, (trajectory(t) - trajectory(t - 1)) * 30, t / 100.0
    return x


def test_training_loss_falls_and_forecasts_beat_no_change():
    model = DynamicsModel(hidden=32, ensemble=3, horizon=8, window=4, batch=16, lr=3e-3, seed=0)
    nll = []
    for t in range(220):
        model.observe(state(t), trajectory(t))
        if t % 2 == 0 and model.ready():
            nll.append(model.train_step(minibatches=2))
        if t % 4 == 0 and model.ready():
            model.forecast()  # scored against the real trajectory as it arrives
    early, late = sum(nll[:10]) / 10, sum(nll[-10:]) / 10
    assert late < early - 1.0, (early, late)
    errors = model.error_report()
    assert set(errors) == set(range(1, 9))
    # Late in the run, the forecast of the loss change at horizon 8 beats "no change".
    fc = model.forecast(score=False)
    t = model.count - 1
    actual = trajectory(t + 8) - trajectory(t)
    assert abs(float(fc["mean"][7]) - actual) < 0.5 * abs(actual), (float(fc["mean"][7]), actual)
    assert bool((fc["epistemic"] >= 0).all()) and bool((fc["aleatoric"] > 0).all())


def test_confidence_is_zero_without_data_and_in_unit_interval_after():
    model = DynamicsModel(hidden=16, ensemble=2, horizon=4, window=2, batch=4, seed=1)
    assert model.confidence(model.forecast(), 4, noise_std=0.1) == 0.0
    for t in range(40):
        model.observe(state(t), trajectory(t))
        if model.ready():
            model.train_step()
            model.forecast()
    c = model.confidence(model.forecast(score=False), 4, noise_std=0.05)
    assert 0.0 < c <= 1.0


def test_state_round_trip_gives_identical_forecasts():
    a = DynamicsModel(hidden=16, ensemble=2, horizon=4, window=3, batch=4, seed=2)
    for t in range(30):
        a.observe(state(t), trajectory(t))
        if a.ready():
            a.train_step()
    b = DynamicsModel(hidden=16, ensemble=2, horizon=4, window=3, batch=4, seed=99)
    b.load_full_state_dict(a.full_state_dict())
    for t in range(30, 40):
        for m in (a, b):
            m.observe(state(t), trajectory(t))
            m.train_step()
    assert torch.equal(a.forecast(score=False)["mean"], b.forecast(score=False)["mean"])


def test_the_networks_are_built_by_the_first_training_step_with_the_weights_an_eager_build_draws():
    """Observing needs only the replay; the GRUs and their Adam state come with the first training
    step, drawn from the model's own seeded generator: the same weights whenever they are built."""
    def model():
        return DynamicsModel(hidden=16, ensemble=2, horizon=4, window=3, batch=4, seed=5)

    late, early = model(), model()
    early._build()  # as the model was built before: at construction
    for t in range(20):
        for m in (late, early):
            m.observe(state(t), trajectory(t))
    assert not late.built and not list(late.parameters())
    unbuilt = late.full_state_dict()
    assert unbuilt["params"] == {} and unbuilt["optimizer"] is None
    for m in (late, early):
        m.train_step()
    assert late.built and all(torch.equal(a, b) for a, b in zip(late.state_dict().values(), early.state_dict().values()))
    assert torch.equal(late.forecast(score=False)["mean"], early.forecast(score=False)["mean"])
    late.load_full_state_dict(unbuilt)  # a state saved before the build: the networks go
    assert not late.built and not list(late.parameters())


def test_the_replay_grows_with_the_steps_and_wraps_at_its_capacity():
    model = DynamicsModel(hidden=8, ensemble=1, horizon=2, window=3, capacity=40, seed=0)
    for t in range(5):
        model.observe(state(t), trajectory(t))
    assert model.states.shape[0] == 16  # a few steps keep a few rows, not the capacity
    for t in range(5, 95):
        model.observe(state(t), trajectory(t))
    assert model.states.shape[0] == 40
    windows = model._window_at(torch.tensor([94, 60]))  # the last steps, across the wrap
    for row, end in zip(windows, (94, 60)):
        assert torch.equal(row, torch.stack([state(t) for t in range(end - 2, end + 1)]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_forecast_on_a_gpu_comes_back_on_the_host_in_one_piece():
    """Its consumers are host logic: a forecast left on the GPU cost one device wait per float()."""
    model = DynamicsModel(hidden=16, ensemble=2, horizon=4, window=2, batch=4, seed=1, device=torch.device("cuda"))
    for t in range(12):
        model.observe(state(t).cuda(), trajectory(t))
    fc = model.forecast()
    assert {t.device.type for t in fc.values()} == {"cpu"}
    assert fc["mean"].dtype == torch.float64 and fc["mean"].shape == (4,)

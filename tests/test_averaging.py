"""WeightAverage (hybrid_trainer/averaging.py): the lag-corrected weight average."""
import pytest
import torch

from hybrid_trainer.averaging import FAST_BETA, SLOW_BETA, WeightAverage, lag


def _follow(average: WeightAverage, params: list[torch.Tensor], trajectory, steps: int) -> None:
    for t in range(1, steps + 1):
        with torch.no_grad():
            for p, value in zip(params, trajectory(t)):
                p.copy_(value)
        average.update()


def test_lags_are_those_of_the_two_emas():
    assert lag(FAST_BETA) == pytest.approx(9.0) and lag(SLOW_BETA) == pytest.approx(49.0)


def test_estimate_of_a_steadily_moving_point_is_that_point_not_the_lagging_average():
    a, v = [torch.randn(4, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64)], \
        [torch.randn(4, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64)]
    trajectory = lambda t: [ai + t * vi for ai, vi in zip(a, v)]  # noqa: E731
    params = [x.clone() for x in trajectory(0)]
    average = WeightAverage(params)
    _follow(average, params, trajectory, 1000)
    for estimate, current, fast, vi in zip(average.estimate(), params, average._fast, v):
        torch.testing.assert_close(estimate, current)
        # The plain fast average trails by its lag (9 steps): the correction is not a no-op.
        torch.testing.assert_close(current - fast, lag(FAST_BETA) * vi)


def test_estimate_removes_most_of_an_oscillation_around_the_trend():
    gen = torch.Generator().manual_seed(0)
    a, v, o = (torch.randn(200, generator=gen) for _ in range(3))
    trend = lambda t: a + 0.01 * t * v  # noqa: E731
    params = [trend(0).clone()]
    average = WeightAverage(params)
    _follow(average, params, lambda t: [trend(t) + (-1) ** t * o], 500)
    off_iterate = (params[0] - trend(500)).norm()
    off_estimate = (average.estimate()[0] - trend(500)).norm()
    assert off_estimate < 0.1 * off_iterate


def test_swapped_in_shows_the_estimate_and_restores_the_exact_weights_even_on_error():
    model = torch.nn.Linear(6, 3)
    params = list(model.parameters())
    average = WeightAverage(params)
    for _ in range(20):
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn_like(p) * 0.1)
        average.update()
    trained = [p.detach().clone() for p in params]
    estimate = average.estimate()
    with average.swapped_in():
        for p, e in zip(params, estimate):
            assert torch.equal(p, e)
    for p, t in zip(params, trained):
        assert torch.equal(p, t)
    with pytest.raises(RuntimeError, match="inside"):
        with average.swapped_in():
            raise RuntimeError("error inside the block")
    for p, t in zip(params, trained):
        assert torch.equal(p, t)


def test_low_precision_weights_are_averaged_in_fp32():
    """A 0.02 lerp step of a bf16 average would be lost below its resolution; the fp32 average keeps it."""
    params = [torch.ones(8, dtype=torch.bfloat16)]
    average = WeightAverage(params)
    assert average._slow[0].dtype == torch.float32
    with torch.no_grad():
        params[0].fill_(1.0078125)  # one bf16 ulp above 1
    average.update()
    assert average._slow[0][0].item() == pytest.approx(1 + 0.02 * 0.0078125)
    with average.swapped_in():
        assert params[0].dtype == torch.bfloat16
    assert torch.equal(params[0], torch.full((8,), 1.0078125, dtype=torch.bfloat16))


def test_state_dict_round_trip_and_clear_errors():
    params = [torch.randn(3, 2), torch.randn(4)]
    average = WeightAverage(params)
    with torch.no_grad():
        params[0].add_(1.0)
    average.update()
    state = average.state_dict()
    other = WeightAverage([p.clone() for p in params])
    other.load_state_dict(state)
    assert other.updates == 1
    for x, y in zip(other.estimate(), average.estimate()):
        assert torch.equal(x, y)
    bad = dict(state, fast=[torch.zeros(2, 3), torch.zeros(4)])
    with pytest.raises(ValueError, match=r"state\['fast'\]\[0\] has shape \(2, 3\)"):
        other.load_state_dict(bad)
    with pytest.raises(TypeError, match=r"params\[0\] has dtype torch.int64"):
        WeightAverage([torch.zeros(3, dtype=torch.long)])
    with pytest.raises(ValueError, match="at least one"):
        WeightAverage([])

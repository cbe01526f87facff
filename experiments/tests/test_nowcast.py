"""Weight-nowcasting experiment (experiments/nowcast.py, experiments/nowcaster.py): the pieces whose errors
would silently change what the benchmark reports."""
import pytest
import torch

from experiments import nowcast
from experiments.nowcaster import Nowcaster, SnapshotHistory, dmd_nowcast, drift_nowcast, element_features, secant_nowcast
from bench.tasks import get_task


def linear_params(t: float, a: list[torch.Tensor], v: list[torch.Tensor]) -> list[torch.Tensor]:
    return [ai + t * vi for ai, vi in zip(a, v)]


def test_snapshot_history_displacements_newest_first_and_reset():
    a = [torch.randn(3, 4), torch.randn(5)]
    v = [torch.randn(3, 4), torch.randn(5)]
    params = [x.clone() for x in a]
    history = SnapshotHistory(params, context=3, every=2)
    quadratic = lambda t: [ai + t * vi + 0.1 * t * t * vi for ai, vi in zip(a, v)]  # noqa: E731
    for step in range(0, 7):
        for p, q in zip(params, quadratic(step)):
            p.copy_(q)
        history.observe_real_step()
    assert history.ready and history.count == 4  # snapshots at steps 0, 2, 4, 6
    disp = history.displacements()
    flat = lambda ts: torch.cat([t.reshape(-1) for t in ts])  # noqa: E731
    for j, (t_new, t_old) in enumerate([(6, 4), (4, 2), (2, 0)]):  # newest first
        torch.testing.assert_close(disp[j], flat(quadratic(t_new)) - flat(quadratic(t_old)))
    history.reset()
    assert history.count == 1 and not history.ready


def test_drift_rule_is_exact_on_a_straight_trajectory():
    a, v = torch.randn(100), torch.randn(100)
    snaps = torch.stack([a + t * v for t in range(5)])
    disp = snaps[1:].flip(0) - snaps[:-1].flip(0)
    torch.testing.assert_close(drift_nowcast(disp, 3), 3 * v)


def test_features_reconstruct_the_displacements_and_the_model_can_be_the_drift_rule(tmp_path):
    k, sizes = 4, [60, 40]
    disp = torch.randn(k, sum(sizes))
    x, s = element_features(disp, sizes)
    assert x.shape == (100, k + 1) and s.shape == (100,)
    torch.testing.assert_close(x[:, :k].t() * s, disp)
    model = Nowcaster(k, horizons=(1, 2))
    with torch.no_grad():  # output h: h · mean_j(d_j / s); the MLP correction starts at zero
        model.linear.weight.zero_()
        model.linear.bias.zero_()
        model.linear.weight[0, :k] = 1 / k
        model.linear.weight[1, :k] = 2 / k
    torch.testing.assert_close(model.predict(disp, sizes, 2), drift_nowcast(disp, 2))
    model.save(tmp_path / "n.pt", meta={"note": "test"})
    loaded = Nowcaster.load(tmp_path / "n.pt")
    torch.testing.assert_close(loaded.predict(disp, sizes, 1), model.predict(disp, sizes, 1))
    assert loaded.meta == {"note": "test"}


def test_floor_nowcast_of_a_steadily_moving_point_is_that_point_ahead():
    """EMAs of θ(t) = a + v t lag by β/(1−β) steps; the lag-corrected floor ``ahead`` steps on is θ(t + ahead)."""
    a, v = [torch.randn(50)], [torch.randn(50)]
    params = linear_params(0, a, v)
    averages = [[p.clone() for p in params] for _ in nowcast.AVG_BETAS]
    for t in range(1, 2001):
        params = linear_params(t, a, v)
        for beta, avg in zip(nowcast.AVG_BETAS, averages):
            torch._foreach_lerp_(avg, params, 1 - beta)
    delta = nowcast._smoothed_delta(averages, params, "floor", 30)
    torch.testing.assert_close(delta[0], 30 * v[0], rtol=1e-3, atol=1e-3)
    smooth = nowcast._smoothed_delta(averages, params, "smooth", 30)
    torch.testing.assert_close(smooth[0], 30 * v[0], rtol=1e-3, atol=1e-3)


def test_jump_arm_keeps_accepted_jumps_and_undoes_rejected_ones():
    task = get_task("digits", quick=True)
    plain = nowcast.run_arm(task, 3e-3, 0, None, 1, None, steps=100)
    jumped = nowcast.run_arm(task, 3e-3, 0, "floor", 1, None, steps=100)
    assert plain["jumps"] == [] and len(plain["curve"]) == 100 // nowcast.EVAL_EVERY
    assert [j["step"] for j in jumped["jumps"]] == [80]  # after WARMUP, every CONTEXT·EVERY steps
    for j in jumped["jumps"]:
        assert j["accepted"] == (j["after"] < j["before"])
    # Identical up to the first jump (same data, same initialisation), different after it only if kept.
    first = jumped["jumps"][0]["step"]
    before_jump = [p for p in plain["curve"] if p["step"] < first]
    assert [p["val_loss"] for p in before_jump] == [p["val_loss"] for p in jumped["curve"][:len(before_jump)]]
    after = (plain["curve"][-1]["val_loss"], jumped["curve"][-1]["val_loss"])
    assert (after[0] != after[1]) == jumped["jumps"][0]["accepted"]


def test_training_samples_and_error_measure_on_a_straight_trajectory():
    """On θ(t) = a + v t every element's normalised displacements are sign(v), its target h·sign(v),
    and the drift rule (and its best multiple) has zero error."""
    a, v = torch.randn(40), torch.randn(40)
    snaps = torch.stack([a + t * v for t in range(12)])
    sizes = [25, 15]
    x, y, w = nowcast.samples(snaps, sizes, context=4, horizons=(1, 2), per_index=40,
                              gen=torch.Generator().manual_seed(0))
    n_indices = 12 - 4 - 2
    assert x.shape == (40 * n_indices, 5) and y.shape == (40 * n_indices, 2) and w.shape == (40 * n_indices,)
    sign = x[:, 0].sign()
    torch.testing.assert_close(x[:, :4], sign[:, None].expand(-1, 4))
    torch.testing.assert_close(y, torch.stack([sign, 2 * sign], 1))
    errors = nowcast.relative_errors(None, snaps, sizes, context=4, horizons=(1, 3))
    assert set(errors) == {"drift", "oracle-scaled drift"}
    for name in errors:
        assert errors[name][1] < 1e-10 and errors[name][3] < 1e-10


def _modal_trajectory(steps: int, n: int = 300, growth: float = 1.0):
    """θ(t) = c + v t + (−0.9)^t o + 0.7^t e + growth^t g: drift, oscillation, transient (and a
    growing mode when growth > 1), each along its own random direction."""
    gen = torch.Generator().manual_seed(0)
    c, v, o, e, g = (torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(5))
    theta = lambda t: c + 0.05 * v * t + (-0.9) ** t * o + 0.7 ** t * e + (0.1 * growth ** t * g if growth > 1 else 0)  # noqa: E731
    return theta, torch.stack([theta(t) for t in range(steps + 1)])


def test_dmd_nowcast_is_exact_on_a_trajectory_of_few_linear_modes():
    theta, snaps = _modal_trajectory(12)
    disp = (snaps[1:] - snaps[:-1]).flip(0)  # newest first
    for ahead in (1, 7, 30):
        torch.testing.assert_close(dmd_nowcast(disp, ahead, rank=8), theta(12 + ahead) - theta(12))
    # Too few directions kept: not exact any more (the test would notice a rank that is ignored).
    assert not torch.allclose(dmd_nowcast(disp, 7, rank=1), theta(19) - theta(12), atol=1e-3)
    # The drift rule averages the oscillation and transient into its slope instead.
    assert not torch.allclose(drift_nowcast(disp, 7), theta(19) - theta(12), atol=1e-3)


def test_dmd_nowcast_clips_growing_modes_instead_of_extrapolating_a_blow_up():
    _, snaps = _modal_trajectory(12, growth=1.3)
    disp = (snaps[1:] - snaps[:-1]).flip(0)
    ahead = 40
    prediction = dmd_nowcast(disp, ahead, rank=8)
    assert torch.isfinite(prediction).all()
    # A modulus clipped to 1 continues that mode at most ``ahead`` times its current displacement;
    # unclipped, 1.3^40 would make it ~3.6e4 times larger.
    assert prediction.norm() < 2 * ahead * disp[0].norm()
    for bad in (dict(disp=disp[:2], ahead=1), dict(disp=disp, ahead=0), dict(disp=disp[0], ahead=1)):
        with pytest.raises(ValueError):
            dmd_nowcast(**bad)


def _quadratic(n: int, concave: bool = False):
    """Gradient of 0.5 θᵀHθ + bᵀθ with H symmetric (positive definite unless ``concave``)."""
    gen = torch.Generator().manual_seed(1)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    curvature = torch.linspace(0.1, 5.0, n, dtype=torch.float64)
    if concave:
        curvature[0] = -1.0
    h = q @ torch.diag(curvature) @ q.T
    b = torch.randn(n, generator=gen, dtype=torch.float64)
    points = torch.randn(n + 1, n, generator=gen, dtype=torch.float64)
    return h, b, points, points @ h + b, q


def test_secant_nowcast_steps_to_the_minimum_of_a_quadratic_its_points_span():
    h, b, points, grads, _ = _quadratic(6)
    minimum = -torch.linalg.solve(h, b)
    step = secant_nowcast(points, grads, rank=6, max_ratio=1e6)
    torch.testing.assert_close(points[-1] + step, minimum)
    # Fewer directions than the problem has: the step stays in the span it kept and is not the minimum.
    partial = secant_nowcast(points, grads, rank=2, max_ratio=1e6)
    assert not torch.allclose(points[-1] + partial, minimum, atol=1e-2)


def test_secant_nowcast_leaves_a_concave_direction_alone_and_caps_the_step():
    h, b, points, grads, q = _quadratic(6, concave=True)
    step = secant_nowcast(points, grads, rank=6, max_ratio=1e6)
    # No movement along the negative-curvature axis (a Newton step there would climb to a maximum).
    assert abs(float(q[:, 0] @ step)) < 1e-8
    assert float(q[:, 1:].T @ step @ (q[:, 1:].T @ step)) > 0
    capped = secant_nowcast(points, grads, rank=6, max_ratio=0.01)
    largest = (points[:-1] - points[-1]).norm(dim=1).max()
    torch.testing.assert_close(capped.norm(), 0.01 * largest)
    torch.testing.assert_close(capped / capped.norm(), step / step.norm())


def test_secant_nowcast_rejects_bad_arguments():
    _, _, points, grads, _ = _quadratic(4)
    for bad in (dict(points=points[:2], grads=grads[:2]), dict(points=points, grads=grads[:-1]),
                dict(points=points, grads=grads, rank=0), dict(points=points, grads=grads, max_ratio=0.0)):
        with pytest.raises(ValueError):
            secant_nowcast(**bad)


def test_secant_pairs_match_the_smoothed_gradient_to_the_average_it_was_taken_at():
    """On a quadratic, Adam's bias-corrected first moment after step t is the gradient at the fast
    weight average *before* that step's update (both EMAs with β 0.9 over the same iterates)."""
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(5, 5, generator=gen, dtype=torch.float64)
    h, b = a @ a.T + torch.eye(5, dtype=torch.float64), torch.randn(5, generator=gen, dtype=torch.float64)
    theta = torch.nn.Parameter(torch.randn(5, generator=gen, dtype=torch.float64))
    optimizer = torch.optim.AdamW([theta], lr=0.01, weight_decay=0.0, betas=(nowcast.AVG_BETAS[0], 0.999))
    fast = [theta.detach().clone()]
    for step in range(1, 301):
        optimizer.zero_grad()
        (0.5 * theta @ h @ theta + b @ theta).backward()
        optimizer.step()
        with torch.no_grad():
            point, moment = nowcast._secant_pair(optimizer, [theta], fast, step)
            torch._foreach_lerp_(fast, [theta.detach()], 1 - nowcast.AVG_BETAS[0])
    torch.testing.assert_close(moment, h @ point + b)
    # The average after this step's update is off by the step's share of it: the pairing matters.
    assert not torch.allclose(moment, h @ fast[0] + b, rtol=1e-4, atol=1e-6)


def test_secant_arm_jumps_after_warmup_and_verifies():
    task = get_task("digits", quick=True)
    run = nowcast.run_arm(task, 3e-3, 0, "secant", 2, None, steps=120)
    assert [j["step"] for j in run["jumps"]] == [80, 120]
    for j in run["jumps"]:
        assert j["accepted"] == (j["after"] < j["before"])

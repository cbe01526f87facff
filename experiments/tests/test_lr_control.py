"""experiments.lr_control: the hypergradient controller's rule, and the benchmark's output (digits, seconds)."""
import json

import pytest
import torch

from experiments import lr_control
from experiments.lr_control import HypergradientLR, warmup_cosine
from _images import assert_plot


def _quadratic_run(lr: float, beta: float, steps: int, bounds=(0.1, 10.0)):
    """SGD on f(x) = ½|x|², deterministic: consecutive gradients are exactly parallel."""
    x = torch.nn.Parameter(torch.tensor([3.0, -2.0, 1.0]))
    opt = torch.optim.SGD([x], lr=lr)
    ctl = HypergradientLR(opt, beta, lr_bounds=bounds)
    for _ in range(steps):
        opt.zero_grad()
        (0.5 * (x * x).sum()).backward()
        ctl.before_step()
        opt.step()
        ctl.after_step()
    return ctl, opt


def test_under_stepping_raises_the_rate_by_one_plus_beta_per_step():
    # lr 0.01 < 1: x keeps shrinking in the same direction, cos(g_t, u_{t-1}) = -1 exactly.
    ctl, opt = _quadratic_run(lr=0.01, beta=0.05, steps=6)
    assert ctl.cosines == pytest.approx([-1.0] * 5, abs=1e-6)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * 1.05 ** 5, rel=1e-6)


def test_over_stepping_lowers_the_rate():
    # lr 1.9 > 1: x flips sign every step, so each fresh gradient opposes the last update: cos = +1.
    ctl, opt = _quadratic_run(lr=1.9, beta=0.05, steps=6)
    assert ctl.cosines == pytest.approx([1.0] * 5, abs=1e-6)
    assert opt.param_groups[0]["lr"] == pytest.approx(1.9 * 0.95 ** 5, rel=1e-6)


def test_rate_stays_within_bounds_and_bad_beta_is_refused():
    _, opt = _quadratic_run(lr=0.01, beta=0.5, steps=20, bounds=(0.1, 3.0))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.03)
    with pytest.raises(ValueError, match="beta must be > 0"):
        HypergradientLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), beta=0.0)


def test_warmup_cosine_rises_linearly_then_falls_to_zero_at_the_budget():
    factor = warmup_cosine(200)  # warmup: 5% = 10 steps
    assert [factor(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert factor(10) == pytest.approx(1.0) and factor(105) == pytest.approx(0.5) and factor(200) == pytest.approx(0.0)
    after = [factor(s) for s in range(10, 201)]
    assert all(a >= b for a, b in zip(after, after[1:]))


def test_benchmark_writes_json_table_and_plot(tmp_path):
    assert lr_control.main(["--tasks", "digits", "--seeds", "1", "--betas", "0.02", "--cosine-factors", "2",
                            "--clipped-factors", "2", "--tag", "t", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "lr_control_digits_t.json").read_text())
    cosine = result["arms"]["AdamW + warmup-cosine, peak 2x lr"]
    assert cosine["cosine_schedule"] and cosine["lr"] == 2 * result["tuned_lr"]
    assert cosine["final_lr"] == [pytest.approx(0.0, abs=1e-12)] and cosine["grad_clip"] is None
    clipped = result["arms"]["AdamW + grad clip 1, 2x lr"]
    assert clipped["grad_clip"] == 1.0 and clipped["final_lr"] == [2 * result["tuned_lr"]]
    assert not clipped["cosine_schedule"] and clipped["hypergradient_beta"] is None
    controlled = result["arms"]["AdamW + hypergradient lr (beta 0.02)"]
    assert controlled["hypergradient_beta"] == 0.02 and -1.0 <= controlled["mean_cosine"] <= 1.0
    curve = controlled["seeds"][0]["curve"]
    assert curve[0]["lr"] == result["tuned_lr"] and curve[-1]["lr"] == controlled["final_lr"][0]
    assert curve[-1]["lr"] != result["tuned_lr"]  # the controller moved the rate
    plain = result["arms"]["AdamW (tuned lr)"]
    assert plain["final_lr"] == [result["tuned_lr"]] and plain["summary"]["speedup_vs_baseline"]["mean"] == 1.0
    table = (tmp_path / "lr_control_t.md").read_text()
    assert table.count("\n| AdamW") == 5 and "Mean cos(fresh gradient, last update)" in table
    assert_plot(tmp_path / "lr_control_digits_t.png", (12, 4.5), dpi=110)

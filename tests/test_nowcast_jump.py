"""PREDICT as a nowcast jump: exact displacement, bit-exact rollback, exact resume, the judge."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hybrid_kernels as hk
from hybrid_trainer import nowcaster as nc
from hybrid_trainer.nowcast_jump import NowcastJump, SnapshotWindow, trend_at


def _setup(seed: int = 0, **kw):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    caster = nc.build_nowcaster("weight")
    torch.manual_seed(seed + 1)
    with torch.no_grad():  # a caster that moves the weights noticeably
        for p in caster.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    cfg = dict(spacing=2, call_every=12, recovery_steps=4, trend_steps=6)
    cfg.update(kw)
    return model, opt, NowcastJump(model, opt, caster=caster, **cfg)


def _data(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 8, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return x, y


def _train(model, opt, jumper, steps, start=0, events=None):
    x, y = _data()
    for step in range(start, start + steps):
        idx = torch.arange(step * 8, step * 8 + 8) % 64
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        ev = jumper.after_step(step, loss.item())
        if events is not None and ev:
            events.append((step, ev))


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def test_snapshot_window_is_compact_and_close():
    p = nn.Parameter(torch.randn(1000))
    win = SnapshotWindow([p], context=4)
    exact = []
    for i in range(5):
        with torch.no_grad():
            p.add_(torch.randn(1000) * 1e-3)
        win.take()
        exact.append(p.detach().clone())
    w = win.window()
    torch.testing.assert_close(w[-1], exact[-1], rtol=0, atol=0)  # the newest is exact
    diffs_true = torch.stack(exact).diff(dim=0)
    err = (w.diff(dim=0) - diffs_true).abs().max() / diffs_true.abs().max()
    assert err < 0.02
    assert win.nbytes() < 0.45 * 5 * 1000 * 4  # vs five fp32 copies


def test_jump_changes_the_weights_by_exactly_the_prediction():
    model, opt, jumper = _setup()
    x, y = _data()
    for step in range(11):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        jumper.after_step(step, loss.item())
    assert jumper.window.ready and jumper.pending is None
    before = _flat(model)
    expected = jumper.caster.predict(jumper.window.window(), jumper.layout, jumper.schedule[0])
    assert jumper.jump(jumper.schedule[0]) == "jump"
    after = _flat(model)
    assert expected.abs().max() > 0
    torch.testing.assert_close(after - before, expected, rtol=1e-6, atol=1e-7)
    # The pending state is the exact pre-jump weights.
    torch.testing.assert_close(torch.cat([w.reshape(-1) for w in jumper.pending["weights"]]), before, rtol=0, atol=0)


def test_rejected_jump_restores_weights_and_optimizer_bit_exactly():
    model, opt, jumper = _setup(margin=1e9)  # nothing can beat the trend by 1e9 standard errors
    events = []
    _train(model, opt, jumper, 11, events=events)
    assert not events
    pre_weights = _flat(model)
    _train(model, opt, jumper, 1, start=11, events=events)  # this step triggers the jump
    assert events == [(11, "jump")]
    # Pre-jump = after step 11's optimizer step.
    pre_weights = torch.cat([w.reshape(-1) for w in jumper.pending["weights"]]).clone()
    pre_opt = copy.deepcopy(opt.state_dict())
    _train(model, opt, jumper, 4, start=12, events=events)
    assert events[-1] == (15, "rolled_back") and jumper.records[-1].kept is False
    assert torch.equal(_flat(model), pre_weights)
    after_opt = opt.state_dict()
    for k, st in pre_opt["state"].items():
        for name, v in st.items():
            assert torch.equal(after_opt["state"][k][name], v), name


def test_accepted_jump_is_kept():
    model, opt, jumper = _setup(margin=-1e9)  # everything beats the trend
    events = []
    _train(model, opt, jumper, 16, events=events)
    assert events == [(11, "jump"), (15, "kept")] and jumper.records[-1].kept


def test_reset_moments_clears_the_optimizer_state():
    model, opt, jumper = _setup(moments="reset")
    _train(model, opt, jumper, 12)
    assert jumper.pending is not None and len(opt.state) == 0


def test_resume_across_a_jump_is_exact():
    """Save in the middle of a recovery window; the resumed run matches the uninterrupted one."""
    model, opt, jumper = _setup(margin=0.0)
    _train(model, opt, jumper, 30)
    reference = _flat(model)

    model2, opt2, jumper2 = _setup(margin=0.0)
    _train(model2, opt2, jumper2, 13)
    assert jumper2.pending is not None  # mid-window
    state = copy.deepcopy(dict(model=model2.state_dict(), opt=opt2.state_dict(), jump=jumper2.state_dict()))
    model3, opt3, jumper3 = _setup(seed=7, margin=0.0)  # different init, overwritten by the load
    jumper3.caster = jumper2.caster
    model3.load_state_dict(state["model"])
    opt3.load_state_dict(state["opt"])
    jumper3.load_state_dict(state["jump"])
    _train(model3, opt3, jumper3, 17, start=13)
    assert torch.equal(_flat(model3), reference)
    assert [r.kept for r in jumper3.records] == [r.kept for r in jumper.records]


def test_non_finite_prediction_is_refused():
    model, opt, jumper = _setup()
    _train(model, opt, jumper, 11)
    with torch.no_grad():
        next(jumper.caster.parameters()).fill_(float("nan"))
    before = _flat(model)
    assert jumper.jump(5) is None
    assert torch.equal(_flat(model), before) and jumper.pending is None


def test_trend_extrapolates_a_line():
    vals, sd = trend_at([5.0, 4.0, 3.0, 2.0], [1, 2])
    assert vals == pytest.approx([1.0, 0.0]) and sd == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError):
        trend_at([1.0, 2.0], [1])


def test_arguments_are_checked():
    model, opt, _ = _setup()
    with pytest.raises(ValueError, match="moments"):
        NowcastJump(model, opt, caster=nc.build_nowcaster("weight"), moments="rescale")
    with pytest.raises(ValueError, match="recovery_steps"):
        NowcastJump(model, opt, caster=nc.build_nowcaster("weight"), call_every=10, recovery_steps=10)
    other = torch.optim.Adam(list(model.parameters())[:1])
    with pytest.raises(ValueError, match="optimizer"):
        NowcastJump(model, other, caster=nc.build_nowcaster("weight"))

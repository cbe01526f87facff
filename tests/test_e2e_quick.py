"""The end-to-end benchmark's output contract, on the digits smoke task (real data, seconds)."""
import json

import matplotlib.image
import pytest
import torch

from bench import e2e, protocol
from bench.tasks import get_task

requires_muon = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
# The bench extra; without it bench.e2e leaves the schedule-free arms out of its default presets.
NO_SCHEDULEFREE = "schedulefree (the bench extra) is not installed"


@pytest.fixture(autouse=True)
def eager(monkeypatch):
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", "eager")  # CPU production path, as the benchmark runs


@pytest.fixture(scope="session")
def quick_run(tmp_path_factory):
    """One quick run of the benchmark with its default presets (default, weight-average,
    schedule-free, muon, no-predict; less the schedule-free and muon arms where their optimizers
    are missing), shared by the tests of its output: ``(out folder, result)``."""
    out = tmp_path_factory.mktemp("e2e_quick")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HYBRID_KERNELS_BACKEND", "eager")
        assert e2e.main(["--quick", "--tasks", "digits", "--seeds", "2", "--out", str(out)]) == 0
    return out, json.loads((out / "e2e_digits_quick.json").read_text())


def _departs_from_the_adamw_loop(result: dict, control: str) -> None:
    """``control`` starts where the tuned AdamW loop starts (same initialisation), is evaluated on
    the same step grid, and then reports losses of its own at (nearly) every evaluation."""
    raw = result["arms"]["AdamW (tuned lr)"]["seeds"][0]["curve"]
    curve = result["arms"][control]["seeds"][0]["curve"]
    assert [p["step"] for p in curve] == [p["step"] for p in raw]
    assert curve[0]["val_loss"] == raw[0]["val_loss"]
    differing = sum(c["val_loss"] != r["val_loss"] for c, r in zip(curve[1:], raw[1:]))
    assert differing >= len(raw) - 2, (control, differing, len(raw))


@pytest.mark.slow
def test_quick_digits_writes_json_table_and_plot(quick_run):
    tmp_path, result = quick_run
    assert result["task"] == "digits" and result["seeds"] == [0, 1]
    assert set(result["lr_sweep"]) == {"0.001", "0.003", "0.01"}
    assert result["tuned_lr"] in (0.001, 0.003, 0.01)
    arms = result["arms"]
    assert {"AdamW (tuned lr)", "AdamW (2x lr)", "HybridTrainer (default)", "HybridTrainer (no-predict)"} <= set(arms)
    for name, arm in arms.items():
        summary = arm["summary"]
        for key in ("time_to_target_s", "backward_to_target", "val_loss_at_equal_time",
                    "loss_gap_pct_at_equal_time", "final_val_loss", "speedup_vs_baseline"):
            assert {"mean", "std", "n"} <= set(summary[key]), (name, key)
        assert len(arm["seeds"]) == 2
        for seed in arm["seeds"]:
            times = [p["time"] for p in seed["curve"]]
            assert times == sorted(times) and seed["curve"][0]["step"] == 0
    baseline = arms["AdamW (tuned lr)"]["summary"]
    assert baseline["loss_gap_pct_at_equal_time"]["mean"] == 0.0
    assert baseline["reached_target"] == 2  # the target is the baseline's own loss at 80% of its budget
    hybrid = arms["HybridTrainer (default)"]
    assert "backward_saved_pct" in hybrid["summary"] and hybrid["seeds"][0]["hybrid"]["steps_by_phase"]
    assert (tmp_path / "e2e_quick.md").read_text().count("| HybridTrainer (default) |") == 1
    # predict=False gives the tuned loop's weights step for step: the same passes to the target.
    no_predict = arms["HybridTrainer (no-predict)"]
    assert [s["backward_to_target"] for s in no_predict["seeds"]] == \
        [s["backward_to_target"] for s in arms["AdamW (tuned lr)"]["seeds"]]
    assert all(s["hybrid"]["predicted_steps"] == 0 for s in no_predict["seeds"])
    image = matplotlib.image.imread(tmp_path / "e2e_digits_quick.png")  # figsize (9, 5) at 110 dpi, not blank
    assert image.shape[:2] == (550, 990) and image[..., :3].std() > 0.05
    assert result["meta"]["command"] == f"python -m bench.e2e --quick --tasks digits --seeds 2 --out {tmp_path}"
    assert {"git_commit", "git_dirty", "date", "torch"} <= set(result["meta"])
    # The host, told apart: its CPU and vector instructions, and how it runs Muon's bf16 products.
    machine = result["meta"]["machine"]
    assert machine["isa"] == torch.backends.cpu.get_cpu_capability() and machine["bf16_matmul_vs_fp32"] > 0
    assert result["meta"]["device"] == protocol.cpu_description() and f"({machine['isa']})" in result["meta"]["device"]
    assert (f"a bf16 matrix product takes {machine['bf16_matmul_vs_fp32']:.1f}× an fp32 one's time"
            in (tmp_path / "e2e_quick.md").read_text())


def test_the_bf16_product_measure_reads_a_slower_bf16_product_as_slower(monkeypatch):
    """bench.protocol.bf16_matmul_vs_fp32 is the bf16 product's time over the fp32 one's: a clock
    that runs ten times faster while a bf16 product is timed reads as a ratio of a tenth."""
    real = protocol.bf16_matmul_vs_fp32(size=64, repeats=3)
    assert real > 0
    ticks = {"now": 0.0}
    matmul = torch.Tensor.__matmul__

    def timed_matmul(a, b):
        ticks["now"] += 0.1 if a.dtype is torch.bfloat16 else 1.0
        return matmul(a, b)

    monkeypatch.setattr(torch.Tensor, "__matmul__", timed_matmul)
    monkeypatch.setattr(protocol.time, "perf_counter", lambda: ticks["now"])
    assert protocol.bf16_matmul_vs_fp32(size=8, repeats=3) == pytest.approx(0.1)


@pytest.mark.slow
def test_fused_adamw_arms_and_the_trainer_steps_like_the_plain_fused_loop(tmp_path, monkeypatch):
    # The trainer launches a fused optimizer's update before its guard reads (skipped on the
    # device when non-finite): with predict=False its weights must still be the plain loop's.
    monkeypatch.setattr(protocol, "ADAMW_OPTIONS", {})  # main() sets fused=True in it
    assert e2e.main(["--quick", "--tasks", "digits", "--seeds", "1", "--presets", "no-predict",
                     "--fused-adamw", "--out", str(tmp_path)]) == 0
    assert protocol.ADAMW_OPTIONS == {"fused": True}
    result = json.loads((tmp_path / "e2e_digits_quick_fused.json").read_text())
    assert result["meta"]["command"].endswith(f"--fused-adamw --out {tmp_path}")
    plain, trainer = result["arms"]["AdamW (tuned lr)"]["seeds"][0], result["arms"]["HybridTrainer (no-predict)"]["seeds"][0]
    assert [p["val_loss"] for p in trainer["curve"]][: len(plain["curve"])] == [p["val_loss"] for p in plain["curve"]]


def test_first_crossing_interpolates_in_time():
    curve = [dict(step=0, time=0.0, val_loss=2.0, backward=0, forward=0),
             dict(step=10, time=1.0, val_loss=1.0, backward=10, forward=10)]
    cross = protocol.first_crossing(curve, 1.5)
    assert cross["time"] == pytest.approx(0.5) and cross["backward"] == pytest.approx(5)
    assert protocol.first_crossing(curve, 0.5) is None
    assert protocol.interpolate(curve, "time", 0.25) == pytest.approx(1.75)


def test_presets_map_to_configs_and_a_bad_name_fails_before_any_run(tmp_path):
    assert protocol.preset_config("no-predict").predict is False
    graph = protocol.preset_config("no-predict-graph")
    assert graph.cuda_graph and not graph.predict and not protocol.preset_config("no-predict").cuda_graph
    assert protocol.preset_config("aggressive") == protocol.HybridConfig.aggressive()
    with pytest.raises(ValueError, match="--presets: each must be one of"):
        e2e.main(["--quick", "--tasks", "digits", "--presets", "fast", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_worth_text_is_left_out_when_the_gate_never_measured():
    measured = dict(predicted_step_worth=0.12, required_worth=0.3, prediction_overhead=0.3,
                    cost_seconds={"core": 1e-3, "recording": 4e-4, "forecasting": None})
    text = e2e._worth_text(measured)
    assert "worth of a predicted step 0.120" in text and "core 1.00, recording 0.40" in text
    assert "forecasting" not in text
    assert e2e._worth_text(dict(predicted_step_worth=None)) == ""


@pytest.mark.slow
def test_weight_average_arms_get_their_own_swept_rate_and_a_control(quick_run):
    tmp_path, result = quick_run
    tuned, chosen = result["tuned_lr"], result["weight_average_lr"]
    candidates = [tuned * f for f in e2e.AVERAGE_LR_FACTORS]
    assert set(result["weight_average_lr_sweep"]) == {f"{lr:g}" for lr in candidates}
    assert chosen == min(candidates, key=lambda lr: result["weight_average_lr_sweep"][f"{lr:g}"])
    arms = result["arms"]
    assert arms["AdamW + weight average"]["lr"] == chosen == arms["HybridTrainer (weight-average)"]["lr"]
    assert arms["HybridTrainer (weight-average)"]["config"]["weight_average"] is True
    assert arms["AdamW + weight average"]["hybrid"] is False
    _departs_from_the_adamw_loop(result, "AdamW + weight average")  # evaluated at the average
    assert f"lr for evaluation at the weight average {chosen:g}" in (tmp_path / "e2e_quick.md").read_text()


@pytest.mark.slow
def test_schedule_free_arms_get_their_own_swept_rate_and_warm_up_and_a_control(quick_run):
    pytest.importorskip("schedulefree", reason=NO_SCHEDULEFREE)
    tmp_path, result = quick_run
    free, tuned, budget = result["schedule_free"], result["tuned_lr"], result["steps"]
    grid = [(tuned * f, round(budget * w)) for f in e2e.SCHEDULE_FREE_LR_FACTORS for w in e2e.SCHEDULE_FREE_WARMUP_FRACTIONS]
    assert set(free["sweep"]) == {f"lr={lr:g} warmup={w}" for lr, w in grid}
    assert (free["lr"], free["warmup_steps"]) == min(grid, key=lambda g: free["sweep"][f"lr={g[0]:g} warmup={g[1]}"])
    assert free["betas"] == list(protocol.SCHEDULE_FREE_BETAS)
    arms = result["arms"]
    assert arms["Schedule-free AdamW"]["lr"] == free["lr"] == arms["HybridTrainer (schedule-free)"]["lr"]
    assert arms["Schedule-free AdamW"]["hybrid"] is False and arms["HybridTrainer (schedule-free)"]["hybrid"] is True
    _departs_from_the_adamw_loop(result, "Schedule-free AdamW")  # its own path, at its averaged weights
    assert f"schedule-free AdamW lr {free['lr']:g}, warm-up {free['warmup_steps']} steps" in (tmp_path / "e2e_quick.md").read_text()


def test_schedule_free_evaluation_moves_to_the_average_and_back():
    pytest.importorskip("schedulefree", reason=NO_SCHEDULEFREE)
    model = torch.nn.Linear(3, 2)
    optimizer = protocol.make_optimizer(protocol.ArmSpec("sf", 0.1, schedule_free_warmup=0), model)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.ones(4, 3)).square().sum().backward()
        optimizer.step()
    train_point = model.weight.detach().clone()
    with protocol.schedule_free_evaluation(optimizer):
        assert not torch.allclose(model.weight, train_point)
        assert optimizer.param_groups[0]["train_mode"] is False
    assert optimizer.param_groups[0]["train_mode"] is True
    torch.testing.assert_close(model.weight.detach(), train_point)  # the library's round trip is float-exact only


@pytest.mark.slow
@requires_muon
def test_muon_arms_get_their_own_swept_rates_and_a_control(quick_run):
    tmp_path, result = quick_run
    muon, tuned = result["muon"], result["tuned_lr"]
    grid = [(m, tuned * f) for m in e2e.MUON_LRS for f in e2e.MUON_ADAMW_LR_FACTORS]
    assert set(muon["sweep"]) == {f"muon={m:g} adamw={a:g}" for m, a in grid}
    assert (muon["lr"], muon["adamw_lr"]) == min(grid, key=lambda g: muon["sweep"][f"muon={g[0]:g} adamw={g[1]:g}"])
    arms = result["arms"]
    for name in ("Muon + AdamW", "HybridTrainer (muon)"):
        assert (arms[name]["muon_lr"], arms[name]["lr"]) == (muon["lr"], muon["adamw_lr"])
    assert arms["AdamW (tuned lr)"]["muon_lr"] is None
    _departs_from_the_adamw_loop(result, "Muon + AdamW")
    assert f"Muon lr {muon['lr']:g} with AdamW lr {muon['adamw_lr']:g} for the rest" in (tmp_path / "e2e_quick.md").read_text()


@requires_muon
def test_muon_trains_the_hidden_matrices_and_adamw_the_rest():
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                              torch.nn.Linear(16, 3))
    assert [tuple(p.shape) for p in protocol.hidden_matrices(mlp)] == [(16, 8), (16, 16)]  # not the output layer
    gpt = get_task("charlm", quick=True).make_model(0)
    hidden = protocol.hidden_matrices(gpt)
    assert len(hidden) == 4 and all(p.ndim == 2 for p in hidden)  # qkv, out_proj and two MLP matrices
    assert all(p is not gpt.tok.weight and p is not gpt.pos for p in hidden)
    optimizer = protocol.make_optimizer(protocol.ArmSpec("m", 3e-3, muon_lr=0.02), gpt)
    muon, adamw = optimizer.parts
    assert isinstance(muon, torch.optim.Muon) and muon.param_groups[0]["lr"] == 0.02
    assert {id(p) for p in muon.param_groups[0]["params"]} == {id(p) for p in hidden}
    assert isinstance(adamw, torch.optim.AdamW) and adamw.param_groups[0]["lr"] == 3e-3
    assert len(adamw.param_groups[0]["params"]) + len(hidden) == len(list(gpt.parameters()))


@requires_muon
def test_muon_forced_predicts_over_muon_whatever_it_is_worth():
    config = protocol.preset_config("muon-forced")
    assert config.min_predicted_worth == protocol.FORCED_PREDICTION["min_predicted_worth"] and not config.cost_aware
    task = get_task("digits", quick=True)
    arm = protocol.ArmSpec("forced over Muon", 0.01, config, muon_lr=0.02)
    run = protocol.ArmRun(arm, task, seed=0, budget=task.steps)
    assert isinstance(run.optimizer.parts[0], torch.optim.Muon)
    while not run.done:
        run.run_chunk(task.eval_every, record_phases=False)
    assert run.trainer.statistics()["predicted_steps"] > 0


def test_written_to_a_log_the_arms_report_each_seed_as_a_line(capsys):
    """tqdm draws no bar where stderr is not a terminal (a log, CI): the runs then say, seed by
    seed, how far they are, so an hour-long benchmark is not silent."""
    task = get_task("digits", quick=True)
    protocol.run_arms(task, [protocol.ArmSpec("AdamW", 3e-3)], seeds=[0, 1], desc="digits: progress")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("digits: progress: seed")]
    assert [line.split(" s so far")[0].rsplit(", ", 1)[0] for line in lines] == [
        "digits: progress: seed 0 done (1 of 2, 1 arm(s))", "digits: progress: seed 1 done (2 of 2, 1 arm(s))"]


def test_report_rebuilds_the_table_from_the_task_files_each_under_its_own_run(quick_run, tmp_path):
    # A task run in a call of its own (or a run stopped after its first task) still gets its table.
    out, digits = quick_run
    other = json.loads(json.dumps(digits))
    other["task"] = "charlm-stand-in"
    other["meta"] = dict(digits["meta"], command="python -m bench.e2e --tasks charlm", date="2026-01-01T00:00:00+00:00")
    (tmp_path / "e2e_charlm_quick.json").write_text(json.dumps(other))
    (tmp_path / "e2e_digits_quick.json").write_text(json.dumps(digits))
    assert e2e.main(["--quick", "--report", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "e2e_quick.md").read_text()
    assert text.startswith(f"End-to-end benchmark, `{digits['meta']['command']}`")  # the newest run's header
    assert text.index("### digits") < text.index("### charlm-stand-in")  # --quick's task order: digits, charlm
    assert text.count("Run: `") == 1 and "Run: `python -m bench.e2e --tasks charlm` (2026-01-01" in text
    with pytest.raises(SystemExit, match="--report: no e2e_<task>_quick.json"):
        e2e.main(["--quick", "--report", "--out", str(tmp_path / "empty")])

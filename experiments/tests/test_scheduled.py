"""experiments.scheduled: the arms predict on the probe's schedule with the scale they name, and the
command writes its result (digits, seconds)."""
import json

import pytest
import torch

from experiments import scheduled
from bench.tasks import get_task
from hybrid_trainer.predictor import DeltaPredictor
from _images import assert_plot


@pytest.fixture
def applied(monkeypatch):
    """Every predicted step the arms apply: (real steps recorded so far, scales used)."""
    calls = []
    original = DeltaPredictor.apply_predicted_step

    def spy(self, multiplier=1.0):
        calls.append((self.n_updates, self.scales.clone()))
        return original(self, multiplier)

    monkeypatch.setattr(DeltaPredictor, "apply_predicted_step", spy)
    return calls


def test_arms_predict_on_schedule_with_their_scale(applied):
    task = get_task("digits", quick=True)  # 150 real steps
    assert scheduled.run(task, "plain", 3e-3, 0)["predicted_steps"] == 0 and applied == []
    result = scheduled.run(task, "ema 0.98, α 1", 3e-3, 0)
    phases = [100, 115, 130, 145]  # FIRST_PREDICT, then every REAL_BETWEEN real steps
    assert result["predicted_steps"] == scheduled.PREDICTED * len(phases) == scheduled._predicted_before(150)
    recorded = [step - scheduled.RECORD_FROM + 1 for step in phases]  # updates recorded by then
    assert [n for n, _ in applied] == [n for n in recorded for _ in range(scheduled.PREDICTED)]
    assert all(bool((scales == 1).all()) for _, scales in applied)
    applied.clear()
    scheduled.run(task, "ema 0.98, fitted α", 3e-3, 0)
    assert len(applied) == result["predicted_steps"]
    assert not all(bool((scales == 1).all()) for _, scales in applied)  # the least-squares fit, not 1


def test_predicted_steps_before_a_real_step():
    assert scheduled._predicted_before(99) == 0
    assert scheduled._predicted_before(100) == scheduled.PREDICTED
    assert scheduled._predicted_before(114.5) == scheduled.PREDICTED
    assert scheduled._predicted_before(115) == 2 * scheduled.PREDICTED


def test_command_writes_every_arm(tmp_path):
    assert scheduled.main(["--task", "digits", "--quick", "--seeds", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "scheduled_digits.json").read_text())
    assert set(result["arms"]) == set(scheduled.ARMS)
    assert result["arms"]["plain"]["worth_per_predicted_step"]["n"] == 0
    assert result["arms"]["ema 0.99, α 1"]["predicted_steps"] == 40
    assert_plot(tmp_path / "scheduled_digits.png", (8, 4.5), dpi=110)


def test_weight_ema_direction_is_the_bias_corrected_ema_of_the_updates():
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(20, generator=gen, dtype=torch.float64))
    ema = scheduled.WeightEMA([param], 0.9)
    reference, weight = torch.zeros(20, dtype=torch.float64), 0.0
    for _ in range(7):
        update = torch.randn(20, generator=gen, dtype=torch.float64)
        with torch.no_grad():
            param += update
        ema.update()
        reference, weight = 0.9 * reference + 0.1 * update, 0.9 * weight + 0.1
    torch.testing.assert_close(ema.direction()[0], reference / weight)
    # Predicted steps move the weights along it and leave the direction as it was.
    before, direction = param.detach().clone(), ema.direction()[0]
    ema.predict(3)
    torch.testing.assert_close(param.detach(), before + 3 * direction)
    torch.testing.assert_close(ema.direction()[0], direction)


def test_one_pass_arm_predicts_the_ema_of_the_updates_since_recording_began(monkeypatch):
    """The arm's first predicted step is the bias-corrected EMA of exactly the real updates from
    RECORD_FROM to FIRST_PREDICT, with nothing from the steps before (a plain run of the same
    seed makes the same updates up to there)."""
    task = get_task("digits", quick=True)
    models, make_model = [], task.make_model
    task.make_model = lambda seed: models.append(make_model(seed)) or models[-1]
    snapshots, optimizer_step = [], torch.optim.AdamW.step

    def step_and_snapshot(self, *args, **kwargs):
        loss = optimizer_step(self, *args, **kwargs)
        if len(models) == 1:  # the plain run: weights after every real step
            snapshots.append(torch.cat([p.detach().flatten().clone() for p in models[0].parameters()]))
        return loss

    monkeypatch.setattr(torch.optim.AdamW, "step", step_and_snapshot)
    scheduled.run(task, "plain", 3e-3, 0)
    predicted, predict = [], scheduled.WeightEMA.predict
    monkeypatch.setattr(scheduled.WeightEMA, "predict", lambda self, steps, tangential=False: (
        predicted.append(torch.cat([d.flatten() for d in self.direction()])), predict(self, steps, tangential)))
    scheduled.run(task, "ema 0.99, α 1, one pass", 3e-3, 0)
    beta, reference, weight = 0.99, torch.zeros_like(snapshots[0]), 0.0
    for step in range(scheduled.RECORD_FROM, scheduled.FIRST_PREDICT + 1):  # snapshots[k] is after step k + 1
        reference = beta * reference + (1 - beta) * (snapshots[step - 1] - snapshots[step - 2])
        weight = beta * weight + (1 - beta)
    torch.testing.assert_close(predicted[0], reference / weight, rtol=1e-4, atol=1e-7)


def test_weight_drift_is_the_rate_of_a_steadily_moving_point_from_the_first_update():
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(4, 5, generator=gen, dtype=torch.float64))
    velocity = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    drift = scheduled.WeightDrift([param])
    for _ in range(3):  # lags still far from β / (1 − β): the small-n correction matters
        with torch.no_grad():
            param += velocity
        drift.update()
        torch.testing.assert_close(drift.direction()[0], velocity)
    # Predicted steps move the weights along it and leave it as it was.
    before, d = param.detach().clone(), drift.direction()[0]
    drift.predict(4)
    torch.testing.assert_close(param.detach(), before + 4 * d)
    torch.testing.assert_close(drift.direction()[0], d)
    # An oscillation around the steady path mostly cancels in the drift, not in the EMA of the updates.
    wobbly = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    drift, ema = scheduled.WeightDrift([wobbly]), scheduled.WeightEMA([wobbly], 0.99)
    rate = torch.tensor([0.01, 0.0], dtype=torch.float64)
    for step in range(1, 401):
        with torch.no_grad():
            wobbly.copy_(rate * step + torch.tensor([0.0, 1.0 if step % 2 else -1.0], dtype=torch.float64))
        drift.update()
        ema.update()
    torch.testing.assert_close(drift.direction()[0][0], rate[0], rtol=1e-6, atol=0)
    assert abs(float(drift.direction()[0][1])) < 0.2 * abs(float(ema.direction()[0][1]))


def test_command_runs_the_named_arms_under_a_tag(tmp_path):
    argv = ["--task", "digits", "--quick", "--seeds", "1", "--arms", "ema 0.99, α 1, one pass", "--tag", "t",
            "--out", str(tmp_path)]
    assert scheduled.main(argv) == 0
    result = json.loads((tmp_path / "scheduled_digits_t.json").read_text())
    assert list(result["arms"]) == ["plain", "ema 0.99, α 1, one pass"]  # plain always: the target is its
    assert "--arms 'ema 0.99, α 1, one pass' --tag t" in result["command"]


def test_steps_sets_the_budget_and_the_target_follows_it(tmp_path):
    argv = ["--task", "digits", "--quick", "--seeds", "1", "--arms", "ema 0.99, α 1, one pass", "--steps", "250",
            "--tag", "long", "--out", str(tmp_path)]
    assert scheduled.main(argv) == 0
    result = json.loads((tmp_path / "scheduled_digits_long.json").read_text())
    assert get_task("digits", quick=True).steps != 250
    assert result["steps"] == 250 and result["target_step"] == 200  # plain at 80% of the budget
    assert all(run[0]["curve"][-1]["step"] == 250 for run in result["runs"].values())
    assert "--steps 250" in result["command"]
    with pytest.raises(SystemExit):
        scheduled.main(["--task", "digits", "--quick", "--steps", "150", "--out", str(tmp_path)])


def test_averaged_arm_validates_at_the_weight_average_and_trains_from_the_iterate():
    task = get_task("digits", quick=True)
    models, make_model = [], task.make_model
    task.make_model = lambda seed: models.append(make_model(seed)) or models[-1]
    plain = scheduled.run(task, "plain", 3e-3, 0)
    averaged = scheduled.run(task, "plain, evaluated at its weight average", 3e-3, 0)
    # Training never sees the average: the final weights are the plain run's, bit for bit ...
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)
    # ... while every validation after the first step is at a different point.
    assert [p["step"] for p in plain["curve"]] == [p["step"] for p in averaged["curve"]]
    assert averaged["curve"][0]["val_loss"] == plain["curve"][0]["val_loss"]  # before any step: one point
    assert all(a["val_loss"] != b["val_loss"] for a, b in zip(averaged["curve"][1:], plain["curve"][1:]))


def test_tangential_prediction_leaves_matrix_norms_alone_to_first_order():
    gen = torch.Generator().manual_seed(1)
    matrix = torch.nn.Parameter(torch.randn(6, 5, generator=gen, dtype=torch.float64))
    bias = torch.nn.Parameter(torch.randn(5, generator=gen, dtype=torch.float64))
    ema = scheduled.WeightEMA([matrix, bias], 0.9)
    for _ in range(5):  # updates that mostly grow the weights, as on the char-LM
        with torch.no_grad():
            matrix.mul_(1.1).add_(0.01 * torch.randn(6, 5, generator=gen, dtype=torch.float64))
            bias.mul_(1.1)
        ema.update()
    full = ema.direction()
    before = [matrix.detach().clone(), bias.detach().clone()]
    ema.predict(2, tangential=True)
    moved = [matrix.detach() - before[0], bias.detach() - before[1]]
    assert abs(float((moved[0] * before[0]).sum())) < 1e-10 * float(moved[0].norm() * before[0].norm())
    assert float((full[0] * before[0]).sum()) > 0.9 * float(full[0].norm() * before[0].norm())  # was radial
    torch.testing.assert_close(moved[1], 2 * full[1])  # vectors keep their whole direction
    # What is left of the matrix's direction is the full one minus its projection on the weights.
    radial = float((full[0] * before[0]).sum() / (before[0] * before[0]).sum())
    torch.testing.assert_close(moved[0], 2 * (full[0] - radial * before[0]))


def _paired_result(arm_losses: dict[int, list[float]], control_losses: dict[int, list[float]]) -> dict:
    """A committed-result shape with curves every 25 steps from 0 to 300 (target 1.0, fork at 100)."""
    def runs(losses):
        return [dict(curve=[dict(step=25 * i, time=float(i), val_loss=v, backward=25 * i, forward=25 * i)
                           for i, v in enumerate(seed)])
                for seed in losses.values()]
    return dict(task="t", lr=1e-3, target_val_loss=1.0, schedule=dict(first_predict=100),
                runs={"arm": runs(arm_losses), "control": runs(control_losses)})


def test_fork_trial_reads_decisions_and_step_costs_off_paired_curves():
    shared = [3.0, 2.5, 2.2, 2.0]  # steps 0..75: one trajectory until the fork
    control = {0: shared + [1.9, 1.8, 1.7, 1.6, 1.5, 1.4, 1.2, 1.1, 0.9],  # crosses 1.0 at step 287.5
               1: shared + [1.9, 1.8, 1.7, 1.6, 1.5, 1.4, 1.2, 1.1, 0.9]}
    arm = {0: shared + [1.85, 1.7, 1.5, 1.3, 1.1, 0.9, 0.8, 0.7, 0.6],  # better from the start, crosses at 212.5
           1: shared + [1.95, 1.85, 1.6, 1.7, 1.6, 1.5, 1.4, 1.3, 1.2]}  # worse at 125, better at 150, never crosses
    trial = scheduled.fork_trial(_paired_result(arm, control), "arm", "control", widths=(25, 50))
    by_width = {row["width"]: row for row in trial["widths"]}
    assert [d["predict"] for d in by_width[25]["decisions"]] == [True, False]
    assert by_width[25]["right_decisions"] == 2
    assert [d["predict"] for d in by_width[50]["decisions"]] == [True, True]
    assert by_width[50]["right_decisions"] == 1
    # Seed 0 predicts: 287.5 control steps against 212.5 + the trial's width; seed 1 at width 25
    # goes on along the control, having paid 25 steps for the discarded branch.
    assert by_width[25]["step_speedup"]["mean"] == pytest.approx((287.5 / 237.5 + 287.5 / 312.5) / 2)
    assert by_width[50]["step_speedup"]["n"] == 1  # seed 1 chose a branch that never reaches the target
    assert by_width[50]["step_speedup"]["mean"] == pytest.approx(287.5 / 262.5)
    assert trial["arm_step_speedup"]["mean"] == pytest.approx(287.5 / 212.5)  # untrialled, where it reached


def test_fork_trial_refuses_arms_that_differ_before_the_fork():
    shared = [3.0, 2.5, 2.2, 2.0, 1.9, 1.8, 1.7, 1.6, 1.5, 1.4, 1.2, 1.1, 0.9]
    other = list(shared)
    other[2] = 2.3
    with pytest.raises(ValueError, match="differ before the fork"):
        scheduled.fork_trial(_paired_result({0: other}, {0: shared}), "arm", "control")

"""bench.scheduled: the arms predict on the probe's schedule with the scale they name, and the
command writes its result (digits, seconds)."""
import json

import pytest
import torch

from bench import scheduled
from bench.tasks import get_task
from hybrid_trainer.predictor import DeltaPredictor


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
    assert (tmp_path / "scheduled_digits.png").stat().st_size > 0


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


def test_command_runs_the_named_arms_under_a_tag(tmp_path):
    argv = ["--task", "digits", "--quick", "--seeds", "1", "--arms", "ema 0.99, α 1, one pass", "--tag", "t",
            "--out", str(tmp_path)]
    assert scheduled.main(argv) == 0
    result = json.loads((tmp_path / "scheduled_digits_t.json").read_text())
    assert list(result["arms"]) == ["plain", "ema 0.99, α 1, one pass"]  # plain always: the target is its
    assert "--arms 'ema 0.99, α 1, one pass' --tag t" in result["command"]


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

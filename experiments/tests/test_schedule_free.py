"""experiments.schedule_free's output contract on the quick char-LM (real data, seconds)."""
import json

import pytest

from bench import protocol
from experiments import schedule_free
from _images import assert_plot

pytest.importorskip("schedulefree")


pytestmark = pytest.mark.usefixtures("eager_backend")  # the CPU path, not the Triton interpreter


def test_quick_exploration_writes_crossings_against_the_tuned_runs_target(tmp_path):
    assert schedule_free.main(["--task", "charlm", "--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "schedule_free_charlm.json").read_text())
    tuned, free = result["runs"]
    assert tuned["setting"] == {"optimizer": "adamw", "lr": 2e-3, "warmup": 0, "betas": [0.9, 0.999],
                                "weight_lr_power": 2.0, "r": 0.0}
    # The target is the tuned run's own loss at 80% of the budget, so it crosses there or earlier.
    assert result["target_step"] == int(0.8 * result["steps"])
    assert tuned["crossing_step"] is not None and tuned["crossing_step"] <= result["target_step"] + 1e-9
    assert result["target_val_loss"] == protocol.interpolate(tuned["curve"], "step", result["target_step"])
    assert free["setting"]["optimizer"] == "schedule-free" and free["curve"][0] == tuned["curve"][0]
    assert free["final_val_loss"] == free["curve"][-1]["val_loss"] != tuned["final_val_loss"]
    table = (tmp_path / "schedule_free_charlm.md").read_text()
    assert "| schedule-free | 0.01 | 20 | (0.95, 0.95) | 2, 0 |" in table
    assert_plot(tmp_path / "schedule_free_charlm.png", (9, 5), dpi=110)


def test_adamw_warm_up_is_linear_to_the_rate():
    import torch
    model = torch.nn.Linear(2, 1)
    optimizer, scheduler = schedule_free.make_optimizer(schedule_free.Setting("adamw", 0.01, 4), model)
    rates = []
    for _ in range(6):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx([0.0025, 0.005, 0.0075, 0.01, 0.01, 0.01])


def test_the_averages_weighting_reaches_the_schedule_free_optimizer():
    import torch
    optimizer, scheduler = schedule_free.make_optimizer(
        schedule_free.Setting("schedule-free", 0.01, 4, (0.95, 0.95), weight_lr_power=3.0, r=1.0), torch.nn.Linear(2, 1))
    group = optimizer.param_groups[0]
    assert scheduler is None and (group["weight_lr_power"], group["r"], group["warmup_steps"]) == (3.0, 1.0, 4)

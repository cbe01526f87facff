import json

import pytest
import torch

from experiments import spike_cost


def test_each_arm_runs_the_guard_it_names_in_each_scenario_and_the_report_has_a_row_each(tmp_path):
    spike_cost.main(["--seeds", "1", "--before", "40", "--after", "32", "--out", str(tmp_path)])
    text = (tmp_path / "spike_cost.md").read_text()
    assert all(f"**{scenario}**" in text for scenario in spike_cost.SCENARIOS)
    assert text.count("| plain |") == len(spike_cost.SCENARIOS)
    assert all(text.count(f"| {arm} |") == len(spike_cost.SCENARIOS) for arm in spike_cost.ARMS)
    scenarios = json.loads((tmp_path / "spike_cost.json").read_text())["result"]["scenarios"]
    for arms in scenarios.values():
        plain, per_step_before, per_step, gpu_before, gpu = (arms[a][0] for a in spike_cost.ARMS)
        assert "refused" not in plain and plain["stalled_at"] is None
        for run, every, on_gpu, tolerates in ((per_step_before, 1, False, False), (per_step, 1, False, True),
                                              (gpu_before, 16, True, False), (gpu, 16, True, True)):
            assert (run["read_every"], run["as_on_gpu"], run["tolerates"]) == (every, on_gpu, tolerates)
            assert run["steps"] == 72
    from hybrid_trainer import step_guard

    assert step_guard.reads_are_free(torch.device("cpu"))  # put back after the arm was built


def test_each_scenario_changes_what_it_says_in_the_second_stage():
    batches = [(torch.ones(2, 3) * i, torch.tensor([0, 1])) for i in range(4)]
    regime = spike_cost.second_stage("new regime", 160, batches, 1e-3)
    assert all(regime(i) == (batches[i % 4], 1e-3) for i in range(160))
    lr = spike_cost.second_stage("learning rate x100", 160, batches, 1e-3)
    high = [i for i in range(160) if lr(i)[1] != 1e-3]
    assert high == list(range(20, 24)) and lr(20)[1] == pytest.approx(0.1)
    poisoned = spike_cost.second_stage("poisoned batches", 160, batches, 1e-3)
    bad = [i for i in range(160) if not torch.equal(poisoned(i)[0][0], batches[i % 4][0])]
    assert bad == list(range(5, 160, 10))
    x, y = poisoned(5)[0]
    assert torch.equal(x, batches[1][0] * spike_cost.POISON_SCALE) and torch.equal(y, batches[1][1].roll(1))


def test_the_sizes_are_checked():
    with pytest.raises(SystemExit):
        spike_cost.main(["--after", "0"])


def test_the_model_is_chosen_and_named_in_the_files_and_the_report(tmp_path):
    spike_cost.main(["--model", "mlp-1ms", "--seeds", "1", "--before", "8", "--after", "8",
                     "--scenarios", "new regime", "--out", str(tmp_path)])
    assert not (tmp_path / "spike_cost.md").exists()
    text = (tmp_path / "spike_cost_mlp-1ms.md").read_text()
    assert "CPU, the 1 ms MLP: 8 steps" in text and "--model mlp-1ms" in text
    result = json.loads((tmp_path / "spike_cost_mlp-1ms.json").read_text())["result"]
    assert result["model"] == "mlp-1ms" and list(result["scenarios"]) == ["new regime"]
    with pytest.raises(SystemExit):
        spike_cost.main(["--model", "mlp-50m"])

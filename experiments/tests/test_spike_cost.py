import pytest

from experiments import spike_cost


def test_each_arm_runs_the_guard_it_names_and_the_report_has_a_row_each(tmp_path):
    spike_cost.main(["--seeds", "1", "--before", "40", "--after", "20", "--out", str(tmp_path)])
    text = (tmp_path / "spike_cost.md").read_text()
    assert all(f"| {arm} |" in text for arm in spike_cost.ARMS)
    import json

    arms = json.loads((tmp_path / "spike_cost.json").read_text())["result"]["arms"]
    plain, per_step, as_gpu = (arms[a][0] for a in spike_cost.ARMS)
    assert "refused" not in plain and plain["stalled_at"] is None
    assert per_step["read_every"] == 1 and not per_step["as_on_gpu"]
    assert as_gpu["read_every"] == 16 and as_gpu["as_on_gpu"] and as_gpu["steps"] == 60
    from hybrid_trainer import step_guard
    import torch

    assert step_guard.reads_are_free(torch.device("cpu"))  # put back after the arm was built


def test_the_sizes_are_checked():
    with pytest.raises(SystemExit):
        spike_cost.main(["--after", "0"])

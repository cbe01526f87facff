import json

import pytest
import torch

from experiments import new_classes


def test_each_arm_runs_and_the_report_has_a_row_each(tmp_path):
    new_classes.main(["--seeds", "1", "--before", "6", "--after", "6", "--out", str(tmp_path)])
    text = (tmp_path / "new_classes.md").read_text()
    assert all(text.count(f"| {arm} |") == 1 for arm in new_classes.ARMS)
    arms = json.loads((tmp_path / "new_classes.json").read_text())["result"]["arms"]
    assert "refused" not in arms["plain"][0]
    for arm in new_classes.ARMS[1:]:
        run = arms[arm][0]
        assert run["stalled_at"] is None and 0 <= run["new_accuracy"] <= 1 and run["new_loss"] > 0
    from hybrid_trainer import step_guard

    assert step_guard.reads_are_free(torch.device("cpu"))  # put back after the GPU arm


def test_the_first_stage_holds_only_the_old_classes(monkeypatch):
    monkeypatch.setattr(new_classes, "BATCH", 4)
    data = dict(x=torch.arange(40.0).reshape(20, 2), y=torch.arange(20) % 10)
    first = new_classes.batches(data, new_classes.OLD_CLASSES, 0)
    labels = torch.cat([next(first)[1] for _ in range(8)])
    assert set(labels.tolist()) == set(range(new_classes.OLD_CLASSES))
    every = new_classes.batches(data, 10, 0)
    assert set(torch.cat([next(every)[1] for _ in range(10)]).tolist()) == set(range(10))


def test_the_sizes_are_checked():
    with pytest.raises(SystemExit):
        new_classes.main(["--after", "0"])

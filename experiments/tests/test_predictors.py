"""experiments.predictors' batch-size sweep and the tasks' batch-size override (digits: real data, seconds)."""
import json

import pytest

from experiments import predictors
from bench.tasks import get_task
from _images import assert_plot


def test_batch_size_override_and_full_batch_task():
    x, y = next(get_task("digits", batch_size=32).batches(0))
    assert x.shape == (32, 64) and y.shape == (32,)
    full = get_task("digits-full")
    assert full.details["batch_size"] == full.details["train_size"] == 1437
    with pytest.raises(ValueError, match="batch_size=5000 exceeds the 1437 training samples"):
        get_task("digits", batch_size=5000)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        get_task("digits", batch_size=0)


def test_sweep_writes_table_plot_and_sees_noise_fall(tmp_path):
    assert predictors.main(["--task", "digits", "--steps", "24", "--lr", "0.001", "--batch-sizes", "16", "1437",
                            "--out", str(tmp_path)]) == 0
    sweep = json.loads((tmp_path / "predictors_digits_batch_sweep.json").read_text())
    assert [r["batch_size"] for r in sweep["runs"]] == [16, 1437]
    assert "--batch-sizes 16 1437" in sweep["command"]
    full = sweep["runs"][1]
    # Full batch, small lr: the next batch is the same data, every small step lowers it, and
    # repeating the last step is worth about one real step (first order).
    assert full["fraction_of_real_updates_that_help_the_next_batch"] == 1.0
    assert 0.8 < full["worth_whole_run"]["last update"] < 1.2
    table = (tmp_path / "predictors_digits_batch_sweep.md").read_text()
    assert "| 1437 | 100% |" in table and table.count("\n| ") == 3  # header + 2 rows
    assert_plot(tmp_path / "predictors_digits_batch_sweep.png", (11, 4.5), dpi=110)


def test_single_and_sweep_flags_exclude_each_other(tmp_path):
    with pytest.raises(SystemExit):
        predictors.main(["--task", "digits", "--batch-size", "8", "--batch-sizes", "8", "16", "--out", str(tmp_path)])

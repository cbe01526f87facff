"""bench.gram_read: times both ways of the guard's read on the same steps and writes both files."""
import json

import pytest
import torch

from bench import gram_read
from bench.overhead import synthetic_mlp


def test_measure_times_both_reads_and_the_grams_give_the_wide_layers(tmp_path):
    # 2 rows over 256 x 256 layers: 4 * 512 <= 65536, so both hidden layers' weights go by Grams.
    workload = synthetic_mlp("test", 256, [256, 256], 10, 2, 4, torch.device("cpu"))
    result = gram_read.measure(workload, steps=3, min_entries=256 * 256, progress=lambda line: None)
    assert result["layers_hooked"] == 2 and result["by_grams"] == 2
    assert result["max_relative_difference"] < 1e-5
    assert len(result["steps"]) == 3
    assert all(r[k] > 0 for r in result["steps"] for k in ("step_wall_ms", "read_wall_ms", "grams_wall_ms"))


def test_main_writes_the_result_files_with_the_command(tmp_path, monkeypatch):
    monkeypatch.setattr(gram_read, "measure", lambda workload, steps: dict(
        model=workload.name, parameters=676, gradients=4, gradient_bytes=2704, layers_hooked=0, steps=[{}] * steps,
        median=dict(step_cpu_ms=2.0, step_wall_ms=2.1, read_cpu_ms=0.02, read_wall_ms=0.02, grams_cpu_ms=0.03,
                    grams_wall_ms=0.03), by_grams=0, max_relative_difference=0.0))
    assert gram_read.main(["--model", "tiny", "--steps", "2", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "gram_read.json").read_text())
    assert results["command"].startswith("python -m bench.gram_read --model tiny --steps 2 --out ")
    assert "read_gb_s" in results["machine"] and "read_gb_s" in results["machine_after"]
    text = (tmp_path / "gram_read.md").read_text()
    assert "| read every gradient (the guard without Grams) | 0.02 | 0.02 | 1.00% |" in text


def test_steps_must_be_positive():
    with pytest.raises(SystemExit):
        gram_read.main(["--steps", "0"])

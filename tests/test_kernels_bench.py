"""bench.kernels: the table names its reference per group, and says when benchmarks failed."""
import json

import pytest

from bench import kernels


def _raw(path, rows):
    path.write_text(json.dumps({"benchmarks": [
        {"name": name, "group": "g", "stats": dict(median=t, min=t, max=t, mean=t, stddev=0.0, rounds=3),
         "extra_info": dict(impl=name, baseline=baseline)} for name, t, baseline in rows]}))


@pytest.mark.slow
def test_flagged_baseline_is_the_reference_and_failures_are_announced(monkeypatch, tmp_path, capsys):
    def fake_pytest(raw_path, quick, keyword):
        _raw(raw_path, [("fast", 1e-3, False), ("slow", 4e-3, False), ("ceiling", 2e-3, True)])
        return 1  # one benchmark failed: it has no row

    monkeypatch.setattr(kernels, "run_pytest", fake_pytest)
    assert kernels.main(["--quick", "--out", str(tmp_path)]) == 1
    md = next(tmp_path.glob("kernels_*_quick.md")).read_text()
    assert "pytest exited with 1: failed benchmarks are missing" in md
    assert "| g | ceiling (reference) | 2.000 ms |" in md and "| g | fast | 1.000 ms |" in md
    assert "| 2.00 |" in md  # fast vs the flagged ceiling, not vs the slowest row
    assert "their rows are missing" in capsys.readouterr().err

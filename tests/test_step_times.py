"""bench.step_times: every step timed with its phase, the slowest listed, compiles counted."""
import json

import pytest

from bench import step_times


@pytest.mark.slow
def test_every_step_is_timed_and_the_slowest_are_listed(tmp_path):
    assert step_times.main(["--task", "digits", "--quick", "--seeds", "2", "--steps", "40", "--top", "3",
                            "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "step_times_digits_cpu.json").read_text())
    assert result["device"] == "cpu" and result["triton_cache_dir"] is None and result["lr"] == 3e-3
    for run in result["runs"].values():
        steps, summary = run["steps"], run["summary"]
        assert [s["step"] for s in steps] == list(range(40))
        # The default config's first 20 steps are WARMUP; nothing is compiled on a CPU.
        assert {s["phase"] for s in steps[:20]} == {"WARMUP"} and steps[20]["phase"] == "FULL"
        assert summary["steps_by_phase"]["WARMUP"] == 20 and sum(summary["steps_by_phase"].values()) == 40
        assert summary["kernels_compiled"] == 0 and all(s["ms"] > 0 for s in steps)
        slowest = summary["slowest"]
        assert len(slowest) == 3 and slowest[0]["ms"] == max(s["ms"] for s in steps)
        assert [s["ms"] for s in slowest] == sorted((s["ms"] for s in slowest), reverse=True)


def test_compiled_kernels_counts_cache_entries(tmp_path):
    assert step_times.compiled_kernels(None) == 0 and step_times.compiled_kernels(tmp_path / "missing") == 0
    for name in ("a1b2", "c3d4"):
        (tmp_path / name).mkdir()
    assert step_times.compiled_kernels(tmp_path) == 2

"""bench.overhead: the report holds every arm, and its ratios come from its own measurements."""
import json

import pytest

from bench import overhead


def test_compare_divides_and_subtracts_the_measurements():
    plain = {"time": {"median_us": 1000.0, "real_median_us": 1000.0}, "memory": {"training_bytes": 4_000_000}}
    arm = {"time": {"median_us": 1030.0, "real_median_us": 1100.0}, "memory": {"training_bytes": 4_200_000}}
    c = overhead.compare(plain, arm)
    assert c["time_ratio"] == pytest.approx(1.03) and c["overhead_us"] == pytest.approx(30.0)
    assert c["real_step_ratio"] == pytest.approx(1.1) and c["real_step_overhead_us"] == pytest.approx(100.0)
    assert c["memory_ratio"] == pytest.approx(1.05) and c["extra_bytes"] == 200_000


@pytest.mark.slow
def test_quick_run_reports_every_arm_with_ratios_from_its_measurements(tmp_path):
    assert overhead.main(["--quick", "--models", "tiny", "--warmup", "3", "--steps", "10", "--chunk", "5",
                          "--memory-steps", "25", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "overhead_quick.json").read_text())
    assert results["git"]["commit"] and isinstance(results["git"]["dirty"], bool)
    arms = results["models"]["tiny"]["arms"]
    assert list(arms) == [*overhead.ARMS, overhead.GUARD_FLOOR]
    floor = arms[overhead.GUARD_FLOOR]  # timed only: the plain loop plus a norm and its read
    assert floor["time"]["steps"] == 10 and "memory" not in floor and floor["vs_plain"]["time_ratio"] > 0
    plain = arms["plain"]
    assert plain["time"]["steps"] == 10 and plain["memory"]["training_bytes"] > 0
    for name in list(overhead.ARMS)[1:]:
        arm = arms[name]
        c = arm["vs_plain"]
        # Time from the median over chunks of each chunk's mean step (a cost every N steps counts).
        assert arm["time"]["chunk"] == 5
        assert c["time_ratio"] == pytest.approx(arm["time"]["chunk_median_us"] / plain["time"]["chunk_median_us"])
        assert c["overhead_us"] == pytest.approx(arm["time"]["chunk_median_us"] - plain["time"]["chunk_median_us"])
        assert c["memory_ratio"] == pytest.approx(arm["memory"]["training_bytes"] / plain["memory"]["training_bytes"])
        assert c["extra_bytes"] == arm["memory"]["training_bytes"] - plain["memory"]["training_bytes"]
        assert arm["memory"]["trainer_tensor_bytes"]["total"] >= 0
    parts = results["models"]["tiny"]["breakdown"]
    assert parts["arm"] == "predict=False" and parts["parts_us"]["gradient norm (guard)"] > 0
    assert parts["own_us"] == pytest.approx(parts["step_us"] - sum(
        parts["parts_us"][k] for k in ("model forward", "backward", "optimizer step")))
    table = (tmp_path / "overhead_quick.md").read_text()
    assert "| tiny |" in table and "| weight_average |" in table

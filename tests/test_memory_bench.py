"""The memory benchmark's leak measurement, on a tiny run (real digits data, seconds)."""
import json

import pytest
import torch

from bench import memory


@pytest.fixture(autouse=True)
def eager(monkeypatch):
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", "eager")  # the CPU production path, as the bench runs


def test_leak_run_reports_growth_and_no_reallocation():
    result = memory.measure_leak(steps=60, chunk=15, warmup_chunks=1, progress=False)
    json.dumps(result)  # the bench writes it as JSON
    assert result["steps_per_arm"] == 60 and result["warmup_steps"] == 15
    assert result["reallocations"] == {"plain": 0, "hybrid": 0, "hybrid_always_predict": 0}
    assert result["rss_end"] > 0 and result["rss_after_warmup"] > 0
    assert result["extra_growth_hybrid"] == result["growth_hybrid"] - result["growth_plain"]
    assert result["allowed_extra_growth"] == pytest.approx(0.01 * result["rss_end"])
    assert result["within_tolerance"] == all(arm["extra_growth"] <= result["allowed_extra_growth"]
                                             for arm in result["hybrid_arms"].values())
    assert "dynamics_hidden=64" in result["hybrid_config_note"]
    assert result["hybrid_config"]["dynamics_hidden"] == 64
    assert [s for s, _ in result["rss_trace"]["hybrid"]] == [15, 30, 45, 60]
    for name, arm in result["hybrid_arms"].items():
        assert sum(arm["steps_by_phase"].values()) == 60, name
        assert arm["extra_growth"] == result["growth_by_arm"][name] - result["growth_plain"]
    assert result["hybrid_arms"]["hybrid_always_predict"]["predicted_steps"] > 0  # its PREDICT path ran
    assert result["live_tensors_end"] > 0


def test_reallocation_counter_catches_a_replaced_parameter():
    arm = memory._LeakArm(memory.get_task("digits"), config=None, seed=0)
    arm.run(2)
    assert arm.reallocations == 0
    step = arm.optimizer.step

    def reallocating_step():
        step()
        with torch.no_grad():
            arm.params[0].data = arm.params[0].data.clone()  # a copy instead of an in-place update

    arm.optimizer.step = reallocating_step
    arm.run(3)
    assert arm.reallocations == 3


def test_leak_run_needs_a_measured_chunk():
    with pytest.raises(ValueError, match="leaves no chunk"):
        memory.measure_leak(steps=20, chunk=10, warmup_chunks=2, progress=False)

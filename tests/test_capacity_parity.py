"""bench.capacity_parity's arithmetic: gaps against fp32 over the same seeds, the frontier of
bytes/param against gap, the goal check, the learning-rate schedule and the report."""
import pytest

from bench.capacity_parity import (FINAL_LR_FRACTION, WARMUP_STEPS, frontier, goal_met, low_bit_floor, lr_factor,
                                   markdown, noise_verdict, summarize)


def _task(arms):
    return {"steps": 10, "lr": 1e-3, "seeds": [0, 1, 2], "arms": arms}


def _arm(vals, plan_bytes, ms=10.0):
    return {"val_loss": vals, "step_ms": [ms] * len(vals), "plan_bytes_per_param": plan_bytes}


def test_gap_is_against_fp32_over_the_same_seeds():
    tr = _task({"fp32 AdamW": _arm([1.0, 2.0, 3.0], 16.0),
                "one seed": _arm([1.01], 3.06, ms=20.0),
                "three seeds": _arm([1.0, 2.0, 3.3], 10.0)})
    summarize(tr)
    assert tr["arms"]["one seed"]["gap_pct"] == pytest.approx(1.0)  # against seed 0's 1.0, not the mean 2.0
    assert tr["arms"]["one seed"]["step_time_factor"] == pytest.approx(2.0)
    assert tr["arms"]["three seeds"]["gap_pct"] == pytest.approx(5.0)
    assert tr["arms"]["three seeds"]["paired_gap_pct"] == pytest.approx([0.0, 0.0, 10.0])


def test_frontier_and_goal():
    tr = _task({"fp32 AdamW": _arm([1.0], 16.0), "cheap, good": _arm([1.005], 2.9),
                "dominated": _arm([1.02], 10.0), "cheapest, bad": _arm([1.2], 2.0)})
    summarize(tr)
    assert frontier(tr, {}) == ["cheapest, bad", "cheap, good", "fp32 AdamW"]
    assert goal_met(tr) == ["cheap, good"]
    # the measured slope, where there is one, replaces the plan's count
    assert frontier(tr, {"cheap, good": {"bytes_per_param": 20.0}}, key="measured") == \
        ["cheapest, bad", "dominated", "fp32 AdamW"]


def test_schedule_warms_up_then_decays_to_its_floor():
    assert lr_factor(0, 300, "cosine") == pytest.approx(1 / WARMUP_STEPS)
    assert lr_factor(WARMUP_STEPS, 300, "cosine") == pytest.approx(1.0)
    assert lr_factor(299, 300, "cosine") == pytest.approx(FINAL_LR_FRACTION)
    assert all(lr_factor(s, 300, "constant") == 1.0 for s in (0, 150, 299))


def test_report_renders_with_an_error_row():
    tr = _task({"fp32 AdamW": _arm([1.0, 1.1], 16.0), "broken": {"val_loss": [], "step_ms": [], "error": "boom"}})
    summarize(tr)
    text = markdown({"command": "python -m bench.capacity_parity", "git_commit": "abcdef123456", "date": "d",
                     "machine": "m", "tasks": {"charlm": tr}})
    assert "| fp32 AdamW | 16.00 |" in text and "boom" in text and "not met" in text


def test_goal_is_one_sided_and_noise_is_named():
    # a loss 5% lower than fp32's is within the "no more than 1% worse" goal; 2% higher is not
    tr = _task({"fp32 AdamW": _arm([1.0, 1.1, 1.2], 16.0), "lower": _arm([0.95, 1.045, 1.14], 2.9),
                "higher": _arm([1.02, 1.122, 1.224], 2.9), "noisy": _arm([0.9, 1.2, 1.2], 2.9)})
    summarize(tr)
    assert goal_met(tr) == ["lower", "noisy"]
    assert tr["arms"]["lower"]["noise_verdict"] == "lower than fp32 beyond seed noise"  # same -5% on every seed
    assert tr["arms"]["higher"]["noise_verdict"] == "higher than fp32 beyond seed noise"
    assert tr["arms"]["noisy"]["noise_verdict"] == "within seed noise"  # -10%, +9%, 0%
    assert tr["arms"]["noisy"]["paired_gap_ci95_pct"] > abs(tr["arms"]["noisy"]["paired_gap_mean_pct"])
    assert tr["arms"]["fp32 AdamW"]["noise_verdict"] == "the baseline"
    assert noise_verdict(0.5, None, 1) == "1 seed: spread unknown"


def test_smallest_configuration_count_stays_above_three_bytes():
    from hybrid_kernels.adamw_lowbit import DEFAULT_BLOCK
    from hybrid_trainer.memory_plan import _state_bytes_per_param

    # the planner's count: bf16 weights (2 bytes) + its 4-bit state count at the default block
    assert low_bit_floor(DEFAULT_BLOCK[4]) == pytest.approx(2.0 + _state_bytes_per_param(4, None, True))
    assert low_bit_floor(128) == pytest.approx(3.0625)
    assert low_bit_floor(512) == pytest.approx(3.015625)
    assert all(low_bit_floor(b) > 3.0 for b in (64, 128, 256, 512, 4096))

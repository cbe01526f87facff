"""The memory benchmark's leak measurement, on a tiny run (real digits data, seconds)."""
import json

import pytest
import torch

from bench import memory
from hybrid_trainer.grad_checkpoint import GradientCheckpointing


@pytest.fixture(autouse=True)
def eager(monkeypatch):
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", "eager")  # the CPU production path, as the bench runs


class ScriptedRss:
    """Stands in for ``memory._rss``: returns the scripted byte counts in call order."""

    def __init__(self, values):
        self.values, self.calls = list(values), 0

    def __call__(self):
        self.calls += 1
        return self.values[self.calls - 1]


@pytest.mark.slow
def test_leak_run_reports_growth_and_no_reallocation(monkeypatch):
    """The growth bookkeeping against hand-computed numbers: RSS is scripted, one (before, after)
    pair per chunk and arm in the order the run reads them (60 steps = 4 chunks of 15, the first
    a warm-up), with jumps between chunks that belong to no arm."""
    rss = ScriptedRss([
        1_000_000, 1_050_000, 1_060_000, 1_090_000, 1_090_000, 1_100_000,  # warm-up chunk: not charged
        1_100_000,  # rss_after_warmup
        1_100_000, 1_101_000, 1_101_000, 1_105_000, 1_200_000, 1_230_000,  # plain +1000, hybrid +4000, always +30000
        1_230_000, 1_229_000, 1_229_000, 1_236_500, 1_236_500, 1_236_500,  # plain -1000, hybrid +7500, always 0
        1_240_000, 1_242_000, 1_242_000, 1_245_000, 1_245_000, 1_240_000,  # plain +2000, hybrid +3000, always -5000
        1_250_000,  # rss_end
    ])
    monkeypatch.setattr(memory, "_rss", rss)
    result = memory.measure_leak(steps=60, chunk=15, warmup_chunks=1, progress=False)
    json.dumps(result)  # the bench writes it as JSON
    assert rss.calls == len(rss.values)
    assert result["steps_per_arm"] == 60 and result["warmup_steps"] == 15
    assert (result["rss_after_warmup"], result["rss_end"]) == (1_100_000, 1_250_000)
    assert result["growth_by_arm"] == {"plain": 2000, "hybrid": 14500, "hybrid_always_predict": 25000}
    assert (result["growth_plain"], result["growth_hybrid"], result["extra_growth_hybrid"]) == (2000, 14500, 12500)
    assert result["allowed_extra_growth"] == 12500  # 1% of 1_250_000
    arms = result["hybrid_arms"]
    assert (arms["hybrid"]["extra_growth"], arms["hybrid"]["within_tolerance"]) == (12500, True)  # equal passes
    assert (arms["hybrid_always_predict"]["extra_growth"], arms["hybrid_always_predict"]["within_tolerance"]) == \
           (23000, False)
    assert result["within_tolerance"] is False  # one arm over the limit fails the run
    assert result["rss_trace"] == {
        "plain": [(15, 1_050_000), (30, 1_101_000), (45, 1_229_000), (60, 1_242_000)],
        "hybrid": [(15, 1_090_000), (30, 1_105_000), (45, 1_236_500), (60, 1_245_000)],
        "hybrid_always_predict": [(15, 1_100_000), (30, 1_230_000), (45, 1_236_500), (60, 1_240_000)],
    }
    assert result["reallocations"] == {"plain": 0, "hybrid": 0, "hybrid_always_predict": 0}
    assert "dynamics_hidden=64" in result["hybrid_config_note"]
    assert result["hybrid_config"]["dynamics_hidden"] == 64
    for name, arm in arms.items():
        assert sum(arm["steps_by_phase"].values()) == 60, name
    assert arms["hybrid_always_predict"]["predicted_steps"] > 0  # its PREDICT path ran
    assert result["live_tensors_end"] > 0


def test_rss_is_this_process_resident_set():
    import psutil

    assert abs(memory._rss() - psutil.Process().memory_info().rss) < 64 * 2 ** 20
    assert memory._rss() > 50 * 2 ** 20  # torch alone maps more than 50 MiB


def _tiny_model():
    """block "0" = Linear(4, 8), ReLU, Linear(8, 8), ReLU; head "1" = Linear(8, 2)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8),
                                                   torch.nn.ReLU()),
                               torch.nn.Linear(8, 2))


@pytest.mark.parametrize("checkpointed, expected", [
    ([], 32 + 64 + 64),  # the input x [2, 4] (first Linear), both ReLU outputs [2, 8] (ReLU, next Linear); fp32
    (["0"], 32 + 64),  # the checkpoint keeps the block's input; only the head's input stays saved
], ids=["no-checkpointing", "block-checkpointed"])
def test_saved_activation_bytes_of_a_tiny_model(checkpointed, expected):
    """Hand-counted bytes: parameters (and their transposed views) are excluded, a storage saved
    twice counts once, the sum saves no tensor."""
    model = _tiny_model()
    checkpointing = GradientCheckpointing(model, modules=checkpointed)
    x = torch.randn(2, 4)
    assert memory.saved_activation_bytes(model, lambda m, b: m(b).sum(), x, checkpointing) == expected


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

"""bench.host_ops: counts what it claims, and the batched reductions stay flat in the tensor count."""
import json

import pytest
import torch

from bench import host_ops
from bench.host_ops import HostOps


def test_counts_each_op_and_attributes_it_to_its_caller():
    x = torch.randn(4)
    with HostOps() as host:
        torch.mul(x, 2).sum()
    assert host.ops == ["mul", "sum"] and host.by_caller == {None: 2}


@pytest.mark.slow
def test_quick_run_writes_every_arm_and_recording_with_batched_reductions_costs_fewer_ops(tmp_path):
    assert host_ops.main(["--tasks", "digits", "--quick", "--warmup", "22", "--steps", "3", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "host_ops.json").read_text())
    arms = result["tasks"]["digits"]
    assert list(arms) == list(host_ops.ARMS)
    plain, no_predict, per_tensor, batched, fused_plain, fused_deferred = (arms[a]["median"] for a in host_ops.ARMS)
    assert plain < no_predict < batched < per_tensor
    assert arms[host_ops.ARMS[2]]["phases"].get("FULL", 0) >= 1  # counted real steps that record
    assert "| HybridTrainer, batched reductions |" in (tmp_path / "host_ops.md").read_text()
    # The plain loop's only reads are the optimizer's own (its step counters); the trainer's are named.
    assert set(arms[host_ops.ARMS[0]]["read_backs_by_caller"]) <= {"optimizer"}
    assert arms[host_ops.ARMS[1]]["read_backs_median"] >= arms[host_ops.ARMS[0]]["read_backs_median"]
    # read_every=16 with a fused optimizer: a step reads no more than the fused plain loop does.
    assert arms[host_ops.ARMS[5]]["read_backs_median"] == arms[host_ops.ARMS[4]]["read_backs_median"]


def test_read_backs_are_counted_for_item_and_tolist():
    x = torch.randn(3)
    with HostOps() as host:
        x.sum().item()
        x.tolist()
    assert sum(host.read_backs.values()) == 2
    assert torch.Tensor.tolist is not None and x.tolist() == x.tolist()  # unwrapped again


def test_arms_are_counted_with_the_guard_and_the_snapshot_check_as_on_a_gpu_and_put_back_after():
    from hybrid_trainer import resume_check, step_guard

    cpu = torch.device("cpu")
    from bench.protocol import guard_as_on_a_gpu

    with guard_as_on_a_gpu():
        assert not step_guard.reads_are_free(cpu) and resume_check._multi_tensor_norm_pays(cpu)
    assert step_guard.reads_are_free(cpu) and not resume_check._multi_tensor_norm_pays(cpu)

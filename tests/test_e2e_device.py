"""bench.e2e --device: a clear error without a GPU, an unchanged CPU path, and a CUDA run on a GPU."""
import json

import pytest
import torch

from bench import e2e, protocol
from bench.tasks import get_task

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is available")
def test_device_cuda_without_a_gpu_is_an_argument_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        e2e.main(["--quick", "--tasks", "digits", "--device", "cuda", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "argument --device" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # failed before any run or output


def test_a_cpu_task_is_the_task_built_without_a_device():
    default, cpu = get_task("digits", quick=True), get_task("digits", quick=True, device="cpu")
    assert cpu.device == default.device == torch.device("cpu")
    a, b = default.batches(3), cpu.batches(3)
    for _ in range(30):  # past the end of the first epoch (1437 // 64 = 22 batches)
        (xa, ya), (xb, yb) = next(a), next(b)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    model_a, model_b = default.make_model(0), cpu.make_model(0)
    assert all(torch.equal(p, q) for p, q in zip(model_a.parameters(), model_b.parameters()))
    assert default.val_loss(model_a) == cpu.val_loss(model_b)


@needs_cuda
def test_quick_digits_runs_on_cuda(tmp_path):
    task = get_task("digits", quick=True, device="cuda")
    x, y = next(task.batches(0))
    assert x.is_cuda and y.is_cuda
    arms = [protocol.ArmSpec("AdamW", 3e-3), protocol.ArmSpec("HybridTrainer (default)", 3e-3, protocol.preset_config("default"))]
    runs = protocol.run_arms(task, arms, seeds=[0], desc="cuda")
    for arm in arms:
        run = runs[arm.name][0]
        assert run.done and all(p.is_cuda for p in run.model.parameters())
        assert run.train_time > 0 and all(torch.isfinite(torch.tensor(p["val_loss"])) for p in run.curve)

    assert e2e.main(["--quick", "--tasks", "digits", "--seeds", "1", "--presets", "default", "--device", "cuda",
                     "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "e2e_digits_quick_cuda.json").read_text())
    assert result["meta"]["device"] == torch.cuda.get_device_name(0)
    assert result["meta"]["command"].endswith(f"--device cuda --out {tmp_path}")
    assert (tmp_path / "e2e_quick_cuda.md").exists() and not (tmp_path / "e2e_quick.md").exists()


@pytest.mark.slow
def test_warm_up_reaches_every_kernel_a_timed_run_may_use(monkeypatch):
    """Which of the trainer's kernels a run calls depends on its measured worth (the encoder and
    the dynamics model wait for the gate), so the warm-up forces prediction on once per hybrid
    arm: a GPU then compiles every kernel before the clock runs."""
    import hybrid_kernels as hk

    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", "eager")
    task = get_task("digits", quick=True)
    arms = [protocol.ArmSpec("AdamW", 3e-3), protocol.ArmSpec("HybridTrainer (default)", 3e-3, protocol.preset_config("default"))]
    hk.reset_backend_counts()
    runs = e2e.warm_up(task, arms, steps=e2e.WARM_UP_STEPS)
    assert [r.spec.name for r in runs] == ["AdamW", "HybridTrainer (default)", "HybridTrainer (default)"]
    default, forced = runs[1].trainer, runs[2].trainer
    assert default.config.min_predicted_worth != forced.config.min_predicted_worth  # the arm's own config first
    assert forced.dynamics.train_steps > 0 and forced.stats.predicted_steps > 0
    counts = hk.backend_counts()
    assert counts.get(("encode_state", "eager"), 0) > 0 and counts.get(("apply_delta_", "eager"), 0) > 0

"""experiments.gpu_step_capture on the CPU: the eager arms, the trainer's profile and op counts, and
a report built from what was timed (the captured arms need CUDA and are not built here)."""
import json
import statistics

import pytest
import torch

from experiments import gpu_step_capture


def test_a_cpu_run_times_the_eager_arms_and_profiles_the_trainer(tmp_path):
    gpu_step_capture.main(["--device", "cpu", "--models", "tiny", "--rounds", "6", "--chunk", "4",
                           "--profile-steps", "5", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "gpu_step_capture_cpu.json").read_text())
    assert saved["meta"]["command"].startswith("python -m experiments.gpu_step_capture --device cpu")
    run = saved["results"][0]
    assert list(run["arms"]) == ["plain", "trainer", "plain, lean calls",
                                 *[f"lean + guard ops ({v})" for v in gpu_step_capture.GUARD_VARIANTS]]
    assert run["capture_error"] is None and run["replayed"] is None  # the replayed trainer's arm needs a GPU
    plain, trainer = run["arms"]["plain"]["per_round_us"], run["arms"]["trainer"]["per_round_us"]
    assert len(plain) == len(trainer) == 6
    assert run["arms"]["trainer"]["over_plain_us"] == pytest.approx(
        statistics.median(t - p for t, p in zip(trainer, plain)))
    # The guard reads the loss and the gradients on every step: ops the plain loop never issues.
    assert run["kernels"]["trainer"]["aten_ops_per_step"] > run["kernels"]["plain"]["aten_ops_per_step"]
    assert "_steady_step" in run["trainer_profile"]
    report = (tmp_path / "gpu_step_capture_cpu.md").read_text()
    assert f"| trainer | {run['arms']['trainer']['step_us']:.0f} |" in report


def test_each_model_is_written_as_it_is_done_so_a_later_failure_keeps_it(tmp_path, monkeypatch):
    # On a lent GPU the time can run out, or a later model's capture fail (the first run's did,
    # with an illegal address), after the first model's figures were taken.
    done = gpu_step_capture.run

    def run(model, *args):
        if model == "mlp-1ms":
            raise RuntimeError("the second model failed")
        return done(model, *args)

    monkeypatch.setattr(gpu_step_capture, "run", run)
    with pytest.raises(RuntimeError, match="second model"):
        gpu_step_capture.main(["--device", "cpu", "--models", "tiny", "mlp-1ms", "--rounds", "2", "--chunk", "2",
                               "--profile-steps", "2", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "gpu_step_capture_cpu.json").read_text())
    assert [r["model"] for r in saved["results"]] == ["tiny"]
    assert "## tiny" in (tmp_path / "gpu_step_capture_cpu.md").read_text()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_the_captured_step_trains_as_the_eager_step_does():
    """A replayed graph steps the model as the eager loop does: the same weights after the same
    batches (the captured arm's three warm-up steps on the first batch included)."""
    from bench.overhead import make_workload

    device = torch.device("cuda")
    workload = make_workload("tiny", 4, device)
    step = gpu_step_capture.captured_arm(workload, device, guarded=False)
    reference = workload.make_model(0)
    # capturable, as the captured arm's: the step count and bias corrections on the device, the same arithmetic
    optimizer = torch.optim.AdamW(reference.parameters(), lr=workload.lr, fused=True, capturable=True)

    def eager(batch):
        optimizer.zero_grad(set_to_none=True)
        workload.loss_fn(reference, batch).backward()
        optimizer.step()
    for _ in range(3):
        eager(workload.batches[0])
    for batch in workload.batches:
        step(batch)
        eager(batch)
    for p, q in zip(step.keep[0].parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_the_guarded_graph_skips_a_non_finite_step_and_reads_once_per_ring():
    from bench.overhead import make_workload

    device = torch.device("cuda")
    workload = make_workload("tiny", 4, device)
    step = gpu_step_capture.captured_arm(workload, device, guarded=True)
    model = step.keep[0][0]
    for i in range(gpu_step_capture.RING - 1):
        step(workload.batches[i % 4])
    before = [p.detach().clone() for p in model.parameters()]
    x, y = workload.batches[0]
    step((torch.full_like(x, float("nan")), y))  # the ring's last step: the block is read
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert len(step.read) == 1 and len(step.read[0]) == gpu_step_capture.RING
    assert all(torch.tensor(row).isfinite().all() for row in step.read[0][:-1])
    assert not torch.tensor(step.read[0][-1]).isfinite().all()


def test_both_guard_op_variants_read_the_same_norm_and_skip_a_non_finite_step():
    """The two ways of taking the norm give the global gradient norm to float32 rounding, and a NaN
    batch's update is skipped on the device (the weights do not move)."""
    from bench.overhead import make_workload

    workload = make_workload("tiny", 4, torch.device("cpu"))
    steps = {v: gpu_step_capture.guard_ops_arm(workload, torch.device("cpu"), v) for v in gpu_step_capture.GUARD_VARIANTS}
    for step in steps.values():
        for i in range(gpu_step_capture.RING - 1):
            step(workload.batches[i % 4])
        before = [p.detach().clone() for p in step.model.parameters()]
        x, y = workload.batches[0]
        step((torch.full_like(x, float("nan")), y))
        assert all(torch.equal(p, q) for p, q in zip(step.model.parameters(), before))
    per_gradient, concatenated = (steps[v].read[0] for v in gpu_step_capture.GUARD_VARIANTS)
    norms = len(list(workload.make_model(0).parameters()))
    for i in range(gpu_step_capture.RING - 1):
        row = per_gradient[i * (1 + norms):(i + 1) * (1 + norms)]
        assert row[0] == pytest.approx(concatenated[2 * i], rel=1e-6)  # the same loss
        assert sum(n * n for n in row[1:]) ** 0.5 == pytest.approx(concatenated[2 * i + 1], rel=1e-5)


def test_merge_keeps_the_other_models_each_with_the_run_that_timed_it(tmp_path):
    # A lent GPU's calls are short: one model a call, the file gathering them.
    common = ["--device", "cpu", "--rounds", "2", "--chunk", "2", "--profile-steps", "2", "--out", str(tmp_path)]
    gpu_step_capture.main(["--models", "tiny", "small", *common])
    first = json.loads((tmp_path / "gpu_step_capture_cpu.json").read_text())
    gpu_step_capture.main(["--models", "small", "--merge", *common])
    saved = json.loads((tmp_path / "gpu_step_capture_cpu.json").read_text())
    assert [r["model"] for r in saved["results"]] == ["tiny", "small"]
    tiny, small = saved["results"]
    assert tiny == first["results"][0]  # kept as timed, with the first run's command
    assert tiny["run"]["command"] == first["meta"]["command"] != saved["meta"]["command"]
    assert small["run"]["command"] == saved["meta"]["command"] and small != first["results"][1]
    report = (tmp_path / "gpu_step_capture_cpu.md").read_text()
    assert report.count("Timed by `python -m experiments.gpu_step_capture --models tiny small") == 1
    # Without --merge the file holds this run's models only.
    gpu_step_capture.main(["--models", "small", *common])
    assert [r["model"] for r in json.loads((tmp_path / "gpu_step_capture_cpu.json").read_text())["results"]] == ["small"]


def test_a_file_written_before_models_recorded_their_run_is_merged_with_its_own():
    old = dict(meta=dict(command="python -m experiments.gpu_step_capture --models a b", date="d", git_commit="c",
                         torch="t"), results=[dict(model="a"), dict(model="b")])
    new = [dict(model="b", run=dict(command="new")), dict(model="c", run=dict(command="new"))]
    out = gpu_step_capture.merged(old, new)
    assert [r["model"] for r in out] == ["a", "b", "c"]
    assert out[0]["run"]["command"] == old["meta"]["command"] and out[1] is new[0]

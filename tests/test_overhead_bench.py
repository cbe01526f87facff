"""bench.overhead: the report holds every arm, and its ratios come from its own measurements."""
import json

import pytest
import torch

from bench import overhead


def memory_stand_in(calls: list, first: dict | None = None):
    """A stand-in for ``overhead.run_memory_child`` in tests of how a run merges and keeps its
    figures: a child is a fresh interpreter (~7 s on the CI host, ten per model and run), and
    the real ones run in :func:`test_quick_run_reports_every_arm_with_ratios_from_its_measurements`.
    Records each ``(arm, measure)`` in ``calls`` and returns ``first``'s figures for the arm (a
    results file's ``models[model]``) plus 4 kB, or made-up ones, distinct per arm, without it."""

    def measured(model_name, arm, device, steps, n_batches, measure="rss"):
        calls.append((arm, measure))
        kind, key = ("memory", "training_bytes") if measure == "rss" else ("tensors", "tensor_peak_bytes")
        if first is not None:
            figures = first["arms"][arm][kind]
            return dict(figures, **{key: figures[key] + 4096})
        figures = {key: 1_000_000 + 1000 * list(overhead.ARMS).index(arm)}
        if measure == "rss" and arm != "plain":
            figures["trainer_tensor_bytes"] = dict(total=0, by_holder={})
        return dict(model=model_name, arm=arm, **figures)

    return measured


def test_compare_divides_and_subtracts_the_measurements():
    plain = {"time": {"median_us": 1000.0, "real_median_us": 1000.0}, "memory": {"training_bytes": 4_000_000}}
    arm = {"time": {"median_us": 1030.0, "real_median_us": 1100.0}, "memory": {"training_bytes": 4_200_000}}
    c = overhead.compare(plain, arm)
    assert c["time_ratio"] == pytest.approx(1.03) and c["overhead_us"] == pytest.approx(30.0)
    assert c["real_step_ratio"] == pytest.approx(1.1) and c["real_step_overhead_us"] == pytest.approx(100.0)
    assert c["memory_ratio"] == pytest.approx(1.05) and c["extra_bytes"] == 200_000
    assert c["memory_basis"] == "rss"  # no tensor peak measured: the RSS one


def test_the_memory_ratio_is_the_tensor_peaks_where_rss_cannot_resolve_it():
    small = overhead.RSS_RESOLVES_BYTES / 2
    plain = {"memory": {"training_bytes": small}, "tensors": {"tensor_peak_bytes": 2_000_000}}
    arm = {"memory": {"training_bytes": small * 1.5}, "tensors": {"tensor_peak_bytes": 2_040_000}}
    c = overhead.compare(plain, arm)
    assert c["rss_ratio"] == pytest.approx(1.5) and c["tensor_ratio"] == pytest.approx(1.02)
    assert c["memory_basis"] == "tensors" and c["memory_ratio"] == pytest.approx(1.02) and c["extra_bytes"] == 40_000
    big = overhead.RSS_RESOLVES_BYTES * 2
    plain["memory"]["training_bytes"], arm["memory"]["training_bytes"] = big, big * 1.05
    c = overhead.compare(plain, arm)
    assert c["memory_basis"] == "rss" and c["memory_ratio"] == pytest.approx(1.05)


def test_the_overhead_is_the_median_of_paired_chunk_differences_with_a_sign_test_interval():
    # Round by round the arm's chunk mean minus the plain loop's: 1..20 µs, whatever the levels.
    plain = {"time": {"chunk_median_us": 1000.0, "chunk_means_us": [1000.0 + 50 * (i % 3) for i in range(20)],
                      "median_us": 1000.0, "real_median_us": 1000.0}}
    arm = {"time": {"chunk_median_us": 1010.0, "chunk_means_us": [x + 1 + i for i, x in
                                                                  enumerate(plain["time"]["chunk_means_us"])],
                    "median_us": 1010.0, "real_median_us": None}}
    c = overhead.compare(plain, arm)
    assert c["overhead_pairs"] == 20 and c["overhead_us"] == pytest.approx(10.5)
    assert c["overhead_ci95_us"] == [6.0, 15.0]  # ranks 5 and 14 of 20 sorted differences
    assert c["time_ratio"] == pytest.approx(1.0105)
    assert overhead.median_interval_ranks(5) is None and overhead.median_interval_ranks(6) == (0, 5)
    assert overhead.median_interval_ranks(100) == (39, 60)
    # The verdict: met only if the whole interval is within the goal, NOT met only if all of it is over.
    assert overhead.goal_verdict(48, [44, 49], 50) == "met"
    assert overhead.goal_verdict(52, [51, 55], 50) == "NOT met"
    assert overhead.goal_verdict(48, [44, 53], 50).startswith("not resolved")
    assert overhead.goal_verdict(48, None, 50) == "met"


# Chunk means of a plain loop over 20 rounds, and an arm's timed that many µs above them round by round.
PLAIN_MEANS = [1000.0 + 40 * (i % 4) for i in range(20)]


def _timed_arm(offsets: list[float]) -> dict:
    means = [x + d for x, d in zip(PLAIN_MEANS, offsets)]
    return {"time": {"chunk_median_us": sorted(means)[10], "chunk_means_us": means, "median_us": means[0],
                     "real_median_us": None}}


def _plain_arm() -> dict:
    return {"time": {"chunk_median_us": 1040.0, "chunk_means_us": PLAIN_MEANS, "median_us": 1000.0,
                     "real_median_us": 1000.0}}


def test_the_goal_lines_give_the_overhead_over_the_plain_loop_and_over_its_lean_calls():
    arm = _timed_arm
    arms = {"plain": _plain_arm(),
            "predict=False": arm([30.0 + i for i in range(20)]),  # 30..49 over the plain loop
            overhead.LEAN_PLAIN: arm([-40.0 + (i % 2) for i in range(20)])}  # -40 or -39
    for a in ("predict=False", overhead.LEAN_PLAIN):
        arms[a]["vs_plain"] = overhead.compare(arms["plain"], arms[a])
    line = overhead.goal_lines({"models": {"m": {"arms": arms}}})[-1]
    assert line.startswith("- m: +40 µs") and "95% interval +35…+44 µs), goal ≤ 50 µs: met" in line
    # Round by round: (30 + i) - (-40 + i % 2) = 70, 70, 72, 72, ..., 88, 88: median 79, sign-test ranks 5 and 14.
    assert "without profiler scopes (-40 µs against the plain loop): +79 µs [+74, +84]" in line
    # An arm whose guard refused more than 1% of its timed steps skipped updates: no verdict from it.
    arms["predict=False"]["time"].update(steps=1000, refusals={"skipped_steps": 10, "divergence_rollbacks": 10})
    assert "goal ≤ 50 µs: met" in overhead.goal_lines({"models": {"m": {"arms": arms}}})[-1]  # 1%: still steady
    arms["predict=False"]["time"]["refusals"]["skipped_steps"] = 11
    line = overhead.goal_lines({"models": {"m": {"arms": arms}}})[-1]
    assert "goal ≤ 50 µs: not resolved (the guard refused 11 of its 1000 timed steps)" in line


def test_a_second_plain_loop_that_measures_apart_from_the_first_is_taken_off_the_overhead():
    """Two identical plain loops are the protocol's own error: where their interval excludes zero,
    the verdict is drawn from the overhead less it, over an interval that counts both uncertainties."""
    arm = _timed_arm
    arms = {"plain": _plain_arm(),
            "predict=False": arm([30.0 + i for i in range(20)])}  # 30..49 over the plain loop: met alone
    arms["predict=False"]["vs_plain"] = overhead.compare(arms["plain"], arms["predict=False"])
    arms[overhead.PLAIN_AGAIN] = arm([-2.0 + (i % 5) for i in range(20)])  # -2..+2 round by round: holds zero
    line = overhead.goal_lines({"models": {"m": {"arms": arms}}})[-1]
    assert "goal ≤ 50 µs: met; a second plain loop (the noise floor) +0 µs (+0.0%) [-1, +1]" in line
    arms[overhead.PLAIN_AGAIN] = arm([-30.0 + (i % 5) for i in range(20)])  # -30..-26: excludes zero
    line = overhead.goal_lines({"models": {"m": {"arms": arms}}})[-1]
    # Round by round 30 + i - (-30 + i % 5): 56..79; less the noise (-28 [-29, -27]): +68 µs over
    # [+35 - (-27), +44 - (-29)] = [+62, +73]: the goal not met.
    assert ("+40 µs (+3.8%, 95% interval +35…+44 µs; less the noise floor (two identical plain loops differed "
            "by -28 µs): +68 µs [+62 µs, +73 µs]), goal ≤ 50 µs: NOT met; a second plain loop (the noise floor) "
            "-28 µs (-2.7%) [-29, -27]") in line
    arms[overhead.PLAIN_AGAIN] = arm([10.0 + (i % 5) for i in range(20)])  # +10..+14: a loop measured slow
    line = overhead.goal_lines({"models": {"m": {"arms": arms}}})[-1]
    assert "+28 µs [+22 µs, +33 µs]), goal ≤ 50 µs: met" in line  # +40 - 12 over [35 - 13, 44 - 11]
    step, trainer, _ = overhead._arm_step(overhead.PLAIN_AGAIN, overhead.make_workload("tiny", 2, torch.device("cpu")),
                                          torch.device("cpu"))
    assert trainer is None and step.__name__ == "plain"  # the plain loop's own code


def test_on_a_gpu_the_goal_is_the_speed_ratio_whatever_the_step():
    """A GPU's goal is predict=False at >= 0.97x the plain loop's speed: an overhead of at most
    3.09% of the plain step, judged on its interval (a 1 ms step's 40 µs would meet the CPU's 50 µs)."""
    plain = _plain_arm()

    def entry(offsets):
        arm = _timed_arm(offsets)
        arm["vs_plain"] = overhead.compare(plain, arm)
        return {"arms": {"plain": plain, "predict=False": arm}}

    line = overhead.goal_lines({"device": "cuda", "models": {"m": entry([30.0 + i for i in range(20)])}})[-1]
    assert "goal ≥ 0.97× the plain loop's speed: NOT met" in line  # +35…+44 µs of 1040 is over 3.09% (32 µs)
    assert "goal ≤ 50 µs: met" in overhead.goal_lines({"models": {"m": entry([30.0 + i for i in range(20)])}})[-1]
    line = overhead.goal_lines({"device": "cuda", "models": {"m": entry([10.0 + i for i in range(20)])}})[-1]
    assert "goal ≥ 0.97× the plain loop's speed: met" in line  # +15…+24 µs
    line = overhead.goal_lines({"device": "cuda", "models": {"m": entry([20.0 + i for i in range(20)])}})[-1]
    assert "goal ≥ 0.97× the plain loop's speed: not resolved" in line  # +25…+34 µs spans 32
    assert "a GPU): at least 0.97× the plain loop's speed" in overhead.goal_lines({"device": "cuda", "models": {}})[0]
    # The trainer with its steady step replayed from a CUDA graph, where timed, is held to the same goal.
    replayed = entry([30.0 + i for i in range(20)])
    replayed["arms"][overhead.CUDA_GRAPH] = _timed_arm([-900.0 + i for i in range(20)])
    replayed["arms"][overhead.CUDA_GRAPH]["vs_plain"] = overhead.compare(plain, replayed["arms"][overhead.CUDA_GRAPH])
    lines = overhead.goal_lines({"device": "cuda", "models": {"m": replayed}})
    assert "goal ≥ 0.97× the plain loop's speed: NOT met" in lines[-2]
    assert lines[-1].startswith("- m, its steady step replayed from a CUDA graph (`predict=False, cuda_graph`): -")
    assert lines[-1].endswith("goal ≥ 0.97× the plain loop's speed: met")
    assert not any("replayed" in line for line in overhead.goal_lines({"models": {"m": replayed}}))  # a CPU: no graph


def test_fused_adamw_reaches_every_arm_through_the_environment(monkeypatch):
    """--fused-adamw sets an environment variable, so that arms in processes of their own and
    the memory children build the same optimizer as the arms in this process."""
    workload = overhead.make_workload("tiny", 4, torch.device("cpu"))
    monkeypatch.delenv(overhead.FUSED_ENV, raising=False)
    step, trainer, _ = overhead._arm_step("predict=False", workload, torch.device("cpu"))
    assert not trainer.optimizer.defaults["fused"]
    monkeypatch.setenv(overhead.FUSED_ENV, "1")
    for arm in ("plain", "predict=False"):
        step, trainer, _ = overhead._arm_step(arm, workload, torch.device("cpu"))
        optimizer = step.optimizer if trainer is None else trainer.optimizer
        assert optimizer.defaults["fused"] is True, arm


def test_breakdown_of_a_deferred_arm_times_its_launch_and_block_reads():
    """With read_every=16 (a GPU's default) the step goes through the deferred path, which the
    per-step guard's parts never see: its launch and block read are timed, and only parts the
    arm reaches appear (none of the per-step read's)."""
    workload = overhead.make_workload("tiny", 8, torch.device("cpu"))
    parts = overhead.breakdown(workload, "predict=False, read_every=16", torch.device("cpu"), 20, 48)
    timed = parts["parts_us"]
    assert timed["checks read + update (deferred)"] > timed["optimizer step"] > 0  # the launch holds the update
    assert timed["block read and judgment (deferred)"] > 0 and timed["end of lean step: counters, events, metrics"] > 0
    assert "end of step: counters, events, metrics" not in timed  # a waiting step ends as a judged steady one
    assert "checks queued + update (deferred, device-side skip)" not in timed  # no fused optimizer here
    assert parts["own_us"] == pytest.approx(parts["step_us"] - sum(
        timed[k] for k in ("model forward", "backward", "optimizer step")))


def test_breakdown_of_a_per_step_arm_times_the_lean_step_s_check_and_end():
    """Once prediction is off the per-step arm takes the lean step, which ends with its own
    method and calls the monitor's check itself: both are timed, every step."""
    workload = overhead.make_workload("tiny", 8, torch.device("cpu"))
    parts = overhead.breakdown(workload, "predict=False", torch.device("cpu"), 20, 48)
    timed = parts["parts_us"]
    assert timed["end of lean step: counters, events, metrics"] > 0 and timed["divergence check (guard)"] > 0
    assert "end of step: counters, events, metrics" not in timed  # the general path's end never ran
    assert timed["gradient norm and read (guard)"] > 0


def test_breakdown_times_the_trainer_s_update_without_sending_it_through_torch_s_profiler_scope(monkeypatch):
    """Timing the update must not change it: the trainer skips the optimizer's profiler-scoped
    ``step`` (hybrid_trainer.optimizer_call), the plain loop does not, and the breakdown keeps it so
    (a wrapper on the optimizer's ``step`` sent the trainer's update through the scope too)."""
    scoped = []
    entry = torch.optim.Optimizer._optimizer_step_code  # what torch's wrapped ``step`` calls, scope open

    def counting(self):
        scoped.append(self)
        return entry(self)
    monkeypatch.setattr(torch.optim.Optimizer, "_optimizer_step_code", counting)
    workload = overhead.make_workload("tiny", 8, torch.device("cpu"))
    parts = overhead.breakdown(workload, "predict=False", torch.device("cpu"), 5, 20)
    assert parts["parts_us"]["optimizer step"] > 0 and parts["plain_parts_us"]["optimizer step"] > 0
    assert len(scoped) == 5 + 20 and len({id(o) for o in scoped}) == 1  # the plain loop's steps alone


def test_breakdown_counts_the_gram_hooks_inside_forward_and_backward_as_the_trainer_s_own():
    """A 1024 x 1024 layer over 2 rows gets its weight-gradient norm from Grams (hybrid_trainer.gram_norm):
    the hooks run inside the model's forward and backward, whose wrapped time holds them, so the
    trainer's own time adds them back."""
    workload = overhead.synthetic_mlp("wide", 1024, [1024], 10, 2, 4, torch.device("cpu"))
    parts = overhead.breakdown(workload, "predict=False", torch.device("cpu"), 20, 10)
    timed = parts["parts_us"]
    assert all(timed[k] > 0 for k in (*overhead.NESTED_PARTS, "Gram norms: check"))
    assert parts["own_us"] == pytest.approx(parts["step_us"] - sum(
        timed[k] for k in ("model forward", "backward", "optimizer step")) + sum(timed[k] for k in overhead.NESTED_PARTS))


def test_tensor_peak_is_exact_on_a_known_sequence_of_allocations():
    keep = torch.empty(250_000)  # allocated before: not in the peak, and its free is not reported
    with overhead.TensorPeak() as peak:
        a = torch.empty(1_000_000)  # 4 MB live
        b = torch.empty(2_000_000)  # 12 MB live: the peak
        del a  # 8 MB
        c = torch.ones(500_000)  # 10 MB
        del b, keep
    assert peak.peak_bytes == 12_000_000
    assert peak.end_bytes == 2_000_000 == c.numel() * 4


def test_tensor_peak_of_a_plain_adamw_loop_is_its_state_plus_the_steps_transients():
    """The plain loop's end state is exactly weights + gradients + two moments; its peak adds the
    activations (a few kB here) and the optimizer step's transients: single-tensor AdamW computes
    ``exp_avg_sq.sqrt() / bias_correction`` per parameter, two temporaries of the largest one."""
    torch.manual_seed(0)
    with overhead.TensorPeak() as peak:
        model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        x, y = torch.randn(4, 512), torch.randint(0, 10, (4,))
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        del x, y
    weights = sum(p.numel() * 4 for p in model.parameters())
    steps = sum(s["step"].numel() * 4 for s in optimizer.state.values())  # the step counters are CPU tensors too
    assert peak.end_bytes == 4 * weights + steps  # weights, gradients, exp_avg, exp_avg_sq
    largest = max(p.numel() * 4 for p in model.parameters())
    assert 2 * largest <= peak.peak_bytes - peak.end_bytes <= 2 * largest + 64_000


class _NoProgress:
    def update(self, n: int) -> None:
        pass


def test_exploration_times_the_default_config_from_its_first_step_until_prediction_is_off():
    workload = overhead.make_workload("tiny", 8, torch.device("cpu"))
    e = overhead.exploration(workload, torch.device("cpu"), max_steps=400, chunk=7, progress=_NoProgress())
    # The gate switches prediction off on the tiny model (a predicted step cannot pay there).
    assert e["switched_off"] and 0 < e["steps_on"] < 400 and "prediction is off" in e["disabled_reason"]
    assert e["phases"]["WARMUP"] == 20 and sum(e["phases"].values()) == e["steps_on"]  # HybridConfig().warmup_steps
    # It goes off at a phase decision, the end of a 20-step FULL phase, not at the end of the
    # 7-step chunk the bench was in: the steps after it are not counted.
    assert (e["steps_on"] - 20) % 20 == 0
    assert e["ratio"] == pytest.approx(e["default_s"] / e["plain_s"])
    assert e["extra_s"] == pytest.approx(e["default_s"] - e["plain_s"])
    # The per-phase means are of the steps taken with prediction on, which make up default_s.
    assert sum(e["default_mean_us_by_phase"][p] * n for p, n in e["phases"].items()) == pytest.approx(1e6 * e["default_s"])
    assert e["plain_mean_us"] == pytest.approx(1e6 * e["plain_s"] / e["steps_on"])
    lines = "\n".join(overhead.exploration_lines({"models": {"tiny": {"exploration": e}}}))
    assert f"tiny: off after {e['steps_on']} steps (WARMUP 20, FULL" in lines


@pytest.mark.slow
def test_quick_run_reports_every_arm_with_ratios_from_its_measurements(tmp_path, monkeypatch):
    assert overhead.main(["--quick", "--models", "tiny", "--warmup", "3", "--steps", "10", "--chunk", "5",
                          "--memory-steps", "25", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "overhead_quick.json").read_text())
    assert results["git"]["commit"] and isinstance(results["git"]["dirty"], bool)
    # The host's speed, per run too: figures of models merged from two hosts are told apart.
    machine = results["machine"]
    assert machine["python_ns"] > 0 and machine["read_gb_s"] > 0 and machine["cores"] >= 1
    assert results["models"]["tiny"]["run"]["machine"] == machine
    # ... and again once the model's arms are timed: a host that drifts during the timing shows it.
    after = results["models"]["tiny"]["run"]["machine_after_time"]
    assert after["python_ns"] > 0 and after["read_gb_s"] > 0
    report = (tmp_path / "overhead_quick.md").read_text()
    assert f"one thread reads {machine['read_gb_s']:.1f} GB/s ({after['read_gb_s']:.1f} after)" in report
    assert f"a Python loop step {machine['python_ns']:.0f} ns ({after['python_ns']:.0f} ns after the timing)" in report
    arms = results["models"]["tiny"]["arms"]
    assert list(arms) == [*overhead.ARMS, overhead.GUARD_FLOOR, overhead.LEAN_PLAIN]
    # Timed only: the plain loop plus a norm and its read; the plain loop making the trainer's two calls.
    for name in overhead.TIMED_ONLY:
        assert arms[name]["time"]["steps"] == 10 and "memory" not in arms[name]
        assert arms[name]["vs_plain"]["time_ratio"] > 0
    plain = arms["plain"]
    assert plain["time"]["steps"] == 10 and plain["memory"]["training_bytes"] > 0
    for name in list(overhead.ARMS)[1:]:
        arm = arms[name]
        c = arm["vs_plain"]
        # Time from the median over chunks of each chunk's mean step (a cost every N steps counts).
        assert arm["time"]["chunk"] == 5
        # The overhead: the median of the round-by-round differences of the two arms' chunk means.
        differences = [x - y for x, y in zip(arm["time"]["chunk_means_us"], plain["time"]["chunk_means_us"])]
        assert len(differences) == 2 and c["overhead_pairs"] == 2 and c["overhead_ci95_us"] is None  # too few pairs
        assert c["overhead_us"] == pytest.approx(sum(differences) / 2)
        assert c["time_ratio"] == pytest.approx(1 + c["overhead_us"] / plain["time"]["chunk_median_us"])
        assert c["rss_ratio"] == pytest.approx(arm["memory"]["training_bytes"] / plain["memory"]["training_bytes"])
        assert c["rss_extra_bytes"] == arm["memory"]["training_bytes"] - plain["memory"]["training_bytes"]
        assert c["tensor_ratio"] == pytest.approx(arm["tensors"]["tensor_peak_bytes"] / plain["tensors"]["tensor_peak_bytes"])
        assert c["memory_basis"] == "tensors" and c["memory_ratio"] == c["tensor_ratio"]  # a tiny model's RSS cannot resolve it
        assert arm["memory"]["trainer_tensor_bytes"]["total"] >= 0
    parts = results["models"]["tiny"]["breakdown"]
    assert parts["arm"] == "predict=False" and parts["parts_us"]["gradient norm and read (guard)"] > 0
    assert parts["own_us"] == pytest.approx(parts["step_us"] - sum(
        parts["parts_us"][k] for k in ("model forward", "backward", "optimizer step")))
    explored = results["models"]["tiny"]["exploration"]  # --quick: at most 40 steps, too few for the gate
    assert explored["steps_on"] == 40 and not explored["switched_off"] and explored["plain_s"] > 0
    table = (tmp_path / "overhead_quick.md").read_text()
    assert "| tiny |" in table and "| weight_average |" in table
    assert "- tiny: still on after 40 steps" in table
    # --memory-only measures memory again and keeps every arm's time figures, naming their run
    # (the children above were real; these return the first figures plus 4 kB, to be told apart).
    calls = []
    monkeypatch.setattr(overhead, "run_memory_child", memory_stand_in(calls, results["models"]["tiny"]))
    assert overhead.main(["--quick", "--models", "tiny", "--memory-steps", "25", "--memory-only",
                          "--out", str(tmp_path)]) == 0
    assert calls == [(arm, measure) for arm in overhead.ARMS for measure in ("rss", "tensors")]
    again = json.loads((tmp_path / "overhead_quick.json").read_text())["models"]["tiny"]
    for name, arm in arms.items():
        assert again["arms"][name]["time"] == arm["time"]
    assert again["time_run"] == results["models"]["tiny"]["run"]
    for name in overhead.ARMS:
        assert again["arms"][name]["memory"]["training_bytes"] == arms[name]["memory"]["training_bytes"] + 4096
        assert again["arms"][name]["tensors"]["tensor_peak_bytes"] == arms[name]["tensors"]["tensor_peak_bytes"] + 4096
    # --breakdown-only times the parts again and keeps every other figure, naming the run it made.
    assert overhead.main(["--quick", "--models", "tiny", "--warmup", "3", "--breakdown-only", "--breakdown-steps", "7",
                          "--out", str(tmp_path)]) == 0
    parted = json.loads((tmp_path / "overhead_quick.json").read_text())["models"]["tiny"]
    assert {k: v for k, v in parted.items() if k != "breakdown"} == {k: v for k, v in again.items() if k != "breakdown"}
    assert parted["breakdown"]["steps"] == 7 and "--breakdown-only" in parted["breakdown"]["run"]["command"]
    report = (tmp_path / "overhead_quick.md").read_text()
    assert "over 7 steps" in report
    assert "(from `python -m bench.overhead --quick --models tiny --warmup 3 --breakdown-only --breakdown-steps 7" in report
    b = parted["breakdown"]
    assert f"not counted): {b['own_over_plain_us']:+.0f} µs" in report
    assert b["own_over_plain_us"] == pytest.approx(b["own_us"] - b["plain_own_us"])
    assert b["plain_own_us"] == pytest.approx(b["plain_step_us"] - sum(
        b["plain_parts_us"][k] for k in ("model forward", "backward", "optimizer step")))
    # A run made with the guard's dots through torch.dot (hybrid_trainer.blas_dots) says so in
    # the command it records, which it changes.
    monkeypatch.setenv(overhead.TORCH_DOTS_ENV, "1")
    assert overhead.main(["--quick", "--models", "tiny", "--warmup", "3", "--breakdown-only", "--breakdown-steps", "3",
                          "--out", str(tmp_path)]) == 0
    command = json.loads((tmp_path / "overhead_quick.json").read_text())["models"]["tiny"]["breakdown"]["run"]["command"]
    assert command.startswith("HYBRID_TRAINER_TORCH_DOTS=1 python -m bench.overhead --quick"), command


def test_arms_times_only_the_named_arms_and_keeps_the_rest_against_their_own_plain_loop(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(overhead, "run_memory_child", memory_stand_in(calls))
    common = ["--quick", "--models", "tiny", "--warmup", "3", "--chunk", "5", "--memory-steps", "25",
              "--explore-steps", "10", "--breakdown-steps", "5", "--out", str(tmp_path)]
    assert overhead.main([*common, "--steps", "10"]) == 0
    before = json.loads((tmp_path / "overhead_quick.json").read_text())["models"]["tiny"]
    assert len(calls) == 2 * len(overhead.ARMS)  # each arm's peak RSS and tensor peak
    assert overhead.main([*common, "--steps", "15", "--arms", "predict=False", overhead.LEAN_PLAIN]) == 0
    assert len(calls) == 2 * len(overhead.ARMS)  # --arms measures no memory: it keeps it
    after = json.loads((tmp_path / "overhead_quick.json").read_text())["models"]["tiny"]
    arms = after["arms"]
    assert list(arms) == list(before["arms"])
    for name in ("plain", "predict=False", overhead.LEAN_PLAIN):  # timed again, over 3 chunks now
        assert arms[name]["time"]["steps"] == 15 and "time_run" not in arms[name]["time"]
    assert arms["predict=False"]["time"]["plain_chunk_means_us"] == arms["plain"]["time"]["chunk_means_us"]
    old_plain = before["arms"]["plain"]["time"]
    for name in ("default", "weight_average", overhead.GUARD_FLOOR):  # kept, with the plain loop of their run
        kept = arms[name]["time"]
        assert kept["chunk_means_us"] == before["arms"][name]["time"]["chunk_means_us"]
        assert kept["plain_chunk_means_us"] == old_plain["chunk_means_us"] and kept["time_run"] == before["run"]
        assert arms[name]["vs_plain"]["overhead_us"] == pytest.approx(before["arms"][name]["vs_plain"]["overhead_us"])
        assert arms[name]["vs_plain"]["real_step_overhead_us"] == pytest.approx(
            before["arms"][name]["vs_plain"]["real_step_overhead_us"])
    # The re-timed arm over this run's plain loop; the memory figures, breakdown and exploration kept.
    differences = [x - y for x, y in zip(arms["predict=False"]["time"]["chunk_means_us"],
                                         arms["plain"]["time"]["chunk_means_us"])]
    assert arms["predict=False"]["vs_plain"]["overhead_us"] == pytest.approx(sorted(differences)[1])
    for name in overhead.ARMS:
        assert arms[name]["memory"] == before["arms"][name]["memory"]
    assert after["breakdown"] == before["breakdown"] and after["exploration"] == before["exploration"]
    assert after["memory_run"] == before["run"] and after["run"]["command"].endswith(f"'{overhead.LEAN_PLAIN}'")
    table = (tmp_path / "overhead_quick.md").read_text()
    assert "tiny: this run timed plain, predict=False, plain, no profiler scopes; memory figures" in table
    assert "; default, weight_average, predict=False, read_every=16, plain + norm and read (guard floor): timed by `python -m bench.overhead" in table
    with pytest.raises(SystemExit):
        overhead.main([*common, "--arms", "predict=True"])  # no such arm: argparse names --arms


def test_the_arms_with_prediction_are_timed_once_it_is_off():
    """The table times the default config as it runs after its worth gate decided; the steps
    before are exploration()'s. On the tiny model the gate switches prediction off from step 80."""
    workload = overhead.make_workload("tiny", 8, torch.device("cpu"))
    out = overhead.time_interleaved(workload, torch.device("cpu"), 3, 20, 10, _NoProgress(),
                                    arms=["plain", "default", "predict=False"])
    assert out["plain"]["warmup_steps"] == out["predict=False"]["warmup_steps"] == 3
    # Off at a phase decision (80 steps or later, as the gate finds), then at most a few steps more.
    assert 80 <= out["default"]["warmup_steps"] < 3 + overhead.UNTIL_OFF_MAX
    assert not out["default"]["prediction_enabled_at_end"] and out["default"]["steps"] == 20
    capped = overhead.time_interleaved(workload, torch.device("cpu"), 3, 10, 10, _NoProgress(), arms=["default"],
                                       until_off_max=30)
    assert capped["default"]["warmup_steps"] == 33 and capped["default"]["prediction_enabled_at_end"]


@pytest.mark.parametrize("chunk, settle", [(overhead.PERIOD, 0), (overhead.BIG_CHUNK, overhead.BIG_SETTLE)])
@pytest.mark.parametrize("warmup", [0, 7, overhead.BIG_WARMUP])
def test_every_chunk_times_exactly_one_good_state_snapshot(chunk, settle, warmup):
    """A snapshot every ``good_state_every`` steps is a cost of the trainer's: each chunk's timed
    steps must hold one, wherever the chunk starts (chunks of 5 with an untimed first step had
    the 51M model's snapshots all on untimed steps)."""
    from hybrid_trainer import HybridConfig

    assert overhead.PERIOD == HybridConfig().good_state_every
    workload = overhead.make_workload("tiny", 8, torch.device("cpu"))
    arm = overhead.LocalArm("predict=False", workload, torch.device("cpu"))
    saved_at, save = [], arm.trainer.guard.good_state.save

    def counting_save(*args, **kwargs):
        saved_at.append(len(arm.times))  # the index this step's time (None if untimed) is appended at
        return save(*args, **kwargs)

    arm.trainer.guard.good_state.save = counting_save
    arm.run(warmup, timed=False)
    saved_at.clear()
    for _ in range(4):
        arm.run(chunk, settle=settle)
    per_chunk = [0] * 4
    for i in saved_at:
        if arm.times[i] is not None:
            per_chunk[i // chunk] += 1
    assert per_chunk == [1, 1, 1, 1]


def test_a_chunk_needs_a_timed_step():
    workload = overhead.make_workload("tiny", 8, torch.device("cpu"))
    with pytest.raises(ValueError, match="settle"):
        overhead.time_interleaved(workload, torch.device("cpu"), 0, 4, 2, _NoProgress(), settle=2)


@pytest.mark.slow
def test_arms_in_processes_of_their_own_step_as_they_do_in_this_one():
    """A big model's arms each run in a process of their own (ProcessArm), stepped one chunk at
    a time: the same phases and counts as the same arms stepped here."""
    workload = overhead.make_workload("tiny", 8, torch.device("cpu"))
    arms = ["plain", "default"]
    # until_off_max=0: timed from the 4th step, prediction on (the phases below are what is compared)
    apart = overhead.time_interleaved(workload, torch.device("cpu"), 3, 40, 7, _NoProgress(), separate=True, arms=arms,
                                      until_off_max=0)
    here = overhead.time_interleaved(workload, torch.device("cpu"), 3, 40, 7, _NoProgress(), separate=False, arms=arms,
                                     until_off_max=0)
    assert list(apart) == arms
    for arm in arms:
        assert apart[arm]["steps"] == here[arm]["steps"] == 42  # 6 rounds of 7
        assert apart[arm]["phases"] == here[arm]["phases"]
        assert apart[arm]["chunk_median_us"] > 0
    assert apart["default"]["phases"] == {"WARMUP": 17, "FULL": 25}  # 3 untimed warm-up steps first
    assert apart["default"]["prediction_enabled_at_end"] == here["default"]["prediction_enabled_at_end"]


@pytest.mark.slow
def test_an_arm_process_that_fails_raises_its_error_here():
    workload = overhead.make_workload("tiny", 8, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="(?s)the process of arm .no such arm. failed:.*KeyError"):
        overhead.ProcessArm("no such arm", workload, torch.device("cpu"))


def test_the_first_steps_of_each_chunk_can_run_untimed_in_both_arms_alike():
    """``settle``: a big model's arms pay for the switch of arms on their first step of a chunk;
    those steps run (the trainer's phases advance) but are left out of every time figure."""
    workload = overhead.make_workload("tiny", 8, torch.device("cpu"))
    out = overhead.time_interleaved(workload, torch.device("cpu"), 2, 12, 4, _NoProgress(), arms=["plain", "default"],
                                    settle=1, until_off_max=0)
    for arm in ("plain", "default"):
        assert out[arm]["steps"] == 12 and out[arm]["settle"] == 1  # 4 rounds of 3 timed steps
    # 2 warm-up steps and 4 untimed first steps ran as well: 18 steps in all, WARMUP's 20 not over.
    assert out["default"]["phases"] == {"WARMUP": 12}
    e = overhead.exploration(workload, torch.device("cpu"), max_steps=400, chunk=5, progress=_NoProgress(), settle=2)
    assert e["switched_off"] and e["timed_steps"] == sum(e["timed_phases"].values())
    # Each 5-step chunk's first 2 steps untimed: 3 of every 5 steps with prediction on are timed.
    assert e["timed_steps"] == 3 * (e["steps_on"] // 5) + max(0, e["steps_on"] % 5 - 2)
    assert sum(e["default_mean_us_by_phase"][p] * n for p, n in e["timed_phases"].items()) == pytest.approx(
        1e6 * e["default_s"])
    assert e["plain_mean_us"] == pytest.approx(1e6 * e["plain_s"] / e["timed_steps"])
    assert "over the timed ones" in "\n".join(overhead.exploration_lines({"models": {"tiny": {"exploration": e}}}))


def test_the_guards_refusals_while_timed_are_counted_per_arm():
    """A step the guard refuses (here a NaN loss every 4th call from step 30 on) is in the arm's
    time; the report says how many were refused while timed, not during the warm-up."""
    workload = overhead.make_workload("tiny", 8, torch.device("cpu"))
    calls = {"n": 0}
    loss_fn = workload.loss_fn

    def sometimes_nan(model, batch):
        calls["n"] += 1
        loss = loss_fn(model, batch)
        return loss * float("nan") if calls["n"] > 60 and calls["n"] % 4 == 0 else loss

    workload.loss_fn = sometimes_nan
    out = overhead.time_interleaved(workload, torch.device("cpu"), 20, 24, 6, _NoProgress(),
                                    arms=["plain", "predict=False"])
    assert out["plain"]["refusals"] == {"skipped_steps": 0, "divergence_rollbacks": 0}
    refused = out["predict=False"]["refusals"]
    assert 0 < refused["skipped_steps"] <= 24 and refused["divergence_rollbacks"] == 0  # NaN: refused, no rollback


def test_in_pairs_each_arm_is_timed_beside_the_plain_loop_alone(monkeypatch):
    """``in_pairs`` (the 51M model's arms): one plain loop throughout, each other arm built,
    timed beside it alone and closed before the next, and kept with the plain loop's chunk
    means of its own rounds. Seven arms interleaved made each idle six chunks (~150 s there)
    between two of its own, which had the kernel page out its snapshot's file cache."""
    workload = overhead.make_workload("tiny", 8, torch.device("cpu"))
    log, open_arms = [], set()
    make_arms = overhead.make_arms

    def logging_arms(names, *args, **kwargs):
        arms = make_arms(names, *args, **kwargs)
        for name, arm in arms.items():
            open_arms.add(name)
            run, close = arm.run, getattr(arm, "close", lambda: None)

            def logged_run(steps, timed=True, settle=0, _name=name, _run=run):
                if timed:
                    log.append((_name, frozenset(open_arms)))
                return _run(steps, timed=timed, settle=settle)

            def logged_close(_name=name, _close=close):
                open_arms.discard(_name)
                return _close()
            arm.run, arm.close = logged_run, logged_close
        return arms

    monkeypatch.setattr(overhead, "make_arms", logging_arms)
    names = ["plain", "predict=False", overhead.GUARD_FLOOR]
    out = overhead.time_interleaved(workload, torch.device("cpu"), 3, 12, 4, _NoProgress(), arms=names,
                                    settle=1, until_off_max=0, in_pairs=True)
    assert list(out) == names
    # 4 rounds of 3 timed steps per pair: the floor's chunks come only after predict=False is closed.
    assert [n for n, _ in log] == ["plain", "predict=False", "predict=False", "plain"] * 2 + \
        ["plain", overhead.GUARD_FLOOR, overhead.GUARD_FLOOR, "plain"] * 2
    assert all(len(alive) == 2 and "plain" in alive for _, alive in log)
    assert out["plain"]["steps"] == 2 * 12 and out["plain"]["in_pairs"]
    plain_means = out["plain"]["chunk_means_us"]
    assert out["predict=False"]["plain_chunk_means_us"] == plain_means[:4]
    assert out[overhead.GUARD_FLOOR]["plain_chunk_means_us"] == plain_means[4:]
    for arm in names[1:]:
        assert out[arm]["steps"] == 12 and len(out[arm]["chunk_means_us"]) == 4
    assert "prediction_enabled_at_end" in out["predict=False"] and "prediction_enabled_at_end" not in out["plain"]
    with pytest.raises(ValueError, match="in_pairs"):
        overhead.time_interleaved(workload, torch.device("cpu"), 0, 4, 4, _NoProgress(), arms=["default"],
                                  in_pairs=True)


def test_an_arm_timed_in_a_pair_is_taken_against_the_plain_loop_of_its_own_rounds():
    plain = {"chunk_means_us": [100.0] * 6 + [200.0] * 6, "median_us": 150.0}
    # Timed beside the plain loop's first 6 chunks (100 µs): +10 µs; the second arm beside its last 6: +30 µs.
    first = {"chunk_means_us": [110.0] * 6, "plain_chunk_means_us": [100.0] * 6}
    second = {"chunk_means_us": [230.0] * 6, "plain_chunk_means_us": [200.0] * 6}
    assert overhead.paired_overhead(plain, first)["median_us"] == pytest.approx(10.0)
    assert overhead.paired_overhead(plain, second)["median_us"] == pytest.approx(30.0)
    # One paired arm over another: each over its own rounds' plain loop, then the difference.
    assert overhead.paired_overhead(first, second)["median_us"] == pytest.approx(20.0)
    results = {"models": {"mlp-50m": {"arms": {"plain": {"time": {"chunk": 51, "settle": 1, "in_pairs": True}}}},
                          "tiny": {"arms": {"plain": {"time": {"chunk": 50}}}}}}
    assert "mlp-50m: each arm timed beside the plain loop alone" in overhead._pairs_said(results)
    assert overhead._pairs_said({"models": {"tiny": results["models"]["tiny"]}}) == ""


class _Built(Exception):
    pass


def test_a_model_with_a_batch_count_of_its_own_gets_it_unless_batches_is_given(monkeypatch, tmp_path):
    """Fashion-MNIST is timed on one epoch of distinct batches (its 64 cycled ones drew the
    guard's refusals); ``--batches`` still decides for every model."""
    built = []

    def recording_workload(name, n_batches, device):
        built.append((name, n_batches))
        raise _Built

    monkeypatch.setattr(overhead, "make_workload", recording_workload)
    for argv in (["--models", "fashion"], ["--models", "fashion", "--batches", "32"], ["--models", "tiny"]):
        with pytest.raises(_Built):
            overhead.main([*argv, "--out", str(tmp_path)])
    assert built == [("fashion", overhead.MODEL_BATCHES["fashion"]), ("fashion", 32), ("tiny", 64)]
    assert overhead.MODEL_BATCHES["fashion"] == 60_000 // 128  # one epoch of the training set, batches of 128


def test_machine_speed_reads_a_slower_python_loop_as_slower_and_the_report_says_it(monkeypatch):
    from bench import protocol

    real = protocol.machine_speed(read_mb=8, repeats=3)
    assert real["python_ns"] > 0 and real["read_gb_s"] > 0 and real["cpu"]

    # Clocks that advance a fixed step per reading, so the figures follow from the step alone: two
    # real timings compared under pytest-xdist's load once read a 3x slower clock as only 1.7x
    # slower. One loop of 200,000 iterations and one read of 8 MiB each lie between two readings.
    def stepping_clocks(loop_ns, read_s):
        ns, s = iter(range(0, 10**15, loop_ns)), iter(x * read_s for x in range(10**6))
        monkeypatch.setattr(protocol.time, "perf_counter_ns", lambda: next(ns))
        monkeypatch.setattr(protocol.time, "perf_counter", lambda: next(s))
        return protocol.machine_speed(read_mb=8, repeats=3)

    fast = stepping_clocks(loop_ns=200_000 * 50, read_s=0.001)
    assert fast["python_ns"] == 50.0 and fast["read_gb_s"] == round(8 * 2**20 / 0.001 / 1e9, 2)
    slow = stepping_clocks(loop_ns=200_000 * 150, read_s=0.002)
    assert slow["python_ns"] == 150.0 and slow["read_gb_s"] == round(8 * 2**20 / 0.002 / 1e9, 2)
    assert overhead._machine_said(None) == ""
    said = overhead._machine_said(fast)
    assert f"{fast['cores']} cores" in said and f"{fast['python_ns']:.0f} ns" in said and "after" not in said
    slow = dict(fast, python_ns=3 * fast["python_ns"], read_gb_s=fast["read_gb_s"] / 2)
    said = overhead._machine_said(fast, slow)
    assert f"{fast['python_ns']:.0f} ns ({slow['python_ns']:.0f} ns after the timing)" in said
    assert f"{fast['read_gb_s']:.1f} GB/s ({slow['read_gb_s']:.1f} after)" in said


def test_slices_interleave_the_arms_chunks_across_the_round_and_keep_each_chunk_one_period():
    log = []

    class Runner:
        def __init__(self, name):
            self.name, self.steps = name, 0

        def run(self, steps, settle=0):
            log.append((self.name, steps))
            self.steps += steps

    class Bar:
        rounds = 0

        def update(self, n):
            self.rounds += n

    runners, bar = {n: Runner(n) for n in ("plain", "a", "b")}, Bar()
    overhead._interleave(runners, 2, 50, 0, bar, slices=5)
    assert bar.rounds == 2 and all(r.steps == 100 for r in runners.values())
    assert all(steps == 10 for _, steps in log) and len(log) == 2 * 5 * 3
    # Every slice steps each arm once, the order rotated slice by slice: within a round each arm's
    # 50 steps are spread over the whole round instead of one third of it.
    slices = [[name for name, _ in log[i:i + 3]] for i in range(0, len(log), 3)]
    assert all(sorted(s) == ["a", "b", "plain"] for s in slices)
    assert slices[0] != slices[1] and {s[0] for s in slices[:3]} == {"plain", "a", "b"}
    # Without slices: one chunk per arm per round, as before.
    log.clear()
    overhead._interleave(runners, 1, 50, 0, bar)
    assert log == [("plain", 50), ("a", 50), ("b", 50)]
    with pytest.raises(ValueError, match="slices"):
        overhead._interleave(runners, 1, 50, 0, bar, slices=3)  # not a divisor of the chunk
    with pytest.raises(ValueError, match="slices"):
        overhead._interleave(runners, 1, 51, 1, bar, slices=3)  # not a divisor of the 50 timed steps
    # With an untimed first step per chunk (models above IN_PROCESS_PARAMS, stepped in processes of
    # their own), each slice has one of its own: the switch of arms is paid on every turn.
    log.clear()
    overhead._interleave(runners, 1, overhead.BIG_CHUNK, overhead.BIG_SETTLE, bar, slices=5)
    turn = overhead.BIG_SETTLE + overhead.PERIOD // 5
    assert log == [(name, turn) for s in range(5) for name in (["plain", "a", "b"] * 2)[s % 3:s % 3 + 3]]


def test_a_chunk_run_in_slices_still_times_one_snapshot_per_period_and_the_report_says_so():
    workload = overhead.make_workload("tiny", 8, torch.device("cpu"))
    arm = overhead.LocalArm("predict=False", workload, torch.device("cpu"))
    saved_at, save = [], arm.trainer.guard.good_state.save

    def counting_save(*args, **kwargs):
        saved_at.append(len(arm.times))
        return save(*args, **kwargs)

    arm.trainer.guard.good_state.save = counting_save
    arm.run(7, timed=False)
    saved_at.clear()
    for _ in range(4 * 5):  # four chunks of a period, each in five slices (another arm would step in between)
        arm.run(overhead.PERIOD // 5)
    per_chunk = [0] * 4
    for i in saved_at:
        per_chunk[i // overhead.PERIOD] += 1
    assert per_chunk == [1, 1, 1, 1]
    summary = overhead._time_summary(arm.times, arm.phases, overhead.PERIOD)
    assert len(summary["chunk_means_us"]) == 4
    said = overhead._chunks_said({"models": {"tiny": {"arms": {"plain": {"time": {"chunk": 50, "slices": 5}}}}}})
    assert said == "50 timed steps in 5 slices between the other arms' (--slices)"
    said = overhead._chunks_said({"models": {"mlp-50m": {"arms": {"plain": {"time": {"chunk": 51, "settle": 1,
                                                                                        "slices": 5}}}}}})
    assert said == "50 timed steps in 5 slices between the other arms' (--slices), each after 1 untimed"


def test_a_big_model_gets_a_batch_for_every_step_an_arm_takes():
    """No arm of a model above IN_PROCESS_PARAMS sees a batch twice: 32 rounds in 5 slices cycled
    1,024 batches and drew the guard's refusals."""
    chunk, settle = overhead.BIG_CHUNK, overhead.BIG_SETTLE
    assert overhead.big_batches(20, 400, 1600, chunk, settle, 5) == 20 + 400 + 32 * (50 + 5)
    assert overhead.big_batches(20, 400, 1600, chunk, settle, 1) == 20 + 400 + 32 * 51
    assert overhead.big_batches(20, 400, 100, chunk, settle, 1) == overhead.BIG_BATCHES  # never fewer than before
    workload = overhead.make_workload("tiny", 8, torch.device("cpu"))
    arm = overhead.LocalArm("plain", workload, torch.device("cpu"))
    overhead._interleave({"plain": arm}, 2, 11, 1, _NoProgress(), slices=2)  # 2 rounds of 2 slices of 1 + 5
    assert arm.position == 2 * (10 + 1 * 2)  # what big_batches counts per round: timed + settle * slices


def test_slices_with_untimed_steps_time_each_slices_steps_after_its_own_untimed_one():
    """A model stepped in processes of its own: ``_timed_chunk``'s settle runs once per slice, so
    the timed steps per round are still the chunk's, and each round is one chunk mean."""
    workload = overhead.make_workload("tiny", 8, torch.device("cpu"))
    arm = overhead.LocalArm("predict=False", workload, torch.device("cpu"))
    overhead._interleave({"predict=False": arm}, 2, 11, 1, _NoProgress(), slices=2)
    assert arm.times[0] is None and arm.times[6] is None and arm.times[12] is None and len(arm.times) == 24
    assert sum(t is None for t in arm.times) == 4
    summary = overhead._time_summary(arm.times, arm.phases, 11, 1)
    assert summary["steps"] == 20 and len(summary["chunk_means_us"]) == 2


def test_slices_must_divide_the_chunk():
    with pytest.raises(SystemExit):
        overhead.main(["--quick", "--models", "tiny", "--chunk", "10", "--slices", "3"])


def _run_summary(means: list[float], steps_per_chunk: int = 5, refused: int = 0) -> dict:
    """One arm's time summary from one timing run, as time_interleaved gives it."""
    ordered = sorted(means)
    return dict(steps=steps_per_chunk * len(means), chunk=steps_per_chunk, settle=0, chunk_means_us=list(means),
                chunk_median_us=ordered[len(ordered) // 2], median_us=ordered[len(ordered) // 2],
                mean_us=sum(means) / len(means), real_steps=steps_per_chunk * len(means),
                real_median_us=ordered[len(ordered) // 2], phases={"FULL": steps_per_chunk * len(means)},
                refusals={"skipped_steps": refused, "divergence_rollbacks": 0}, warmup_steps=3, slices=1)


def test_runs_in_fresh_processes_give_the_median_of_their_overheads_and_an_interval_over_runs():
    """Each run's overhead is taken within its run; the figure is their median and its interval
    spans the runs, however tight each run's rounds are (a process's own error is redrawn per run)."""
    offsets = [20.0, 60.0, 25.0, 58.0, 30.0, 55.0]  # six runs, each steady to within ±1 µs
    runs = []
    for r, offset in enumerate(offsets):
        plain = [1000.0 + 100 * r + 10 * (i % 3) for i in range(12)]
        runs.append({"plain": _run_summary(plain),
                     "predict=False": _run_summary([x + offset + (i % 3) - 1 for i, x in enumerate(plain)], refused=r),
                     overhead.PLAIN_AGAIN: _run_summary([x + (i % 2) for i, x in enumerate(plain)])})
    pooled = overhead.pool_runs(runs)
    arm, plain = pooled["predict=False"], pooled["plain"]
    assert len(arm["runs"]) == 6 and arm["steps"] == 6 * 60 and arm["chunk_means_us"][:12] == runs[0]["predict=False"]["chunk_means_us"]
    assert arm["refusals"] == {"skipped_steps": 15, "divergence_rollbacks": 0} and arm["phases"] == {"FULL": 360}
    c = overhead.compare({"time": plain}, {"time": arm})
    assert c["overhead_runs"] == 6 and c["overhead_run_medians_us"] == pytest.approx(offsets)
    assert c["overhead_us"] == pytest.approx(42.5)  # the median of the six runs' overheads
    assert c["overhead_ci95_us"] == pytest.approx([20.0, 60.0])  # over runs: the least and greatest of six
    # Pairing the runs' rounds end to end would have hidden the spread between them: about [+30, +55].
    low, high = overhead.paired_overhead({"chunk_means_us": plain["chunk_means_us"]},
                                         {"chunk_means_us": arm["chunk_means_us"]})["ci95_us"]
    assert 21.0 < low and high < 59.0
    arms = {"plain": {"time": plain}, "predict=False": {"time": arm, "vs_plain": c},
            overhead.PLAIN_AGAIN: {"time": pooled[overhead.PLAIN_AGAIN]}}
    line = overhead.goal_lines({"models": {"m": {"arms": arms}}})[-1]
    assert "goal ≤ 50 µs: not resolved" in line
    assert "run by run +20, +60, +25, +58, +30, +55 µs (noise floor +0, +0, +0, +0, +0, +0)" in line
    results = {"models": {"m": {"arms": arms, "run": {"run_machines": [
        dict(python_ns=40.0 + r, read_gb_s=10.0 + r / 10) for r in range(6)]}}}}
    assert "(--runs; m: 6 runs, a Python loop step 40–45 ns and one thread's read 10.0–10.5 GB/s" in overhead._runs_said(results)
    assert overhead._runs_said({"models": {"m": {"arms": {"plain": {"time": runs[0]["plain"]}}}}}) == ""


def test_an_arm_kept_from_a_run_in_several_processes_is_taken_run_by_run_against_its_own_plain_loops():
    old_runs = []
    for r, offset in enumerate([10.0, 30.0, 20.0]):
        plain = [1000.0 + 200 * r + 5 * i for i in range(6)]
        old_runs.append({"plain": _run_summary(plain), "default": _run_summary([x + offset for x in plain])})
    old_pooled = overhead.pool_runs(old_runs)
    old = {"arms": {name: {"time": t} for name, t in old_pooled.items()}, "run": {"command": "old"}}
    # This run: one process, a plain loop far slower than the old ones (another host, say).
    entry = {"arms": {"plain": {"time": _run_summary([5000.0] * 6)}}}
    overhead.keep_untimed_arms(old, entry, ["predict=False"])
    kept = entry["arms"]["default"]["time"]
    assert all("plain_chunk_means_us" in run for run in kept["runs"]) and kept["time_run"] == {"command": "old"}
    c = overhead.compare(entry["arms"]["plain"], entry["arms"]["default"])
    assert c["overhead_run_medians_us"] == pytest.approx([10.0, 30.0, 20.0]) and c["overhead_us"] == pytest.approx(20.0)
    # Beside an arm of one process with a plain loop of its own, run-by-run pairing has no meaning: none.
    assert overhead.paired_overhead({"chunk_means_us": [1.0] * 6, "plain_chunk_means_us": [1.0] * 6}, kept) is None


def test_runs_time_each_in_a_fresh_process_and_the_report_pools_them(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(overhead, "run_memory_child", memory_stand_in(calls))
    common = ["--quick", "--models", "tiny", "--warmup", "3", "--steps", "10", "--chunk", "5", "--memory-steps", "25",
              "--explore-steps", "0", "--breakdown-steps", "0", "--out", str(tmp_path), "--runs", "2"]
    assert overhead.main(common) == 0
    entry = json.loads((tmp_path / "overhead_quick.json").read_text())["models"]["tiny"]
    assert len(entry["run"]["run_machines"]) == 2 and entry["run"]["run_machines"][0]["python_ns"] > 0
    plain, arm = entry["arms"]["plain"]["time"], entry["arms"]["predict=False"]["time"]
    assert [r["steps"] for r in arm["runs"]] == [10, 10] and arm["steps"] == 20
    per_run = [sum(x - y for x, y in zip(a["chunk_means_us"], p["chunk_means_us"])) / 2
               for a, p in zip(arm["runs"], plain["runs"])]
    c = entry["arms"]["predict=False"]["vs_plain"]
    assert c["overhead_run_medians_us"] == pytest.approx(per_run) and c["overhead_ci95_us"] is None  # 2 runs: no interval
    assert c["overhead_us"] == pytest.approx(sum(per_run) / 2)
    assert "tiny: 2 runs, a Python loop step" in (tmp_path / "overhead_quick.md").read_text()
    # --arms with --runs: the re-timed arm per run; the kept ones still against their own runs' plain loops.
    before = entry["arms"]["default"]["vs_plain"]["overhead_us"]
    assert overhead.main([*common, "--arms", "predict=False"]) == 0
    after = json.loads((tmp_path / "overhead_quick.json").read_text())["models"]["tiny"]["arms"]
    assert after["default"]["vs_plain"]["overhead_us"] == pytest.approx(before)
    assert all("plain_chunk_means_us" in r for r in after["predict=False"]["time"]["runs"])
    with pytest.raises(SystemExit):
        overhead.main([*common[:-1], "0"])  # --runs 0


def test_a_timing_run_that_fails_in_its_process_raises_its_error_here():
    from tqdm import tqdm

    workload = overhead.make_workload("tiny", 2, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="timing run 1 of 1 \\(tiny\\) failed"):
        overhead.time_in_fresh_processes(workload, torch.device("cpu"), 1, tqdm(disable=True), warmup=1, steps=5,
                                         chunk=5, arms=["plain", "no such arm"])


def test_a_small_model_s_chunks_begin_with_untimed_steps_unless_the_chunk_is_given(monkeypatch, tmp_path):
    """An arm's first steps after another arm's pay for the switch: in one process the default
    chunk is SMALL_SETTLE untimed steps and one timed good-state period, in every arm alike."""
    seen = []

    def recording_timing(workload, device, progress=None, **options):
        seen.append((options["chunk"], options["settle"], options["slices"]))
        raise _Built

    monkeypatch.setattr(overhead, "time_interleaved", recording_timing)
    for argv in ([], ["--chunk", "10"], ["--slices", "5"]):
        with pytest.raises(_Built):
            overhead.main(["--models", "tiny", "--steps", "10", "--out", str(tmp_path), *argv])
    assert seen == [(overhead.SMALL_SETTLE + overhead.PERIOD, overhead.SMALL_SETTLE, 1), (10, 0, 1),
                    (overhead.SMALL_SETTLE + overhead.PERIOD, overhead.SMALL_SETTLE, 5)]
    assert overhead.SMALL_SETTLE > 0


def test_the_report_says_why_first_steps_went_untimed_only_where_some_did():
    unsettled = {"models": {"tiny": {"arms": {"plain": {"time": {"chunk": 10, "settle": 0}}}}}}
    assert overhead._settle_said(unsettled) == ""
    settled = {"models": {"tiny": {"arms": {"plain": {"time": {"chunk": 55, "settle": overhead.SMALL_SETTLE}}}}}}
    assert "untimed in every arm alike, as they pay for the switch of arms" in overhead._settle_said(settled)
    assert overhead._chunks_said(settled) == f"{overhead.SMALL_SETTLE} untimed + 50 timed steps"


def test_the_replayed_step_arm_is_the_trainer_with_cuda_graph_timed_only_when_asked(monkeypatch):
    # On a CPU there is no graph: the trainer says so once and steps as predict=False does.
    assert overhead.CUDA_GRAPH in overhead.OPT_IN and overhead.CUDA_GRAPH not in overhead.ARMS
    with pytest.warns(RuntimeWarning, match="cuda_graph.*not a CUDA device"):
        step, trainer, _ = overhead._arm_step(overhead.CUDA_GRAPH, overhead.make_workload("tiny", 2, torch.device("cpu")),
                                              torch.device("cpu"))
    assert trainer.config.cuda_graph and not trainer.config.predict and step == trainer.step


def test_arms_measures_the_memory_of_the_replayed_step_on_cuda_only_and_says_so():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert overhead.arms_to_measure(None, cpu) == list(overhead.ARMS)
    assert overhead.arms_to_measure(["predict=False", overhead.CUDA_GRAPH], cuda) == [overhead.CUDA_GRAPH]
    assert overhead.arms_to_measure(["predict=False", overhead.CUDA_GRAPH], cpu) == []  # steps as predict=False there
    assert overhead.arms_to_measure(["predict=False", overhead.PLAIN_AGAIN], cuda) == []
    run = dict(command="python -m bench.overhead --memory", date="2026-11-28", git=dict(commit="abc"))
    arms = {"plain": dict(time=dict(steps=10)), overhead.CUDA_GRAPH: dict(time=dict(steps=10))}
    said = overhead._kept_said(dict(models=dict(fashion=dict(arms=arms, memory_run=run,
                                                             memory_of_this_run=[overhead.CUDA_GRAPH]))))
    assert said[0].startswith(f"fashion: this run timed plain, {overhead.CUDA_GRAPH} and measured the memory of "
                              f"{overhead.CUDA_GRAPH}; other memory figures, breakdown and exploration from "
                              "`python -m bench.overhead --memory`")


def test_device_memory_is_split_into_graph_pools_and_the_default_pool_by_stream():
    snapshot = dict(segments=[
        dict(allocated_size=100, segment_pool_id=(0, 0), stream=0),
        dict(allocated_size=30, segment_pool_id=(0, 0), stream=0),
        dict(allocated_size=64, segment_pool_id=(0, 0), stream=7),  # a side stream's (its cuBLAS workspace)
        dict(allocated_size=50, segment_pool_id=(1, 0), stream=7),  # a graph's private pool
        dict(allocated_size=5, segment_pool_id=(0, 2), stream=7),
    ])
    assert overhead.allocated_by_pool(snapshot) == dict(graph_pools=55, by_stream={"0": 130, "7": 64})
    assert overhead.allocated_by_pool({}) == dict(graph_pools=0, by_stream={})

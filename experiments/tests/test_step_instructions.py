import pytest

from experiments import step_instructions


def test_a_dump_gives_its_summary_count_and_a_dump_without_one_is_refused():
    dump = "version: 1\ncreator: callgrind-3.19.0\nevents: Ir\nsummary: 123456789\ntotals: 123456789\n"
    assert step_instructions.counted_instructions(dump) == 123456789
    with pytest.raises(ValueError, match="summary"):
        step_instructions.counted_instructions("events: Ir\ntotals: 5\n")


def test_the_counts_become_per_step_figures_in_the_arms_order(tmp_path, monkeypatch):
    # Stand in for valgrind: a child that writes one dump per arm, as --dump-before would.
    def fake_run(command, **kwargs):
        out = next(a for a in command if a.startswith("--callgrind-out-file=")).split("=", 1)[1]
        for i, total in enumerate((2000, 1000, 3000), 1):
            (tmp_path / f"{out.rsplit('/', 1)[1]}.{i}").write_text(f"events: Ir\nsummary: {total}\n")

        class Done:
            returncode, stderr = 0, ""
        return Done()

    monkeypatch.setattr(step_instructions.subprocess, "run", fake_run)
    arms = ["plain", "plain, no profiler scopes", "predict=False"]
    per_step = step_instructions.count("tiny", arms, 1, 10, "valgrind", tmp_path)
    assert per_step == {"plain": {"Ir": 200.0}, "plain, no profiler scopes": {"Ir": 100.0}, "predict=False": {"Ir": 300.0}}
    (tmp_path / "callgrind.out.4").write_text("events: Ir\nsummary: 1\n")  # an extra dump: something else called getpgrp
    with pytest.raises(RuntimeError, match="one callgrind dump per arm"):
        step_instructions.count("tiny", arms, 1, 10, "valgrind", tmp_path)


def test_the_report_gives_each_arm_over_the_plain_loop_and_over_the_lean_one():
    result = dict(model="tiny", warmup=1, steps=10,
                  per_step={"plain": 1000.0, "plain, no profiler scopes": 900.0, "predict=False": 1100.0})
    meta = dict(command="python -m experiments.step_instructions", date="d", git_commit="abc", git_dirty=False,
                torch="2")
    text = step_instructions.report(result, meta)
    assert "| predict=False | 1,100 | +100 | +200 |" in text
    assert "| plain, no profiler scopes | 900 | -100 | +0 |" in text


def test_the_step_counts_are_checked():
    with pytest.raises(SystemExit):
        step_instructions.main(["--steps", "0"])


def test_cache_events_are_read_by_name_and_give_valgrinds_cycle_estimate():
    dump = "events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw\nsummary: 1000 400 100 10 20 5 1 2 3\n"
    events = step_instructions.counted_events(dump)
    assert events == dict(Ir=1000, Dr=400, Dw=100, I1mr=10, D1mr=20, D1mw=5, ILmr=1, DLmr=2, DLmw=3)
    assert step_instructions.cycle_estimate(events) == 1000 + 10 * 35 + 100 * 6
    with pytest.raises(ValueError, match="events"):
        step_instructions.counted_events("summary: 5\n")


def test_the_report_with_the_cache_simulation_adds_misses_and_the_estimate_over_the_plain_loop():
    cache = dict(Ir=0, I1mr=1, D1mr=1, D1mw=0, ILmr=0, DLmr=0, DLmw=0)
    events = {"plain": dict(cache, Ir=1000.0), "predict=False": dict(cache, Ir=1100.0, DLmr=1)}
    result = dict(model="tiny", warmup=1, steps=10, per_step={arm: e["Ir"] for arm, e in events.items()},
                  events=events)
    meta = dict(command="c", date="d", git_commit="abc", git_dirty=False, torch="2")
    text = step_instructions.report(result, meta)
    assert "| predict=False | 1,100 | +100 | – | 2 | 1 | 1,220 | +200 |" in text
    assert "| plain | 1,000 | +0 | – | 2 | 0 | 1,020 | +0 |" in text


def test_as_on_gpu_the_child_gets_the_flag_and_fused_adamw_and_otherwise_neither(tmp_path, monkeypatch):
    from bench.overhead import FUSED_ENV

    seen = []

    def fake_run(command, env, **kwargs):
        seen.append((command, env))
        out = next(a for a in command if a.startswith("--callgrind-out-file=")).split("=", 1)[1]
        (tmp_path / f"{out.rsplit('/', 1)[1]}.1").write_text("events: Ir\nsummary: 10\n")

        class Done:
            returncode, stderr = 0, ""
        return Done()

    monkeypatch.setattr(step_instructions.subprocess, "run", fake_run)
    monkeypatch.setenv(FUSED_ENV, "1")  # left over in the caller's environment: not passed on unasked
    step_instructions.count("tiny", ["plain"], 1, 10, "valgrind", tmp_path)
    (tmp_path / "callgrind.out.1").unlink()
    step_instructions.count("tiny", ["plain"], 1, 10, "valgrind", tmp_path, as_on_gpu=True)
    (plain_command, plain_env), (gpu_command, gpu_env) = seen
    assert "--as-on-gpu" not in plain_command and FUSED_ENV not in plain_env
    assert gpu_command[-1] == "--as-on-gpu" and gpu_env[FUSED_ENV] == "1"


def test_as_on_gpu_the_trainer_defers_its_checks_with_fused_adamw_or_the_child_refuses(monkeypatch):
    import torch
    from bench.overhead import FUSED_ENV
    from hybrid_trainer import step_guard

    from hybrid_trainer import resume_check

    monkeypatch.setattr(step_guard, "reads_are_free", step_guard.reads_are_free)  # restored after the test
    monkeypatch.setattr(resume_check, "_multi_tensor_norm_pays", resume_check._multi_tensor_norm_pays)
    monkeypatch.setenv(FUSED_ENV, "1")
    built = []
    import bench.overhead

    real_arm_step = bench.overhead._arm_step

    def arm_step(*args, **kwargs):
        built.append(real_arm_step(*args, **kwargs))
        return built[-1]
    monkeypatch.setattr(bench.overhead, "_arm_step", arm_step)
    step_instructions.step_arms("tiny", ["predict=False"], warmup=3, steps=1, as_on_gpu=True)
    trainer = built[0][1]
    assert trainer.guard.defers() and trainer.guard.deferred.every == 16 and trainer.guard.deferred.pending
    assert all(group["fused"] for group in trainer.optimizer.param_groups)
    assert not step_guard.reads_are_free(torch.device("cpu"))
    assert resume_check._multi_tensor_norm_pays(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="does not defer"):  # no good state yet before the first step
        step_instructions.step_arms("tiny", ["predict=False"], warmup=0, steps=1, as_on_gpu=True)

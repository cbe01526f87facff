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
            (tmp_path / f"{out.rsplit('/', 1)[1]}.{i}").write_text(f"summary: {total}\n")

        class Done:
            returncode, stderr = 0, ""
        return Done()

    monkeypatch.setattr(step_instructions.subprocess, "run", fake_run)
    arms = ["plain", "plain, no profiler scopes", "predict=False"]
    per_step = step_instructions.count("tiny", arms, 1, 10, "valgrind", tmp_path)
    assert per_step == {"plain": 200.0, "plain, no profiler scopes": 100.0, "predict=False": 300.0}
    (tmp_path / "callgrind.out.4").write_text("summary: 1\n")  # an extra dump: something else called getpgrp
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

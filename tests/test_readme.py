"""The README and docs stay true: the quick start runs, the result tables match the result JSON,
every relative link resolves, and no text points outside the repository or at issue numbers."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import readme_tables

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "experiments" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _quick_start() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quick start"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_quick_start_runs(tmp_path):
    """The README's quick start, run as a user would paste it (its own process, a fresh directory):
    it trains, prints the summary and writes a checkpoint that loads."""
    code = _quick_start()
    assert 10 <= len(code.strip().splitlines()) <= 25  # a quick start, not a tutorial
    script = code + "\nassert sum(trainer.stats.steps_by_phase.values()) == 200\ntrainer.load('run.pt')\nprint('LOADED')\n"
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LOADED" in done.stdout and (tmp_path / "run.pt").stat().st_size > 0


def test_readme_tables_match_the_result_json():
    text = (ROOT / "README.md").read_text()
    assert {"status", "e2e", "overhead"} <= {m.group("name") for m in readme_tables.MARKER.finditer(text)}
    assert readme_tables.render(text) == text, "README tables are stale: run python -m bench.readme_tables"


def test_readme_tables_refuse_an_unknown_table():
    with pytest.raises(ValueError, match="nosuch"):
        readme_tables.render("<!-- table:nosuch -->\nold\n<!-- /table -->\n")


def test_status_table_rows_carry_a_figure_and_a_command_or_say_not_measured():
    rows = [line for line in readme_tables.status().splitlines()[2:]]
    assert len(rows) >= 5
    for row in rows:
        what, figure, command = [cell.strip() for cell in row.strip("|").split(" | ")]
        assert (re.search(r"\d\.\d\d", figure) and command.startswith("`python -m ")) or \
            (figure == readme_tables.NOT_MEASURED and command == "–"), row


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+://|#|mailto:", target):
            continue
        assert (doc.parent / target.split("#")[0]).exists(), f"{doc.relative_to(ROOT)}: broken link {target}"


def test_no_references_outside_the_repository_or_to_issue_numbers():
    """Docs and code speak for themselves: no ``../shared``-style paths, notes kept elsewhere or
    issue numbers (result files are left as they were written)."""
    files = [*DOCS, *ROOT.glob("bench/*.py"), *ROOT.glob("experiments/*.py"), *ROOT.glob("hybrid_trainer/*.py"),
             *ROOT.glob("hybrid_kernels/*.py"), *ROOT.glob("tests/*.py"), ROOT / "Makefile", ROOT / "pyproject.toml"]
    pattern = re.compile(r"\.\./shared|shared/(notes|design)|notes/\w+\.md|[Ii]ssue #?\d+|(?<![&\w])#\d{1,3}\b")
    hits = [f"{f.relative_to(ROOT)}:{n}: {line.strip()[:100]}" for f in files if f.name != "test_readme.py"
            for n, line in enumerate(f.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, "\n".join(hits)


def test_the_overhead_table_says_which_host_timed_each_model(tmp_path, monkeypatch):
    from bench import readme_tables

    data = json.loads((readme_tables.RESULTS / "overhead.json").read_text())
    for model in data["models"].values():
        model.pop("time_run", None)
        model["run"].pop("machine", None)
        model["run"].pop("machine_after_time", None)  # the committed runs may have measured it
    slow = dict(cpu="AMD EPYC", cores=2, python_ns=39.5, read_gb_s=11.8)
    (tmp_path / "overhead.json").write_text(json.dumps(data))
    monkeypatch.setattr(readme_tables, "RESULTS", tmp_path)
    host_row = "| the host's speed when timed (a Python loop step, one thread's memory read) | "
    assert host_row + "not recorded | not recorded | " in readme_tables.overhead()  # no run recorded its host
    data["models"]["tiny"]["run"]["machine"] = slow
    (tmp_path / "overhead.json").write_text(json.dumps(data))
    assert host_row + "40 ns, 11.8 GB/s | not recorded | " in readme_tables.overhead()
    # A run that measured the host again after its timing: both said, so a drift during it shows.
    data["models"]["tiny"]["run"]["machine_after_time"] = dict(slow, python_ns=64.2, read_gb_s=8.0)
    (tmp_path / "overhead.json").write_text(json.dumps(data))
    assert host_row + "40 ns, 11.8 GB/s (after the timing 64 ns, 8.0 GB/s) | not recorded | " in readme_tables.overhead()


def test_the_overhead_rows_name_every_run_their_figures_came_from_and_sign_each_figure(tmp_path, monkeypatch):
    """A model timed with ``--arms`` keeps its other arms' times and its memory figures from
    earlier runs: the overhead table's list of runs names the runs that timed the kept arms and
    the one that measured memory, the memory and exploration rows the run that measured memory;
    every figure in µs carries its own sign."""
    from bench import readme_tables

    data = json.loads((readme_tables.RESULTS / "overhead.json").read_text())
    fashion = data["models"]["fashion"]
    fashion["arms"]["default"]["time"]["time_run"] = dict(command="python -m bench.overhead --kept-arm-run")
    fashion["memory_run"] = dict(command="python -m bench.overhead --memory-run")
    fashion["arms"]["predict=False, read_every=16"]["vs_plain"]["overhead_us"] = -12.0
    (tmp_path / "overhead.json").write_text(json.dumps(data))
    monkeypatch.setattr(readme_tables, "RESULTS", tmp_path)
    rows = {what.split(" (")[0]: (figure, command) for what, figure, command in readme_tables._overhead_rows()}
    time_figure, time_command = rows["The trainer's cost per step next to the plain loop, prediction off"]
    assert time_command.startswith("`python -m bench.overhead`") and readme_tables.OVERHEAD_SECTION in time_command
    assert "--memory-run" in rows["Peak training memory next to the plain loop"][1]
    exploration = [c for what, (_, c) in rows.items() if what.startswith("The default config while")]
    assert exploration and "--memory-run" in exploration[0]
    assert "+-" not in time_figure
    table = readme_tables.overhead()
    fashion_runs = next(line for line in table.splitlines() if line.startswith("* Fashion-MNIST: "))
    assert "--kept-arm-run" in fashion_runs and "--memory-run" in fashion_runs
    assert "--kept-arm-run" not in table.replace(fashion_runs, "")
    every_16 = next(line for line in table.splitlines() if line.startswith("| reading the guard's values every 16"))
    assert "+-" not in table and " | -12 µs | " in every_16


def test_the_overhead_table_gives_the_noise_floor_of_a_model_that_timed_a_second_plain_loop(tmp_path, monkeypatch):
    """A second plain loop (``bench.overhead.PLAIN_AGAIN``) is the protocol's own error: the table
    gives its paired difference beside the verdicts, which take it off where it is not zero."""
    from bench import overhead, readme_tables

    data = json.loads((readme_tables.RESULTS / "overhead.json").read_text())
    for model in data["models"].values():
        model["arms"].pop(overhead.PLAIN_AGAIN, None)
    (tmp_path / "overhead.json").write_text(json.dumps(data))
    monkeypatch.setattr(readme_tables, "RESULTS", tmp_path)
    noise_row = "| two identical plain loops (the protocol's own error) [95% interval] | "
    assert noise_row + "– | – | – | – | – |" in readme_tables.overhead()
    tiny = data["models"]["tiny"]["arms"]
    plain_means = tiny["plain"]["time"]["chunk_means_us"]
    step = tiny["plain"]["time"]["chunk_median_us"]
    # 10% of the step faster in every round: an interval that excludes zero, taken off the
    # trainer's overhead before the verdict (10% of the tiny MLP's step is above its 50 µs goal).
    def faster(timed: dict) -> dict:  # run by run where the plain loop was timed in several processes
        out = dict(timed, chunk_means_us=[m - 0.10 * step for m in timed["chunk_means_us"]])
        if "runs" in timed:
            out["runs"] = [faster(run) for run in timed["runs"]]
        return out

    assert plain_means
    tiny[overhead.PLAIN_AGAIN] = {"time": faster(tiny["plain"]["time"])}
    (tmp_path / "overhead.json").write_text(json.dumps(data))
    assert noise_row + "-10.0% [-10.0, -10.0] | – | " in readme_tables.overhead()
    assert "here: NOT met / " in readme_tables._overhead_rows()[0][1]  # the tiny MLP's verdict, first of the models
    assert "| goal: verdict | ≤ 50 µs: NOT met | " in readme_tables.overhead()


def test_the_overhead_table_says_over_how_many_fresh_processes_a_figure_was_pooled(tmp_path, monkeypatch):
    from bench import readme_tables

    data = json.loads((readme_tables.RESULTS / "overhead.json").read_text())
    for model in data["models"].values():
        model["arms"]["predict=False"]["vs_plain"].pop("overhead_runs", None)
    (tmp_path / "overhead.json").write_text(json.dumps(data))
    monkeypatch.setattr(readme_tables, "RESULTS", tmp_path)
    timed_row = "| timed over | "
    assert timed_row + "one run | one run | one run | one run | one run |" in readme_tables.overhead()
    data["models"]["tiny"]["arms"]["predict=False"]["vs_plain"]["overhead_runs"] = 9
    data["models"]["mlp-1ms"]["arms"]["predict=False"]["vs_plain"]["overhead_runs"] = 6
    (tmp_path / "overhead.json").write_text(json.dumps(data))
    assert (timed_row + "the median of 9 runs, each in a fresh process | the median of 6 runs, each in a fresh "
            "process | one run | " in readme_tables.overhead())


def test_a_trainer_over_another_optimizer_is_said_faster_only_where_both_loops_were():
    """The status row over Muon or schedule-free AdamW calls the result a gain only where the
    trainer and the plain loop over that optimizer both beat tuned AdamW; slower both, a loss."""
    def data(trainer: float, plain: float) -> dict:
        def arm(mean: float) -> dict:
            return dict(summary=dict(speedup_vs_baseline=dict(mean=mean), reached_target=3), seeds=[{}] * 3)
        return dict(arms={"T": arm(trainer), "P": arm(plain)})

    assert readme_tables._over_optimizer(data(2.32, 2.37), "T", "P", "the plain loop") == \
        "**2.32×** sooner than tuned AdamW; the plain loop 2.37×: the gain is the optimizer's"
    assert readme_tables._over_optimizer(data(0.75, 0.81), "T", "P", "the plain loop") == \
        "**0.75×** tuned AdamW's speed to its target; the plain loop 0.81×: the loss is the optimizer's"
    assert "sooner" not in readme_tables._over_optimizer(data(0.95, 1.10), "T", "P", "the plain loop")


def test_the_prediction_off_row_takes_the_run_of_that_arm_alone_where_there_is_one(tmp_path, monkeypatch):
    """``bench.e2e --presets no-predict`` into its own folder measures the trainer's end-to-end
    cost on newer code than the full run's: the status row then quotes it, with its date, host
    and command; without it, the full run's arm."""
    full = {t: readme_tables._e2e(t) for t in readme_tables.TASKS}
    monkeypatch.setattr(readme_tables, "NO_PREDICT", tmp_path / "none")
    what, figure, command = readme_tables._no_predict_row(full, "`python -m bench.e2e`")
    assert command == "`python -m bench.e2e`" and "the full run's table below is older" not in figure
    arm = "HybridTrainer (no-predict)"
    for task, data in full.items():
        alone = json.loads(json.dumps(data))
        alone["arms"][arm]["summary"]["speedup_vs_baseline"]["mean"] = 1.234
        alone["meta"] = dict(data["meta"], command="python -m bench.e2e --presets no-predict --out x",
                             date="2031-01-02T03:04:05+00:00", device="Some CPU (AVX2), 2 cores")
        (tmp_path / f"e2e_{task}.json").write_text(json.dumps(alone))
    monkeypatch.setattr(readme_tables, "NO_PREDICT", tmp_path)
    what, figure, command = readme_tables._no_predict_row(full, "`python -m bench.e2e`")
    assert figure.startswith("speed-up 1.23× / 1.23× / 1.23× (1.00× would be free; 2031-01-02, commit ")
    assert "Some CPU (AVX2), 2 cores" in figure and command == "`python -m bench.e2e --presets no-predict --out x`"
    # Tasks run by two commands (one of them failed to find its data and was run again): both named.
    charlm = json.loads((tmp_path / "e2e_charlm.json").read_text())
    charlm["meta"]["command"] = "python -m bench.e2e --tasks charlm --presets no-predict --out x"
    (tmp_path / "e2e_charlm.json").write_text(json.dumps(charlm))
    assert readme_tables._no_predict_row(full, "`python -m bench.e2e`")[2] == (
        "`python -m bench.e2e --tasks charlm --presets no-predict --out x` `python -m bench.e2e --presets no-predict --out x`")
    # A full run made after it (here, one task's) takes the row back: its table is then as new.
    newer = {t: dict(d, meta=dict(d["meta"], date="2032-01-01T00:00:00+00:00")) if t == "digits" else d
             for t, d in full.items()}
    what, figure, command = readme_tables._no_predict_row(newer, "`python -m bench.e2e`")
    assert command == "`python -m bench.e2e`" and "1.23×" not in figure and "older" not in figure


def test_the_gpu_rows_name_every_run_and_give_the_replayed_step_where_it_was_timed(tmp_path, monkeypatch):
    """The GPU row of a file timed in several runs (one model a call, the replayed step with
    ``--arms``) names each run; the replayed step's figures come from its arm, and a file
    without that arm says nothing of it."""
    from bench.overhead import CUDA_GRAPH

    data = json.loads((readme_tables.RESULTS / "overhead_cuda_fused.json").read_text())
    for model, entry in data["models"].items():
        entry["memory_run"] = dict(command=f"python -m bench.overhead --memory-run-{model}")
        entry["arms"][CUDA_GRAPH] = dict(time=dict(chunk_median_us=100.0 + len(model)),
                                         vs_plain=dict(time_ratio=0.25, overhead_us=-900.0,
                                                       overhead_ci95_us=[-950.0, -850.0]))
    (tmp_path / "overhead_cuda_fused.json").write_text(json.dumps(data))
    monkeypatch.setattr(readme_tables, "RESULTS", tmp_path)
    (what, figure, commands), = readme_tables._gpu_overhead_rows()
    assert "H200" in what or "H100" in what
    assert "--memory-run-fashion" in commands and "--memory-run-charlm" in commands
    assert "`cuda_graph=True`, opt-in) 107 / 106 µs a step, 4.0 / 4.0× the plain loop's speed (met / met;" in figure
    for entry in data["models"].values():
        del entry["arms"][CUDA_GRAPH]
    (tmp_path / "overhead_cuda_fused.json").write_text(json.dumps(data))
    (_, figure, _), = readme_tables._gpu_overhead_rows()
    assert "cuda_graph" not in figure

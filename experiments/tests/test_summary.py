"""experiments.summary: reads each benchmark's results the way that benchmark writes them."""
import json
from pathlib import Path

import matplotlib.image
import pytest

from experiments import summary

ROOT = Path(__file__).resolve().parents[2]
RESULTS = [ROOT / "docs" / "results", ROOT / "experiments" / "results"]


def _write(folder: Path, name: str, data: dict) -> None:
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(data))


def _e2e_arm(lr, speedup, backward, reached):
    return dict(lr=lr, summary=dict(speedup_vs_baseline=dict(mean=speedup), reached_target=reached),
                seeds=[dict(seed=s, backward_to_target=b) for s, b in enumerate(backward)])


def _scheduled_arm(wall, steps, reached):
    return dict(speedup_vs_plain=dict(mean=wall), step_speedup_vs_plain=dict(mean=steps), reached_target=reached)


@pytest.fixture
def results(tmp_path):
    _write(tmp_path, "e2e_toy.json", dict(tuned_lr=0.001, meta=dict(command="python -m bench.e2e"), arms={
        "AdamW (tuned lr)": _e2e_arm(0.001, 1.0, [100, 120], 2),
        "AdamW + weight average": _e2e_arm(0.004, 1.9, [50, 40], 2),
        "AdamW (2x lr)": _e2e_arm(0.002, None, [None, None], 0)}))
    runs = {"plain": [{}, {}], "ema": [{}, {}]}
    _write(tmp_path, "scheduled_toy.json", dict(command="python -m experiments.scheduled", runs=runs, arms={
        "plain": _scheduled_arm(1.0, 1.0, 2), "ema": _scheduled_arm(0.9, 0.95, 2)}))
    _write(tmp_path, "scheduled_toy_drift.json", dict(command="python -m experiments.scheduled --tag drift", runs=runs, arms={
        "plain": _scheduled_arm(1.0, 1.0, 2), "ema": _scheduled_arm(5.0, 5.0, 2)}))
    _write(tmp_path, "nowcast_toy.json", dict(command="python -m experiments.nowcast evaluate", summary={
        "plain AdamW": dict(reached="2/2", time_to_target_s=10.0, step_speedup=1.0),
        "floor nowcast": dict(reached="2/2", time_to_target_s=8.0, step_speedup=1.1),
        "dmd nowcast": dict(reached="0/2", time_to_target_s=None, step_speedup=None)}))
    return tmp_path


def test_rows_are_each_runs_arms_against_its_own_plain_loop(results):
    rows = {r.approach: r for r in summary.collect(results, "toy")}
    assert set(rows) == {"[e2e] AdamW + weight average at 4x lr", "[e2e] AdamW (2x lr)", "[scheduled] ema",
                         "[verified jumps] floor nowcast", "[verified jumps] dmd nowcast"}
    average = rows["[e2e] AdamW + weight average at 4x lr"]
    assert average.wall_speedup == 1.9
    assert average.step_speedup == pytest.approx((100 / 50 + 120 / 40) / 2)  # per seed, then the mean
    assert (average.reached, average.seeds, average.source, average.command) == (
        2, 2, str(results / "e2e_toy.json"), "python -m bench.e2e")
    unreached = rows["[e2e] AdamW (2x lr)"]
    assert (unreached.wall_speedup, unreached.step_speedup, unreached.reached) == (None, None, 0)
    # The arm repeated in a tagged run is taken from the first file read.
    assert (rows["[scheduled] ema"].wall_speedup, rows["[scheduled] ema"].source) == (0.9, str(results / "scheduled_toy.json"))
    assert rows["[verified jumps] floor nowcast"].wall_speedup == pytest.approx(10.0 / 8.0)
    assert rows["[verified jumps] dmd nowcast"].wall_speedup is None


def test_main_writes_table_json_and_plot(results, capsys):
    assert summary.main(["--results", str(results), "--out", str(results), "--tasks", "toy"]) == 0
    table = (results / "summary.md").read_text()
    lines = [line for line in table.splitlines() if line.startswith("| [")]
    assert lines[0].startswith("| [e2e] AdamW + weight average at 4x lr | 1.90× | 2.50× | 2/2 |")  # best first
    assert lines[-1].startswith("| [verified jumps] dmd nowcast | – | – | 0/2 |")
    assert "best wall-clock speed-up reached in every seed: 1.90×" in table
    data = json.loads((results / "summary.json").read_text())
    assert len(data["tasks"]["toy"]) == 5 and data["goal_wall_speedup"] == summary.GOAL
    assert data["command"].startswith("python -m experiments.summary") and "git_commit" in data and "git_dirty" in data
    image = matplotlib.image.imread(results / "summary.png")  # 13 in wide at 110 dpi, a band per arm; not blank
    assert image.shape[1] == 13 * 110 and image.shape[0] >= 110 * (0.24 * 5 + 1.6)
    assert image[..., :3].std() > 0.05
    assert "[scheduled] ema" in capsys.readouterr().out


def test_bad_arguments_name_themselves(results, tmp_path, capsys):
    with pytest.raises(SystemExit):
        summary.main(["--results", str(tmp_path / "missing")])
    assert "--results" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        summary.main(["--results", str(results), "--tasks", "nosuchtask"])
    assert "--tasks" in capsys.readouterr().err


@pytest.mark.parametrize("task", ["charlm", "fashion"])
def test_committed_results_parse(task):
    """Every committed source file for the task is read (a changed schema fails here)."""
    present = [(folder / p.format(task=task), reader) for p, reader, _ in summary.SOURCES for folder in RESULTS
               if (folder / p.format(task=task)).exists()]
    assert len(present) >= 10
    for name, reader in present:
        rows = summary.READERS[reader](json.loads(name.read_text()))
        assert rows, name
        assert all(0 <= reached <= seeds for _, _, _, reached, seeds in rows), name
        assert all(wall is None or 0.1 < wall < 10 for _, wall, _, _, _ in rows), name
    assert summary.collect(RESULTS, task)

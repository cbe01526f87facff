"""Every approach measured against plain AdamW, on one page.

    python -m experiments.summary [--results docs/results experiments/results] [--out experiments/results]
                                  [--tasks charlm fashion]

Runs no training. It reads the committed results of the benchmarks that compare something with
the plain AdamW loop in the same interleaved run (``bench.e2e``, ``experiments.lr_control``,
``experiments.scheduled``, ``experiments.nowcast``, ``experiments.partial_backward``; the
end-to-end runs in ``docs/results``, the research runs in ``experiments/results``) and writes
``<out>/summary.{md,json,png}``: per task, each arm's speed-up to the target against that
run's own plain loop, in wall-clock and in real steps (backward passes), with how many seeds
reached the target. The figures are the files' own; each row names the file it came from, and
that file names the command that produced it.

Definitions follow the source: ``bench.e2e`` / ``experiments.lr_control`` / ``experiments.scheduled``
average per-seed ratios over the seeds that reached the target; ``experiments.nowcast`` reports the
ratio of the mean steps (and here of the mean times) to the target. An arm seen in several files
is listed once, from the first file read (the order of :data:`SOURCES`). The reference of each
row is the plain loop of its own file: at the tuned rate unless the row says otherwise (the
``[scheduled, 2x lr]`` rows compare with plain AdamW at twice the rate).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.protocol import run_metadata

GOAL = 2.0  # the project's goal: the target reached at least 2x sooner in wall-clock

# (file pattern with {task}, reader, row prefix naming the run). Order decides which copy of a repeated arm is kept.
SOURCES = (
    ("e2e_{task}.json", "e2e", "[e2e] "),
    ("forced/e2e_{task}.json", "e2e", "[e2e] "),
    ("muon_forced/e2e_{task}.json", "e2e", "[e2e] "),
    ("lr_control_{task}.json", "e2e", "[lr control] "),
    ("lr_control_{task}_cosine.json", "e2e", "[lr control] "),
    ("lr_control_{task}_clip.json", "e2e", "[lr control] "),
    ("scheduled_{task}.json", "scheduled", "[scheduled] "),
    ("scheduled_{task}_one_pass.json", "scheduled", "[scheduled] "),
    ("scheduled_{task}_tangential.json", "scheduled", "[scheduled] "),
    ("scheduled_{task}_drift.json", "scheduled", "[scheduled] "),
    ("scheduled_{task}_lr2x.json", "scheduled", "[scheduled, 2x lr] "),
    ("scheduled_{task}_steps1800.json", "scheduled", "[scheduled, 1800 steps] "),
    ("nowcast_{task}.json", "nowcast", "[verified jumps] "),
    ("nowcast_{task}_floor_reset.json", "nowcast", "[verified jumps] "),
    ("nowcast_{task}_secant.json", "nowcast", "[verified jumps] "),
    ("nowcast_{task}_dmd.json", "nowcast", "[verified jumps] "),
    ("partial_backward_{task}.json", "partial_backward", "[partial backward] "),
)
REFERENCE_ARMS = {"AdamW (tuned lr)", "plain", "plain AdamW"}


@dataclass
class Row:
    """One arm of one run against that run's plain loop."""

    approach: str
    wall_speedup: float | None  # plain's time to the target / the arm's (None: not reached or not measured)
    step_speedup: float | None  # the same in real steps (backward passes)
    reached: int  # seeds that reached the target
    seeds: int
    source: str  # the file read, as found under one of the results folders
    command: str


def _finite(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def _ratio(num, den) -> float | None:
    num, den = _finite(num), _finite(den)
    return num / den if num is not None and den else None


def _lr_note(name: str, lr: float | None, tuned: float | None) -> str:
    """' at 4x lr' when an arm runs at another rate than the tuned one and its name does not say."""
    if lr is None or not tuned or "lr" in name or math.isclose(lr, tuned):
        return ""
    return f" at {lr / tuned:g}x lr"


def read_e2e(data: dict) -> list[tuple[str, float | None, float | None, int, int]]:
    """``bench.e2e`` / ``experiments.lr_control`` results: arms against ``AdamW (tuned lr)``; steps
    per seed from ``backward_to_target``."""
    reference = {s["seed"]: s for s in data["arms"]["AdamW (tuned lr)"]["seeds"]}
    tuned = data.get("tuned_lr") or data["arms"]["AdamW (tuned lr)"]["lr"]
    rows = []
    for name, arm in data["arms"].items():
        seeds = arm["seeds"]
        step_ratios = [r for r in (_ratio(reference[s["seed"]]["backward_to_target"], s["backward_to_target"])
                                   for s in seeds) if r is not None]
        summary = arm["summary"]
        step = statistics.fmean(step_ratios) if step_ratios else None
        rows.append((name + _lr_note(name, arm.get("lr"), tuned), _finite(summary["speedup_vs_baseline"]["mean"]),
                     step, int(summary["reached_target"]), len(seeds)))
    return rows


def read_scheduled(data: dict) -> list[tuple[str, float | None, float | None, int, int]]:
    """``experiments.scheduled`` / ``experiments.partial_backward`` results: arms against ``plain``."""
    rows = []
    for name, arm in data["arms"].items():
        seeds = len(data["runs"][name])
        step = arm.get("step_speedup_vs_plain", {}).get("mean")  # partial_backward times only
        rows.append((name, _finite(arm["speedup_vs_plain"]["mean"]), _finite(step), int(arm["reached_target"]), seeds))
    return rows


def read_nowcast(data: dict) -> list[tuple[str, float | None, float | None, int, int]]:
    """``experiments.nowcast evaluate`` results: arms against ``plain AdamW``, ratios of means."""
    plain = data["summary"]["plain AdamW"]
    rows = []
    for name, arm in data["summary"].items():
        reached, seeds = (int(x) for x in arm["reached"].split("/"))
        wall = _ratio(plain["time_to_target_s"], arm["time_to_target_s"]) if reached else None
        rows.append((name, wall, _finite(arm["step_speedup"]) if reached else None, reached, seeds))
    return rows


READERS = {"e2e": read_e2e, "scheduled": read_scheduled, "partial_backward": read_scheduled,
           "nowcast": read_nowcast}


def _command(data: dict) -> str:
    return data.get("command") or data.get("meta", {}).get("command", "")


def collect(results: Path | list[Path], task: str) -> list[Row]:
    """Rows for ``task`` from every source file present under the ``results`` folders (a pattern is
    looked up in each folder in turn, the first copy found is read; missing files are skipped:
    not every benchmark ran on every task). A row's ``source`` is the file's path as found."""
    folders = [results] if isinstance(results, Path) else list(results)
    rows: list[Row] = []
    seen: set[str] = set()
    for pattern, reader, prefix in SOURCES:
        path = next((f / pattern.format(task=task) for f in folders if (f / pattern.format(task=task)).exists()), None)
        if path is None:
            continue
        data = json.loads(path.read_text())
        for name, wall, step, reached, seeds in READERS[reader](data):
            approach = prefix + name
            if name in REFERENCE_ARMS or approach in seen:
                continue
            seen.add(approach)
            rows.append(Row(approach, wall, step, reached, seeds, str(path), _command(data)))
    return rows


def _cell(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}×"


def markdown(by_task: dict[str, list[Row]]) -> str:
    lines = [
        "Every approach measured against plain AdamW in its own run, `python -m experiments.summary` "
        "(reads the results below; runs nothing). Speed-up = the plain loop's time (or real steps) "
        f"to the target over the arm's; the project's goal is {GOAL:g}× in wall-clock with the final "
        "loss within 1%. Rows sorted by wall-clock speed-up; a dash: not reached in any seed "
        "(nowcast steps: in every seed), or not measured (`experiments.partial_backward` reports wall-clock only). "
        "Nowcast rows are ratios of means, the others means of per-seed ratios. The reference of a "
        "`[scheduled, 2x lr]` row is plain AdamW at twice the tuned rate (its own run's plain arm); "
        "every other row's is plain AdamW at the tuned rate. Each file names its command.", "",
        "![speed-up of every arm against plain AdamW](summary.png)", ""]
    for task, rows in by_task.items():
        best = max((r.wall_speedup for r in rows if r.wall_speedup is not None and r.reached == r.seeds),
                   default=None)
        lines += [f"### {task}", "",
                  f"{len(rows)} arms; the best wall-clock speed-up reached in every seed: {_cell(best)}.", "",
                  "| approach | wall-clock | real steps | seeds reached | file |", "|---|---|---|---|---|"]
        for r in sorted(rows, key=_sort_key, reverse=True):
            lines.append(f"| {r.approach} | {_cell(r.wall_speedup)} | {_cell(r.step_speedup)} "
                         f"| {r.reached}/{r.seeds} | `{r.source}` |")
        lines.append("")
    return "\n".join(lines)


def _sort_key(row: Row) -> float:
    value = row.wall_speedup if row.wall_speedup is not None else row.step_speedup
    return -1.0 if value is None else value


def plot(by_task: dict[str, list[Row]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    heights = [max(len(rows), 1) for rows in by_task.values()]
    fig, axes = plt.subplots(len(by_task), 1, figsize=(13, 0.24 * sum(heights) + 1.6 * len(by_task)),
                             gridspec_kw=dict(height_ratios=heights), squeeze=False)
    left, right = 0.3, 3.0
    legend = [Line2D([], [], marker="o", ls="", color="tab:blue", label="wall-clock"),
              Line2D([], [], marker="s", ls="", color="tab:blue", mfc="none", label="real steps"),
              Line2D([], [], color="tab:green", ls="--", label=f"goal {GOAL:g}×")]
    for ax, (task, rows) in zip(axes[:, 0], by_task.items()):
        rows = sorted(rows, key=_sort_key)
        for y, r in enumerate(rows):
            partial = r.reached < r.seeds
            for value, marker in ((r.wall_speedup, "o"), (r.step_speedup, "s")):
                if value is None:
                    continue
                ax.plot(min(max(value, left), right), y, marker, ms=6 if marker == "o" else 5,
                        color="tab:red" if partial else "tab:blue", mfc="none" if marker == "s" else None)
            if r.reached == 0:
                ax.text(left * 1.03, y, "not reached", va="center", fontsize=7, color="tab:red")
            elif partial:
                ax.text(right * 0.97, y, f"{r.reached}/{r.seeds} seeds", va="center", ha="right", fontsize=7,
                        color="tab:red")
        ax.axvline(1.0, color="gray", lw=1)
        ax.axvline(GOAL, color="tab:green", lw=1.5, ls="--")
        ax.set_yticks(range(len(rows)), [r.approach for r in rows], fontsize=7)
        ax.set_xscale("log")
        ax.set_xlim(left, right)
        ax.set_xticks([0.5, 0.75, 1, 1.5, 2, 3], ["0.5×", "0.75×", "1×", "1.5×", "2×", "3×"])
        ax.minorticks_off()
        ax.set_ylim(-0.7, len(rows) - 0.3)
        ax.grid(axis="x", alpha=0.3)
        ax.set_title(f"{task}: speed-up to the target against plain AdamW in the same run "
                     "(red: not every seed reached it)", fontsize=9, loc="right")
        ax.legend(handles=legend, loc="lower right", fontsize=7)
    fig.subplots_adjust(left=0.4, right=0.98, top=0.98, bottom=0.03, hspace=0.08)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, nargs="+", default=[Path("docs/results"), Path("experiments/results")],
                        help="folders of the benchmarks' JSON results, searched in turn")
    parser.add_argument("--out", type=Path, default=Path("experiments/results"),
                        help="where summary.{md,json,png} are written")
    parser.add_argument("--tasks", nargs="+", default=["charlm", "fashion"])
    args = parser.parse_args(argv)
    missing = [str(f) for f in args.results if not f.is_dir()]
    if missing:
        parser.error(f"--results: {missing} not a folder")
    by_task = {task: collect(args.results, task) for task in args.tasks}
    empty = [t for t, rows in by_task.items() if not rows]
    if empty:
        parser.error(f"--tasks: no results for {empty} under {args.results}")
    args.out.mkdir(parents=True, exist_ok=True)
    meta = run_metadata("python -m experiments.summary " + " ".join(argv if argv is not None else sys.argv[1:]))
    (args.out / "summary.json").write_text(json.dumps(
        {**meta, "goal_wall_speedup": GOAL, "tasks": {t: [asdict(r) for r in rows] for t, rows in by_task.items()}},
        indent=1, ensure_ascii=False) + "\n")
    text = markdown(by_task)
    (args.out / "summary.md").write_text(text)
    plot(by_task, args.out / "summary.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

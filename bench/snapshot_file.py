"""What does a good-state snapshot to a file cost, by how long its file sat untouched before?

    python -m bench.snapshot_file [--model mlp-50m] [--idle 0 30 90] [--repeats 2]

On a CPU the trainer keeps its last good state (weights and AdamW's two moments) in an unlinked
temporary file (``good_state_storage="auto"`` resolves to ``"file"``, :mod:`hybrid_trainer.anchor`),
rewritten every ``good_state_every`` real steps. The rewrite lands in the kernel's page cache: cheap
while the file's pages are still cached, dearer when the kernel has dropped them and the write must
take fresh pages. This machine's kernel runs a DAMON scheme that pages out file cache untouched for
a while (its parameters are recorded), so how long the file sat idle sets the cost. This bench
builds the model and optimizer of ``bench.overhead``'s ``--model``, takes one AdamW step (so the
moments exist), saves the good state once (the file's first write), then, ``--repeats`` times over
each gap of ``--idle`` seconds, sleeps that long and times one more save through the trainer's
own store (:func:`hybrid_trainer.step_guard.make_good_state_store`): the thread's CPU time and the
wall time. Writes ``docs/results/snapshot_file.{json,md}``.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .protocol import run_metadata, write_results

ROOT = Path(__file__).resolve().parents[1]
DAMON = Path("/sys/kernel/mm/damon/admin/kdamonds")


def damon_schemes() -> list[dict[str, Any]]:
    """The DAMON schemes this machine's kernel runs (action, minimum age in seconds of the
    regions it acts on, the memory filters), read from sysfs; empty where there are none or
    they cannot be read."""
    schemes = []
    for scheme in sorted(DAMON.glob("*/contexts/*/schemes/[0-9]*")):
        try:
            context = scheme.parents[1]
            if (context.parents[1] / "state").read_text().strip() != "on":
                continue
            aggregation_us = int((context / "monitoring_attrs/intervals/aggr_us").read_text())
            age = int((scheme / "access_pattern/age/min").read_text())
            filters = []
            for f in sorted((scheme / "ops_filters").glob("[0-9]*")):
                filters.append(f"{'allow' if (f / 'allow').read_text().strip() == 'Y' else 'reject'} "
                               f"{(f / 'type').read_text().strip()}")
            schemes.append(dict(action=(scheme / "action").read_text().strip(),
                                min_age_s=age * aggregation_us / 1e6, filters=filters))
        except (OSError, ValueError):
            continue
    return schemes


def timed_save(store, step: int, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """One save of the good state: the thread's CPU time and the wall time, in ms."""
    cpu, wall = time.thread_time(), time.perf_counter()
    store.save(step, optimizer)
    return dict(cpu_ms=1e3 * (time.thread_time() - cpu), wall_ms=1e3 * (time.perf_counter() - wall))


def measure(model_name: str, idle_s: list[float], repeats: int, progress=print) -> dict[str, Any]:
    """Save times of the good state of ``model_name`` (``bench.overhead``'s models) after each
    idle gap, ``repeats`` rounds over ``idle_s``; the first save (into an empty file) apart."""
    from hybrid_trainer.step_guard import make_good_state_store

    from .overhead import make_workload

    workload = make_workload(model_name, 1, torch.device("cpu"))
    model = workload.make_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr)
    workload.loss_fn(model, workload.batches[0]).backward()
    optimizer.step()
    params = [p for p in model.parameters() if p.requires_grad]
    store = make_good_state_store(params, [], storage="file")
    state_bytes = sum(p.nbytes for p in params) + sum(
        v.nbytes for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    first = timed_save(store, 0, optimizer)
    saves: dict[str, list[dict[str, float]]] = {str(gap): [] for gap in idle_s}
    for r in range(repeats):
        for gap in idle_s:
            time.sleep(gap)
            saves[str(gap)].append(timed_save(store, r + 1, optimizer))
            last = saves[str(gap)][-1]
            progress(f"round {r + 1}/{repeats}, idle {gap:g} s: {last['cpu_ms']:.0f} ms CPU, {last['wall_ms']:.0f} ms wall")
    return dict(model=model_name, parameters=sum(p.numel() for p in params), state_bytes=state_bytes,
                first_save=first, saves=saves,
                median_cpu_ms={gap: statistics.median(s["cpu_ms"] for s in v) for gap, v in saves.items()},
                median_wall_ms={gap: statistics.median(s["wall_ms"] for s in v) for gap, v in saves.items()})


def markdown(results: dict[str, Any]) -> str:
    r = results["result"]
    schemes = results["damon_schemes"]
    said = ("; ".join(f"{s['action']} of regions untouched for {s['min_age_s']:g} s or more ({', '.join(s['filters'])})"
                      for s in schemes) or "none")
    lines = [f"Good-state snapshot to a file, `{results['command']}` ({results['date']}, commit "
             f"{(results['git_commit'] or '?')[:10]}{' + uncommitted changes' if results['git_dirty'] else ''}, "
             f"torch {results['torch']}, 1 thread).", "",
             f"Model: {r['model']} ({r['parameters'] / 1e6:.2f}M parameters); the snapshot (weights and AdamW's two "
             f"moments) is {r['state_bytes'] / 1e6:.0f} MB. This machine's DAMON schemes: {said}. First save "
             f"(into the empty file): {r['first_save']['cpu_ms']:.0f} ms CPU, {r['first_save']['wall_ms']:.0f} ms "
             "wall.", "",
             "| file idle before the save (s) | saves | CPU time (ms), median | wall time (ms), median | each save's CPU time (ms) |",
             "|---|---|---|---|---|"]
    for gap, saves in r["saves"].items():
        lines.append(f"| {float(gap):g} | {len(saves)} | {r['median_cpu_ms'][gap]:.0f} | {r['median_wall_ms'][gap]:.0f} | "
                     + ", ".join(f"{s['cpu_ms']:.0f}" for s in saves) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp-50m", help="one of bench.overhead's models")
    parser.add_argument("--idle", type=float, nargs="+", default=[0.0, 30.0, 90.0],
                        help="seconds the file sits untouched before each timed save")
    parser.add_argument("--repeats", type=int, default=2, help="rounds over the --idle gaps")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats: at least 1, got {args.repeats}")
    if any(gap < 0 for gap in args.idle):
        parser.error(f"--idle: seconds >= 0, got {args.idle}")
    torch.set_num_threads(1)
    command = "python -m bench.snapshot_file " + shlex.join(argv if argv is not None else sys.argv[1:])
    results = dict(run_metadata(command), damon_schemes=damon_schemes(),
                   result=measure(args.model, args.idle, args.repeats))
    write_results(args.out, "snapshot_file", results, markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What small host work costs right after a model's ops on a CPU, against the same work repeated
at once: why the trainer's guard read and its Python cost more inside a step than in a loop of
their own (docs/trainer.md, "The switch of arms, and runs in fresh processes").

    python -m experiments.after_backward [--models mlp-1ms fashion] [--steps 600]

Trains each ``bench.overhead`` model with the plain AdamW loop for ``--steps`` steps and times,
by ``time.perf_counter``, in turns of three steps: (1) a 50-int list comprehension, then two
scalar in-place adds, right after ``backward``; (2) a scalar add after the forward and after the
optimizer step; (3) the guard's read of the gradients (``squares_by_dots``: one dot per
gradient) right after ``backward``, and again at once. Then the same read alone, 500 times in a
loop. Medians in µs, the first 60 steps left out. → ``experiments/results/after_backward.{json,md}``.
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

from bench.overhead import make_workload
from bench.protocol import run_metadata, write_results
from hybrid_trainer.step_guard import squares_by_dots

RESULTS = Path(__file__).resolve().parent / "results"
SKIPPED_STEPS = 60  # the allocator and caches settle over the first steps
LOOP_REPEATS = 500


def run(model_name: str, steps: int) -> dict[str, Any]:
    """Median µs of each timed piece (keys below) over ``steps`` plain steps of ``model_name``."""
    workload = make_workload(model_name, 64, torch.device("cpu"))
    model = workload.make_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr)
    params = list(model.parameters())
    scalar = torch.zeros(1)
    clock = time.perf_counter
    times: dict[str, list[float]] = {k: [] for k in (
        "python_after_backward", "add_after_backward", "second_add_after_backward", "add_after_forward",
        "add_after_optimizer", "read_after_backward", "read_repeated")}
    for i in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = workload.loss_fn(model, workload.batches[i % len(workload.batches)])
        turn = i % 3
        if turn == 1:
            t0 = clock()
            scalar.add_(1.0)
            times["add_after_forward"].append(clock() - t0)
        loss.backward()
        if turn == 0:
            t0 = clock()
            _ = [j for j in range(50)]
            t1 = clock()
            scalar.add_(1.0)
            t2 = clock()
            scalar.add_(1.0)
            t3 = clock()
            times["python_after_backward"].append(t1 - t0)
            times["add_after_backward"].append(t2 - t1)
            times["second_add_after_backward"].append(t3 - t2)
        elif turn == 2:
            grads = [p.grad for p in params]
            t0 = clock()
            squares_by_dots(grads)
            t1 = clock()
            squares_by_dots(grads)
            t2 = clock()
            times["read_after_backward"].append(t1 - t0)
            times["read_repeated"].append(t2 - t1)
        optimizer.step()
        if turn == 1:
            t0 = clock()
            scalar.add_(1.0)
            times["add_after_optimizer"].append(clock() - t0)
    medians = {k: 1e6 * statistics.median(v[SKIPPED_STEPS // 3:] or v) for k, v in times.items()}
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    t0 = clock()
    for _ in range(LOOP_REPEATS):
        squares_by_dots(grads)
    medians["read_in_a_loop"] = 1e6 * (clock() - t0) / LOOP_REPEATS
    return dict(model=model_name, steps=steps, gradient_mb=sum(p.numel() * p.element_size() for p in params) / 1e6,
                us={k: round(v, 1) for k, v in medians.items()})


def report(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    keys = list(results[0]["us"])
    lines = [f"What small host work costs right after a model's ops (CPU), `{meta['command']}` "
             f"({meta['date']}, commit {str(meta['git_commit'])[:10]}, torch {meta['torch']}). Medians in µs "
             f"(the first {SKIPPED_STEPS} steps left out; the read in a loop: mean of {LOOP_REPEATS}).", "",
             "| piece | " + " | ".join(f"{r['model']} ({r['gradient_mb']:.2f} MB of gradients)" for r in results) + " |",
             "|---|" + "---|" * len(results)]
    lines += [f"| {k.replace('_', ' ')} | " + " | ".join(f"{r['us'][k]:.1f}" for r in results) + " |" for k in keys]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp-1ms", "fashion"])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error(f"--steps: at least 3 (one turn), got {args.steps}")
    torch.set_num_threads(1)
    results = [run(m, args.steps) for m in args.models]
    meta = run_metadata("python -m experiments.after_backward " + shlex.join(sys.argv[1:] if argv is None else argv))
    write_results(args.out, "after_backward", dict(meta=meta, results=results), report(results, meta))


if __name__ == "__main__":
    main()

"""What the guard's per-step gradient read costs on a CPU: reading the gradients, or taking the
large layers' norms from Gram matrices (``hybrid_trainer.gram_norm``).

    python -m bench.gram_read [--model mlp-50m] [--steps 20]

The whole-step comparison (``python -m bench.overhead``) cannot resolve a few percent of the 51M
model's step on a host whose speed drifts by more than that between chunks. This bench times the
two ways of getting the same figure instead, on the same gradients of the same real steps: it runs
``--steps`` steps of ``bench.overhead``'s ``--model`` (forward, backward, AdamW) with the guard's
Gram hooks armed, and after each backward times, on one thread:

* ``read``: the guard's read without Grams (``StepGuard.read_step_values``: the loss, and every
  gradient's square by dot products for large gradients, else one norm per gradient), right after
  the backward as in a step;
* ``grams``: the Gram path's whole host work for that step: the forward hooks, the output
  pre-hooks (two Gram products and three figures per layer, inside the backward), the graph walk
  and the checks (``finish``), and the same read of the loss and of the gradients the Grams did
  not give (the biases).

and the step's forward + backward + update without either (``step``), so each can be said as a
share of it. Also recorded: how many gradients the Grams gave per step and the largest relative
difference between the two sums. Thread CPU time (one thread: the work itself, not time the core
was lent to another process) and wall time. Writes ``docs/results/gram_read.{json,md}``.
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

from .protocol import machine_speed, run_metadata, write_results

ROOT = Path(__file__).resolve().parents[1]


def _timed_grams(min_entries: int):
    """A GramNorms whose hooks add their thread and wall time to ``spent`` (ms)."""
    from hybrid_trainer.gram_norm import GramNorms

    class TimedGramNorms(GramNorms):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.spent = dict(cpu_ms=0.0, wall_ms=0.0)

        def _timed(self, method, *args):
            cpu, wall = time.thread_time(), time.perf_counter()
            method(*args)
            self.spent["cpu_ms"] += 1e3 * (time.thread_time() - cpu)
            self.spent["wall_ms"] += 1e3 * (time.perf_counter() - wall)

        def _forward(self, *args):
            self._timed(super()._forward, *args)

        def _output_grad(self, *args):
            self._timed(super()._output_grad, *args)

        def finish(self, loss):
            self._timed(super().finish, loss)

    return lambda module, params: TimedGramNorms(module, params, min_entries=min_entries)


def measure(workload: Any, steps: int, min_entries: int | None = None, progress=print) -> dict[str, Any]:
    """Per step of ``workload`` (``bench.overhead``'s :class:`Workload`): the read's, the Grams'
    and the step's times (ms), the gradients the Grams gave and the two sums' agreement. Two
    guards over the same parameters: one reads every gradient, the other takes the Grams
    (hooked with ``min_entries``, the trainer's :data:`GRAM_MIN_ENTRIES` by default); which of the
    two reads first alternates by step."""
    from hybrid_trainer.config import HybridConfig
    from hybrid_trainer.gram_norm import GRAM_MIN_ENTRIES
    from hybrid_trainer.step_guard import StepGuard

    device = torch.device("cpu")
    model = workload.make_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr)
    params = [p for p in model.parameters() if p.requires_grad]
    reads, by_grams = (StepGuard(HybridConfig(predict=False), optimizer, None, None, device) for _ in range(2))
    reads.retarget(params, [])
    by_grams.retarget(params, [])
    by_grams.gram = grams = _timed_grams(GRAM_MIN_ENTRIES if min_entries is None else min_entries)(model, params)

    def timed_read(guard: StepGuard, loss: torch.Tensor) -> tuple[float, float, float]:
        cpu, wall = time.thread_time(), time.perf_counter()
        norm = guard.read_step_values(loss)[1]
        return norm, 1e3 * (time.thread_time() - cpu), 1e3 * (time.perf_counter() - wall)

    records = []
    for step in range(steps):
        batch = workload.batches[step % len(workload.batches)]
        optimizer.zero_grad(set_to_none=True)
        grams.spent.update(cpu_ms=0.0, wall_ms=0.0)
        cpu, wall = time.thread_time(), time.perf_counter()
        by_grams.before_forward(gram=True)
        loss = workload.loss_fn(model, batch)
        loss.backward()
        by_grams.after_backward(loss)
        step_cpu, step_wall = time.thread_time() - cpu, time.perf_counter() - wall
        taken = grams.taken
        if step % 2:
            grams_norm, grams_cpu, grams_wall = timed_read(by_grams, loss)
            read_norm, read_cpu, read_wall = timed_read(reads, loss)
        else:
            read_norm, read_cpu, read_wall = timed_read(reads, loss)
            grams_norm, grams_cpu, grams_wall = timed_read(by_grams, loss)
        cpu, wall = time.thread_time(), time.perf_counter()
        optimizer.step()
        step_cpu += time.thread_time() - cpu
        step_wall += time.perf_counter() - wall
        hooks = dict(grams.spent)
        records.append(dict(
            step_cpu_ms=1e3 * step_cpu - hooks["cpu_ms"], step_wall_ms=1e3 * step_wall - hooks["wall_ms"],
            read_cpu_ms=read_cpu, read_wall_ms=read_wall,
            grams_cpu_ms=hooks["cpu_ms"] + grams_cpu, grams_wall_ms=hooks["wall_ms"] + grams_wall,
            by_grams=grams.taken - taken,
            relative_difference=abs(grams_norm ** 2 - read_norm ** 2) / read_norm ** 2 if read_norm else 0.0))
        r = records[-1]
        progress(f"step {step + 1}/{steps}: step {r['step_cpu_ms']:.1f} ms, read {r['read_cpu_ms']:.2f} ms, "
                 f"grams {r['grams_cpu_ms']:.2f} ms CPU ({r['by_grams']} gradients by Grams)")
    grams.remove()
    median = {key: statistics.median(r[key] for r in records)
              for key in ("step_cpu_ms", "step_wall_ms", "read_cpu_ms", "read_wall_ms", "grams_cpu_ms", "grams_wall_ms")}
    return dict(model=workload.name, parameters=sum(p.numel() for p in params), gradients=len(params),
                gradient_bytes=sum(p.nbytes for p in params), layers_hooked=len(grams.layers), steps=records,
                median=median, by_grams=min(r["by_grams"] for r in records),
                max_relative_difference=max(r["relative_difference"] for r in records))


def markdown(results: dict[str, Any]) -> str:
    r, m = results["result"], results["result"]["median"]
    share = lambda key: 100 * m[key] / m["step_cpu_ms"]  # noqa: E731
    lines = [f"The guard's gradient read, `{results['command']}` ({results['date']}, commit "
             f"{(results['git_commit'] or '?')[:10]}{' + uncommitted changes' if results['git_dirty'] else ''}, "
             f"torch {results['torch']}, 1 thread; host: {results['machine']['cpu']}, "
             f"{results['machine']['read_gb_s']:.1f} GB/s read at the start, "
             f"{results['machine_after']['read_gb_s']:.1f} GB/s at the end).", "",
             f"Model: {r['model']} ({r['parameters'] / 1e6:.2f}M parameters, {r['gradients']} gradients, "
             f"{r['gradient_bytes'] / 1e6:.0f} MB); {r['layers_hooked']} layers hooked, and the Grams gave "
             f"{r['by_grams']} or more weight gradients on every step; the two sums of squares differed by "
             f"{r['max_relative_difference']:.1e} (relative) at most. Medians over {len(r['steps'])} steps:", "",
             "| per step | thread CPU time (ms) | wall time (ms) | share of the step (CPU) |", "|---|---|---|---|",
             f"| forward + backward + AdamW (neither read) | {m['step_cpu_ms']:.1f} | {m['step_wall_ms']:.1f} | |",
             f"| read every gradient (the guard without Grams) | {m['read_cpu_ms']:.2f} | {m['read_wall_ms']:.2f} | "
             f"{share('read_cpu_ms'):.2f}% |",
             f"| Grams: hooks, walk, checks, the other gradients read | {m['grams_cpu_ms']:.2f} | "
             f"{m['grams_wall_ms']:.2f} | {share('grams_cpu_ms'):.2f}% |"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp-50m", help="one of bench.overhead's models")
    parser.add_argument("--steps", type=int, default=20, help="real steps timed")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps: at least 1, got {args.steps}")
    from .overhead import make_workload

    torch.set_num_threads(1)
    command = "python -m bench.gram_read " + shlex.join(argv if argv is not None else sys.argv[1:])
    machine = machine_speed()
    result = measure(make_workload(args.model, 16, torch.device("cpu")), args.steps)
    results = dict(run_metadata(command, machine=machine, machine_after=machine_speed()), result=result)
    write_results(args.out, "gram_read", results, markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

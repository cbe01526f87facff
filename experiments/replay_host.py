"""The host work of a step the trainer replays from a CUDA graph, timed on the CPU.

Question: with ``HybridConfig(cuda_graph=True)`` a steady step is one replay of a captured graph
plus the trainer's host work around it: the batch copied into the graph's inputs, the step's
values copied into the guard's ring, the checks of what could have changed since the capture
(the batch's layout, the optimizer's values, a rollback), the counters, the end of the step and
the block read every 16 steps. On a GPU that host work is hidden behind the device's work as long
as it takes less time than the replayed kernels (Fashion-MNIST's guarded step, captured, ran
205 µs on the H200: ``experiments/results/gpu_step_capture_cuda.md``); above that, it is the step.
How long is it, with no GPU to run a graph?

Method: the trainer with ``cuda_graph=True`` on the CPU, its capture backend replaced by one whose
capture runs the step's body once (so its output row exists) and whose replay runs nothing: every
step after the capture times the trainer's host work around an empty replay. The copies run on
the CPU (a memcpy each, where a GPU launches a copy kernel). Timed in chunks of 16 steps (one
block read each, where the good state is taken when due, as on a GPU), median over rounds with
the sign test's 95% interval, after warm-up. Then a ``cProfile`` of the same steps, by function.

Run: ``python -m experiments.replay_host`` (about a minute) →
``experiments/results/replay_host.{json,md}``. A prediction for the GPU, not a GPU figure: the
next GPU session times the replayed trainer (``bench.overhead --arms 'predict=False, cuda_graph'``).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from bench.overhead import make_workload, median_interval_ranks
from bench.protocol import run_metadata, write_results

RESULTS = Path(__file__).parent / "results"
CHUNK = 16


class EmptyReplays:
    """A capture backend whose capture runs the step's body once and whose replay runs nothing."""

    def __init__(self):
        self.captures = 0

    @contextlib.contextmanager
    def warmup(self) -> Iterator[None]:
        yield

    def capture(self, body: Callable[[], None]) -> Callable[[], None]:
        body()
        self.captures += 1
        return lambda: None


def replaying_trainer(model_name: str, batches: int):
    """A ``cuda_graph=True`` trainer over fused AdamW on the CPU with :class:`EmptyReplays`, and its batches."""
    import hybrid_trainer.trainer as trainer_module
    from hybrid_trainer import HybridConfig, HybridTrainer

    workload = make_workload(model_name, batches, torch.device("cpu"))
    model = workload.make_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr, fused=True)
    backend = EmptyReplays()
    built_with = trainer_module.graphs_for
    trainer_module.graphs_for = lambda device: backend
    try:
        trainer = HybridTrainer(model, optimizer, workload.loss_fn,
                                HybridConfig(seed=0, predict=False, read_every=CHUNK, cuda_graph=True))
    finally:
        trainer_module.graphs_for = built_with
    return trainer, workload.batches


def run(model_name: str, rounds: int, warmup: int, profile_steps: int, batches: int = 64) -> dict[str, Any]:
    trainer, data = replaying_trainer(model_name, batches)
    step = trainer.step
    for i in range(warmup):
        step(data[i % len(data)])
    if not trainer.captured.captured:
        raise RuntimeError(f"{model_name}: no graph captured after {warmup} warm-up steps: "
                           f"{trainer.captured.statistics()}")
    replays_before, index, chunks = trainer.captured.replays, warmup, []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(CHUNK):
            step(data[index % len(data)])
            index += 1
        chunks.append((time.perf_counter() - started) / CHUNK * 1e6)
    replayed = trainer.captured.replays - replays_before
    ordered = sorted(chunks)
    ranks = median_interval_ranks(len(ordered))
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(profile_steps):
        step(data[index % len(data)])
        index += 1
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
    trainer.close()
    return dict(model=model_name, parameters=sum(p.numel() for p in trainer.params), rounds=rounds, chunk=CHUNK,
                timed_steps=rounds * CHUNK, replayed_steps=replayed, step_us=statistics.median(chunks),
                interval_us=None if ranks is None else [ordered[ranks[0]], ordered[ranks[1]]],
                profile=text.getvalue())


def report(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# The host work of a replayed step, timed on the CPU (its replay empty)", "",
             f"`{meta['command']}` ({meta['date']}, commit {meta['git_commit'][:10]}"
             f"{' + uncommitted changes' if meta['git_dirty'] else ''}, torch {meta['torch']}).",
             "The trainer with `cuda_graph=True` over `AdamW(fused=True)`, `read_every=16`; after the "
             "capture every step replays an empty graph; the good state is taken at a block read when due. "
             "Median over rounds of the mean step in a chunk of 16 (one block read each), 95% sign interval. "
             "A prediction of the host side of a replayed step on a GPU, not a GPU figure.", "",
             "| model | parameters | timed steps (replayed) | host time a step (µs) [95%] |", "|---|---|---|---|"]
    for r in results:
        interval = "" if r["interval_us"] is None else f" [{r['interval_us'][0]:.0f}, {r['interval_us'][1]:.0f}]"
        lines.append(f"| {r['model']} | {r['parameters'] / 1e6:.2f}M | {r['timed_steps']} ({r['replayed_steps']}) "
                     f"| {r['step_us']:.0f}{interval} |")
    for r in results:
        lines += ["", f"{r['model']}, by function (cProfile, own time):", "", "```", r["profile"].strip(), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "fashion", "charlm"])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=120, help="steps before the timing (the capture among them)")
    parser.add_argument("--profile-steps", type=int, default=400)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    meta = run_metadata("python -m experiments.replay_host " + shlex.join(sys.argv[1:] if argv is None else argv))
    results = [run(name, args.rounds, args.warmup, args.profile_steps) for name in args.models]
    write_results(args.out, "replay_host", dict(meta=meta, results=results), report(results, meta))


if __name__ == "__main__":
    main()

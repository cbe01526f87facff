"""What the trainer's per-step guard work costs when it is written as a compact loop, next to the
trainer itself (CPU): how much of the trainer's overhead over the plain loop is the guard's
work, how much the good-state snapshot and how much the trainer's own machinery
(docs/trainer.md, "What a compact guard costs").

    python -m experiments.compact_guard [--model mlp-1ms] [--processes 10] [--rounds 24]

Arms, each built fresh on the ``bench.overhead`` model (AdamW at the model's learning rate):

* ``plain``: ``zero_grad``, forward, backward, ``optimizer.step()``;
* ``plain again``: a second plain loop (the noise floor);
* ``compact guard``: the trainer's steady-step guard with nothing around it: gradients set to
  None, forward, backward, the loss read, the gradients' squares read as the trainer reads them
  (:func:`~hybrid_trainer.step_guard.squares_read`), the
  :class:`~hybrid_trainer.divergence.DivergenceMonitor`'s check, the update (refused when the
  check is critical) through :class:`~hybrid_trainer.optimizer_call.OptimizerStep` (no
  profiler scope, as the trainer), the monitor's observe and a
  :class:`~hybrid_trainer.run_report.StepResult`. No good-state snapshot, so no rollback to one;
* ``trainer, no snapshot``: ``HybridTrainer(predict=False, good_state_every=0)``;
* ``trainer``: ``HybridTrainer(predict=False)`` (a good-state snapshot every 50 real steps).

Each fresh process times ``--rounds`` rounds; a round steps every arm, in an order shuffled each
round (an arm's place in the round moves its time by tens of µs on this project's CI host), 5
untimed then 50 timed steps (one good-state period). Per process: the median over rounds of each
arm's chunk mean minus the plain loop's in the same round. Over processes: the median of those,
with the sign test's 95% interval where there are 6 or more (what differs between processes,
which no round of one shows, counts). → ``experiments/results/compact_guard.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from bench.overhead import Workload, _arm_step, adamw_options, make_workload, median_interval_ranks
from bench.protocol import run_metadata, write_results
from hybrid_trainer import HybridConfig, HybridTrainer
from hybrid_trainer.divergence import DivergenceMonitor
from hybrid_trainer.optimizer_call import OptimizerStep
from hybrid_trainer.run_report import StepResult
from hybrid_trainer.step_guard import read_by_dots, squares_read

RESULTS = Path(__file__).resolve().parent / "results"
ARMS = ("plain", "plain again", "compact guard", "trainer, no snapshot", "trainer")
WARMUP_STEPS = 300  # untimed steps per arm before the first round (allocator, caches, the trainer's phases)
UNTIMED, TIMED = 5, 50  # per arm per round: the first steps pay for the switch of arms


def compact_guard_step(workload: Workload, seed: int = 0) -> tuple[Callable[[Any], StepResult], torch.nn.Module]:
    """(step function, model) of the ``compact guard`` arm (module docstring). The step returns
    the step's :class:`StepResult`; ``skipped`` when the monitor refused the update (a
    non-finite loss or gradient, or a spike), which then leaves the weights as they were."""
    model = workload.make_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr)
    params = [p for p in model.parameters() if p.requires_grad]
    update, by_dots, monitor = OptimizerStep(optimizer), read_by_dots(params), DivergenceMonitor()
    count = 0

    def step(batch: Any) -> StepResult:
        nonlocal count
        for p in params:
            p.grad = None
        loss = workload.loss_fn(model, batch)
        loss.backward()
        total = loss.item()
        norm = math.sqrt(squares_read([p.grad for p in params], by_dots)) if math.isfinite(total) else None
        report = monitor.check(total, norm)
        count += 1
        lrs = tuple([float(group["lr"]) for group in optimizer.param_groups])
        if report.critical:
            for p in params:
                p.grad = None
            return StepResult(step=count, phase="FULL", loss=total, backward_done=True, skipped=True,
                              divergence="; ".join(report.reasons), grad_norm=norm, lr=lrs[0], lrs=lrs)
        update()
        for p in params:
            p.grad = None
        monitor.observe(total, norm)
        return StepResult(step=count, phase="FULL", loss=total, backward_done=True, divergence=report.severity.name,
                          grad_norm=norm, lr=lrs[0], lrs=lrs)
    return step, model


def arm_steps(workload: Workload) -> dict[str, Callable[[Any], Any]]:
    """Every arm's step function (:data:`ARMS`), each on a fresh model built from seed 0: the
    plain loops and the trainer as ``bench.overhead`` builds them."""
    cpu = torch.device("cpu")
    model = workload.make_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr, **adamw_options())
    no_snapshot = HybridTrainer(model, optimizer, workload.loss_fn, HybridConfig(seed=0, predict=False, good_state_every=0))
    return {"plain": _arm_step("plain", workload, cpu)[0],
            "plain again": _arm_step("plain again (noise floor)", workload, cpu)[0],
            "compact guard": compact_guard_step(workload)[0],
            "trainer, no snapshot": no_snapshot.step,
            "trainer": _arm_step("predict=False", workload, cpu)[0]}


def time_one_process(model_name: str, rounds: int, seed: int, warmup: int = WARMUP_STEPS) -> dict[str, Any]:
    """One process's figures: per arm, the median over ``rounds`` of its chunk mean minus the
    plain loop's (µs), and the plain loop's median chunk mean; ``warmup`` untimed steps per arm
    first, ``seed`` shuffles the arms' order."""
    workload = make_workload(model_name, 64, torch.device("cpu"))
    steps = arm_steps(workload)
    batches = workload.batches
    for step in steps.values():
        for i in range(warmup):
            step(batches[i % len(batches)])
    chunk_means: dict[str, list[float]] = {arm: [] for arm in steps}
    order, shuffle = list(steps), random.Random(seed).shuffle
    clock = time.perf_counter
    for _ in range(rounds):
        shuffle(order)
        for arm in order:
            step = steps[arm]
            for i in range(UNTIMED):
                step(batches[i % len(batches)])
            started = clock()
            for i in range(TIMED):
                step(batches[i % len(batches)])
            chunk_means[arm].append(1e6 * (clock() - started) / TIMED)
    plain = chunk_means["plain"]
    return dict(plain_step_us=statistics.median(plain),
                overhead_us={arm: statistics.median([a - p for a, p in zip(means, plain)])
                             for arm, means in chunk_means.items() if arm != "plain"})


def pool(processes: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm over processes: the median of their overheads, the sign test's 95% interval for it
    (None below 6 processes) and every process's figure."""
    pooled = {}
    for arm in ARMS[1:]:
        values = sorted(p["overhead_us"][arm] for p in processes)
        ranks = median_interval_ranks(len(values))
        pooled[arm] = dict(median_us=statistics.median(values),
                           interval_us=None if ranks is None else [values[ranks[0]], values[ranks[1]]],
                           by_process_us=[p["overhead_us"][arm] for p in processes])
    return dict(plain_step_us=statistics.median(p["plain_step_us"] for p in processes), arms=pooled)


def report(result: dict[str, Any], meta: dict[str, Any]) -> str:
    n = result["processes"]
    lines = [f"What the trainer's guard work costs as a compact loop, next to the trainer (CPU, "
             f"{result['model']}), `{meta['command']}` ({meta['date']}, commit {str(meta['git_commit'])[:10]}, "
             f"torch {meta['torch']}). Each arm's chunk mean minus the plain loop's in the same round, "
             f"median over {result['rounds']} rounds (arms in shuffled order) in each of {n} fresh processes; "
             f"median over processes, with the sign test's 95% interval (6 or more processes). "
             f"Plain step {result['plain_step_us']:.0f} µs.", "",
             "| arm | over the plain loop (µs) | 95% interval (µs) | process by process (µs) |",
             "|---|---|---|---|"]
    for arm, figures in result["arms"].items():
        interval = figures["interval_us"]
        lines.append(f"| {arm} | {figures['median_us']:+.0f} | "
                     + ("–" if interval is None else f"{interval[0]:+.0f} … {interval[1]:+.0f}") + " | "
                     + ", ".join(f"{v:+.0f}" for v in figures["by_process_us"]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mlp-1ms", help="a bench.overhead model under 5M parameters")
    parser.add_argument("--processes", type=int, default=10, help="fresh processes, one after another")
    parser.add_argument("--rounds", type=int, default=24, help="rounds per process")
    parser.add_argument("--warmup", type=int, default=WARMUP_STEPS, help="untimed steps per arm first")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # a child: its seed
    args = parser.parse_args(argv)
    for name, least in (("processes", 1), ("rounds", 1), ("warmup", 0)):
        if getattr(args, name) < least:
            parser.error(f"--{name}: at least {least}, got {getattr(args, name)}")
    torch.set_num_threads(1)
    if args.worker is not None:  # one fresh process's figures, as one JSON line
        print(json.dumps(time_one_process(args.model, args.rounds, args.worker, args.warmup)))
        return
    processes = []
    for index in range(args.processes):
        child = subprocess.run([sys.executable, "-m", "experiments.compact_guard", "--model", args.model,
                                "--rounds", str(args.rounds), "--warmup", str(args.warmup),
                                "--worker", str(index)],
                               capture_output=True, text=True, check=True)
        processes.append(json.loads(child.stdout.strip().splitlines()[-1]))
        print(f"process {index + 1}/{args.processes}: " + ", ".join(
            f"{arm} {v:+.0f} µs" for arm, v in processes[-1]["overhead_us"].items()), flush=True)
    result = dict(model=args.model, processes=args.processes, rounds=args.rounds, **pool(processes))
    meta = run_metadata("python -m experiments.compact_guard " + shlex.join(sys.argv[1:] if argv is None else argv))
    write_results(args.out, "compact_guard", dict(meta=meta, result=result, processes=processes), report(result, meta))


if __name__ == "__main__":
    main()

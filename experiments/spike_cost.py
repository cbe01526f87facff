"""What the divergence guard costs a healthy run and saves a faulty one, on the CPU.

Read per step or once per block, with every alarm refused (the rule before) or a lone alarm taken
for the batch's:

    python -m experiments.spike_cost [--model tiny|mlp-1ms] [--seeds 3] [--before 2280] [--after 1600]
                                     [--scenarios ...]

A synthetic MLP of ``bench.overhead`` (a fixed random teacher's labels; ``--model tiny``, the
default: 676 parameters, 64 batches of 8; ``mlp-1ms``: 134k parameters, 64 batches of 32, which
it learns by heart, so that the batches it has not seen lose ten thousand times more than the
rest) steps ``--before`` times, then ``--after`` times in which the scenario happens:

* ``new regime`` (nothing is wrong): the first stage steps over 48 of the 64 batches, which the
  model learns by heart; the second over all 64. The 16 it has not seen lose far more than the
  window of the learnt ones, and the monitor scores some of them as spikes.
* ``learning rate x100`` (something is wrong): all 64 batches throughout; for ``after // 40``
  steps from ``after // 8`` on, every arm's learning rate is 100 times its own, set before each
  step (a schedule gone wrong).
* ``poisoned batches`` (something is wrong): all 64 batches throughout; in the second stage one
  step in ``after // 16`` gets a corrupt batch instead (inputs times 1,000, labels shifted).

Arms, each with ``AdamW(fused=True)``, the same initial weights and the same batches:

* ``plain``: the plain loop (it refuses nothing);
* ``read every step``: ``HybridTrainer(predict=False, read_every=1)``;
* ``read every 16 steps, as on a GPU``: ``read_every=16`` with the guard built as on a GPU
  (:func:`bench.protocol.guard_as_on_a_gpu`): the update skipped on the device, the checks judged
  once per block;
* each of the two again ``, each alarm refused``: ``divergence={"blame_lone_alarms_on_the_batch": False}``,
  the guard before it tolerated a lone z-score outlier
  (:class:`~hybrid_trainer.divergence.DivergenceMonitor`).

Per scenario, arm and seed: the steps refused, the rollbacks and the lone outliers tolerated in
the second stage, whether the guard stopped the run (``TrainingStalledError``), and the mean loss
over all 64 clean batches at the end (no gradient). → ``experiments/results/spike_cost.{json,md}``
(``spike_cost_mlp-1ms.{json,md}`` for ``--model mlp-1ms``).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch

RESULTS = Path(__file__).resolve().parent / "results"
ARMS = ("plain", "read every step, each alarm refused", "read every step",
        "read every 16 steps, as on a GPU, each alarm refused", "read every 16 steps, as on a GPU")
SCENARIOS = ("new regime", "learning rate x100", "poisoned batches")
SEEN = 48  # batches of the new-regime scenario's first stage, of the 64
LR_FACTOR = 100.0
POISON_SCALE = 1000.0


MODELS = ("tiny", "mlp-1ms")


def run_arm(scenario: str, arm: str, seed: int, before: int, after: int, model: str = "tiny") -> dict[str, Any]:
    """One arm on one seed: the second stage's refusals, rollbacks and tolerated outliers, and the
    final loss (the GPU arms run inside :func:`bench.protocol.guard_as_on_a_gpu`)."""
    from bench.protocol import guard_as_on_a_gpu

    with guard_as_on_a_gpu() if "GPU" in arm else contextlib.nullcontext():
        return _run(scenario, arm, seed, before, after, model)


def second_stage(scenario: str, after: int, batches: list, base_lr: float) -> Callable[[int], tuple[Any, float]]:
    """The second stage's (batch, learning rate) at each of its steps under ``scenario``."""
    if scenario == "new regime":
        return lambda i: (batches[i % len(batches)], base_lr)
    if scenario == "learning rate x100":
        start, length = after // 8, max(1, after // 40)
        return lambda i: (batches[i % len(batches)], base_lr * (LR_FACTOR if start <= i < start + length else 1.0))
    period = max(2, after // 16)

    def poisoned(i: int) -> tuple[Any, float]:
        x, y = batches[i % len(batches)]
        if i % period == period // 2:
            return (x * POISON_SCALE, y.roll(1)), base_lr
        return (x, y), base_lr
    return poisoned


def _run(scenario: str, arm: str, seed: int, before: int, after: int, model_name: str) -> dict[str, Any]:
    from bench.overhead import make_workload
    from hybrid_trainer import HybridConfig, HybridTrainer
    from hybrid_trainer.errors import TrainingStalledError

    workload = make_workload(model_name, 64, torch.device("cpu"))
    model = workload.make_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr, fused=True)
    trainer = None
    if arm == "plain":
        def step(batch) -> None:
            optimizer.zero_grad(set_to_none=True)
            workload.loss_fn(model, batch).backward()
            optimizer.step()
    else:
        divergence = {"blame_lone_alarms_on_the_batch": False} if arm.endswith("each alarm refused") else {}
        trainer = HybridTrainer(model, optimizer, workload.loss_fn,
                                HybridConfig(seed=seed, predict=False, read_every=16 if "GPU" in arm else 1,
                                             divergence=divergence))
        step = trainer.step
    batches = workload.batches
    first = batches[:SEEN] if scenario == "new regime" else batches
    for i in range(before):
        step(first[i % len(first)])
    counted = ("skipped_steps", "divergence_rollbacks")
    at_start = {}
    if trainer is not None:
        trainer.statistics()  # settles a block still waiting
        at_start = {key: getattr(trainer.stats, key) for key in counted}
        at_start["tolerated"] = trainer.monitor.tolerated
    stage = second_stage(scenario, after, batches, workload.lr)
    stalled_at = None
    try:
        for i in range(after):
            batch, lr = stage(i)
            for group in optimizer.param_groups:
                group["lr"] = lr
            step(batch)
        if trainer is not None:
            trainer.statistics()
    except TrainingStalledError:
        stalled_at = before + i
    with torch.no_grad():
        final = statistics.fmean(float(workload.loss_fn(model, b)) for b in batches)
    out = dict(final_loss=final, stalled_at=stalled_at)
    if trainer is not None:
        out.update(refused=trainer.stats.skipped_steps - at_start["skipped_steps"],
                   rollbacks=trainer.stats.divergence_rollbacks - at_start["divergence_rollbacks"],
                   tolerated=trainer.monitor.tolerated - at_start["tolerated"], steps=trainer.step_count,
                   read_every=trainer.guard.deferred.every if trainer.guard.deferred is not None else 1,
                   as_on_gpu=not trainer.guard.reads_free,
                   tolerates=trainer.monitor.blame_lone_alarms_on_the_batch)
        trainer.close()
    return out


def median_cell(runs: list[dict[str, Any]], key: str, fmt: str = "{:.0f}") -> str:
    """A table cell: the median over seeds of ``key`` and each seed's value in brackets; "–" where
    a run has none (the plain loop's refusals)."""
    values = [r.get(key) for r in runs]
    if any(v is None for v in values):
        return "–"
    return f"{fmt.format(statistics.median(values))} [{', '.join(fmt.format(v) for v in values)}]"


def report(result: dict[str, Any], meta: dict[str, Any]) -> str:
    model = {"tiny": "the tiny MLP", "mlp-1ms": "the 1 ms MLP"}[result.get("model", "tiny")]
    lines = [f"What the divergence guard costs and saves (CPU, {model}: {result['before']} steps, then "
             f"{result['after']} in which the scenario happens), `{meta['command']}` ({meta['date']}, commit "
             f"{str(meta['git_commit'])[:10]}{' (dirty tree)' if meta['git_dirty'] else ''}). Per scenario and "
             f"arm, the median over {len(result['seeds'])} seeds (each seed's value in brackets): steps refused, "
             "rollbacks and lone outliers tolerated in the second stage, and the mean loss over the 64 clean "
             "batches at its end.", ""]
    for scenario, arms in result["scenarios"].items():
        lines += [f"**{scenario}**", "",
                  "| arm | steps refused | rollbacks | outliers tolerated | stopped by the guard | final loss |",
                  "|---|---|---|---|---|---|"]
        for arm, runs in arms.items():
            cell = functools.partial(median_cell, runs)
            stopped = [r["stalled_at"] for r in runs]
            said = ", ".join("no" if s is None else f"at step {s}" for s in stopped)
            lines.append(f"| {arm} | {cell('refused')} | {cell('rollbacks')} | {cell('tolerated')} | {said} | "
                         f"{cell('final_loss', '{:.4f}')} |")
        lines.append("")
    return "\n".join(lines)


def parse_stage_arguments(argv: list[str] | None, description: str, seeds: int, scenarios: tuple[str, ...],
                          name: str, models: tuple[str, ...] = ()) -> argparse.Namespace:
    """The two-stage runs' command line (this probe's and ``experiments.quiet_probe``'s): seeds,
    the stages' lengths, the scenarios among ``scenarios``, the folder for ``name``'s files."""
    parser = argparse.ArgumentParser(description=description)
    if models:
        parser.add_argument("--model", choices=models, default=models[0],
                            help=f"the synthetic MLP of bench.overhead ({name}_<model>.{{json,md}} for another than {models[0]})")
    parser.add_argument("--seeds", type=int, default=seeds, help="seeds per arm and scenario (0, 1, ...)")
    parser.add_argument("--before", type=int, default=2280, help="steps of the first stage")
    parser.add_argument("--after", type=int, default=1600, help="steps of the second stage, the scenario's")
    parser.add_argument("--scenarios", nargs="+", choices=scenarios, default=list(scenarios))
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"folder for {name}.{{json,md}}")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.before < 1 or args.after < 1:
        parser.error(f"--seeds, --before and --after must be >= 1, got {args.seeds}, {args.before}, {args.after}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_stage_arguments(argv, __doc__.split("\n")[0], 3, SCENARIOS, "spike_cost", MODELS)
    from bench.protocol import run_metadata, write_results

    meta = run_metadata("python -m experiments.spike_cost " + shlex.join(sys.argv[1:] if argv is None else argv))
    torch.set_num_threads(1)
    logging.getLogger("hybrid_trainer").setLevel(logging.ERROR)  # a warning per refused step
    seeds = list(range(args.seeds))
    scenarios = {scenario: {arm: [run_arm(scenario, arm, seed, args.before, args.after, args.model) for seed in seeds]
                            for arm in ARMS} for scenario in args.scenarios}
    result = dict(model=args.model, before=args.before, after=args.after, seeds=seeds, scenarios=scenarios)
    name = "spike_cost" if args.model == MODELS[0] else f"spike_cost_{args.model}"
    write_results(args.out, name, dict(meta=meta, result=result), report(result, meta))


if __name__ == "__main__":
    main()

"""What a false alarm of the divergence guard costs a run, read per step or once per block (CPU).

A loss that legitimately changes level (new data, a curriculum stage) can score above the
monitor's critical z-score. The per-step guard then refuses that step and goes back to the last
good state; with ``read_every=16`` (a GPU's default, :mod:`hybrid_trainer.deferred_checks`) the
spike is found at the block's read, and the steps queued after it, trained on from the refused
weights, are discarded with it. This measures what that costs on a run where nothing is wrong:

    python -m experiments.spike_cost [--seeds 3] [--before 2280] [--after 1600]

The tiny MLP of ``bench.overhead`` (a fixed random teacher's labels) first steps ``--before``
times over 48 of its 64 batches, which it learns by heart, then ``--after`` times over all 64:
the 16 it has not seen lose more, some of them far above the window of the learnt ones. Arms,
each with ``AdamW(fused=True)``, the same initial weights and the same batches:

* ``plain``: the plain loop (it refuses nothing);
* ``read every step``: ``HybridTrainer(predict=False, read_every=1)``;
* ``read every 16 steps, as on a GPU``: ``HybridTrainer(predict=False, read_every=16)`` with its
  guard built as on a GPU (:func:`bench.protocol.guard_as_on_a_gpu`): the update skipped on the
  device, the checks judged once per block.

Per arm and seed: the steps refused and the rollbacks in the second stage, whether the guard
stopped the run (``TrainingStalledError``), and the mean loss over all 64 batches at the end
(no gradient). → ``experiments/results/spike_cost.{json,md}``.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
ARMS = ("plain", "read every step", "read every 16 steps, as on a GPU")
SEEN = 48  # batches of the first stage, of the 64


def run_arm(arm: str, seed: int, before: int, after: int) -> dict[str, Any]:
    """One arm on one seed: the second stage's refusals and rollbacks, and the final loss (the
    GPU arm runs inside :func:`bench.protocol.guard_as_on_a_gpu`)."""
    from bench.protocol import guard_as_on_a_gpu

    with guard_as_on_a_gpu() if arm == ARMS[2] else contextlib.nullcontext():
        return _run(arm, seed, before, after)


def _run(arm: str, seed: int, before: int, after: int) -> dict[str, Any]:
    from bench.overhead import make_workload
    from hybrid_trainer import HybridConfig, HybridTrainer
    from hybrid_trainer.errors import TrainingStalledError

    workload = make_workload("tiny", 64, torch.device("cpu"))
    model = workload.make_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr, fused=True)
    trainer = None
    if arm == "plain":
        def step(batch) -> None:
            optimizer.zero_grad(set_to_none=True)
            workload.loss_fn(model, batch).backward()
            optimizer.step()
    else:
        trainer = HybridTrainer(model, optimizer, workload.loss_fn,
                                HybridConfig(seed=seed, predict=False, read_every=1 if arm == ARMS[1] else 16))
        step = trainer.step
    batches = workload.batches
    for i in range(before):
        step(batches[i % SEEN])
    refused = rollbacks = 0
    if trainer is not None:
        trainer.statistics()  # settles a block still waiting
        refused, rollbacks = trainer.stats.skipped_steps, trainer.stats.divergence_rollbacks
    stalled_at = None
    try:
        for i in range(after):
            step(batches[i % len(batches)])
        if trainer is not None:
            trainer.statistics()
    except TrainingStalledError:
        stalled_at = before + i
    with torch.no_grad():
        final = statistics.fmean(float(workload.loss_fn(model, b)) for b in batches)
    out = dict(final_loss=final, stalled_at=stalled_at)
    if trainer is not None:
        out.update(refused=trainer.stats.skipped_steps - refused,
                   rollbacks=trainer.stats.divergence_rollbacks - rollbacks, steps=trainer.step_count,
                   read_every=trainer.guard.deferred.every if trainer.guard.deferred is not None else 1,
                   as_on_gpu=not trainer.guard.reads_free)
        trainer.close()
    return out


def report(result: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [f"What the guard's false alarms cost (CPU, the tiny MLP: {result['before']} steps over 48 of its 64 "
             f"batches, then {result['after']} over all 64), `{meta['command']}` ({meta['date']}, commit "
             f"{str(meta['git_commit'])[:10]}{' (dirty tree)' if meta['git_dirty'] else ''}). Per arm, the median "
             f"over {len(result['seeds'])} seeds (each seed's value in brackets): steps refused and rollbacks in "
             "the second stage, and the mean loss over the 64 batches at its end.", "",
             "| arm | steps refused | rollbacks | stopped by the guard | final loss |", "|---|---|---|---|---|"]
    for arm, runs in result["arms"].items():
        def cell(key: str, fmt: str = "{:.0f}") -> str:
            values = [r.get(key) for r in runs]
            if any(v is None for v in values):
                return "–"
            return f"{fmt.format(statistics.median(values))} [{', '.join(fmt.format(v) for v in values)}]"
        stopped = [r["stalled_at"] for r in runs]
        said = ", ".join("no" if s is None else f"at step {s}" for s in stopped)
        lines.append(f"| {arm} | {cell('refused')} | {cell('rollbacks')} | {said} | {cell('final_loss', '{:.4f}')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--before", type=int, default=2280, help="steps over the first 48 batches")
    parser.add_argument("--after", type=int, default=1600, help="steps over all 64 batches")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.before < 1 or args.after < 1:
        parser.error(f"--seeds, --before and --after must be >= 1, got {args.seeds}, {args.before}, {args.after}")
    from bench.protocol import run_metadata, write_results

    meta = run_metadata("python -m experiments.spike_cost " + shlex.join(sys.argv[1:] if argv is None else argv))
    torch.set_num_threads(1)
    logging.getLogger("hybrid_trainer").setLevel(logging.ERROR)  # a warning per refused step
    seeds = list(range(args.seeds))
    arms = {arm: [run_arm(arm, seed, args.before, args.after) for seed in seeds] for arm in ARMS}
    result = dict(before=args.before, after=args.after, seeds=seeds, arms=arms)
    write_results(args.out, "spike_cost", dict(meta=meta, result=result), report(result, meta))


if __name__ == "__main__":
    main()

"""What queueing a step's gradient norms as one vector saves in host dispatch, timed on the CPU.

Question: on a GPU the deferred path (:mod:`hybrid_trainer.deferred_checks`) queues each step's
loss and k gradient norms and reads 16 steps at once. CUDA's ``_foreach_norm`` returns the k
norms as 0-d views of one k-entry buffer; queued as that one vector, a step's values cost the
device-side non-finite check and the block's read one tensor for the k norms instead of k. How
much host time does that save a step, against the look at the layout it adds?

    python -m experiments.queued_read [--norms 6 40] [--rounds 200] [--calls 20]

For each k of ``--norms`` (Fashion-MNIST's MLP has 6 gradients, the char-LM 40), 16 queued steps
are built both ways: one by one, ``[loss, n_1, ..., n_k]`` (separate 0-d tensors, as the CPU's
``_foreach_norm`` gives them), and as one vector, ``[loss, vector]``. Timed, with the product's
own functions and the arms interleaved call by call within each round:

* the check: GradScaler's ``_amp_foreach_non_finite_check_and_unscale_`` over one step's values
  (each step of a fused optimizer runs it);
* the block's read: :func:`~hybrid_trainer.run_report.stack_queued`, ``tolist`` and
  :func:`~hybrid_trainer.run_report.split_read` over the 16 steps (once every 16 steps);
* the layout's look once the route is taken: ``DeferredChecks._one_vector`` (each step).

Per arm, the median over ``--rounds`` of the mean over ``--calls`` calls. The tensors are the
CPU's, so each op's work is the CPU's too; for 0-d and k-entry tensors that is a few
nanoseconds next to the dispatch the figures are about, which a GPU's host runs the same way up
to its kernel launch (one a multi-tensor op). → ``experiments/results/queued_read.{json,md}``.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK = 16  # steps a block read takes: HybridConfig.read_every's default on a GPU


def queued_steps(k: int, as_vector: bool, seed: int = 0) -> list[list[torch.Tensor]]:
    """``BLOCK`` steps' queued values: ``[loss, n_1, ..., n_k]`` or ``[loss, vector]``."""
    generator = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(BLOCK):
        loss, norms = torch.rand((), generator=generator), torch.rand(k, generator=generator)
        steps.append([loss, norms] if as_vector else [loss, *(n.clone() for n in norms.unbind())])
    return steps


def arms(k: int) -> dict[str, dict[str, Callable[[], Any]]]:
    """What is timed for ``k`` norms: per measure, the call one by one and as one vector."""
    from hybrid_trainer.deferred_checks import DeferredChecks
    from hybrid_trainer.run_report import split_read, stack_queued

    scalar, vector = queued_steps(k, False), queued_steps(k, True)
    found, one = torch.zeros(()), torch.ones(())
    views = list(vector[0][1].unbind())
    layout = DeferredChecks(BLOCK)
    if layout._one_vector(views) is not vector[0][1]:  # the route taken: later calls check the ends
        raise RuntimeError("DeferredChecks._one_vector did not take the entries of one vector as it")

    def read(queued: list[list[torch.Tensor]], vectors: bool) -> list[list[float]]:
        flat, flags = stack_queued(queued, vectors=vectors)
        return split_read(queued, flags, flat.tolist())

    check = torch._amp_foreach_non_finite_check_and_unscale_
    return {
        "check, a step": {"one by one": lambda: check(scalar[0], found, one),
                          "as one vector": lambda: check(vector[0], found, one)},
        f"block read, {BLOCK} steps": {"one by one": lambda: read(scalar, False),
                                       "as one vector": lambda: read(vector, True)},
        "layout look, a step": {"one by one": lambda: None,
                                "as one vector": lambda: layout._one_vector(views)},
    }


def time_measure(calls: dict[str, Callable[[], Any]], rounds: int, per_round: int) -> dict[str, float]:
    """Median over ``rounds`` of each call's mean time (µs) over ``per_round`` calls, the calls
    interleaved round by round."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for name, call in calls.items():
        call()  # warm
    for _ in range(rounds):
        for name, call in calls.items():
            started = time.perf_counter_ns()
            for _ in range(per_round):
                call()
            times[name].append((time.perf_counter_ns() - started) / per_round / 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def run(norms: list[int], rounds: int, per_round: int) -> list[dict[str, Any]]:
    rows = []
    for k in norms:
        for measure, calls in arms(k).items():
            medians = time_measure(calls, rounds, per_round)
            rows.append(dict(norms=k, measure=measure, one_by_one_us=medians["one by one"],
                             as_one_vector_us=medians["as one vector"]))
    return rows


def saving_per_step(rows: list[dict[str, Any]], k: int) -> float:
    """Host time a step saves as one vector (µs): the check's and the layout look's difference,
    and the block read's over ``BLOCK`` steps."""
    total = 0.0
    for row in rows:
        if row["norms"] == k:
            difference = row["one_by_one_us"] - row["as_one_vector_us"]
            total += difference / BLOCK if row["measure"].startswith("block read") else difference
    return total


def report(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"Host dispatch of the deferred path's queued values, one by one and as one vector (CPU, one "
             f"thread), `{meta['command']}` ({meta['date']}, commit "
             f"{str(meta['git_commit'])[:10]}{' (dirty tree)' if meta['git_dirty'] else ''}, torch "
             f"{meta['torch']}): per measure, the median over rounds of the mean over a round's calls, the two "
             "ways interleaved.", "",
             "| gradient norms | measure | one by one (µs) | as one vector (µs) |", "|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['norms']} | {row['measure']} | {row['one_by_one_us']:.1f} | "
                     f"{row['as_one_vector_us']:.1f} |")
    lines.append("")
    for k in sorted({row["norms"] for row in rows}):
        lines.append(f"- {k} norms: {saving_per_step(rows, k):+.1f} µs a step saved as one vector (the check and "
                     f"the layout look a step, the block read over its {BLOCK} steps)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from bench.protocol import run_metadata, write_results

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--norms", type=int, nargs="+", default=[6, 40], help="gradient norms a step (k)")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--calls", type=int, default=20, help="calls of each arm a round")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if min(args.norms) < 2 or args.rounds < 1 or args.calls < 1:
        parser.error(f"--norms must be >= 2 (one norm is queued as it is), --rounds and --calls >= 1, got "
                     f"{args.norms}, {args.rounds}, {args.calls}")
    torch.set_num_threads(1)
    meta = run_metadata("python -m experiments.queued_read " + shlex.join(sys.argv[1:] if argv is None else argv))
    rows = run(args.norms, args.rounds, args.calls)
    write_results(args.out, "queued_read", dict(meta=meta, rows=rows,
                                                saving_per_step_us={k: saving_per_step(rows, k) for k in args.norms}),
                  report(rows, meta))


if __name__ == "__main__":
    main()

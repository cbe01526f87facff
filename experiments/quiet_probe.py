"""Could a batch known to be ordinary tell weights gone wrong from a run of hard batches? (CPU)

The guard takes a lone loss outlier for the batch's and rolls back at the second critical step in
a row, for weights gone wrong make every batch lose more (docs/trainer.md, "What a false alarm
costs"). A run of hard batches, as when a healthy run meets new data, then looks like weights gone
wrong. The idea looked at: before that rollback, evaluate the last batch the guard called quiet
at the weights about to be left, and judge its loss against the window with the monitor's own
check; a quiet probe would say the weights are fine. This records, without changing the guard's
decisions, what such a probe would have said at every one of those rollbacks:

    python -m experiments.quiet_probe [--seeds 6] [--before 2280] [--after 1600]

The scenarios of :mod:`experiments.spike_cost` where the rule fires (``new regime``, nothing
wrong; ``learning rate x100``, the weights going wrong), the trainer reading every step
(``HybridConfig(predict=False, read_every=1)``, fused AdamW), the same seeds, batches and stages.
At each rollback for a finite critical step with another right before it (``StepGuard.refuse_update``
wrapped, the monitor's ``critical_in_a_row`` above 1): the probe batch's loss when it was stepped
and now (``torch.no_grad``), and whether ``DivergenceMonitor.check(loss, None, count=False)``
calls it critical. Per scenario and seed: the rollbacks probed, how many probes were quiet, and
the run's final mean loss over the 64 clean batches. → ``experiments/results/quiet_probe.{json,md}``.
"""
from __future__ import annotations

import logging
import math
import shlex
import statistics
import sys
from typing import Any

import torch

from experiments.spike_cost import SEEN, parse_stage_arguments, second_stage

SCENARIOS = ("new regime", "learning rate x100")


def run_seed(scenario: str, seed: int, before: int, after: int) -> dict[str, Any]:
    """One seed of ``scenario``: every probe taken at a rollback of the second stage, and the final loss."""
    from bench.overhead import make_workload
    from hybrid_trainer import HybridConfig, HybridTrainer

    workload = make_workload("tiny", 64, torch.device("cpu"))
    model = workload.make_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr, fused=True)
    trainer = HybridTrainer(model, optimizer, workload.loss_fn, HybridConfig(seed=seed, predict=False, read_every=1))
    batches = workload.batches
    first = batches[:SEEN] if scenario == "new regime" else batches
    for i in range(before):
        trainer.step(first[i % len(first)])
    rollbacks_before = trainer.stats.divergence_rollbacks
    last_quiet: dict[str, Any] = {}
    probes: list[dict[str, Any]] = []
    refuse = trainer.guard.refuse_update

    def probed_refusal(loss, grad_norm, *args, **kwargs):
        monitor = trainer.guard.monitor
        if math.isfinite(loss) and monitor.critical_in_a_row > 1 and last_quiet:
            with torch.no_grad():
                now = float(workload.loss_fn(model, last_quiet["batch"]))
            probes.append(dict(step=trainer.step_count, loss=loss, probe_then=last_quiet["loss"], probe_now=now,
                               probe_critical=monitor.check(now, None, count=False).critical))
        return refuse(loss, grad_norm, *args, **kwargs)

    trainer.guard.refuse_update = probed_refusal  # type: ignore[method-assign]  (this trainer's guard only)
    stage = second_stage(scenario, after, batches, workload.lr)
    for i in range(after):
        batch, lr = stage(i)
        for group in optimizer.param_groups:
            group["lr"] = lr
        result = trainer.step(batch)
        if result.divergence == "OK" and not result.skipped:
            last_quiet.update(batch=batch, loss=result.loss)
    trainer.close()
    with torch.no_grad():
        final = statistics.fmean(float(workload.loss_fn(model, b)) for b in batches)
    return dict(seed=seed, probes=probes, final_loss=final,
                rollbacks=trainer.stats.divergence_rollbacks - rollbacks_before)  # in the second stage


def report(result: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [f"What a probe of the last quiet batch would say at the guard's rollbacks for a second critical step "
             f"in a row (CPU, the tiny MLP, read every step: {result['before']} steps, then {result['after']} in "
             f"which the scenario happens), `{meta['command']}` ({meta['date']}, commit "
             f"{str(meta['git_commit'])[:10]}{' (dirty tree)' if meta['git_dirty'] else ''}). A quiet probe says "
             "the weights are fine; the guard's decisions are its own (the probe changes nothing).", "",
             "| scenario | seed | rollbacks probed | probes quiet | probe loss then → now (each) | final loss |",
             "|---|---|---|---|---|---|"]
    for scenario, runs in result["scenarios"].items():
        for run in runs:
            quiet = sum(not p["probe_critical"] for p in run["probes"])
            moves = ", ".join(f"{p['probe_then']:.4f} → {p['probe_now']:.4f}" for p in run["probes"]) or "–"
            lines.append(f"| {scenario} | {run['seed']} | {len(run['probes'])} | {quiet} | {moves} | "
                         f"{run['final_loss']:.4f} |")
    lines.append("")
    for scenario, runs in result["scenarios"].items():
        probes = [p for run in runs for p in run["probes"]]
        quiet = sum(not p["probe_critical"] for p in probes)
        lines.append(f"- {scenario}: {quiet} of {len(probes)} probes quiet over {len(runs)} seeds; final loss "
                     f"{min(r['final_loss'] for r in runs):.4f}–{max(r['final_loss'] for r in runs):.4f}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from bench.protocol import run_metadata, write_results

    args = parse_stage_arguments(argv, __doc__.split("\n")[0], 6, SCENARIOS, "quiet_probe")
    meta = run_metadata("python -m experiments.quiet_probe " + shlex.join(sys.argv[1:] if argv is None else argv))
    torch.set_num_threads(1)
    logging.getLogger("hybrid_trainer").setLevel(logging.ERROR)  # a warning per refused step
    scenarios = {scenario: [run_seed(scenario, seed, args.before, args.after) for seed in range(args.seeds)]
                 for scenario in args.scenarios}
    result = dict(before=args.before, after=args.after, scenarios=scenarios)
    write_results(args.out, "quiet_probe", dict(meta=meta, result=result), report(result, meta))


if __name__ == "__main__":
    main()

"""What the divergence monitor makes of a tenfold loss on real runs.

Trains a task with plain AdamW and, at a few steps, asks a default :class:`DivergenceMonitor` fed with
the run's accepted losses about a loss ten times the step's own: its z-score against the window, the
ratio to the largest loss in the window, and the severity ``check`` gives. The monitor's docstring quotes
this table; rerun it after changing a rule::

    python -m bench.divergence_scores --tasks digits charlm
"""
from __future__ import annotations

import argparse
import itertools
import subprocess

import torch

from hybrid_trainer.divergence import DivergenceMonitor

from .tasks import get_task

PROBE_STEPS = (12, 30, 60, 100, 200, 300, 400)


def scores(task_name: str, lr: float, seed: int = 0) -> list[dict]:
    task = get_task(task_name, quick=True)
    model = task.make_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    monitor = DivergenceMonitor()
    rows = []
    for step, batch in enumerate(itertools.islice(task.batches(seed), max(PROBE_STEPS) + 1)):
        loss = task.loss_fn(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        value = loss.item()
        if step in PROBE_STEPS:
            spike = 10 * value
            window = list(monitor.state_dict()["losses"])[-monitor.window:]
            report = monitor.check(spike, count=False)
            rows.append(dict(task=task_name, step=step, loss=value, z=monitor.loss_z_score(spike),
                             over_window_max=spike / max(window), severity=report.severity.name,
                             kinds=",".join(report.kinds)))
        monitor.observe(value)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["digits", "charlm"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"commit {commit}; a loss 10x the step's own, against a default DivergenceMonitor")
    print("| task | step | loss | z-score | / window max | severity (kinds) |")
    print("|---|---:|---:|---:|---:|---|")
    lrs = {"digits": 3e-3, "charlm": 2e-3}
    for name in args.tasks:
        for row in scores(name, lrs.get(name, 1e-3), args.seed):
            z = "n/a" if row["z"] is None else f"{row['z']:.1f}"
            print(f"| {row['task']} | {row['step']} | {row['loss']:.3f} | {z} | {row['over_window_max']:.2f} | "
                  f"{row['severity']} ({row['kinds'] or '-'}) |")


if __name__ == "__main__":
    main()

"""Does the way the predictor records updates change what the trainer decides?

    python -m bench.direction_worth [--tasks fashion charlm] [--steps 400 150]

Trains a ``bench.tasks`` task with the default config four times on the same seed and batches:
the update measured against a before-copy with an fp32 direction (the trainer before the
update recovery), recomputed from AdamW's state with an fp32 direction, recomputed with a bf16
direction, and recomputed with the int8 block direction the trainer keeps. The arms are switched here, in the benchmark, by replacing
``AdamUpdateRecovery.for_optimizer`` (None: measure with the copy) and
``predict_phase.DIRECTION_DTYPE``. Reports, per arm against the first: the largest difference of
``trainer.predicted_worth`` over the steps where both have one, the largest worth, whether the
phases are identical, and the step from which the worth no longer changes (the gate switched
prediction off).
"""
from __future__ import annotations

import argparse

import torch

import hybrid_trainer.predict_phase as predict_phase
from hybrid_trainer import HybridConfig, HybridTrainer
from hybrid_trainer.update_recovery import AdamUpdateRecovery

from .tasks import get_task

ARMS = {"copy, fp32": (False, torch.float32), "recovered, fp32": (True, torch.float32),
        "recovered, bf16": (True, torch.bfloat16), "recovered, int8": (True, torch.int8)}


def run(task_name: str, steps: int, recover: bool, dtype: torch.dtype) -> dict:
    original_for_optimizer, original_dtype = AdamUpdateRecovery.__dict__["for_optimizer"], predict_phase.DIRECTION_DTYPE
    if not recover:
        AdamUpdateRecovery.for_optimizer = staticmethod(lambda optimizer, params: None)
    predict_phase.DIRECTION_DTYPE = dtype
    try:
        task = get_task(task_name)
        stream = task.batches(0)
        model = task.make_model(0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=task.lr_grid[len(task.lr_grid) // 2])
        trainer = HybridTrainer(model, optimizer, task.loss_fn, HybridConfig(seed=0))
        worth, phases = [], []
        for _ in range(steps):
            phases.append(trainer.step(next(stream)).phase)
            worth.append(trainer.predicted_worth)
    finally:
        AdamUpdateRecovery.for_optimizer = original_for_optimizer
        predict_phase.DIRECTION_DTYPE = original_dtype
    return dict(worth=worth, phases=phases)


def frozen_from(worth: list) -> int | None:
    """First step from which the worth never changes again (None: it changed at the last step)."""
    for i in range(1, len(worth)):
        if all(w == worth[i] for w in worth[i:]):
            return i if i < len(worth) - 1 else None
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=["fashion", "charlm"])
    parser.add_argument("--steps", nargs="+", type=int, default=[400, 150])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("| task | steps | arm | largest worth difference | largest worth | phases identical | worth frozen from step |")
    print("|---|---|---|---|---|---|---|")
    for task_name, steps in zip(args.tasks, args.steps):
        runs = {arm: run(task_name, steps, *spec) for arm, spec in ARMS.items()}
        base = runs["copy, fp32"]
        for arm, result in runs.items():
            pairs = [(a, b) for a, b in zip(base["worth"], result["worth"]) if a is not None and b is not None]
            diff = max((abs(a - b) for a, b in pairs), default=float("nan"))
            largest = max((abs(b) for _, b in pairs), default=float("nan"))
            print(f"| {task_name} | {steps} | {arm} | {diff:.2g} | {largest:.3g} | {result['phases'] == base['phases']} "
                  f"| {frozen_from(result['worth'])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Predict the lower layers' updates and backpropagate only through the upper ones? (An idea that
failed; kept as evidence.)

    python -m experiments.partial_backward [--task fashion] [--every 2] [--seeds 3] [--out experiments/results]

A predicted update of the *whole* model is worth ≤ 0.05 of a real step on these tasks
(docs/trainer.md), so skipping whole backward passes cannot pay. This benchmark tries the other
cut: every step is real for the upper layers, but on all steps except every ``--every``-th one
(after the first 50) the backward stops at a cut module, so the layers below it get no gradient
and their update is predicted instead. The backward below the cut is what is saved: on the
Fashion-MNIST MLP the first layer holds 75% of the weights, on the char-LM the cut is at the
second of three blocks. Arms, same initialisation, data and learning rate:

* ``plain``: every step real everywhere;
* ``freeze``: no update below the cut on skipped steps (what the saved backward alone buys);
* ``repeat last``: the lower layers' last real update applied again;
* ``EMA of updates``: the EMA (β 0.9) of their real updates applied.

Reported per arm (mean over seeds): training seconds, final validation loss, and seconds to the
target (plain's validation loss at 80% of the steps, the end-to-end benchmark's rule).
Writes ``<out>/partial_backward_<task>.json`` and ``.png``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bench.protocol import plot_seed_curves, run_metadata, summarise_against_plain
from bench.tasks import get_task

ALWAYS_REAL_STEPS = 50  # the first updates are large and fast-changing: nothing to extrapolate yet
EMA_BETA = 0.9
MODES = ("plain", "freeze", "repeat last", "EMA of updates")


def cut_module(task_name: str, model: torch.nn.Module) -> torch.nn.Module:
    """The module whose input is detached on skipped steps: the MLP's second linear layer, the
    char-LM's second block."""
    if task_name == "charlm":
        return model.blocks[1]
    return [m for m in model if isinstance(m, torch.nn.Linear)][1]


def lower_parameters(task, model: torch.nn.Module, seed: int) -> list[torch.nn.Parameter]:
    """The parameters that get no gradient when the cut module's input is detached (found with
    one untimed forward and backward on a batch of a separate stream)."""
    hook = cut_module(task.name, model).register_forward_pre_hook(lambda module, args: (args[0].detach(), *args[1:]))
    task.loss_fn(model, next(task.batches(seed))).backward()
    hook.remove()
    lower = [p for p in model.parameters() if p.grad is None]
    model.zero_grad(set_to_none=True)
    return lower


def run(task, mode: str, every: int, lr: float, seed: int) -> dict:
    model = task.make_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    stream = task.batches(seed)
    lower = lower_parameters(task, model, seed)
    skipping = False
    hook = cut_module(task.name, model).register_forward_pre_hook(
        lambda module, args: (args[0].detach(), *args[1:]) if skipping else None)
    predicts = mode in ("repeat last", "EMA of updates")
    last = [torch.zeros_like(p) for p in lower]  # each lower parameter's last real update
    ema = [torch.zeros_like(p) for p in lower]
    curve = [dict(step=0, time=0.0, val_loss=task.val_loss(model), backward=0, forward=0)]
    train_time, skipped = 0.0, 0
    for step in range(1, task.steps + 1):
        batch = next(stream)
        started = time.perf_counter()
        skipping = mode != "plain" and step > ALWAYS_REAL_STEPS and step % every != 0
        if predicts and not skipping:
            before = [p.detach().clone() for p in lower]
        optimizer.zero_grad(set_to_none=True)
        task.loss_fn(model, batch).backward()
        optimizer.step()  # AdamW leaves parameters without a gradient (the lower ones when skipping) alone
        if predicts:
            with torch.no_grad():
                if skipping:
                    torch._foreach_add_(lower, last if mode == "repeat last" else ema)
                else:
                    torch._foreach_sub_(before, lower)  # before - after = -update
                    torch._foreach_neg_(before)
                    last = before
                    torch._foreach_lerp_(ema, last, 1 - EMA_BETA)
        skipped += skipping
        train_time += time.perf_counter() - started
        if step % task.eval_every == 0:
            model.eval()
            curve.append(dict(step=step, time=train_time, val_loss=task.val_loss(model), backward=step, forward=step))
            model.train()
    hook.remove()
    return dict(mode=mode, seed=seed, curve=curve, lower_backward_skipped=skipped,
                lower_parameters=sum(p.numel() for p in lower), parameters=sum(p.numel() for p in model.parameters()))


def analyse(task, runs: dict[str, list[dict]]) -> dict:
    summary, _ = summarise_against_plain(task, runs)
    for mode, seeds in runs.items():
        summary["arms"][mode].update(lower_backward_skipped=seeds[0]["lower_backward_skipped"],
                                     lower_parameter_share=seeds[0]["lower_parameters"] / seeds[0]["parameters"])
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="fashion", choices=["fashion", "charlm", "digits"])
    parser.add_argument("--every", type=int, default=2, help="a real backward below the cut every N steps (>= 2)")
    parser.add_argument("--lr", type=float, default=None, help="default: the end-to-end benchmark's tuned rate")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the task's quick size (tests)")
    parser.add_argument("--out", type=Path, default=Path("experiments/results"))
    args = parser.parse_args(argv)
    if args.every < 2:
        parser.error(f"--every must be >= 2, got {args.every}")
    torch.set_num_threads(1)
    task = get_task(args.task, quick=args.quick)
    lr = args.lr or {"fashion": 1e-3, "charlm": 2e-3, "digits": 3e-3}[args.task]
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for seed in range(args.seeds):  # modes interleaved per seed: machine noise hits them alike
        for mode in MODES:
            runs[mode].append(run(task, mode, args.every, lr, seed))
            print(f"seed {seed} {mode:15s} final val loss {runs[mode][-1]['curve'][-1]['val_loss']:.4f}", flush=True)
    summary = analyse(task, runs)
    result = dict(run_metadata(f"python -m experiments.partial_backward --task {args.task} --every {args.every} "
                               f"--lr {lr} --seeds {args.seeds}" + (" --quick" if args.quick else "")),
                  threads=torch.get_num_threads(), task=args.task, data_source=task.data_source, lr=lr,
                  every=args.every, steps=task.steps, **summary, runs=runs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"partial_backward_{args.task}.json").write_text(json.dumps(result, indent=1))
    title = f"{args.task}: lower layers' updates predicted on skipped backward passes"
    plot_seed_curves(runs, summary["target_val_loss"], title, args.out / f"partial_backward_{args.task}.png")
    print(f"\ntarget {summary['target_val_loss']:.4f} (plain at step {summary['target_step']})")
    for mode, s in summary["arms"].items():
        speed = s["speedup_vs_plain"]["mean"]
        print(f"{mode:15s} train {s['train_s']['mean']:.2f} s  final {s['final_val_loss']['mean']:.4f}  "
              f"reached {s['reached_target']}/{args.seeds}  speed-up to target "
              f"{'-' if speed is None else f'{speed:.2f}x'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

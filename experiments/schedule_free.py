"""Why the end-to-end benchmark's schedule-free arms use the betas and sweep they do.

    python -m experiments.schedule_free [--task charlm] [--seed 0] [--out experiments/results]

One seed of a ``bench.tasks`` task, one run per optimizer setting, each the plain loop for the
task's step budget: schedule-free AdamW (``schedulefree.AdamWScheduleFree``, evaluated at its
average) over rates, warm-ups and betas, and AdamW controls (the tuned rate, a linear warm-up to a
larger rate, beta2 0.95). Reported per run: the step at which the validation loss first reaches
the target of ``bench.e2e`` (the tuned AdamW run's loss at 80% of the budget; here that run's on
this seed) and the final validation loss. Steps, not seconds: the runs are sequential, so their
clocks are not comparable; the end-to-end benchmark measures time.

Output: ``<out>/schedule_free_<task>.json``, ``.md`` and ``.png`` (validation loss vs step).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from bench.protocol import ADAMW_WEIGHT_DECAY, first_crossing, interpolate, run_metadata, schedule_free_evaluation
from bench.tasks import get_task


@dataclass(frozen=True)
class Setting:
    optimizer: str  # "adamw" or "schedule-free"
    lr: float
    warmup: int = 0  # linear warm-up steps (AdamW: a LambdaLR; schedule-free: its own warmup_steps)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_lr_power: float = 2.0  # schedule-free only: step k enters the average with weight max_lr_so_far**power * (k+1)**r
    r: float = 0.0

    @property
    def name(self) -> str:
        knobs = "" if (self.weight_lr_power, self.r) == (2.0, 0.0) else f", weight_lr_power {self.weight_lr_power:g}, r {self.r:g}"
        return (f"{'AdamW' if self.optimizer == 'adamw' else 'schedule-free'} lr {self.lr:g}, warm-up "
                f"{self.warmup}, betas {self.betas}{knobs}")


TUNED = Setting("adamw", 2e-3)  # bench.e2e's swept AdamW rate on charlm
SETTINGS = [
    TUNED,
    Setting("adamw", 4e-3, 150), Setting("adamw", 3e-3, 100),
    Setting("adamw", 2e-3, 0, (0.9, 0.95)), Setting("adamw", 4e-3, 100, (0.9, 0.95)),
    *[Setting("schedule-free", lr) for lr in (2e-3, 4e-3, 8e-3)],
    Setting("schedule-free", 4e-3, 50), Setting("schedule-free", 4e-3, 100),
    Setting("schedule-free", 8e-3, 150), Setting("schedule-free", 1.2e-2, 200), Setting("schedule-free", 1.6e-2, 200),
    *[Setting("schedule-free", lr, 200, (0.95, 0.999)) for lr in (1e-2, 1.5e-2)],
    *[Setting("schedule-free", lr, 200, (0.95, 0.95)) for lr in (1e-2, 1.5e-2)],
    Setting("schedule-free", 1.5e-2, 200, (0.9, 0.95)),
    # Past the end-to-end sweep's grid: shorter and longer warm-ups at larger rates.
    Setting("schedule-free", 1.5e-2, 120, (0.95, 0.95)), Setting("schedule-free", 2e-2, 150, (0.95, 0.95)),
    Setting("schedule-free", 2.5e-2, 250, (0.95, 0.95)),
    # The average's weights (step k weighs max_lr_so_far**weight_lr_power * (k+1)**r): the package's other knobs.
    *[Setting("schedule-free", 1.5e-2, 200, (0.95, 0.95), power, 0.0) for power in (0.0, 1.0, 3.0)],
    *[Setting("schedule-free", 1.5e-2, 200, (0.95, 0.95), 2.0, r) for r in (0.5, 1.0, 2.0)],
]


def make_optimizer(setting: Setting, model: torch.nn.Module):
    """The optimizer and the LR scheduler stepped after it (None when there is none)."""
    if setting.optimizer == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=setting.lr, betas=setting.betas,
                                      weight_decay=ADAMW_WEIGHT_DECAY)
        warmup = setting.warmup
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / warmup)) if warmup else None
        return optimizer, scheduler
    import schedulefree

    optimizer = schedulefree.AdamWScheduleFree(model.parameters(), lr=setting.lr, warmup_steps=setting.warmup,
                                               betas=setting.betas, weight_decay=ADAMW_WEIGHT_DECAY,
                                               weight_lr_power=setting.weight_lr_power, r=setting.r)
    optimizer.train()
    return optimizer, None


def run(task, setting: Setting, seed: int) -> list[dict]:
    """Validation curve of one run: ``[{step, val_loss}]`` every ``task.eval_every`` steps."""
    model = task.make_model(seed)
    optimizer, scheduler = make_optimizer(setting, model)
    stream = task.batches(seed)

    def evaluate(step: int) -> dict:
        model.eval()
        with schedule_free_evaluation(optimizer) if setting.optimizer == "schedule-free" else contextlib.nullcontext():
            val = task.val_loss(model)
        model.train()
        return dict(step=step, val_loss=val)

    curve = [evaluate(0)]
    for step in range(1, task.steps + 1):
        optimizer.zero_grad(set_to_none=True)
        task.loss_fn(model, next(stream)).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        if step % task.eval_every == 0:
            curve.append(evaluate(step))
    return curve


def markdown(result: dict) -> str:
    lines = [f"Schedule-free exploration, `{result['command']}` ({result['date']}, torch {result['torch']}, "
             f"1 thread): {result['task']}, seed {result['seed']}, {result['steps']} steps each. Target "
             f"{result['target_val_loss']:.4f} = the tuned AdamW run's validation loss at step {result['target_step']}; "
             "crossing = the step at which a run first reaches it (linear between evaluations every "
             f"{result['eval_every']} steps).", "",
             "| optimizer | lr | warm-up | betas | weight_lr_power, r | crossing step | final val loss |",
             "|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        s = r["setting"]
        cross = "not reached" if r["crossing_step"] is None else f"{r['crossing_step']:.0f}"
        knobs = "–" if s["optimizer"] == "adamw" else f"{s['weight_lr_power']:g}, {s['r']:g}"
        lines.append(f"| {s['optimizer']} | {s['lr']:g} | {s['warmup']} | {tuple(s['betas'])} | {knobs} | {cross} "
                     f"| {r['final_val_loss']:.4f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for i, r in enumerate(result["runs"]):
        s = r["setting"]
        ax.plot([p["step"] for p in r["curve"]], [p["val_loss"] for p in r["curve"]], lw=1.0,
                ls="--" if s["optimizer"] == "adamw" else "-", color=f"C{i % 10}", label=r["name"])
    ax.axhline(result["target_val_loss"], color="black", lw=0.8, ls=":", label="target")
    ax.set_ylim(result["target_val_loss"] * 0.8, result["target_val_loss"] * 1.6)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{result['task']}, seed {result['seed']}: schedule-free AdamW (solid) and AdamW (dashed)", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="charlm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="the task's quick variant (tests)")
    parser.add_argument("--out", type=Path, default=Path("experiments/results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    task = get_task(args.task, args.quick)
    settings = SETTINGS if not args.quick else [TUNED, Setting("schedule-free", 1e-2, 20, (0.95, 0.95))]
    curves = [run(task, s, args.seed) for s in tqdm(settings, desc=f"{task.name}: settings", file=sys.stderr, disable=None)]
    target_step = int(0.8 * task.steps)
    target = interpolate(curves[0], "step", target_step)
    runs = []
    for setting, curve in zip(settings, curves):
        cross = first_crossing([dict(p, time=p["step"], backward=p["step"], forward=p["step"]) for p in curve], target)
        runs.append(dict(name=setting.name, setting=asdict(setting), crossing_step=None if cross is None else cross["step"],
                         final_val_loss=curve[-1]["val_loss"], curve=curve))
    command = f"python -m experiments.schedule_free --task {args.task} --seed {args.seed}" + (" --quick" if args.quick else "")
    result = dict(run_metadata(command), task=task.name, seed=args.seed, steps=task.steps, eval_every=task.eval_every,
                  target_step=target_step, target_val_loss=target, runs=runs)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"schedule_free_{task.name}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    stem.with_suffix(".md").write_text(text)
    plot(result, stem.with_suffix(".png"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

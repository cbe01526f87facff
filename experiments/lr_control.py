"""Does an online learning-rate controller pay where predicted updates do not?

    python -m experiments.lr_control [--tasks fashion charlm digits] [--seeds 2] [--out experiments/results]

The trainer's worth gate measures, every real step, the first-order loss change of one more step
along the recent update direction on a fresh batch; on every task it is positive but small
(≈ 0.03–0.07 of a real step), too small to pay for a predicted step. The same signal, the
*hypergradient* ``<g_t, u_{t-1}>`` (Baydin et al., 2018: the derivative of the loss with respect
to the learning rate), can instead drive the learning rate: while fresh gradients keep pointing
along the last update the loop under-steps, when they turn against it, it over-steps. Whether
that beats a tuned constant rate, to a target, in wall-clock, is what this measures.

Controller (multiplicative, normalised, so one ``beta`` fits every model):
``lr ← lr · (1 − beta · cos(g_t, u_{t−1}))`` before each optimizer step, where ``u_{t−1}`` is
the update the last step actually applied (weight decay included) and ``g_t`` the fresh gradient.

Protocol: that of ``bench.e2e`` (same initialisation, same batches, arms interleaved chunk by
chunk, target = the tuned loop's validation loss at 80% of its steps). Arms: AdamW at the swept
rate, at 2× it, and the controlled loop from the tuned rate at each ``--betas``. The controller's
own cost (a copy of the weights and three reductions per step) is in the controlled arms' time.
``--cosine-factors`` adds reference arms that need no signal at all: linear warmup over 5% of the
budget, then a cosine to zero at its end, peaking at each factor × the tuned rate (with
``--tag``, so they are written beside, not over, the controller's results). They ask whether any
learning-rate schedule of the plain loop comes near the 2× the end-to-end goal asks for.
``--clipped-factors`` adds constant-rate arms whose global gradient norm is clipped to 1.0: does
clipping make a larger rate stable?

Writes ``<out>/lr_control_<task>.json``, ``<out>/lr_control.md`` and ``<out>/lr_control_<task>.png``
(``_<tag>`` added to each name with ``--tag``)
(validation loss vs wall-clock, and each controlled arm's learning rate over steps).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.protocol import (ArmRun, ArmSpec, analyse, cpu_description, format_mean_std, plot_loss_curves, run_arms,
                            run_metadata, seed_style, sweep_lr)
from bench.tasks import get_task

BETAS = (0.005, 0.02)


class HypergradientLR:
    """Multiplicative hypergradient control of ``optimizer``'s learning rate (all groups scaled alike).

    Call :meth:`before_step` after ``backward()`` and before ``optimizer.step()``, and
    :meth:`after_step` right after it. ``lr_bounds`` (multiples of the starting rate) keep a
    run of one-sided cosines from running the rate away.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, beta: float, lr_bounds: tuple[float, float] = (0.1, 10.0)):
        if not beta > 0:
            raise ValueError(f"beta must be > 0, got {beta}")
        self.optimizer = optimizer
        self.beta = beta
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.start_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self.lr_bounds = lr_bounds
        self.factor = 1.0
        self._previous = [torch.empty_like(p) for p in self.params]
        self._has_update = False
        self.cosines: list[float] = []

    @torch.no_grad()
    def before_step(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self._has_update:  # _previous holds u_{t-1}
            dot = torch.stack([torch.vdot(g.flatten(), u.flatten()) for g, u in zip(grads, self._previous)]).sum()
            g_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
            u_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(self._previous)))
            cos = float(dot / (g_norm * u_norm).clamp_min(1e-30))
            self.cosines.append(cos)
            low, high = self.lr_bounds
            self.factor = min(high, max(low, self.factor * (1.0 - self.beta * cos)))
            for group, start in zip(self.optimizer.param_groups, self.start_lrs):
                group["lr"] = start * self.factor
        torch._foreach_copy_(self._previous, [p.detach() for p in self.params])

    @torch.no_grad()
    def after_step(self) -> None:
        # u_t = w_{t+1} − w_t, stored in place of w_t
        torch._foreach_sub_(self._previous, [p.detach() for p in self.params])
        torch._foreach_neg_(self._previous)
        self._has_update = True


WARMUP_FRACTION = 0.05  # of the plain budget, for the warmup-cosine reference arms
CLIP_NORM = 1.0  # max global gradient norm of the clipped reference arms (nanoGPT's default)


def warmup_cosine(total_steps: int):
    """LambdaLR factor: linear warmup over ``WARMUP_FRACTION`` of ``total_steps``, then a cosine
    from 1 to 0 at ``total_steps``."""
    warmup = max(1, round(WARMUP_FRACTION * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


@dataclass
class ControlledArmSpec(ArmSpec):
    hypergradient_beta: float | None = None  # None: no hypergradient control
    cosine: bool = False  # warmup-cosine schedule over the plain budget, peaking at ``lr``
    clip: bool = False  # clip the global gradient norm to CLIP_NORM before each step


class ControlledArmRun(ArmRun):
    """The e2e plain AdamW loop, with the hypergradient controller when the arm has a ``beta``
    and a warmup-cosine schedule or gradient clipping when it asks for them; the learning rate is
    recorded at each evaluation."""

    def __post_init__(self):
        super().__post_init__()
        beta = self.spec.hypergradient_beta
        self.controller = None if beta is None else HypergradientLR(self.optimizer, beta)
        self.scheduler = (torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup_cosine(self.budget))
                          if self.spec.cosine else None)
        self.curve[-1]["lr"] = self.optimizer.param_groups[0]["lr"]

    def plain_step(self, batch) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.task.loss_fn(self.model, batch).backward()
        if self.spec.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP_NORM)
        if self.controller is not None:
            self.controller.before_step()
        self.optimizer.step()
        if self.controller is not None:
            self.controller.after_step()
        if self.scheduler is not None:
            self.scheduler.step()

    def run_chunk(self, n: int, record_phases: bool) -> None:
        super().run_chunk(n, record_phases)
        self.curve[-1]["lr"] = self.optimizer.param_groups[0]["lr"]


def benchmark_task(name: str, n_seeds: int, betas: list[float], cosine_factors: list[float],
                   clipped_factors: list[float]) -> dict:
    task = get_task(name)
    print(f"\n== {name}: {task.data_source}", flush=True)
    tuned_lr, sweep = sweep_lr(task, seed=1000)
    arms = [ControlledArmSpec("AdamW (tuned lr)", tuned_lr), ControlledArmSpec("AdamW (2x lr)", 2 * tuned_lr)]
    arms += [ControlledArmSpec(f"AdamW + hypergradient lr (beta {b:g})", tuned_lr, hypergradient_beta=b) for b in betas]
    arms += [ControlledArmSpec(f"AdamW + warmup-cosine, peak {f:g}x lr", f * tuned_lr, cosine=True) for f in cosine_factors]
    arms += [ControlledArmSpec(f"AdamW + grad clip {CLIP_NORM:g}, {f:g}x lr", f * tuned_lr, clip=True) for f in clipped_factors]
    seeds = list(range(n_seeds))
    started = time.perf_counter()
    runs = run_arms(task, arms, seeds, desc=f"{name}: {len(arms)} arms x {n_seeds} seeds", make_run=ControlledArmRun)
    result = analyse(task, arms, runs, baseline="AdamW (tuned lr)")
    for spec in arms:
        arm = result["arms"][spec.name]
        arm["hypergradient_beta"] = spec.hypergradient_beta
        arm["cosine_schedule"] = spec.cosine
        arm["grad_clip"] = CLIP_NORM if spec.clip else None
        arm["final_lr"] = [r.optimizer.param_groups[0]["lr"] for r in runs[spec.name]]
        controllers = [r.controller for r in runs[spec.name] if r.controller is not None]
        if controllers:
            cos = [c for ctl in controllers for c in ctl.cosines]
            arm["mean_cosine"] = sum(cos) / len(cos)
    result.update(task=name, data_source=task.data_source, details=task.details, steps=task.steps,
                  eval_every=task.eval_every, lr_sweep=sweep, tuned_lr=tuned_lr, seeds=seeds,
                  wall_s=time.perf_counter() - started)
    return result


def markdown(results: list[dict], meta: dict) -> str:
    cell = format_mean_std
    lines = [f"Learning-rate control vs a tuned constant rate, `{meta['command']}` ({meta['date']}, "
             f"{meta['device']}, torch {meta['torch']}, {meta['threads']} thread). Mean ± std over seeds.", ""]
    for r in results:
        lines += [f"### {r['task']}: {r['data_source']}", "",
                  f"Target val loss {r['target_val_loss']:.4f} ({r['target_definition']}); tuned lr {r['tuned_lr']:g} "
                  f"from sweep {r['lr_sweep']}; seeds {r['seeds']}.", "",
                  "| arm | start (peak) lr | final lr | time to target (s) | speed-up | steps to target | gap vs tuned at equal time "
                  "| final val loss |", "|---|---|---|---|---|---|---|---|"]
        for name, arm in r["arms"].items():
            s = arm["summary"]
            reached = f" ({s['reached_target']}/{len(arm['seeds'])} reached)" if s["reached_target"] < len(arm["seeds"]) else ""
            final_lr = " / ".join(f"{lr:.3g}" for lr in arm["final_lr"])
            lines.append(f"| {name} | {arm['lr']:g} | {final_lr} | {cell(s['time_to_target_s'], 2)}{reached} "
                         f"| {cell(s['speedup_vs_baseline'], 2)}× | {cell(s['backward_to_target'], 0)} "
                         f"| {cell(s['loss_gap_pct_at_equal_time'], 2, True)} | {cell(s['final_val_loss'], 4)} |")
        cos = {n: a["mean_cosine"] for n, a in r["arms"].items() if "mean_cosine" in a}
        if cos:
            lines.append("\nMean cos(fresh gradient, last update) seen by the controller: "
                         + ", ".join(f"{n.split('(')[-1].rstrip(')')} {c:+.4f}" for n, c in cos.items()) + ".")
        lines.append("")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_lr) = plt.subplots(1, 2, figsize=(12, 4.5))
    plot_loss_curves(ax, result)
    ax.legend(fontsize=7)
    for i, (name, arm) in enumerate(result["arms"].items()):
        for j, seed in enumerate(arm["seeds"]):
            ax_lr.plot([p["step"] for p in seed["curve"]], [p["lr"] for p in seed["curve"]], **seed_style(i, j, name))
    ax_lr.set_xlabel("step")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_yscale("log")
    fig.suptitle(f"{result['task']}: learning-rate control vs a tuned constant rate", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="hypergradient learning-rate control vs a tuned constant rate")
    parser.add_argument("--tasks", nargs="+", default=["fashion", "charlm", "digits"])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--betas", nargs="*", type=float, default=list(BETAS),
                        help="hypergradient arms (none: give the flag alone)")
    parser.add_argument("--cosine-factors", nargs="*", type=float, default=[],
                        help="warmup-cosine reference arms, peak lr = factor x the tuned lr")
    parser.add_argument("--clipped-factors", nargs="*", type=float, default=[],
                        help=f"constant-rate reference arms with the gradient norm clipped to {CLIP_NORM:g}, "
                             "lr = factor x the tuned lr")
    parser.add_argument("--tag", default=None, help="write lr_control_<task>_<tag>.* and lr_control_<tag>.md")
    parser.add_argument("--out", type=Path, default=Path("experiments/results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = run_metadata("python -m experiments.lr_control " + " ".join(argv if argv is not None else sys.argv[1:]),
                        device=cpu_description(), threads=torch.get_num_threads())
    results = []
    for name in args.tasks:
        result = benchmark_task(name, args.seeds, args.betas, args.cosine_factors, args.clipped_factors)
        result["meta"] = meta
        results.append(result)
        stem = f"lr_control_{name}" + (f"_{args.tag}" if args.tag else "")
        (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
        plot(result, args.out / f"{stem}.png")
    text = markdown(results, meta)
    (args.out / ("lr_control" + (f"_{args.tag}" if args.tag else "") + ".md")).write_text(text + "\n")
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Loss parity of the memory techniques: the final validation loss of each configuration of
``bench.capacity`` against fp32 AdamW, on the char-LM and Fashion-MNIST tasks.

    python -m bench.capacity_parity                      # both tasks, every arm, 3 seeds (≈ 20 min, 1 core)
    python -m bench.capacity_parity --tasks fashion --arms "fp32 AdamW" "4-bit state"   # re-runs these arms only

Each run is what a user writes: the task's model (``bench.tasks``, initialised from the seed),
the optimizer built by ``bench.capacity.make_optimizer`` and ``HybridTrainer(model, optimizer,
loss_fn, HybridConfig(predict=False, good_state_every=0, **knobs))``, stepped ``--steps-*``
times on the task's seed-determined batch stream; every arm of a seed sees the same
initialisation and the same batches. Peak learning rate char-LM 2e-3, Fashion-MNIST 1e-3, with a
10-step warm-up and a cosine decay to a tenth of it (``--schedule constant``: no schedule; at a
constant rate the final iterate of the char-LM moved by several percent from seed to seed and arm
to arm, more than the techniques' own effect).
The validation loss is the task's (a fixed held-out set), under bf16 autocast where the weights
are bf16.

Reported per configuration: bytes of training state per parameter (the planner's count for the
task's model and, where ``docs/results/capacity.json`` has it, the slope measured by
``bench.capacity --part sweep``), the final validation loss (mean ± standard deviation over
seeds), its gap against fp32 AdamW (the ratio of the means − 1, and the per-seed paired gap),
and the median step time against fp32 AdamW's. When no configuration at ≤ 3 bytes/param is
within 1% of fp32 the report lists the frontier (the configurations no other beats on both
bytes/param and gap). Results in ``docs/results/capacity_parity.{json,md}``, rewritten after
every arm so an interrupted run keeps what it measured; with ``--arms`` the task's other arms keep
their stored results when steps, learning rate and schedule match (each arm records its run).

All arms run in one process on one thread; timings come from a shared 2-core machine (noisy).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.capacity import ARMS, ROOT, make_optimizer
from bench.protocol import run_metadata

PARITY_LR = {"charlm": 2e-3, "fashion": 1e-3}
DEFAULT_STEPS = {"charlm": 300, "fashion": 300}
WARMUP_STEPS = 10
FINAL_LR_FRACTION = 0.1
BASELINE = "fp32 AdamW"
GAP_GOAL_PCT = 1.0
BYTES_GOAL = 3.0
THIRD_PARTY = [arm for arm, (kind, _) in ARMS.items() if kind != "adamw"]


def lr_factor(step: int, steps: int, schedule: str) -> float:
    """The learning rate of step ``step`` (0-based) over the peak: ``"constant"`` 1; ``"cosine"``
    a linear warm-up over the first WARMUP_STEPS steps, then a cosine decay to FINAL_LR_FRACTION
    of the peak at the last step (the decay damps the step-to-step noise of the final iterate, so
    its validation loss compares configurations rather than where the last batches threw it)."""
    if schedule == "constant":
        return 1.0
    if step < WARMUP_STEPS:
        return (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, steps - 1 - WARMUP_STEPS)
    return FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def run_arm(task, arm: str, seed: int, steps: int, lr: float, schedule: str = "cosine") -> dict[str, Any]:
    """One training run of ``arm`` on ``task`` for ``steps`` steps: final validation loss,
    median step time (the first 5 steps, which include compilation, left out) and the plan."""
    from hybrid_trainer import HybridConfig, HybridTrainer

    kind, knobs = ARMS[arm]
    model = task.make_model(seed)
    optimizer = make_optimizer(kind, model, lr=lr)
    # built over the user's optimizer: it drives the one the trainer converts it to
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, steps, schedule))
    trainer = HybridTrainer(model, optimizer, task.loss_fn,
                            HybridConfig(predict=False, good_state_every=0, cost_aware=False, **knobs),
                            scheduler=scheduler)
    batches = task.batches(seed)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        trainer.step(next(batches))
        times.append(time.perf_counter() - started)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=trainer._plan_autocast is not None):
        val = task.val_loss(model)
    return {"val_loss": val, "step_ms": 1e3 * statistics.median(times[5:] or times),
            "plan_bytes_per_param": trainer.memory_plan.bytes_per_param, "optimizer": type(trainer.optimizer).__name__}


def summarize(task_result: dict[str, Any]) -> None:
    """Adds mean, spread, gap against fp32 AdamW and step-time factor to every arm in place."""
    base = task_result["arms"].get(BASELINE)
    for entry in task_result["arms"].values():
        if not entry.get("val_loss"):
            continue
        vals = entry["val_loss"]
        entry["val_mean"] = statistics.mean(vals)
        entry["val_std"] = statistics.stdev(vals) if len(vals) > 1 else 0.0
        entry["step_ms_median"] = statistics.median(entry["step_ms"])
        if base and base.get("val_loss"):
            # against fp32 over the same seeds (an arm may run fewer seeds than the baseline)
            entry["gap_pct"] = 100 * (entry["val_mean"] / statistics.mean(base["val_loss"][:len(vals)]) - 1)
            paired = [100 * (v / b - 1) for v, b in zip(vals, base["val_loss"])]
            entry["paired_gap_pct"] = paired
            entry["paired_gap_std_pct"] = statistics.stdev(paired) if len(paired) > 1 else 0.0
            entry["paired_gap_mean_pct"] = statistics.mean(paired)
            entry["paired_gap_ci95_pct"] = paired_ci95(paired)
            entry["noise_verdict"] = ("the baseline" if entry is base else
                                      noise_verdict(entry["paired_gap_mean_pct"], entry["paired_gap_ci95_pct"], len(paired)))
            entry["step_time_factor"] = entry["step_ms_median"] / statistics.median(base["step_ms"])


def paired_ci95(paired: list[float]) -> float | None:
    """Half-width of the two-sided 95% Student-t interval of the mean paired gap (percent);
    None for one seed. With 3 seeds t(0.975, 2) = 4.30: the interval is wide."""
    if len(paired) < 2:
        return None
    from scipy.stats import t

    return float(t.ppf(0.975, len(paired) - 1) * statistics.stdev(paired) / math.sqrt(len(paired)))


def noise_verdict(mean: float, ci95: float | None, n: int) -> str:
    """Whether a mean paired gap is told apart from zero by the seeds: a gap inside its own 95%
    interval around zero is seed noise, whatever its sign."""
    if ci95 is None:
        return f"{n} seed: spread unknown"
    if abs(mean) <= ci95:
        return "within seed noise"
    return "lower than fp32 beyond seed noise" if mean < 0 else "higher than fp32 beyond seed noise"


def low_bit_floor(block_size: int) -> float:
    """The planner's training-state count of the smallest configuration (step in the backward,
    4-bit moments, bf16 weights) at a block size: 2 bytes of bf16 weight + two moments at half a
    byte + one fp32 scale per block of each moment (8 / block bytes); no gradient is held per
    parameter (each is freed by its hook). 3.00 before any scale, so never at or below 3.00."""
    return 2.0 + 2 * 0.5 + 2 * 4.0 / block_size


def bytes_per_param(arm: str, entry: dict[str, Any], sweep_fits: dict[str, Any]) -> float:
    """The figure the frontier uses: the measured sweep slope where there is one (it includes
    what the plan's table cannot know, e.g. GaLore's low-rank state), else the plan's count."""
    fit = sweep_fits.get(arm)
    return fit["bytes_per_param"] if fit else entry["plan_bytes_per_param"]


def frontier(task_result: dict[str, Any], sweep_fits: dict[str, Any], key: str = "plan") -> list[str]:
    """Arms no other arm beats on both bytes/param and gap (ties kept), fewest bytes first.
    ``key``: "plan" (the planner's training-state count) or "measured" (the sweep's slope)."""
    points = {}
    for arm, e in task_result["arms"].items():
        if "gap_pct" not in e:
            continue
        points[arm] = (e["plan_bytes_per_param"] if key == "plan" else bytes_per_param(arm, e, sweep_fits), e["gap_pct"])
    keep = [a for a, (b, g) in points.items()
            if not any(b2 <= b and g2 <= g and (b2, g2) != (b, g) for a2, (b2, g2) in points.items() if a2 != a)]
    return sorted(keep, key=lambda a: points[a][0])


def within_gap(entry: dict[str, Any]) -> bool:
    """One-sided: the goal is a loss no more than 1% worse than fp32's, so any lower loss passes."""
    return "gap_pct" in entry and entry["gap_pct"] <= GAP_GOAL_PCT


def goal_met(task_result: dict[str, Any]) -> list[str]:
    """Arms at ≤ 3 bytes/param (plan) whose mean loss is at most 1% above fp32 AdamW's (one-sided)."""
    return [a for a, e in task_result["arms"].items()
            if within_gap(e) and e["plan_bytes_per_param"] <= BYTES_GOAL]


def _fmt_pct(x: float | None) -> str:
    return "–" if x is None else f"±{x:.2f}"


def markdown(result: dict[str, Any]) -> str:
    fits = result.get("sweep_fits", {})
    eager = result.get("eager_fits", {})
    lines = ["# Loss parity of the memory techniques against fp32 AdamW", "",
             f"`{result['command']}` at commit `{(result.get('git_commit') or 'unknown')[:10]}`"
             f"{' (dirty tree)' if result.get('git_dirty') else ''}, {result['date']}, {result['machine']}. "
             "Every arm of a seed starts from the same initialisation and sees the same batches and "
             "learning rates; final validation loss on the task's held-out set. Step times on a shared "
             "2-core machine: noisy.", "",
             "bytes/param: the planner's count of training state for the task's model (weights + gradients "
             "+ optimizer state; third-party optimizers from its table by class name, which does not know "
             "GaLore's or APOLLO's low-rank state); the slope of peak memory measured by `python -m "
             "bench.capacity --part sweep` (Llama-shaped models of 3.2M-31.7M parameters; activations and fixed "
             "costs included; the low-bit update compiled at the largest size only, whose resident runtime "
             "enters that slope); and, for the configurations it measures, `python -m bench.capacity --part "
             "eager-sweep` (25M-354M-parameter GPTs, low-bit update eager at every size: slope of the whole "
             "peak / of the steps' peak less the measured activations).", "",
             f"Gaps: 'gap' is the ratio of the mean losses − 1; 'paired' is the mean of the per-seed gaps "
             f"(same seed, same initialisation and batches) ± their standard deviation, and the half-width of "
             f"its two-sided 95% Student-t interval. A gap inside that interval is seed noise whatever its sign. "
             f"The goal is one-sided (no more than {GAP_GOAL_PCT:g}% worse than fp32), so a lower loss than "
             f"fp32's is within it.", ""]
    for task_name, tr in result["tasks"].items():
        run = tr.get("run", {})
        lines += [f"## {task_name} ({tr['steps']} steps, peak lr {tr['lr']}, {tr.get('schedule', 'constant')}, "
                  f"seeds {tr['seeds']})", "",
                  f"`{run.get('command', result['command'])}` at commit `{(run.get('git_commit') or 'unknown')[:10]}`, "
                  f"{run.get('date', result['date'])}. {tr.get('details', '')}", ""]
        later: dict[tuple, list[str]] = {}
        for arm, e in tr["arms"].items():
            arm_run = e.get("run")
            if arm_run and arm_run.get("command") != run.get("command"):
                later.setdefault((arm_run["command"], (arm_run.get("git_commit") or "unknown")[:10],
                                  arm_run.get("date", "")), []).append(arm)
        for (command, commit, date), arms in later.items():
            lines += [f"Re-measured by `{command}` at commit `{commit}`, {date}: {', '.join(arms)}.", ""]
        lines += ["| configuration | bytes/param (plan) | sweep slope | GPT eager sweep (whole / state) | "
                  "val loss (mean ± std) | per seed | gap vs fp32 | paired gap (mean ± std) | 95% interval | "
                  "seeds say | step ms | × fp32 |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for arm, e in tr["arms"].items():
            if "error" in e and not e.get("val_loss"):
                lines.append(f"| {arm} | | | | {e['error'][:150]} | | | | | | | |")
                continue
            fit, eag = fits.get(arm), eager.get(arm)
            paired = e.get("paired_gap_pct")
            lines.append(
                f"| {arm} | {e['plan_bytes_per_param']:.2f} | "
                + (f"{fit['bytes_per_param']:.2f} | " if fit else "– | ")
                + (f"{eag['bytes_per_param']:.2f} / {eag['state_bytes_per_param']:.2f} | " if eag else "– | ")
                + f"{e['val_mean']:.4f} ± {e['val_std']:.4f} | {', '.join(f'{v:.4f}' for v in e['val_loss'])} | "
                + f"{e.get('gap_pct', float('nan')):+.2f}% | "
                + (f"{statistics.mean(paired):+.2f}% ± {e['paired_gap_std_pct']:.2f} | "
                   f"{_fmt_pct(e.get('paired_gap_ci95_pct'))} | {e.get('noise_verdict', '–')} | " if paired else "– | – | – | ")
                + f"{e['step_ms_median']:.1f} | {e.get('step_time_factor', float('nan')):.2f} |")
        met = goal_met(tr)
        lines.append("")
        goal = (f"Goal (≤ {BYTES_GOAL:g} bytes/param of training state in the plan, mean loss at most "
                f"{GAP_GOAL_PCT:g}% above fp32's)")
        lines.append(f"{goal} met by: {', '.join(met)}." if met else f"{goal} not met by any configuration.")
        within = [a for a, e in tr["arms"].items() if within_gap(e)]
        if within:
            best = min(within, key=lambda a: tr["arms"][a]["plan_bytes_per_param"])
            e = tr["arms"][best]
            ci = e.get("paired_gap_ci95_pct")
            lines.append(f"Fewest bytes/param within {GAP_GOAL_PCT:g}% of fp32: {best}, {e['plan_bytes_per_param']:.2f} "
                         f"bytes/param, gap {e['gap_pct']:+.2f}% (paired over {len(e['val_loss'])} seeds "
                         f"{e['paired_gap_mean_pct']:+.2f}% ± {e['paired_gap_std_pct']:.2f}"
                         + (f", 95% interval ±{ci:.2f}: {e['noise_verdict']}" if ci is not None else "") + ").")
        # the measured figure: the GPT eager sweep's whole-peak slope where it measured the
        # configuration (sizes where fixed costs weigh less), else the small sweep's
        measured = {**fits, **{a: {"bytes_per_param": f["bytes_per_param"]} for a, f in eager.items()}}
        for key, label in (("plan", "planner's bytes/param"),
                           ("measured", "measured slope (GPT eager sweep where it ran, else the small sweep)")):
            front = frontier(tr, measured, key)
            pts = [f"{a} ({tr['arms'][a]['plan_bytes_per_param'] if key == 'plan' else bytes_per_param(a, tr['arms'][a], measured):.2f} "
                   f"B/param, {tr['arms'][a]['gap_pct']:+.2f}%)" for a in front]
            lines.append(f"\nFrontier by the {label} (fewest bytes first): {'; '.join(pts)}.")
        lines.append("")
    lines += ["## Why no configuration reaches 3.00 bytes/param", "",
              "The smallest configuration (step inside the backward, 4-bit moments, bf16 weights with stochastic "
              "rounding) holds 2 bytes of bf16 weight and two moments at half a byte each per parameter: 3.00 "
              "bytes before any quantization scale, and each moment adds one fp32 scale per block (8 / block "
              "bytes/param for the two). Its count (`low_bit_floor`): "
              + ", ".join(f"{low_bit_floor(b):.3f} at blocks of {b}" for b in (128, 256, 512))
              + " (128 is the trainer's default for 4 bits). Any block size leaves it above 3.00; getting below "
              "needs dropping a byte class (e.g. a factored second moment or 8-bit weights), which this stack "
              "does not do. The measured slopes add activations, the runtime and allocator slack on top.", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from .tasks import get_task

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="*", default=["charlm", "fashion"])
    parser.add_argument("--arms", nargs="*", default=None, help="configurations (default: every arm of bench.capacity)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--third-party-seeds", type=int, default=None,
                        help="seeds for the third-party optimizers (default: --seeds)")
    parser.add_argument("--steps-charlm", type=int, default=DEFAULT_STEPS["charlm"])
    parser.add_argument("--steps-fashion", type=int, default=DEFAULT_STEPS["fashion"])
    parser.add_argument("--schedule", choices=["cosine", "constant"], default="cosine",
                        help=f"learning rate: {WARMUP_STEPS}-step warm-up then cosine decay to "
                             f"{FINAL_LR_FRACTION:g} of the peak (default), or constant")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results"))
    parser.add_argument("--reports-only", action="store_true", help="rewrite capacity_parity.md from its JSON")
    args = parser.parse_args(argv)
    out = Path(args.out)
    path = out / "capacity_parity.json"
    if args.reports_only:
        stored = json.loads(path.read_text())
        for tr in stored["tasks"].values():
            summarize(tr)  # a file written before a summary field existed gets it
        (out / "capacity_parity.md").write_text(markdown(stored))
        return 0
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["HYBRID_KERNELS_BACKEND"] = "eager"
    torch.set_num_threads(1)
    arms = args.arms or list(ARMS)
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"--arms: unknown {unknown}; choose from {list(ARMS)}")
    if BASELINE in arms:  # the baseline first, so every later arm's gap is known as soon as it ends
        arms = [BASELINE] + [a for a in arms if a != BASELINE]
    steps = {"charlm": args.steps_charlm, "fashion": args.steps_fashion}
    sweep_path = out / "capacity.json"
    stored = json.loads(sweep_path.read_text()) if sweep_path.exists() else {}
    sweep_fits = stored.get("sweep", {}).get("fits", {})
    eager_fits = stored.get("eager_sweep", {}).get("fits", {})
    previous = json.loads(path.read_text()) if path.exists() else {}
    result = run_metadata("python -m bench.capacity_parity " + shlex.join(argv if argv is not None else sys.argv[1:]),
                          machine=f"{os.cpu_count()} CPU cores, torch {torch.__version__}, 1 thread",
                          tasks={}, sweep_fits={a: {"bytes_per_param": f["bytes_per_param"]} for a, f in sweep_fits.items()},
                          eager_fits={a: {k: f[k] for k in ("bytes_per_param", "state_bytes_per_param")}
                                      for a, f in eager_fits.items()})
    # tasks not run now keep their stored results (each task records the run that measured it)
    result["tasks"] = {k: v for k, v in previous.get("tasks", {}).items() if k not in args.tasks}
    for kept in result["tasks"].values():
        summarize(kept)  # a task stored before a summary field existed gets it
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        path.write_text(json.dumps(result, indent=1))
        (out / "capacity_parity.md").write_text(markdown(result))

    this_run = {k: result[k] for k in ("command", "date", "git_commit", "git_dirty")}
    for task_name in args.tasks:
        task = get_task(task_name)
        tr = result["tasks"][task_name] = {"steps": steps[task_name], "lr": PARITY_LR[task_name],
                                           "schedule": (f"{WARMUP_STEPS}-step warm-up, cosine to {FINAL_LR_FRACTION:g}×"
                                                        if args.schedule == "cosine" else "constant"),
                                           "seeds": list(range(args.seeds)), "arms": {},
                                           "details": f"{task.data_source}; {task.details}", "run": this_run}
        stored_task = previous.get("tasks", {}).get(task_name)
        if args.arms and stored_task and all(stored_task.get(k) == tr[k] for k in ("steps", "lr", "schedule")):
            # only some arms re-run under the same protocol: the others keep what they measured,
            # each arm recording the run that measured it
            tr["run"], tr["arms"] = stored_task["run"], stored_task["arms"]
            tr["seeds"] = sorted(set(stored_task["seeds"]) | set(tr["seeds"]))
            for entry in tr["arms"].values():
                entry.setdefault("run", stored_task["run"])
        for arm in arms:
            n_seeds = args.third_party_seeds if arm in THIRD_PARTY and args.third_party_seeds else args.seeds
            entry = tr["arms"][arm] = {"val_loss": [], "step_ms": [], "run": this_run}
            for seed in range(n_seeds):
                try:
                    run = run_arm(task, arm, seed, steps[task_name], PARITY_LR[task_name], args.schedule)
                except Exception as error:  # noqa: BLE001 - reported per arm
                    entry["error"] = f"{type(error).__name__}: {error}"[:300]
                    print(f"parity {task_name} {arm}: {entry['error']}", flush=True)
                    break
                entry["val_loss"].append(run["val_loss"])
                entry["step_ms"].append(run["step_ms"])
                entry["plan_bytes_per_param"] = run["plan_bytes_per_param"]
                entry["optimizer"] = run["optimizer"]
                print(f"parity {task_name} {arm:28s} seed {seed}: val {run['val_loss']:.4f}, "
                      f"{run['step_ms']:.1f} ms/step", flush=True)
            summarize(tr)
            save()
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""End-to-end benchmark: HybridTrainer vs a tuned plain AdamW loop on real data.

    python -m bench.e2e [--quick] [--tasks charlm fashion digits] [--seeds 3] [--device cpu|cuda] [--out docs/results]

Protocol (``bench.protocol``):
* Every arm of a task starts from the same initialisation and sees the same batches in the same
  order, per seed. All arms of a task run in one process, interleaved chunk by chunk
  (``eval_every`` steps of one arm, then of the next), so machine noise hits them alike.
  ``torch.set_num_threads`` is fixed and reported.
* Arms: AdamW at the learning rate picked by a small sweep (recorded in the output), the same
  loop at 2× that rate (repeating updates resembles a larger step: the honest competitor), and
  HybridTrainer at the tuned rate (default config; ``no-predict``: prediction off, what the
  trainer's safety layer alone costs; ``no-predict-graph``: the same, its steady step replayed
  from a CUDA graph, with ``--device cuda --fused-adamw``; ``aggressive``, ``conservative`` and ``forced``, which
  predicts at every decision whatever it is worth, on request). ``weight-average``: the
  trainer evaluated at its lag-corrected weight average, at the rate a second sweep (1×, 2×, 4×
  the tuned one, final loss at the average) picks, with its control, the AdamW loop at that rate
  evaluated at the same average, so a gain is attributed to averaging, not to the trainer.
  ``schedule-free``: the trainer (default config) over schedule-free AdamW (the ``schedulefree``
  package) at the rate and warm-up a third sweep picks, with its control, the plain loop over the
  same optimizer; both are evaluated at the optimizer's averaged weights (``optimizer.eval()``).
  Without that package the default presets leave these arms out (as the muon arms without
  ``torch.optim.Muon``), and asking for them is an error.
  ``muon``: the trainer over Muon (``torch.optim.Muon``) for the hidden weight matrices and AdamW
  for the rest, one ``CombinedOptimizer``, at the rates a fourth sweep picks, with its control,
  the plain loop over the same pair; ``muon-forced`` (on request) the same with prediction forced.
  Plain arms run ``steps`` steps; hybrid arms get 1.5× as many steps (they may see more batches;
  the claim is wall-clock).
* Target = the tuned baseline's validation loss at 80% of its budget (mean over seeds). Reported
  per arm: training wall-clock and forward/backward passes to reach it, validation loss at equal
  wall-clock (the tuned baseline's total training time), its gap in %, backward passes saved,
  verifications accepted/rejected; mean ± std over seeds. Evaluation time is not training time.
* ``--device cuda``: models, data and validation on the GPU (same initialisations and batches as
  on CPU: both are drawn on CPU, then moved); the clock is read after ``torch.cuda.synchronize()``.
* Output: ``<out>/e2e_<task>.json``, ``<out>/e2e.md`` (all tasks) and ``<out>/e2e_<task>.png``
  (validation loss vs wall-clock; phases of the first hybrid run shaded); ``_quick`` then
  ``_cuda`` added to each name with ``--quick`` and ``--device cuda``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from . import protocol
from .protocol import (ADAMW_WEIGHT_DECAY, FORCED_PREDICTION, HYBRID_STEP_FACTOR, MUON_PRESETS,
                       PRESETS, SCHEDULE_FREE_BETAS, ArmRun, ArmSpec, Task, analyse, format_mean_std,
                       cpu_description, machine_speed, plot_loss_curves, preset_config, run_arms, run_metadata, sweep_lr)
from .tasks import get_task

PHASE_COLOURS = {"WARMUP": "#dddddd", "FULL": "#cfe2f3", "PREDICT": "#d9ead3", "CORRECT": "#fce5cd"}

SCHEDULE_FREE_LR_FACTORS = (2.5, 5, 7.5)  # × the tuned AdamW rate
SCHEDULE_FREE_WARMUP_FRACTIONS = (0, 1 / 3)  # × the step budget
# Muon (Jordan et al. 2024; ``torch.optim.Muon``): momentum SGD whose update of each hidden weight
# matrix is orthogonalised by a Newton-Schulz iteration. Its rate is on another scale than
# AdamW's (torch's default adjustment), so it gets its own grid; AdamW trains the rest.
MUON_LRS = (0.01, 0.02, 0.04)
MUON_ADAMW_LR_FACTORS = (1, 2)  # × the tuned AdamW rate, for the parameters Muon does not train
# Rates swept (× the tuned one) for runs evaluated at their weight average: the average removes
# the oscillation a larger rate adds, so its best rate can be higher than the raw iterate's.
AVERAGE_LR_FACTORS = (1, 2, 4)


def sweep_schedule_free(task: Task, seed: int, tuned_lr: float) -> tuple[tuple[float, int], dict[str, float]]:
    """The (rate, warm-up steps) of schedule-free AdamW, over :data:`SCHEDULE_FREE_LR_FACTORS` ×
    ``tuned_lr`` and :data:`SCHEDULE_FREE_WARMUP_FRACTIONS` × the budget, with the lowest final
    validation loss at its averaged weights; returns it and every candidate's final loss."""
    grid = [(tuned_lr * f, round(task.steps * w)) for f in SCHEDULE_FREE_LR_FACTORS for w in SCHEDULE_FREE_WARMUP_FRACTIONS]
    arms = [ArmSpec(f"sweep lr={lr:g} warmup={w}", lr, schedule_free_warmup=w) for lr, w in grid]
    runs = run_arms(task, arms, [seed], desc=f"{task.name}: schedule-free sweep")
    finals = {a.name.removeprefix("sweep "): runs[a.name][0].curve[-1]["val_loss"] for a in arms}
    best = min(grid, key=lambda g: finals[f"lr={g[0]:g} warmup={g[1]}"])
    return best, finals


def sweep_muon(task: Task, seed: int, tuned_lr: float) -> tuple[tuple[float, float], dict[str, float]]:
    """The (Muon rate, AdamW rate for the rest) over :data:`MUON_LRS` × :data:`MUON_ADAMW_LR_FACTORS`
    × ``tuned_lr`` with the lowest final validation loss; returns it and every candidate's."""
    grid = [(muon_lr, tuned_lr * f) for muon_lr in MUON_LRS for f in MUON_ADAMW_LR_FACTORS]
    arms = [ArmSpec(f"sweep muon={m:g} adamw={a:g}", a, muon_lr=m) for m, a in grid]
    runs = run_arms(task, arms, [seed], desc=f"{task.name}: Muon sweep")
    finals = {a.name.removeprefix("sweep "): runs[a.name][0].curve[-1]["val_loss"] for a in arms}
    best = min(grid, key=lambda g: finals[f"muon={g[0]:g} adamw={g[1]:g}"])
    return best, finals


WARM_UP_STEPS = 150  # past the trainer's first phase decisions (step 80), so every kernel it uses has run


def warm_up(task: Task, arms: list[ArmSpec], steps: int) -> list[ArmRun]:
    """Untimed short runs of every arm on a throwaway seed; returns them. On a GPU the first call
    of each Triton kernel in a process compiles it (seconds), which would otherwise be charged
    to whichever timed run came first. Each hybrid arm also runs once with prediction forced on:
    the state encoder and the dynamics model's GRU run only while a run's measured worth passes
    the gate, so a warm-up whose worth never did left them to the first timed seed whose worth
    did (seen on the H100: one fashion seed 2.6 s slower, stalled at step 27; on a CPU that seed
    runs the encoder at steps 26-27 only, the warm-up's seed never)."""
    runs = []
    for arm in arms:
        specs = [arm]
        if arm.hybrid:
            specs.append(replace(arm, config=replace(arm.config, **FORCED_PREDICTION)))
        for spec in specs:
            run = ArmRun(spec, task, 10_000, steps)
            while not run.done:
                run.run_chunk(task.eval_every, record_phases=False)
            runs.append(run)
    return runs


def benchmark_task(name: str, quick: bool, n_seeds: int, presets: list[str], device: str = "cpu") -> dict:
    task = get_task(name, quick, device=device)
    print(f"\n== {name}: {task.data_source}", flush=True)
    tuned_lr, sweep = sweep_lr(task, seed=1000)
    arms = [ArmSpec("AdamW (tuned lr)", tuned_lr), ArmSpec("AdamW (2x lr)", 2 * tuned_lr)]
    average_lr, average_sweep = None, None
    if "weight-average" in presets:
        # Each evaluation gets the rate the same sweep picks for it, and the trainer's averaged
        # arm its control at that rate: does the trainer add anything to the averaging?
        average_lr, average_sweep = sweep_lr(task, seed=1000, lrs=[tuned_lr * f for f in AVERAGE_LR_FACTORS],
                                             average=True)
        arms.append(ArmSpec("AdamW + weight average", average_lr, average=True))
    free, free_sweep = (None, None), None
    if "schedule-free" in presets:
        # Its control is the same optimizer in the plain loop: a gain is the optimizer's, and the
        # trainer's arm shows what it adds to it (or costs).
        free, free_sweep = sweep_schedule_free(task, seed=1000, tuned_lr=tuned_lr)
        arms.append(ArmSpec("Schedule-free AdamW", free[0], schedule_free_warmup=free[1]))
    muon, muon_sweep = (None, None), None
    if any(p in MUON_PRESETS for p in presets):  # likewise: the plain Muon loop is the control of the trainer over it
        muon, muon_sweep = sweep_muon(task, seed=1000, tuned_lr=tuned_lr)
        arms.append(ArmSpec("Muon + AdamW", muon[1], muon_lr=muon[0]))
    for preset in presets:
        lr = (average_lr if preset == "weight-average" else free[0] if preset == "schedule-free"
              else muon[1] if preset in MUON_PRESETS else tuned_lr)
        arms.append(ArmSpec(f"HybridTrainer ({preset})", lr, preset_config(preset),
                            schedule_free_warmup=free[1] if preset == "schedule-free" else None,
                            muon_lr=muon[0] if preset in MUON_PRESETS else None))
    seeds = list(range(n_seeds))
    if task.device.type == "cuda":
        warm_up(task, arms, steps=min(task.steps, WARM_UP_STEPS))
    started = time.perf_counter()
    runs = run_arms(task, arms, seeds, desc=f"{name}: {len(arms)} arms x {n_seeds} seeds")
    result = analyse(task, arms, runs, baseline="AdamW (tuned lr)")
    result.update(task=name, data_source=task.data_source, details=task.details, steps=task.steps,
                  eval_every=task.eval_every, hybrid_step_factor=HYBRID_STEP_FACTOR, lr_sweep=sweep,
                  tuned_lr=tuned_lr, weight_average_lr=average_lr, weight_average_lr_sweep=average_sweep,
                  schedule_free=None if free_sweep is None else dict(
                      lr=free[0], warmup_steps=free[1], betas=list(SCHEDULE_FREE_BETAS),
                      weight_decay=ADAMW_WEIGHT_DECAY, sweep=free_sweep),
                  muon=None if muon_sweep is None else dict(
                      lr=muon[0], adamw_lr=muon[1], weight_decay=ADAMW_WEIGHT_DECAY, sweep=muon_sweep),
                  seeds=seeds, wall_s=time.perf_counter() - started,
                  phases_first_hybrid={a.name: runs[a.name][0].phases for a in arms if a.hybrid})
    return result


def _num(value, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def write_report(out: Path, tasks: list[str], suffix: str) -> int:
    """``--report``: ``out/e2e{suffix}.md`` from the task files there, in ``tasks``' order (those
    present); its header names the newest of their runs, each task the run that made it."""
    results = [json.loads(f.read_text()) for f in (out / f"e2e_{t}{suffix}.json" for t in tasks) if f.exists()]
    if not results:
        raise SystemExit(f"--report: no e2e_<task>{suffix}.json of {tasks} in {out}")
    newest = max((r["meta"] for r in results), key=lambda m: m["date"])
    text = markdown(results, newest)
    (out / f"e2e{suffix}.md").write_text(text + "\n")
    print(text)
    return 0


def markdown(results: list[dict], meta: dict) -> str:
    cell = format_mean_std
    machine = meta.get("machine")  # CPU runs since the host's figures were recorded
    host = "" if not machine else (f"; on this host a bf16 matrix product takes {machine['bf16_matmul_vs_fp32']:.1f}× "
                                   f"an fp32 one's time, which Muon's bf16 Newton-Schulz iteration pays")
    lines = [f"End-to-end benchmark, `{meta['command']}` ({meta['date']}, {meta['device']}, "
             f"torch {meta['torch']}, {meta['threads']} thread(s){host}). Mean ± std over seeds.", ""]
    for r in results:
        lines += [f"### {r['task']}: {r['data_source']}", ""]
        own = r.get("meta")
        if own and (own["command"], own["date"]) != (meta["command"], meta["date"]):  # a file of another run (--report)
            lines += [f"Run: `{own['command']}` ({own['date']}, commit {(own.get('git_commit') or 'unknown')[:7]}, "
                      f"{own['device']}).", ""]
        lines += [f"Target val loss {r['target_val_loss']:.4f} ({r['target_definition']}); tuned lr "
                  f"{r['tuned_lr']:g} from sweep {r['lr_sweep']}"
                  + ("" if r.get("weight_average_lr") is None else
                     f"; lr for evaluation at the weight average {r['weight_average_lr']:g} from sweep "
                     f"{r['weight_average_lr_sweep']}")
                  + ("" if not r.get("schedule_free") else
                     f"; schedule-free AdamW lr {r['schedule_free']['lr']:g}, warm-up {r['schedule_free']['warmup_steps']} "
                     f"steps, betas {tuple(r['schedule_free']['betas'])} from sweep {r['schedule_free']['sweep']}")
                  + ("" if not r.get("muon") else
                     f"; Muon lr {r['muon']['lr']:g} with AdamW lr {r['muon']['adamw_lr']:g} for the rest from sweep "
                     f"{r['muon']['sweep']}")
                  + f"; seeds {r['seeds']}.", "",
                  "| arm | lr | time to target (s) | speed-up | backward to target | forward to target | val loss at equal "
                  "time | gap vs tuned | final val loss | backward saved | verifications ✓/✗ |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, arm in r["arms"].items():
            s = arm["summary"]
            reached = f" ({s['reached_target']}/{len(arm['seeds'])} reached)" if s["reached_target"] < len(arm["seeds"]) else ""
            saved = cell(s["backward_saved_pct"], 1, True) if arm["hybrid"] else "–"
            ver = f"{s['verifications_accepted']}/{s['verifications_rejected']}" if arm["hybrid"] else "–"
            lr = f"{arm['lr']:g}" + ("" if arm.get("muon_lr") is None else f" (Muon {arm['muon_lr']:g})")
            lines.append(f"| {name} | {lr} | {cell(s['time_to_target_s'], 2)}{reached} | {cell(s['speedup_vs_baseline'], 2)}× "
                         f"| {cell(s['backward_to_target'], 0)} | {cell(s['forward_to_target'], 0)} "
                         f"| {cell(s['val_loss_at_equal_time'], 4)} | {cell(s['loss_gap_pct_at_equal_time'], 2, True)} "
                         f"| {cell(s['final_val_loss'], 4)} | {saved} | {ver} |")
        for name, arm in r["arms"].items():
            if arm["hybrid"]:
                h = arm["seeds"][0]["hybrid"]
                lines.append(f"\n{name}, seed {arm['seeds'][0]['seed']}: predicted steps {h['predicted_steps']} "
                             f"({h['predicted_steps_kept']} kept, {h['predicted_steps_rolled_back']} rolled back), "
                             f"predict phases {h['predict_phases']} ({h['predict_phases_rejected']} rejected), "
                             + _worth_text(h) + "time by phase "
                             + ", ".join(f"{k} {v:.1f}s" for k, v in h["time_by_phase_s"].items())
                             + ("" if h["prediction_enabled"] else f"; {h['prediction_disabled_reason']}"))
        lines.append("")
    return "\n".join(lines)


def _worth_text(h: dict) -> str:
    """The worth gate's measurements of one hybrid run ('' when it never measured: predict=False)."""
    if h["predicted_step_worth"] is None:
        return ""
    costs = {k: v for k, v in (h.get("cost_seconds") or {}).items() if v is not None}
    return (f"measured worth of a predicted step {_num(h['predicted_step_worth'])}, required "
            f"{_num(h.get('required_worth'))} (machinery/core step {_num(h.get('prediction_overhead'))}"
            + (", ms: " + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in costs.items()) if costs else "") + "), ")


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    first_hybrid = next((n for n, a in result["arms"].items() if a["hybrid"]), None)
    if first_hybrid:
        spans = result["phases_first_hybrid"][first_hybrid]
        end = result["arms"][first_hybrid]["seeds"][0]["train_time_s"]
        seen = set()
        for (t0, phase), nxt in zip(spans, spans[1:] + [(end, None)]):
            label = f"{first_hybrid} seed 0: {phase}" if phase not in seen else None
            seen.add(phase)
            ax.axvspan(t0, nxt[0], color=PHASE_COLOURS.get(phase, "#eeeeee"), alpha=0.6, lw=0, label=label)
    plot_loss_curves(ax, result)
    ax.set_title(f"{result['task']}: {result['data_source'][:80]}", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="HybridTrainer vs tuned AdamW on real data")
    parser.add_argument("--quick", action="store_true", help="digits + a very short charlm (under a minute)")
    parser.add_argument("--tasks", nargs="+", default=None, help="charlm fashion digits (default: all; quick: digits charlm)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--presets", nargs="+", default=None, help=f"hybrid configs, of {' '.join(PRESETS)}")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where models, data and validation live (cuda: results named *_cuda)")
    parser.add_argument("--fused-adamw", action="store_true",
                        help="AdamW(fused=True) in every arm (results named *_fused)")
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--report", action="store_true",
                        help="run nothing: write e2e.md again from the e2e_<task>.json files in --out, each task "
                             "under the run that made it (tasks run one call at a time, or a run stopped part-way)")
    args = parser.parse_args(argv)
    if args.fused_adamw:
        protocol.ADAMW_OPTIONS["fused"] = True  # read by protocol.make_optimizer for every arm
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"argument --device: cuda asked for, but torch {torch.__version__} sees no CUDA GPU "
                     "(torch.cuda.is_available() is False)")

    torch.set_num_threads(args.threads)
    tasks = args.tasks or (["digits", "charlm"] if args.quick else ["charlm", "fashion", "digits"])
    suffix = ("_quick" if args.quick else "") + ("_cuda" if args.device == "cuda" else "") + (
        "_fused" if args.fused_adamw else "")
    if args.report:
        return write_report(args.out, tasks, suffix)
    presets = args.presets or ["default", "weight-average", "schedule-free", "muon", "no-predict"]
    if not hasattr(torch.optim, "Muon"):  # torch.optim.Muon exists from torch 2.9
        if args.presets and any(p in MUON_PRESETS for p in presets):
            parser.error(f"--presets: {' and '.join(MUON_PRESETS)} need torch.optim.Muon (torch >= 2.9), "
                         f"this is torch {torch.__version__}")
        presets = [p for p in presets if p not in MUON_PRESETS]
        print(f"torch {torch.__version__} has no torch.optim.Muon (torch >= 2.9): the muon arms are left out",
              file=sys.stderr)
    if "schedule-free" in presets and importlib.util.find_spec("schedulefree") is None:  # the bench extra
        if args.presets:
            parser.error("--presets: schedule-free needs the schedulefree package (the bench extra), "
                         "which is not installed")
        presets = [p for p in presets if p != "schedule-free"]
        print("schedulefree (the bench extra) is not installed: the schedule-free arms are left out", file=sys.stderr)
    for name in presets:
        preset_config(name)  # a bad name fails here, not after the first task's runs
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.e2e" + (" --quick" if args.quick else "") + (
        f" --tasks {' '.join(args.tasks)}" if args.tasks else "") + (f" --seeds {args.seeds}" if args.seeds != 3 else "") + (
        f" --presets {' '.join(args.presets)}" if args.presets else "") + (
        f" --device {args.device}" if args.device != "cpu" else "") + (" --fused-adamw" if args.fused_adamw else "") + (
        f" --out {args.out}" if args.out != Path("docs/results") else "")
    meta = run_metadata(command, device=cpu_description() if args.device == "cpu" else torch.cuda.get_device_name(0),
                        threads=torch.get_num_threads(),
                        **({"machine": machine_speed()} if args.device == "cpu" else {}))  # the host, told apart
    results = []
    for name in tasks:
        result = benchmark_task(name, args.quick, args.seeds, presets, args.device)
        result["meta"] = meta
        results.append(result)
        (args.out / f"e2e_{name}{suffix}.json").write_text(json.dumps(result, indent=1))
        plot(result, args.out / f"e2e_{name}{suffix}.png")
    text = markdown(results, meta)
    (args.out / f"e2e{suffix}.md").write_text(text + "\n")
    print("\n" + text)
    print(f"wrote {args.out}/e2e{suffix}.md and e2e_<task>{suffix}.json/.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
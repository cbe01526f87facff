"""Meta-training of :mod:`hybrid_trainer.nowcaster` from the project's own recorded runs.

``record``: trains every source task of :func:`bench.nowcaster_family.source_specs` and keeps a
flat fp32 snapshot of all its parameters every ``--spacing`` steps (step 0 included), one file per
run under ``--runs``.

``train``: fits a nowcaster (``--variant neuron`` or ``weight``) to those snapshots: a sample is
(run, snapshot t); the input is snapshots t-context..t, the targets the displacements to
t+k for every horizon k the run has. Loss: relative squared error per horizon (1.0 = predicting
no movement), every tensor weighted equally. Two runs are held out for validation
(``--val-runs``), and the fitted model is saved (``--out``; the shipped one is
``hybrid_trainer/nowcaster_weights.pt``).

Commands (one CPU thread; the shipped weights came from the ``small`` family)::

    OMP_NUM_THREADS=1 flock /tmp/cpu.lock python -m bench.nowcaster_meta record --scale small
    OMP_NUM_THREADS=1 flock /tmp/cpu.lock python -m bench.nowcaster_meta train --variant neuron --minutes 9
    OMP_NUM_THREADS=1 flock /tmp/cpu.lock python -m bench.nowcaster_meta train --variant weight --minutes 5 \\
        --out results-tmp/nowcaster_weight.pt

Full scale: ``record --scale full`` (six seeds of the family, about 3x the time) and
``train --minutes 60``.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from bench import nowcaster_family as fam
from bench.protocol import run_metadata

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "results-tmp" / "nowcaster_runs"
SPACING = 50  # real steps between snapshots: the nowcaster's unit of time


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_name(spec: dict[str, Any]) -> str:
    shape = spec.get("hidden") or spec.get("channels") or f"d{spec.get('d_model')}l{spec.get('n_layers')}"
    shape = "x".join(map(str, shape)) if isinstance(shape, list) else shape
    return (f"{spec['arch']}_{spec['data']}_{shape}_{spec['opt']}{'_cos' if spec['cosine'] else ''}"
            f"_lr{spec['lr']:g}_s{spec['seed']}")


def record_run(spec: dict[str, Any], spacing: int) -> dict[str, Any]:
    """Train ``spec`` for ``spec['steps']`` steps; snapshots every ``spacing`` steps (fp32, flat)."""
    model = fam.make_model(spec)
    params = [p for p in model.parameters() if p.requires_grad]
    opt, schedule = fam.make_optimizer(spec, model)
    loss_fn = fam.loss_fn(spec)
    stream = fam.batches(spec)
    snaps, losses = [], []
    for step in range(spec["steps"] + 1):
        if step % spacing == 0:
            snaps.append(torch.cat([p.detach().reshape(-1) for p in params]).clone())
        if step == spec["steps"]:
            break
        for group in opt.param_groups:
            group["lr"] = schedule(step)
        loss = loss_fn(model, next(stream))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return dict(spec=spec, spacing=spacing, snapshots=torch.stack(snaps),
                train_loss=[sum(losses[i:i + spacing]) / spacing for i in range(0, len(losses), spacing)])


def cmd_record(args: argparse.Namespace) -> None:
    out = Path(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    specs = fam.source_specs(args.scale, steps=args.steps)
    t_all = time.perf_counter()
    for i, spec in enumerate(specs):
        path = out / f"{run_name(spec)}.pt"
        if path.exists():
            continue
        t0 = time.perf_counter()
        rec = record_run(spec, args.spacing)
        torch.save(rec, path)
        print(f"[{i + 1}/{len(specs)}] {path.name}: {rec['snapshots'].shape[1]} params, "
              f"loss {rec['train_loss'][0]:.3f} -> {rec['train_loss'][-1]:.3f}, {time.perf_counter() - t0:.0f}s",
              flush=True)
    print(f"recorded {len(specs)} runs in {time.perf_counter() - t_all:.0f}s", flush=True)


# ------------------------------------------------------------------------------ train ----
from hybrid_trainer import nowcaster as nc  # noqa: E402  (record needs only the family)


class RunData:
    """One recorded run, ready for sampling: its layout and its snapshots split per tensor."""

    def __init__(self, rec: dict[str, Any], name: str):
        self.name, self.spec, self.spacing = name, rec["spec"], rec["spacing"]
        model = fam.make_model(self.spec)
        self.layout = nc.describe_model(model)
        self.snapshots = rec["snapshots"]  # [T, P]
        self.n_snap = self.snapshots.shape[0]

    def sample_points(self, context: int, horizons: tuple[int, ...]) -> list[int]:
        """Snapshot indices t with a full context and at least the shortest horizon ahead."""
        return [t for t in range(context, self.n_snap - min(horizons))]

    def window(self, t: int, context: int) -> torch.Tensor:
        return self.snapshots[t - context:t + 1]


def load_runs(runs_dir: Path) -> list[RunData]:
    files = sorted(runs_dir.glob("*.pt"))
    if not files:
        raise FileNotFoundError(f"no recorded runs under {runs_dir}: run `python -m bench.nowcaster_meta record`")
    return [RunData(torch.load(f, weights_only=False), f.stem) for f in files]


def sample_loss(model: nc.Nowcaster, run: RunData, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Relative squared error per horizon at (run, t), horizons past the run's end masked out."""
    window = run.window(t, model.context)
    future = torch.stack([run.snapshots[min(t + k, run.n_snap - 1)] for k in model.horizons])
    target = future - window[-1]  # [H, P]
    mask = torch.tensor([t + k < run.n_snap for k in model.horizons], dtype=torch.float32)
    pred = model.predict_flat(window, run.layout)  # [H, P]
    return nc.relative_error(pred, target, run.layout), mask


def evaluate(model: nc.Nowcaster, runs: list[RunData]) -> dict[str, list[float]]:
    """Mean relative squared error per horizon over every sample point of ``runs``: the model's,
    and the drift rule's (the window's mean displacement continued ``k`` intervals) for reference."""
    sums = {"model": torch.zeros(len(model.horizons)), "drift": torch.zeros(len(model.horizons))}
    counts = torch.zeros(len(model.horizons))
    with torch.no_grad():
        for run in runs:
            for t in run.sample_points(model.context, model.horizons):
                err, mask = sample_loss(model, run, t)
                window = run.window(t, model.context)
                mean_step = (window[-1] - window[0]) / model.context
                future = torch.stack([run.snapshots[min(t + k, run.n_snap - 1)] for k in model.horizons])
                drift = torch.stack([mean_step * k for k in model.horizons])
                sums["model"] += err * mask
                sums["drift"] += nc.relative_error(drift, future - window[-1], run.layout) * mask
                counts += mask
    return {k: (v / counts.clamp_min(1)).tolist() for k, v in sums.items()}


def cmd_train(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    runs = load_runs(Path(args.runs))
    if args.val_runs:
        val_names = set(args.val_runs)
    else:  # the last recorded run of each architecture
        val_names = {[r.name for r in runs if r.spec["arch"] == arch][-1] for arch in ("mlp", "cnn", "gpt")
                     if any(r.spec["arch"] == arch for r in runs)}
    train_runs = [r for r in runs if r.name not in val_names]
    val_runs = [r for r in runs if r.name in val_names]
    model = nc.build_nowcaster(args.variant)
    points = [(r, t) for r in train_runs for t in r.sample_points(model.context, model.horizons)]
    print(f"{args.variant}: {sum(p.numel() for p in model.parameters())} parameters; "
          f"{len(points)} samples from {len(train_runs)} runs; validation {sorted(val_names)}", flush=True)
    base = evaluate(model, val_runs)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    deadline = time.perf_counter() + 60 * args.minutes
    step, history = 0, []
    started = time.perf_counter()
    while time.perf_counter() < deadline and (args.steps <= 0 or step < args.steps):
        frac = min(1.0, (time.perf_counter() - deadline + 60 * args.minutes) / (60 * args.minutes))
        for group in opt.param_groups:
            group["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * frac))
        run, t = rng.choice(points)
        err, mask = sample_loss(model, run, t)
        loss = (err * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        history.append(loss.item())
        step += 1
        if step % 200 == 0:
            print(f"step {step}: train rel. error (last 200) {sum(history[-200:]) / 200:.4f}, "
                  f"{time.perf_counter() - started:.0f}s", flush=True)
    final = evaluate(model, val_runs)
    out = Path(args.out) if args.out else nc.SHIPPED_WEIGHTS
    out.parent.mkdir(parents=True, exist_ok=True)
    nc.save_nowcaster(model, out, meta=dict(
        command=f"python -m bench.nowcaster_meta train --variant {args.variant} --minutes {args.minutes}",
        git_commit=git_commit(), train_runs=[r.name for r in train_runs], val_runs=sorted(val_names),
        steps=step, val_rel_error_untrained=base, val_rel_error=final, spacing=runs[0].spacing))
    report = dict(variant=args.variant, steps=step, horizons=list(model.horizons), val_untrained=base,
                  val=final, train_last=sum(history[-200:]) / max(1, len(history[-200:])),
                  out=str(out), **run_metadata(f"python -m bench.nowcaster_meta train --variant {args.variant} "
                                               f"--minutes {args.minutes}"))
    print(json.dumps(report), flush=True)
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.nowcaster_meta", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="record optimizer trajectories of the source family")
    rec.add_argument("--scale", default="small", choices=["small", "full"])
    rec.add_argument("--steps", type=int, default=3000)
    rec.add_argument("--spacing", type=int, default=SPACING)
    rec.add_argument("--runs", default=str(RUNS))
    tr = sub.add_parser("train", help="meta-train a nowcaster on recorded runs")
    tr.add_argument("--variant", default="neuron", choices=["neuron", "weight"])
    tr.add_argument("--runs", default=str(RUNS))
    tr.add_argument("--val-runs", nargs="*", default=None)
    tr.add_argument("--minutes", type=float, default=10.0)
    tr.add_argument("--steps", type=int, default=0, help="stop after this many updates (0: time only)")
    tr.add_argument("--lr", type=float, default=2e-3)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--out", default=None, help="default: the package's shipped weights")
    tr.add_argument("--report", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    {"record": cmd_record, "train": cmd_train}[args.cmd](args)


if __name__ == "__main__":
    main()

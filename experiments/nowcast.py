"""Learned weight nowcasting: record trajectories, train the nowcaster, measure verified jumps.

    python -m experiments.nowcast train     [--out experiments/results]   # records source tasks, writes the asset
    python -m experiments.nowcast evaluate  --task charlm [--seeds 2] [--out experiments/results]
    python -m experiments.nowcast dmd       --task fashion [--out experiments/results]  # cross-parameter linear modes
    python -m experiments.nowcast report    [--out experiments/results]   # nowcast.md from the JSON files

``train`` records AdamW trajectories (a snapshot every ``EVERY`` steps) on *source* tasks only:
the char-LM on Python's standard-library source (``pylm``) and scikit-learn digits, at several
learning rates. The benchmark's charlm (KJV) and fashion tasks are never seen. It fits
:class:`hybrid_trainer.nowcaster.Nowcaster` on (element displacement history → displacement
``h`` snapshots ahead) pairs, reports the held-out error against the drift rule, and writes
``experiments/results/nowcaster.pt`` and ``<out>/nowcast_train.json``.

``evaluate`` trains the task's model with plain AdamW and, in paired arms (same initialisation,
same training batches), the same loop that every ``context`` snapshots jumps the weights by a
nowcast (drift rule or learned, at each horizon), checks the jump with two forward passes on a
separate verification batch (loss before vs after) and undoes it if the loss rose. Reported per
arm: validation loss over steps and over training time, jumps accepted, steps and time to the
target (the plain arm's validation loss at 80% of its steps), final validation loss. Writes
``<out>/nowcast_<task>.json`` and ``.png`` (``nowcast_<task>_<tag>.*`` with ``--tag``).

``dmd`` asks whether the weights' future motion is predictable *across* parameters: it records a
plain AdamW run with a snapshot every step and, every ``DMD_ORIGIN_EVERY`` steps, fits a
dynamic mode decomposition (one low-rank linear map of all weights' displacements,
``experiments.nowcaster.dmd_nowcast``) to the last ``DMD_WINDOW`` displacements at several snapshot
spacings and ranks, then compares its prediction of the displacement 10 and 40 steps ahead with
what happened. Writes ``<out>/dmd_predictability_<task>.json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from hybrid_trainer.averaging import FAST_BETA, SLOW_BETA, lag

from .nowcaster import (ASSET, Nowcaster, SnapshotHistory, dmd_nowcast, drift_nowcast, element_features,
                        secant_nowcast)

from bench.protocol import run_metadata
from bench.tasks import get_task

EVERY = 10  # real steps between snapshots
RECORD_EVERY = 5  # source runs are recorded finer, so other spacings can be analysed from them
SPACINGS = (10, 25, 50)  # snapshot spacings (steps) of the predictability analysis
CONTEXT = 4  # displacements seen
HORIZONS = (1, 2, 4)  # snapshot intervals predicted ahead
SOURCES = [("pylm", 1e-3, 0), ("pylm", 2e-3, 1), ("pylm", 4e-3, 2),
           ("digits", 1e-3, 0), ("digits", 3e-3, 1), ("digits", 1e-2, 2)]
HELD_OUT = ("pylm", 2e-3, 1)  # the source run whose samples validate the fit
WARMUP = 50  # real steps before the first jump
EVAL_EVERY = 25  # validation interval of the jump arms: finer than the tasks' own, to resolve ~1.1x
DMD_EVERY = 2  # real steps between the snapshots the DMD nowcast fits (20 displacements per jump)
DMD_RANK = 8  # leading directions of those displacements it keeps
SECANT_EVERY = 4  # real steps between the secant pairs (averaged weights, Adam's first moment)
SECANT_RANK = 8  # leading directions of their displacements in which the curvature is fitted


# ------------------------------------------------------------------------------ recording ----
def record(task_name: str, lr: float, seed: int, every: int = EVERY) -> tuple[torch.Tensor, list[int]]:
    """Snapshots [T, N] fp32 of a plain AdamW run (one every ``every`` steps, step 0 included)."""
    task = get_task(task_name)
    model = task.make_model(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    stream = task.batches(seed)
    flat = lambda: torch.cat([p.detach().reshape(-1) for p in params]).clone()  # noqa: E731
    snaps = [flat()]
    for step in range(1, task.steps + 1):
        optimizer.zero_grad(set_to_none=True)
        task.loss_fn(model, next(stream)).backward()
        optimizer.step()
        if step % every == 0:
            snaps.append(flat())
    return torch.stack(snaps), [p.numel() for p in params]


def samples(snaps: torch.Tensor, sizes: list[int], context: int, horizons: tuple[int, ...],
            per_index: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(features [M, k+1], normalised targets [M, H], weights [M]) from one recorded trajectory.

    The weight of an element is its step size over its tensor's mean step size, so the fit
    cares about elements in proportion to how far they move."""
    xs, ys, ws = [], [], []
    for i in range(context, len(snaps) - max(horizons)):
        disp = snaps[i - context + 1:i + 1].flip(0) - snaps[i - context:i].flip(0)
        x, s = element_features(disp, sizes)
        pick = torch.randint(0, len(s), (min(per_index, len(s)),), generator=gen)
        s_pick = s[pick].clamp_min(1e-12)
        target = torch.stack([(snaps[i + h][pick] - snaps[i][pick]) / s_pick for h in horizons], 1)
        xs.append(x[pick])
        ys.append(target.clamp(-8 * max(horizons), 8 * max(horizons)))
        ws.append(x[pick, -1].exp().clamp(max=10.0))
    return torch.cat(xs), torch.cat(ys), torch.cat(ws)


def relative_errors(model: Nowcaster | None, snaps: torch.Tensor, sizes: list[int], context: int,
                    horizons: tuple[int, ...]) -> dict[str, dict[int, float]]:
    """||Δ_pred − Δ_true||² / ||Δ_true||² over all elements and indices, per method and horizon
    (1.0 = predicting no movement). ``oracle-scaled drift`` multiplies the drift rule by the
    scalar that fits the true displacement best (known only in hindsight): no jump along the
    drift, whatever its length, can do better."""
    names = ["drift", "oracle-scaled drift"] + (["learned"] if model is not None else [])
    out: dict[str, dict[int, float]] = {name: {} for name in names}
    for h in horizons:
        err = {name: 0.0 for name in names}
        norm = 0.0
        for i in range(context, len(snaps) - h):
            disp = snaps[i - context + 1:i + 1].flip(0) - snaps[i - context:i].flip(0)
            true = snaps[i + h] - snaps[i]
            norm += float(true.square().sum())
            drift = drift_nowcast(disp, h)
            err["drift"] += float((drift - true).square().sum())
            best = float(drift @ true) / max(float(drift @ drift), 1e-30)
            err["oracle-scaled drift"] += float((best * drift - true).square().sum())
            if model is not None:
                err["learned"] += float((model.predict(disp, sizes, h) - true).square().sum())
        for name in names:
            out[name][h] = err[name] / norm
    return out


def train(out: Path, epochs: int = 6, per_index: int = 4000, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    train_parts, held_out = [], None
    recorded = []
    for source in tqdm(SOURCES, desc="recording source trajectories"):
        fine, sizes = record(*source, every=RECORD_EVERY)
        snaps = fine[::EVERY // RECORD_EVERY]
        recorded.append(dict(task=source[0], lr=source[1], seed=source[2], snapshots=len(snaps), params=sum(sizes)))
        if source == HELD_OUT:
            held_out = (snaps, sizes)
            spacing = {every: relative_errors(None, fine[::every // RECORD_EVERY], sizes, CONTEXT, (1, 2))
                       for every in SPACINGS}
        else:
            train_parts.append(samples(snaps, sizes, CONTEXT, HORIZONS, per_index, gen))
    x, y, w = (torch.cat(parts) for parts in zip(*train_parts))
    model = Nowcaster(CONTEXT, HORIZONS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    batch = 4096
    steps = epochs * (len(x) // batch)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    losses = []
    for epoch in tqdm(range(epochs), desc="fitting the nowcaster"):
        order = torch.randperm(len(x), generator=gen)
        total = 0.0
        for start in range(0, len(x) - batch + 1, batch):
            idx = order[start:start + batch]
            loss = (torch.nn.functional.huber_loss(model(x[idx]), y[idx], reduction="none").mean(1) * w[idx]).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            total += float(loss)
        losses.append(total / max(1, len(x) // batch))
    model.eval()
    errors = relative_errors(model, *held_out, CONTEXT, HORIZONS)
    meta = run_metadata("python -m experiments.nowcast train",
                        sources=[s for s in recorded if (s["task"], s["lr"], s["seed"]) != HELD_OUT], every=EVERY,
                        samples=len(x), epochs=epochs)
    ASSET.parent.mkdir(parents=True, exist_ok=True)
    model.save(ASSET, meta)
    report = dict(meta, recorded=recorded, held_out=dict(zip(("task", "lr", "seed"), HELD_OUT)),
                  train_loss_by_epoch=losses, held_out_relative_error=errors,
                  held_out_relative_error_by_spacing=spacing)
    out.mkdir(parents=True, exist_ok=True)
    (out / "nowcast_train.json").write_text(json.dumps(report, indent=1))
    print(f"nowcaster fitted on {len(x)} element samples from {len(train_parts)} trajectories; held-out "
          f"{HELD_OUT[0]} lr {HELD_OUT[1]} relative squared error (1 = no movement):")
    for h in HORIZONS:
        print(f"  h={h} ({h * EVERY} steps): " + ", ".join(f"{name} {errors[name][h]:.3f}" for name in errors))
    print("  other snapshot spacings (rule-based nowcasts only):")
    for every, errs in spacing.items():
        for h in (1, 2):
            print(f"    every {every} steps, {h * every} steps ahead: "
                  + ", ".join(f"{name} {errs[name][h]:.3f}" for name in errs))
    return report


# ------------------------------------------------------------------- DMD predictability ----
DMD_WINDOW = 20  # displacements each DMD fit sees
DMD_SPACINGS = (1, 2, 5, 10)  # real steps between its snapshots
DMD_RANKS = (1, 4, 8)
DMD_AHEAD = (10, 40)  # real steps predicted ahead
DMD_ORIGIN_EVERY = 10  # real steps between the points a prediction is made from


def dmd_predictability(task_name: str, out: Path, lr: float | None = None, seed: int = 0) -> dict:
    """Relative squared error of the DMD nowcast (cross-parameter linear modes) of the weights'
    displacement ``ahead`` real steps on, against the drift rule, on one recorded AdamW run.

    Summed over every element and over prediction points every ``DMD_ORIGIN_EVERY`` steps (from
    the first point with a full window), 1.0 = predicting no movement, as in ``train``."""
    task = get_task(task_name)
    lr = lr if lr is not None else sorted(task.lr_grid)[len(task.lr_grid) // 2]
    snaps, _ = record(task_name, lr, seed, every=1)
    first = DMD_WINDOW * max(DMD_SPACINGS)  # the same prediction points for every spacing
    errors = {f"{every}": {"drift": {}} for every in DMD_SPACINGS}  # [spacing][rank or "drift"][ahead]
    for every in tqdm(DMD_SPACINGS, desc=f"DMD fits on {task_name}"):
        for ahead in DMD_AHEAD:
            err = {"drift": 0.0, **{f"{rank}": 0.0 for rank in DMD_RANKS}}
            norm = 0.0
            for t in range(first, len(snaps) - ahead, DMD_ORIGIN_EVERY):
                window = snaps[t - DMD_WINDOW * every:t + 1:every]
                disp = (window[1:] - window[:-1]).flip(0)  # newest first
                true = snaps[t + ahead] - snaps[t]
                norm += float(true.square().sum())
                err["drift"] += float((drift_nowcast(disp, ahead // every) - true).square().sum())
                for rank in DMD_RANKS:
                    err[f"{rank}"] += float((dmd_nowcast(disp, ahead // every, rank) - true).square().sum())
            for name, total in err.items():
                errors[f"{every}"].setdefault(name, {})[f"{ahead}"] = total / norm
    result = dict(run_metadata(f"python -m experiments.nowcast dmd --task {task_name}"),
                  task=task_name, data_source=task.data_source, lr=lr, seed=seed, steps=len(snaps) - 1,
                  window=DMD_WINDOW, origin_every=DMD_ORIGIN_EVERY, first_origin=first,
                  relative_error=errors)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"dmd_predictability_{task_name}.json").write_text(json.dumps(result, indent=1))
    print(f"{task_name} (lr {lr}): relative squared error of the displacement ahead (1 = no movement)")
    for every, by_rank in errors.items():
        for name, by_ahead in by_rank.items():
            label = "drift" if name == "drift" else f"DMD rank {name}"
            print(f"  snapshots every {every:>2s} steps, {label:10s}: "
                  + ", ".join(f"{a} steps ahead {e:.3f}" for a, e in by_ahead.items()))
    return result


# ----------------------------------------------------------------------------- evaluation ----
AVG_BETAS = (FAST_BETA, SLOW_BETA)  # the trainer's weight average (hybrid_trainer/averaging.py)


def run_arm(task, lr: float, seed: int, method: str | None, horizon: int, model: Nowcaster | None,
            steps: int) -> dict:
    """Plain AdamW (``method`` None) or AdamW with verified jumps every ``CONTEXT·EVERY`` steps.

    Methods: ``drift`` / ``learned`` nowcast the iterate from its snapshots; ``smooth`` moves the
    iterate along the drift of the smoothed trajectory, (EMA_0.9(θ) − EMA_0.98(θ)) / (lag
    difference), for ``horizon·EVERY`` steps; ``floor`` jumps to the fast average moved forward
    by its lag plus that horizon (where the smoothed trajectory will be, without the iterate's
    oscillation); ``floor-reset`` also zeroes Adam's first moment after a kept jump; ``average``
    never jumps but is evaluated at the lag-corrected average (a control); ``dmd`` fits a
    linear map to the displacements of all weights between snapshots every ``DMD_EVERY`` steps
    since the last jump and sums its powers ``horizon·EVERY`` steps ahead (``dmd_nowcast``);
    ``secant`` pairs the fast weight average (β 0.9) with Adam's bias-corrected first moment (the
    same β) every ``SECANT_EVERY`` steps and jumps to the minimum of the quadratic those secants
    fit in the span of the averages' displacements, the step capped at ``horizon`` times the
    largest displacement in the window (``secant_nowcast``)."""
    torch.manual_seed(seed)
    net = task.make_model(seed)
    params = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    stream, checks = task.batches(seed), task.batches(seed + 7919)  # verification batches: their own stream
    history = (SnapshotHistory(params, CONTEXT, EVERY) if method in ("drift", "learned") else
               SnapshotHistory(params, CONTEXT * EVERY // DMD_EVERY, DMD_EVERY) if method == "dmd" else None)
    averages = ([[p.detach().clone() for p in params] for _ in AVG_BETAS]
                if method in ("smooth", "floor", "floor-reset", "average", "secant") else None)
    secants: list[tuple[torch.Tensor, torch.Tensor]] = []  # (θ̄, m̂) pairs, oldest first
    ahead = horizon * EVERY
    curve, jumps, train_time = [], [], 0.0
    for step in range(1, steps + 1):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        task.loss_fn(net, next(stream)).backward()
        optimizer.step()
        delta = None
        with torch.no_grad():
            if method == "secant" and step % SECANT_EVERY == 0:
                # m_t averages gradients taken at θ_0..θ_{t-1}: it pairs with the average before this step's θ.
                secants = secants[-(CONTEXT * EVERY // SECANT_EVERY):] + [_secant_pair(optimizer, params, averages[0], step)]
            if averages is not None:
                for beta, avg in zip(AVG_BETAS, averages):
                    torch._foreach_lerp_(avg, [p.detach() for p in params], 1 - beta)
                if step >= WARMUP and step % (CONTEXT * EVERY) == 0 and method == "secant":
                    points, grads = (torch.stack(column) for column in zip(*secants))
                    target = points[-1] + secant_nowcast(points, grads, SECANT_RANK, float(horizon))
                    delta = [t.view_as(p) - p for t, p in zip(target.split([p.numel() for p in params]), params)]
                elif step >= WARMUP and step % (CONTEXT * EVERY) == 0 and method != "average":
                    delta = _smoothed_delta(averages, params, "smooth" if method == "smooth" else "floor", ahead)
            if history is not None:
                history.observe_real_step()
                if step >= WARMUP and history.ready:
                    disp = history.displacements()
                    flat = (drift_nowcast(disp, horizon) if method == "drift" else
                            dmd_nowcast(disp, ahead // DMD_EVERY, DMD_RANK) if method == "dmd" else
                            model.predict(disp, history.sizes, horizon))
                    delta = [v.view_as(p) for v, p in zip(flat.split(history.sizes), params)]
                    history.reset()
            if delta is not None:
                check = next(checks)
                before = float(task.loss_fn(net, check))
                saved = [p.detach().clone() for p in params]  # exact undo, not θ + Δ − Δ
                torch._foreach_add_(params, delta)
                after = float(task.loss_fn(net, check))
                accepted = after < before
                if not accepted:
                    torch._foreach_copy_(params, saved)
                elif method == "floor-reset":  # Adam's momentum still points up the hill the jump left
                    for p in params:
                        optimizer.state[p]["exp_avg"].zero_()
                jumps.append(dict(step=step, before=before, after=after, accepted=accepted))
        train_time += time.perf_counter() - started
        if step % EVAL_EVERY == 0:
            if method == "average":  # evaluate the lag-corrected average; training goes on from the iterate
                with torch.no_grad():
                    delta = _smoothed_delta(averages, params, "floor", 0)
                    saved = [p.detach().clone() for p in params]
                    torch._foreach_add_(params, delta)
                    val = task.val_loss(net)
                    torch._foreach_copy_(params, saved)
            else:
                val = task.val_loss(net)
            curve.append(dict(step=step, train_time_s=train_time, val_loss=val))
    return dict(curve=curve, jumps=jumps, train_time_s=train_time)


def _smoothed_delta(averages, params, method: str, ahead: int) -> list[torch.Tensor]:
    (fast, slow), (b_fast, b_slow) = averages, AVG_BETAS
    drift = torch._foreach_sub(fast, slow)
    torch._foreach_div_(drift, lag(b_slow) - lag(b_fast))
    if method == "smooth":
        return torch._foreach_mul(drift, float(ahead))
    delta = torch._foreach_add(fast, torch._foreach_mul(drift, lag(b_fast) + ahead))  # floor − θ
    torch._foreach_sub_(delta, [p.detach() for p in params])
    return delta


def _secant_pair(optimizer, params, fast_average, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    beta1 = optimizer.param_groups[0]["betas"][0]
    moment = torch.cat([optimizer.state[p]["exp_avg"].reshape(-1) for p in params]) / (1 - beta1 ** step)
    return torch.cat([a.reshape(-1) for a in fast_average]), moment


def _crossing(curve: list[dict], target: float) -> dict | None:
    for point in curve:
        if point["val_loss"] <= target:
            return point
    return None


def evaluate(task_name: str, seeds: int, out: Path, lr: float | None, arms: list[str], tag: str | None = None) -> dict:
    task = get_task(task_name)
    lr = lr if lr is not None else sorted(task.lr_grid)[len(task.lr_grid) // 2]
    model = Nowcaster.load() if any(a.startswith("learned") for a in arms) else None
    specs = [("plain AdamW", None, 0)]
    for arm in arms:
        method, h = arm.split(":")
        name = ("plain AdamW, evaluated at its lag-corrected weight average" if method == "average"
                else f"secant step, capped at {h}x the window's largest displacement" if method == "secant"
                else f"{method} nowcast, {int(h) * EVERY} steps ahead")
        specs.append((name, method, int(h)))
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in specs}
    with tqdm(total=seeds * len(specs), desc=f"nowcast arms on {task_name}") as bar:
        for seed in range(seeds):
            for name, method, h in specs:  # interleaved per seed: machine noise hits arms alike
                runs[name].append(run_arm(task, lr, seed, method, h, model, task.steps))
                bar.update()
    plain_curves = [r["curve"] for r in runs["plain AdamW"]]
    targets = [curve[int(0.8 * len(curve)) - 1]["val_loss"] for curve in plain_curves]  # per seed
    plain_steps = [_crossing(curve, target)["step"] for curve, target in zip(plain_curves, targets)]
    summary = {}
    for name, rs in runs.items():
        hits = [_crossing(r["curve"], target) for r, target in zip(rs, targets)]
        reached = [t for t in hits if t is not None]
        jumps = [j for r in rs for j in r["jumps"]]
        summary[name] = dict(
            final_val_loss=statistics.mean(r["curve"][-1]["val_loss"] for r in rs),
            reached=f"{len(reached)}/{seeds}",
            steps_to_target=statistics.mean(t["step"] for t in reached) if reached else None,
            time_to_target_s=statistics.mean(t["train_time_s"] for t in reached) if reached else None,
            step_speedup=(statistics.mean(plain_steps) / statistics.mean(t["step"] for t in reached))
            if len(reached) == seeds else None,
            jumps=len(jumps), jumps_accepted=sum(j["accepted"] for j in jumps),
            mean_train_time_s=statistics.mean(r["train_time_s"] for r in rs))
    stem = f"nowcast_{task_name}" + (f"_{tag}" if tag else "")
    result = dict(run_metadata(f"python -m experiments.nowcast evaluate --task {task_name} --seeds {seeds} "
                               f"--arms {' '.join(arms)}" + (f" --tag {tag}" if tag else "")),
                  threads=torch.get_num_threads(), task=task_name, data_source=task.data_source, lr=lr,
                  every=EVERY, context=CONTEXT, warmup=WARMUP, nowcaster=model.meta if model else None, summary=summary, runs=runs)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    plot(result, out / f"{stem}.png")
    print(f"{task_name} (lr {lr}, {seeds} seeds): target = plain AdamW's val loss at 80% of {task.steps} steps")
    print(f"  {'arm':38s} {'final val':>9s} {'reached':>7s} {'steps':>6s} {'speed-up':>8s} {'time s':>7s} {'jumps kept':>10s}")
    for name, s in summary.items():
        steps_ = "-" if s["steps_to_target"] is None else f"{s['steps_to_target']:.0f}"
        speed = "-" if s["step_speedup"] is None else f"{s['step_speedup']:.2f}x"
        tt = "-" if s["time_to_target_s"] is None else f"{s['time_to_target_s']:.1f}"
        print(f"  {name[:38]:38s} {s['final_val_loss']:9.4f} {s['reached']:>7s} {steps_:>6s} {speed:>8s} {tt:>7s} "
              f"{s['jumps_accepted']:>4d}/{s['jumps']:<4d}")
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, rs in result["runs"].items():
        steps = [p["step"] for p in rs[0]["curve"]]
        mean = [statistics.mean(r["curve"][i]["val_loss"] for r in rs) for i in range(len(steps))]
        ax.plot(steps, mean, marker="o", ms=2.5, lw=1.2, label=name)
    ax.set_xlabel("real optimizer step")
    ax.set_ylabel(f"validation loss (mean of {len(next(iter(result['runs'].values())))} seeds)")
    ax.set_title(f"{result['task']}: AdamW with verified nowcast jumps every {result['every'] * result['context']} steps",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(out: Path) -> str:
    """``<out>/nowcast.md`` from the JSON files ``train`` and ``evaluate`` wrote there."""
    lines = ["# Weight nowcasting: measured", ""]
    train_path = out / "nowcast_train.json"
    if train_path.exists():
        t = json.loads(train_path.read_text())
        held = t["held_out"]
        lines += [f"## Predictability of a weight's future displacement (`{t['command']}`, {t['date']})", "",
                  f"Held-out source run: {held['task']} lr {held['lr']} seed {held['seed']}; the learned nowcaster "
                  f"was fitted on {t['samples']} element samples from {len(t['sources'])} other source runs. "
                  "Relative squared error over every element and snapshot, 1.0 = predicting no movement.", "",
                  "| snapshot spacing | ahead | " + " | ".join(t["held_out_relative_error"]) + " |",
                  "|---|---|" + "---|" * len(t["held_out_relative_error"])]
        for h in sorted(t["held_out_relative_error"]["drift"], key=int):
            lines.append(f"| {t['every']} steps | {int(h) * t['every']} steps | "
                         + " | ".join(f"{errs[h]:.3f}" for errs in t["held_out_relative_error"].values()) + " |")
        for every, errs in t.get("held_out_relative_error_by_spacing", {}).items():
            if int(every) == t["every"]:
                continue  # the rows above
            for h in sorted(errs["drift"], key=int):
                lines.append(f"| {every} steps | {int(h) * int(every)} steps | {errs['drift'][h]:.3f} | "
                             f"{errs['oracle-scaled drift'][h]:.3f} | – |")
        lines.append("")
    for task in ("fashion", "charlm"):
        path = out / f"dmd_predictability_{task}.json"
        if path.exists():
            lines += _dmd_table(json.loads(path.read_text()))
    for task in ("fashion", "charlm"):
        for path in [out / f"nowcast_{task}.json"] + sorted(out.glob(f"nowcast_{task}_*.json")):
            if path.exists():
                lines += _jump_table(json.loads(path.read_text()), path.stem)
    text = "\n".join(lines)
    (out / "nowcast.md").write_text(text)
    return text


def _dmd_table(r: dict) -> list[str]:
    ranks = [k for k in next(iter(r["relative_error"].values())) if k != "drift"]
    aheads = list(next(iter(r["relative_error"].values()))["drift"])
    lines = [f"## {r['task']}: cross-parameter linear modes (DMD) (`{r['command']}`, {r['date']})", "",
             f"{r['data_source']}; plain AdamW, lr {r['lr']}, seed {r['seed']}, {r['steps']} steps. Every "
             f"{r['origin_every']} steps from step {r['first_origin']}, a DMD fit to the last {r['window']} "
             "displacements between snapshots predicts the displacement ahead. Relative squared error over "
             "every element and prediction point, 1.0 = predicting no movement.", "",
             "| snapshot spacing | " + " | ".join(f"{name}, {a} steps" for name in ["drift"] + [f"DMD rank {k}" for k in ranks]
                                                 for a in aheads) + " |",
             "|---|" + "---|" * (len(aheads) * (1 + len(ranks)))]
    for every, by_rank in r["relative_error"].items():
        lines.append(f"| {every} steps | " + " | ".join(f"{by_rank[name][a]:.3f}" for name in ["drift"] + ranks
                                                        for a in aheads) + " |")
    return lines + [""]


def _jump_table(r: dict, stem: str) -> list[str]:
    task = r["task"]
    lines = [f"## {task}: AdamW with verified jumps (`{r['command']}`, {r['date']}, {r['threads']} thread)", "",
             f"{r['data_source']}; lr {r['lr']}; a jump every {r['every'] * r['context']} steps after step "
             f"{r['warmup']}, kept only if the loss on a separate batch fell. Target: plain AdamW's validation "
             "loss at 80% of its steps (per seed); speed-up in steps to it (evaluated every "
             f"{r['runs']['plain AdamW'][0]['curve'][1]['step'] - r['runs']['plain AdamW'][0]['curve'][0]['step']} "
             "steps).", "",
             "| arm | final val loss | reached | steps to target | step speed-up | train time (s) | jumps kept "
             "| median loss change at a jump |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s_ in r["summary"].items():
        steps_ = "–" if s_["steps_to_target"] is None else f"{s_['steps_to_target']:.0f}"
        speed = "–" if s_["step_speedup"] is None else f"{s_['step_speedup']:.2f}×"
        jumps = [j for run in r["runs"][name] for j in run["jumps"]]
        change = (f"{100 * statistics.median((j['after'] - j['before']) / j['before'] for j in jumps):+.2f}%"
                  if jumps else "–")
        lines.append(f"| {name} | {s_['final_val_loss']:.4f} | {s_['reached']} | {steps_} | {speed} | "
                     f"{s_['mean_train_time_s']:.1f} | {s_['jumps_accepted']}/{s_['jumps']} | {change} |")
    lines.append("")
    lines.append(f"Validation loss over steps: `{stem}.png`.")
    lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["train", "evaluate", "dmd", "report"])
    parser.add_argument("--task", default="charlm")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--arms", nargs="+", default=[f"{m}:{h}" for m in ("drift", "learned") for h in HORIZONS],
                        help="method:horizon pairs, method in {drift, learned, dmd, smooth, floor, floor-reset, average, secant}, horizon in snapshot intervals")
    parser.add_argument("--out", type=Path, default=Path("experiments/results"))
    parser.add_argument("--tag", default=None, help="evaluate: write nowcast_<task>_<tag>.json instead of nowcast_<task>.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.command == "train":
        train(args.out)
    elif args.command == "evaluate":
        evaluate(args.task, args.seeds, args.out, args.lr, args.arms, args.tag)
    elif args.command == "dmd":
        dmd_predictability(args.task, args.out, args.lr)
    else:
        print(report(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

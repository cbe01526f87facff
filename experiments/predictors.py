"""How much is a predicted step worth? Candidate update predictors measured on a real run.

    python -m experiments.predictors [--task charlm] [--steps 600] [--lr LR] [--batch-size N] [--out experiments/results]
    python -m experiments.predictors --task digits --steps 300 --batch-sizes 16 64 256 1437

Trains the task's model with plain AdamW (tuned-ish lr) and, at every step t, measures for each
candidate predictor the first-order loss decrease of its predicted step ``p_t`` relative to that
of the real update ``u_t``, on the gradient of the *next* batch (which neither has seen):

    worth = mean −<g_{t+1}, p_t>  /  measured loss decrease per real step      (per window of steps)

The loss decrease per step is the least-squares slope of the training loss over the window.
(Dividing by the real update's own first-order gain on the next batch, −<g_{t+1}, u_t>, does not
work: after the first ~100 steps of the char-LM that quantity is negative on average — repeating
the last Adam step from where it landed goes back up the valley it crossed — although the loss
keeps falling. The run reports that fraction too.)

worth = 1: a predicted step is as good as a real one; 0: useless; < 0: harmful. A predicted step
costs about (verification forward / verify_every + one in-place add) of a real step's time, so
it can only pay where worth exceeds that cost. Candidates: EMA of updates (β 0.9/0.98/0.99) with
the trainer's least-squares scale, the raw EMA vector (scale 1), the last update repeated, the
least-squares slope of the weight trajectory over the last 4 updates, and the drift of the
smoothed trajectory, (EMA_0.9(θ) − EMA_0.98(θ)) / (49 − 9), which leaves the current iterate's
oscillation out.

Writes ``<out>/predictors_<task>.json`` and ``.png`` (worth over training); ``--steps`` other
than 600 adds ``_<steps>steps`` to the name, ``--batch-size`` adds ``_bs<N>``.

``--batch-sizes`` runs the measurement once per batch size (same seed, lr and steps) and writes
``predictors_<task>_batch_sweep.{json,md,png}``: how the worth of each candidate depends on the
gradient noise, which falls as the batch grows (the task's whole training set = no noise).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from bench.protocol import run_metadata
from bench.tasks import get_task

EMA_BETAS = (0.9, 0.98, 0.99)
WEIGHT_AVG_BETAS = (0.9, 0.98)  # drift = (fast average − slow average) / (lag_slow − lag_fast)
SLOPE_K = 4


def _flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _flat_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def slope_weights(k: int) -> list[float]:
    """slope of a least-squares line through θ_0..θ_k as Σ_j w_j u_j (u_j = θ_j − θ_{j−1})."""
    times = list(range(k + 1))
    mean_t = sum(times) / len(times)
    denom = sum((t - mean_t) ** 2 for t in times)
    return [sum(t - mean_t for t in times[j:]) / denom for j in range(1, k + 1)]


def measure(task_name: str, steps: int, lr: float | None, seed: int = 0, windows: int = 6,
            batch_size: int | None = None) -> dict:
    task = get_task(task_name, batch_size=batch_size)
    lr = lr if lr is not None else sorted(task.lr_grid)[len(task.lr_grid) // 2]
    model = task.make_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    stream = task.batches(seed)
    emas = {b: None for b in EMA_BETAS}
    weight_avgs = {b: None for b in WEIGHT_AVG_BETAS}  # EMAs of the weights themselves
    recent: list[torch.Tensor] = []
    pending: dict[str, torch.Tensor] | None = None  # predicted steps made after the last update
    last_update = None
    raw: dict[str, list[tuple[float, float]]] = {}  # name -> per step (predicted gain, real gain)
    losses = []
    for step in tqdm(range(steps), desc=f"{task_name} batch {task.details['batch_size']}", unit="step",
                     file=sys.stderr, disable=None, leave=False):
        batch = next(stream)
        optimizer.zero_grad(set_to_none=True)
        loss = task.loss_fn(model, batch)
        loss.backward()
        losses.append(float(loss.detach()))
        grad = _flat_grads(model)
        if pending is not None:
            real_gain = -float(grad @ last_update)
            for name, pred in pending.items():
                raw.setdefault(name, []).append((-float(grad @ pred), real_gain))
        before = _flat_params(model)
        optimizer.step()
        update = _flat_params(model) - before
        candidates = {}
        for beta in EMA_BETAS:
            prev = emas[beta]
            if prev is not None:
                dd = float(prev @ prev)
                scale = max(0.0, float(update @ prev) / dd) if dd > 0 else 0.0
                candidates[f"EMA β={beta} × LS scale"] = prev * scale
                if beta == 0.98:
                    candidates["EMA β=0.98 raw"] = prev.clone()
            emas[beta] = update.clone() if prev is None else prev.mul(beta).add_(update, alpha=1 - beta)
        theta = _flat_params(model)
        for beta in WEIGHT_AVG_BETAS:
            prev = weight_avgs[beta]
            weight_avgs[beta] = theta.clone() if prev is None else prev.mul_(beta).add_(theta, alpha=1 - beta)
        if step >= 10:
            fast, slow = WEIGHT_AVG_BETAS
            lag = lambda b: b / (1 - b)  # noqa: E731
            drift = (weight_avgs[fast] - weight_avgs[slow]) / (lag(slow) - lag(fast))
            dd = float(drift @ drift)
            scale = max(0.0, float(update @ drift) / dd) if dd > 0 else 0.0
            candidates["drift of weight averages × LS scale"] = drift * scale
            candidates["drift of weight averages raw"] = drift
        candidates["last update"] = update.clone()
        recent = (recent + [update])[-SLOPE_K:]
        if len(recent) == SLOPE_K:
            candidates[f"LS slope of last {SLOPE_K}"] = sum(w * u for w, u in zip(slope_weights(SLOPE_K), recent))
        pending, last_update = candidates, update
    size = max(1, steps // windows)
    decrease = []  # measured loss decrease per step in each window (least-squares slope)
    for w in range(windows):
        ys = losses[w * size:(w + 1) * size]
        xs = list(range(len(ys)))
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-12)
        decrease.append(-slope)
    window_worth = {}
    for name, pairs in raw.items():
        offset = steps - len(pairs)  # candidates start after their history fills
        per_window = []
        for w in range(windows):
            chunk = [p for i, p in enumerate(pairs) if w * size <= i + offset < (w + 1) * size]
            gain = sum(p for p, _ in chunk) / len(chunk) if chunk else None
            per_window.append(gain / decrease[w] if gain is not None and decrease[w] > 0 else None)
        window_worth[name] = per_window
    total_decrease = (losses[0] - losses[-1]) / steps
    total = {name: (sum(p for p, _ in pairs) / len(pairs)) / total_decrease if total_decrease > 0 else None
             for name, pairs in raw.items()}
    real_positive = sum(r > 0 for _, r in raw["last update"]) / len(raw["last update"])
    return dict(task=task_name, data_source=task.data_source, steps=steps, lr=lr, seed=seed, window_steps=size,
                batch_size=task.details["batch_size"],
                worth_by_window=window_worth, worth_whole_run=total, loss_decrease_per_step_by_window=decrease,
                fraction_of_real_updates_that_help_the_next_batch=real_positive, train_loss=losses)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    size = result["window_steps"]
    for name, values in result["worth_by_window"].items():
        xs = [(i + 0.5) * size for i, v in enumerate(values) if v is not None]
        ys = [v for v in values if v is not None]
        ax.plot(xs, ys, marker="o", lw=1.2, label=name)
    ax.axhline(0, color="black", lw=0.6)
    ax.axhline(1, color="black", lw=0.6, ls=":", label="a real step (measured loss decrease per step)")
    ax.set_xlabel("training step (plain AdamW); each point sums a window of steps")
    ax.set_ylabel("worth of a predicted step (1 = a real step)")
    ax.set_title(f"{result['task']}: first-order worth of predicted steps on the next batch's gradient", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


SWEEP_CANDIDATES = ("EMA β=0.98 × LS scale", "EMA β=0.9 × LS scale", "last update",
                    "drift of weight averages × LS scale")


def sweep_markdown(sweep: dict) -> str:
    """Table of the batch-size sweep: worth over the whole run and in its last window."""
    runs = sweep["runs"]
    head = (f"Worth of a predicted step vs batch size: `{sweep['command']}` ({sweep['date']}, torch "
            f"{sweep['torch']}, one thread). Task {sweep['task']}, {sweep['steps']} AdamW steps at lr "
            f"{sweep['lr']}, seed {sweep['seed']}. Worth = first-order loss decrease of the predicted step on the "
            "next batch's gradient over the measured loss decrease per real step (1 = as good as a real step); "
            f"'last window' = the last {runs[0]['window_steps']} steps; n/a where the training loss did not fall "
            "over that window (no decrease to compare with).\n")
    cols = " | ".join(f"{c}: whole run / last window" for c in SWEEP_CANDIDATES)
    lines = [head, f"| batch size | real updates that help the next batch | {cols} |",
             "|---" * (2 + len(SWEEP_CANDIDATES)) + "|"]
    for r in runs:
        cells = []
        for c in SWEEP_CANDIDATES:
            last = r["worth_by_window"][c][-1]
            whole = r["worth_whole_run"][c]
            cells.append(f"{_signed(whole)} / {_signed(last)}")
        lines.append(f"| {r['batch_size']} | {100 * r['fraction_of_real_updates_that_help_the_next_batch']:.0f}% | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def _signed(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2f}"


def plot_sweep(sweep: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    sizes = [r["batch_size"] for r in sweep["runs"]]
    for c in SWEEP_CANDIDATES:
        pts = [(b, r["worth_whole_run"][c]) for b, r in zip(sizes, sweep["runs"]) if r["worth_whole_run"][c] is not None]
        left.plot([b for b, _ in pts], [v for _, v in pts], marker="o", lw=1.2, label=c)
    left.axhline(0, color="black", lw=0.6)
    left.axhline(1, color="black", lw=0.6, ls=":", label="a real step")
    left.set_ylabel(f"worth over the whole run ({sweep['steps']} steps; 1 = a real step)")
    left.legend(fontsize=7)
    right.plot(sizes, [100 * r["fraction_of_real_updates_that_help_the_next_batch"] for r in sweep["runs"]],
               marker="o", color="black")
    right.set_ylim(0, 105)
    right.set_ylabel("real updates that lower the next batch's loss (%)")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("batch size (samples per step; log scale)")
    fig.suptitle(f"{sweep['task']}: worth of predicted steps vs batch size (AdamW lr {sweep['lr']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="charlm")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--batch-size", type=int, default=None, help="replace the task's batch size")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="sweep: one run per batch size, summarised in predictors_<task>_batch_sweep.*")
    parser.add_argument("--out", type=Path, default=Path("experiments/results"))
    args = parser.parse_args(argv)
    if args.batch_size is not None and args.batch_sizes is not None:
        parser.error("--batch-size and --batch-sizes: give one of them")
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    base = f"python -m experiments.predictors --task {args.task} --steps {args.steps}" + (f" --lr {args.lr}" if args.lr else "")
    if args.batch_sizes is not None:
        runs = [measure(args.task, args.steps, args.lr, batch_size=b) for b in args.batch_sizes]
        for r in runs:
            r.pop("train_loss")  # the sweep is about worth; single runs keep the loss curve
        sweep = dict(run_metadata(base + " --batch-sizes " + " ".join(map(str, args.batch_sizes))),
                     task=args.task, steps=args.steps, lr=runs[0]["lr"], seed=runs[0]["seed"], runs=runs)
        stem = args.out / f"predictors_{args.task}_batch_sweep"
        stem.with_suffix(".json").write_text(json.dumps(sweep, indent=1))
        text = sweep_markdown(sweep)
        stem.with_suffix(".md").write_text(text + "\n")
        plot_sweep(sweep, stem.with_suffix(".png"))
        print(text)
        return 0
    result = measure(args.task, args.steps, args.lr, batch_size=args.batch_size)
    result.update(run_metadata(base + (f" --batch-size {args.batch_size}" if args.batch_size else "")))
    stem = f"predictors_{args.task}" + ("" if args.steps == 600 else f"_{args.steps}steps") + (
        f"_bs{args.batch_size}" if args.batch_size else "")  # keeps the default run's name
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / f"{stem}.png")
    print(f"{args.task}: worth of a predicted step relative to a real one ({args.steps} steps, lr {result['lr']}, "
          f"batch {result['batch_size']}); windows of {result['window_steps']} steps, then whole run:")
    for name, values in result["worth_by_window"].items():
        shown = " ".join("  n/a " if v is None else f"{v:+.3f}" for v in values)
        whole = result["worth_whole_run"][name]
        print(f"  {name:28s} {shown}   | {'n/a' if whole is None else f'{whole:+.3f}'}")
    print(f"  real updates that lower the next batch's loss (first order): "
          f"{100 * result['fraction_of_real_updates_that_help_the_next_batch']:.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The feasibility probe's best recipe, on the benchmark's tasks: scheduled, unverified predicted steps.

    python -m experiments.scheduled [--task charlm] [--seeds 3] [--out experiments/results]

Before this project started, a feasibility probe (not part of this repository: a char-LM on
Python source, a model clock instead of wall-clock) found one predicted update that paid a little: the
EMA (β 0.98–0.99) of the real AdamW updates applied at scale 1, ten times after every fifteen real
steps, with no loss check (0.92× the tuned loop's time to its target, a predicted step worth
~0.14 of a real one); a fitted least-squares scale shrank it and lost the gain, and a forward
check rejected nearly every step. The trainer's worth gate measures a predicted step's
*first-order* gain on the next batch, which that probe says misses a gain that shows only after
the following real steps. So this benchmark runs the recipe itself, with the trainer's own
:class:`hybrid_trainer.predictor.DeltaPredictor` (it records every real update from step
``RECORD_FROM`` and applies ``scale · EMA`` with one in-place launch), against plain AdamW on the
same initialisation, batches and rate, and measures wall-clock to the target.

Arms: ``plain``; ``ema β, α 1`` for β in 0.98 / 0.99 (scales fixed at 1); ``ema 0.98, fitted α``
(the trainer's per-tensor scale); ``…, one pass``: the same EMA at scale 1 recorded through the
weights' own EMA (:class:`WeightEMA`: one ``lerp_`` per real step instead of the predictor's
bookkeeping); ``…, evaluated at its weight average``: plain and one-pass validated at the
trainer's lag-corrected weight average (``hybrid_trainer.averaging``), training from the iterate;
``…, tangential, …``: one pass without the direction's component along each weight matrix;
``drift 0.9/0.98, one pass, …``: predicted steps along the drift of the smoothed trajectory
(:class:`WeightDrift`) instead of the EMA of the updates.
``--fork-trial JSON…`` analyses committed runs instead: their arms share every weight until the
first predicted steps, so each pair is a fork, and :func:`fork_trial` reads off what a trial that
runs both branches and keeps the better one would decide and cost.
From step ``FIRST_PREDICT`` on, each ``REAL_BETWEEN`` real steps are followed by ``PREDICTED``
predicted ones (the probe's F10 k10 C5 cycle). Predicted steps consume no batch and touch no
optimizer state. The step budget (``task.steps``) counts real
steps, so the predicted arms take 10/15 more steps in all; time includes them and the recording.
Target: plain's validation loss at 80% of its steps (mean over seeds), as in ``bench.e2e``.
Writes ``<out>/scheduled_<task>.json`` and ``.png`` (``scheduled_<task>_<tag>.*`` with ``--tag``).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from hybrid_trainer.averaging import FAST_BETA, SLOW_BETA, WeightAverage, lag
from hybrid_trainer.predictor import DeltaPredictor

from bench.protocol import first_crossing, mean_std, plot_seed_curves, run_metadata, summarise_against_plain
from bench.tasks import get_task

RECORD_FROM = 50  # real steps before the EMA starts: the first updates are large and fast-changing
FIRST_PREDICT = 100  # the probe's warm-up on the char-LM
REAL_BETWEEN, PREDICTED = 15, 10  # the probe's F10 k10 C5: 15 real steps, then 10 predicted
EVAL_EVERY = 25  # real steps between validations: resolves ~1.05x on a 600-step run
# arm → None (no prediction) or (EMA β, how the step is scaled and recorded): "unit" = the
# predictor's EMA at scale 1, "fitted" = its least-squares scale, "one pass" = WeightEMA at scale 1,
# "tangential" = the same without its component along each weight matrix (WeightEMA.predict):
# the EMA of Adam's updates has a part along the weights, so repeating it grows weight norms;
# is that the char-LM's harm? "drift" = the drift of the smoothed trajectory (WeightDrift), which
# leaves out where the iterate sits in its oscillation: the best first-order worth on the char-LM
# of the directions experiments.predictors measured.
ARMS = {"plain": None, "ema 0.98, α 1": (0.98, "unit"), "ema 0.99, α 1": (0.99, "unit"),
        "ema 0.98, fitted α": (0.98, "fitted"), "ema 0.98, α 1, one pass": (0.98, "one pass"),
        "ema 0.99, α 1, one pass": (0.99, "one pass"), "plain, evaluated at its weight average": None,
        "ema 0.99, α 1, one pass, evaluated at its weight average": (0.99, "one pass"),
        "ema 0.99, α 1, one pass, tangential, evaluated at its weight average": (0.99, "tangential"),
        "drift 0.9/0.98, one pass": (None, "drift"),
        "drift 0.9/0.98, one pass, evaluated at its weight average": (None, "drift")}
# Validated at the trainer's lag-corrected weight average (hybrid_trainer.averaging), training
# from the iterate: does extrapolation add to what averaging gives for free?
AVERAGED = {"plain, evaluated at its weight average", "ema 0.99, α 1, one pass, evaluated at its weight average",
            "ema 0.99, α 1, one pass, tangential, evaluated at its weight average",
            "drift 0.9/0.98, one pass, evaluated at its weight average"}


def run(task, arm: str, lr: float, seed: int) -> dict:
    """One arm, one seed: curve of (real step, seconds, validation loss), predicted steps taken."""
    model = task.make_model(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    stream = task.batches(seed)
    beta, mode = ARMS[arm] or (None, None)
    predictor = DeltaPredictor(params, direction="ema", ema_beta=beta) if mode in ("unit", "fitted") else None
    one_pass = mode in ("one pass", "tangential", "drift")
    average = None  # the one-pass EMA, made at the end of step RECORD_FROM − 1 (see WeightEMA)
    evaluated = WeightAverage(params) if arm in AVERAGED else None
    curve = [dict(step=0, time=0.0, val_loss=task.val_loss(model), backward=0, forward=0)]
    train_time, predicted = 0.0, 0
    for step in range(1, task.steps + 1):
        batch = next(stream)
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        task.loss_fn(model, batch).backward()
        recording = predictor is not None and step >= RECORD_FROM
        if recording:
            predictor.begin_step()
        optimizer.step()
        if one_pass and step == RECORD_FROM - 1:
            average = WeightDrift(params) if mode == "drift" else WeightEMA(params, beta)
        elif average is not None:
            average.update()
            if step >= FIRST_PREDICT and (step - FIRST_PREDICT) % REAL_BETWEEN == 0:
                average.predict(PREDICTED, tangential=mode == "tangential")
                predicted += PREDICTED
        if recording:
            predictor.end_step()
            if step >= FIRST_PREDICT and (step - FIRST_PREDICT) % REAL_BETWEEN == 0:
                if mode == "unit":
                    predictor.scales.fill_(1.0)  # α = 1: the raw EMA vector
                for _ in range(PREDICTED):
                    predictor.apply_predicted_step()
                predicted += PREDICTED
        if evaluated is not None:
            evaluated.update()
        train_time += time.perf_counter() - started
        if step % EVAL_EVERY == 0:
            model.eval()
            with evaluated.swapped_in() if evaluated is not None else contextlib.nullcontext():
                val = task.val_loss(model)
            curve.append(dict(step=step, time=train_time, val_loss=val, backward=step, forward=step))
            model.train()
    return dict(arm=arm, seed=seed, curve=curve, predicted_steps=predicted)


class WeightEMA:
    """The EMA of the real updates from one pass per real step, through the weights' own EMA.

    With ``θ̄ ← β θ̄ + (1 − β) θ`` after every real update ``u``, ``e = θ − θ̄`` obeys
    ``e ← β (e + u)``, so ``(1 − β)/β · e`` *is* the EMA of the updates (zero-started; divided by
    ``1 − βⁿ`` after ``n`` updates, bias-corrected). That replaces the predictor's copy before
    the step, difference, norm and direction update (about six passes over the weights and a
    host read) by one ``lerp_``. A predicted step moves ``θ̄`` with ``θ``, so ``e`` and the
    direction stay what the real updates made them. ``e`` must start at zero, so make it right
    after the last update it should not count: any move between its making and its first
    ``update`` would enter as one stale update, which the bias correction then inflates."""

    def __init__(self, params: list[torch.Tensor], beta: float):
        self.params, self.beta, self.n = params, beta, 0
        self.average = [p.detach().clone() for p in params]

    @torch.no_grad()
    def update(self) -> None:
        torch._foreach_lerp_(self.average, [p.detach() for p in self.params], 1 - self.beta)
        self.n += 1

    @torch.no_grad()
    def direction(self) -> list[torch.Tensor]:
        """The bias-corrected EMA of the updates recorded so far."""
        direction = torch._foreach_sub([p.detach() for p in self.params], self.average)
        torch._foreach_mul_(direction, (1 - self.beta) / self.beta / (1 - self.beta ** self.n))
        return direction

    @torch.no_grad()
    def predict(self, steps: int, tangential: bool = False) -> None:
        """``steps`` predicted steps along the direction, one in-place add each; ``tangential``:
        first remove, for each tensor of two or more dimensions, the direction's projection on
        that tensor (the part that only rescales it), so predicted steps leave its norm to first
        order where it was; vectors (biases, norm gains) keep their full direction."""
        direction = self.direction()
        if tangential:
            _remove_radial_part(direction, self.params)
        for _ in range(steps):
            torch._foreach_add_(self.params, direction)
        torch._foreach_add_(self.average, direction, alpha=float(steps))


def _remove_radial_part(direction: list[torch.Tensor], params: list[torch.Tensor]) -> None:
    """In place: for each tensor of two or more dimensions, the direction's projection on it."""
    for d, p in zip(direction, params):
        if p.dim() >= 2:
            d.sub_(p, alpha=float((d * p).sum() / (p * p).sum().clamp_min(1e-30)))


class WeightDrift:
    """The drift per real step of the smoothed weight trajectory, from two one-pass EMAs.

    ``fast = EMA_0.9(θ)`` and ``slow = EMA_0.98(θ)`` (the weight average's pair,
    ``hybrid_trainer.averaging``) trail a point moving at a constant rate by their lags, so
    ``(fast − slow) / (lag_slow − lag_fast)`` is that rate. Both start at the weights at the end
    of the step before the first ``update``; after ``n`` updates a lag is ``β (1 − βⁿ) / (1 − β)``
    (exact for constant motion). Unlike the EMA of the updates (``WeightEMA``, ``(1 − β)/β ·
    (θ − θ̄)``), it does not see where the iterate sits now, so the part of its oscillation
    across the valley that the last steps left is not repeated. Costs two ``lerp_`` per update."""

    def __init__(self, params: list[torch.Tensor]):
        self.params, self.n = params, 0
        self.fast = [p.detach().clone() for p in params]
        self.slow = [p.detach().clone() for p in params]

    @torch.no_grad()
    def update(self) -> None:
        current = [p.detach() for p in self.params]
        torch._foreach_lerp_(self.fast, current, 1 - FAST_BETA)
        torch._foreach_lerp_(self.slow, current, 1 - SLOW_BETA)
        self.n += 1

    @torch.no_grad()
    def direction(self) -> list[torch.Tensor]:
        lags = [lag(beta) * (1 - beta ** self.n) for beta in (FAST_BETA, SLOW_BETA)]  # lag after n updates
        direction = torch._foreach_sub(self.fast, self.slow)
        torch._foreach_div_(direction, lags[1] - lags[0])
        return direction

    @torch.no_grad()
    def predict(self, steps: int, tangential: bool = False) -> None:
        """``steps`` predicted steps along the drift; both EMAs move with the weights, so the
        drift stays what the real updates made it."""
        direction = self.direction()
        if tangential:
            _remove_radial_part(direction, self.params)
        for _ in range(steps):
            torch._foreach_add_(self.params, direction)
        torch._foreach_add_(self.fast, direction, alpha=float(steps))
        torch._foreach_add_(self.slow, direction, alpha=float(steps))


def analyse(task, runs: dict[str, list[dict]]) -> dict:
    summary, crossings = summarise_against_plain(task, runs)
    for arm, seeds in runs.items():
        pairs = list(zip(crossings[arm], crossings["plain"]))
        summary["arms"][arm].update(
            real_steps_to_target=mean_std([c["step"] if c else None for c in crossings[arm]]),
            step_speedup_vs_plain=mean_std([b["step"] / c["step"] if c and b else None for c, b in pairs]),
            # Real steps a predicted step replaced on the way to the target, per predicted step taken by then.
            worth_per_predicted_step=mean_std([
                (b["step"] - c["step"]) / _predicted_before(c["step"]) if c and b and _predicted_before(c["step"]) else None
                for c, b in pairs] if ARMS[arm] is not None else []),
            predicted_steps=seeds[0]["predicted_steps"])
    return summary


def _predicted_before(real_step: float) -> int:
    """Predicted steps an arm has taken once it has made ``real_step`` real steps."""
    if real_step < FIRST_PREDICT:
        return 0
    return PREDICTED * (int((real_step - FIRST_PREDICT) // REAL_BETWEEN) + 1)


FORK_WIDTHS = (25, 50, 75, 100)  # real steps a trial runs each branch for (multiples of EVAL_EVERY)


def fork_trial(result: dict, arm: str, control: str, widths=FORK_WIDTHS) -> dict:
    """Would a trial that forks the run decide well whether to predict, and would it pay?

    ``arm`` and ``control`` of one committed ``result`` share initialisation, batches and every
    weight up to real step ``FIRST_PREDICT``, whose update ends with the first predicted steps
    (checked: their validation losses agree at every evaluation before it), so each seed's pair
    *is* a fork at that step. A trial of width ``W`` runs both branches ``W`` real steps,
    keeps the one with the lower validation loss (the best case: the whole validation set as the
    judge) and goes on along it, having paid ``W`` real steps for the discarded branch. From the
    recorded curves this gives exactly, per seed: the decision, the branch's real steps to the
    target plus ``W``, and the speed-up in real steps against the control's own steps to the
    target. Wall-clock is not derived (it would need each step's cost; the arms differ)."""
    schedule = result["schedule"]
    first, target = schedule["first_predict"], result["target_val_loss"]
    steps_to_target = {name: [c["step"] if c else None
                              for c in (first_crossing(r["curve"], target) for r in result["runs"][name])]
                       for name in (arm, control)}
    by_step = {name: [{p["step"]: p["val_loss"] for p in r["curve"]} for r in result["runs"][name]]
               for name in (arm, control)}
    for seed, (a, c) in enumerate(zip(by_step[arm], by_step[control])):
        for step in (step for step in a if step < first):
            if abs(a[step] - c[step]) > 1e-6:
                raise ValueError(f"{arm!r} and {control!r} differ before the fork (seed {seed}, step {step}): "
                                 f"{a[step]:.6f} vs {c[step]:.6f}")
    rows = []
    for width in widths:
        decisions, speedups = [], []
        for seed, (a, c) in enumerate(zip(by_step[arm], by_step[control])):
            predict = a[first + width] < c[first + width]
            chosen = steps_to_target[arm if predict else control][seed]
            own = steps_to_target[control][seed]
            decisions.append(dict(seed=seed, predict=predict, loss_difference=a[first + width] - c[first + width]))
            speedups.append(own / (chosen + width) if chosen and own else None)
        right = [(d["predict"] == ((steps_to_target[arm][k] or math.inf) < (steps_to_target[control][k] or math.inf)))
                 for k, d in enumerate(decisions)]
        rows.append(dict(width=width, decisions=decisions, right_decisions=sum(right), seeds=len(right),
                         step_speedup=mean_std(speedups)))
    return dict(task=result["task"], lr=result["lr"], arm=arm, control=control, fork_step=first,
                steps_to_target={k: mean_std(v) for k, v in steps_to_target.items()},
                arm_step_speedup=mean_std([c / a if a and c else None
                                           for a, c in zip(steps_to_target[arm], steps_to_target[control])]),
                widths=rows)


def _short(arm: str) -> str:
    return arm.replace(", evaluated at its weight average", " @ average")


def fork_trial_markdown(trials: list[dict], command: str) -> str:
    lines = [f"Fork trials from committed paired runs, `{command}`: each seed's two arms share every weight "
             f"up to the fork, so the table is exact for those runs (the judge is the full validation set, "
             f"a best case). Speed-up: the control's real steps to the target over the chosen branch's plus "
             f"the trial's width (the discarded branch's steps).", "",
             "| task | lr | arm (vs control) | its speed-up in steps, untrialled | trial width | right decisions "
             "| loss difference at the end of the trial, per seed | speed-up in steps with the trial |",
             "|---|---|---|---|---|---|---|---|"]
    for t in trials:
        untrialled = t["arm_step_speedup"]["mean"]
        for row in t["widths"]:
            speed = row["step_speedup"]
            lines.append(f"| {t['task']} | {t['lr']:g} | {_short(t['arm'])} (vs {_short(t['control'])}) | "
                         f"{'–' if untrialled is None else f'{untrialled:.2f}×'} | {row['width']} | "
                         f"{row['right_decisions']}/{row['seeds']} | "
                         + " ".join(f"{d['loss_difference']:+.4f}" for d in row["decisions"]) + " | "
                         + (f"{speed['mean']:.2f} ± {speed['std']:.2f}× ({speed['n']}/{row['seeds']})"
                            if speed["mean"] is not None else "not reached") + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="charlm", choices=["charlm", "fashion", "digits"])
    parser.add_argument("--lr", type=float, default=None, help="default: the end-to-end benchmark's tuned rate")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), metavar="ARM",
                        help=f"arms besides plain (default: all of {', '.join(map(repr, ARMS))})")
    parser.add_argument("--tag", default=None, help="write scheduled_<task>_<tag>.* instead of scheduled_<task>.*")
    parser.add_argument("--quick", action="store_true", help="the task's quick size (tests)")
    parser.add_argument("--steps", type=int, default=None,
                        help="real-step budget (default: the task's); the target follows it (plain at 80%%)")
    parser.add_argument("--out", type=Path, default=Path("experiments/results"))
    parser.add_argument("--fork-trial", nargs="+", type=Path, default=None, metavar="JSON",
                        help="instead of running: analyse committed results (their two evaluated-at-the-average "
                             f"arms, else the one-pass arm against plain) as fork trials of widths {FORK_WIDTHS}; "
                             "writes <out>/scheduled_fork_trial.md and .json")
    args = parser.parse_args(argv)
    if args.fork_trial:
        return _write_fork_trials(args.fork_trial, args.out)
    torch.set_num_threads(1)
    task = get_task(args.task, quick=args.quick)
    if args.steps is not None:
        if args.steps < 2 * FIRST_PREDICT:
            parser.error(f"--steps {args.steps}: needs at least {2 * FIRST_PREDICT} (predicted steps start at {FIRST_PREDICT})")
        task = dataclasses.replace(task, steps=args.steps)
    lr = args.lr or {"fashion": 1e-3, "charlm": 2e-3, "digits": 3e-3}[args.task]
    arms = ["plain"] + [arm for arm in args.arms if arm != "plain"]
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    with tqdm(total=args.seeds * len(arms), desc=f"scheduled prediction on {args.task}") as bar:
        for seed in range(args.seeds):  # arms interleaved per seed: machine noise hits them alike
            for arm in arms:
                runs[arm].append(run(task, arm, lr, seed))
                bar.update()
    summary = analyse(task, runs)
    stem = f"scheduled_{args.task}" + (f"_{args.tag}" if args.tag else "")
    result = dict(**run_metadata(f"python -m experiments.scheduled --task {args.task} --lr {lr} --seeds {args.seeds}"
                          + ("" if arms == list(ARMS) else " --arms " + " ".join(f"'{a}'" for a in arms[1:]))
                          + (f" --steps {args.steps}" if args.steps is not None else "")
                          + (f" --tag {args.tag}" if args.tag else "") + (" --quick" if args.quick else "")),
                  threads=torch.get_num_threads(), task=args.task, data_source=task.data_source, lr=lr,
                  steps=task.steps, schedule=dict(record_from=RECORD_FROM, first_predict=FIRST_PREDICT,
                                                  real_between=REAL_BETWEEN, predicted=PREDICTED),
                  **summary, runs=runs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    title = f"{args.task}: {PREDICTED} unverified predicted steps after every {REAL_BETWEEN} real ones"
    plot_seed_curves(runs, summary["target_val_loss"], title, args.out / f"{stem}.png")
    print(f"\n{args.task}: target {summary['target_val_loss']:.4f} (plain at step {summary['target_step']})")
    for arm, s in summary["arms"].items():
        speed, worth = s["speedup_vs_plain"]["mean"], s["worth_per_predicted_step"]["mean"]
        print(f"{arm:20s} train {s['train_s']['mean']:.2f} s  final {s['final_val_loss']['mean']:.4f}  "
              f"reached {s['reached_target']}/{args.seeds}  speed-up to target "
              f"{'-' if speed is None else f'{speed:.2f}x'}  worth per predicted step "
              f"{'-' if worth is None else f'{worth:.2f}'}")
    return 0


def _write_fork_trials(paths: list[Path], out: Path) -> int:
    trials = []
    for path in paths:
        result = json.loads(path.read_text())
        averaged = [arm for arm in result["runs"] if arm in AVERAGED and arm != "plain, evaluated at its weight average"]
        if averaged:
            pairs = [(arm, "plain, evaluated at its weight average") for arm in averaged]
        else:
            pairs = [(arm, "plain") for arm in result["runs"] if ARMS.get(arm) and ARMS[arm][1] == "one pass"]
        if not pairs:
            raise SystemExit(f"--fork-trial {path}: no one-pass or averaged arm to analyse")
        trials += [fork_trial(result, arm, control) for arm, control in pairs]
    command = "python -m experiments.scheduled --fork-trial " + " ".join(str(p) for p in paths)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scheduled_fork_trial.json").write_text(json.dumps(dict(run_metadata(command), trials=trials), indent=1))
    text = fork_trial_markdown(trials, command)
    (out / "scheduled_fork_trial.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

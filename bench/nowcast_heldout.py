"""Learned nowcasting on held-out tasks: the plain loop with a nowcast jump every ``call_every``
steps, against constant-rate Adam and a tuned AdamW with warm-up and cosine decay.

The tasks are outside the nowcaster's meta-training family (:func:`bench.nowcaster_family.source_specs`):
other widths and depths (a 16/32/32 CNN, a 512-256 MLP on Fashion-MNIST, a 48-wide 2-layer
char-GPT on the King James Bible), and runs of ``--steps`` steps.

Arms (every arm sees the same initialisation and batch stream for a seed):

* ``adam``: Adam at a constant rate (the task's nominal rate; NiNo's baseline).
* ``cosine``: AdamW (weight decay 0.01), 5% linear warm-up then cosine decay to zero, its rate the
  best final validation loss over the task's grid on a separate tuning seed.
* ``adam+nc``, ``cosine+nc``: the same with a jump every ``call_every`` steps: the nowcaster reads
  the last 5 snapshots (``spacing`` steps apart), predicts the displacement ``k`` spacings ahead
  and adds it to the weights. ``k`` follows NiNo's shrinking schedule (40, 33, 26, 21, 16, 11, 8,
  5, 3, 1 over the calls). Adam's moments are kept (``keep``) or zeroed with its step count
  (``reset``). ``cosine+nc:judged`` runs the package's :class:`~hybrid_trainer.nowcast_jump.NowcastJump`:
  each jump judged after ``call_every / 3`` steps against the pre-jump loss trend and rolled back
  exactly when it does not beat it (``:judged:cap16``: with capped horizons, the trainer's default). ``:cap16`` caps the horizon at 16 spacings (the longest at
  which the meta-trained nowcaster beat predicting no movement on its validation runs). The learning-rate schedule is not advanced by a jump. Snapshots restart after a
  jump, so every call sees a trajectory of real steps from the jumped weights.

Measured: validation loss and accuracy every ``eval_every`` steps (and right before and after
each jump), the steps and the training wall-clock (nowcaster calls included, evaluation excluded)
to reach the tuned cosine run's validation loss at 50%, 75% and 100% of its steps, final loss.

    OMP_NUM_THREADS=1 flock /tmp/cpu.lock python -m bench.nowcast_heldout --seeds 0
    python -m bench.nowcast_heldout --quick      # a smoke run in seconds
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from bench import nowcaster_family as fam
from bench.protocol import run_metadata
from bench.nowcaster_meta import ROOT
from hybrid_trainer import nowcaster as nc
from hybrid_trainer.nowcast_jump import NowcastJump

SCHEDULE = (40, 33, 26, 21, 16, 11, 8, 5, 3, 1)  # NiNo's horizons over its 10 calls

HELDOUT = {
    "cnn": dict(arch="cnn", data="fashion", channels=[16, 32, 32], batch=128, nominal_lr=6e-3,
                grid=[3e-3, 6e-3, 1.2e-2]),
    "mlp": dict(arch="mlp", data="fashion", hidden=[512, 256], batch=128, nominal_lr=1e-3,
                grid=[5e-4, 1e-3, 2e-3]),
    "gpt": dict(arch="gpt", data="kjv", d_model=48, n_heads=3, n_layers=2, context=64, batch=32,
                nominal_lr=3e-3, grid=[2e-3, 4e-3, 8e-3]),
}
QUICK = {"mlp": dict(arch="mlp", data="mnist5k", hidden=[48], batch=64, nominal_lr=2e-3, grid=[2e-3, 4e-3])}


class Jumper:
    """Keeps the last ``context + 1`` flat snapshots and applies nowcast jumps to ``params``."""

    def __init__(self, caster: nc.Nowcaster, model: torch.nn.Module, spacing: int,
                 schedule_free: torch.optim.Optimizer | None = None):
        # ``schedule_free``: a schedule-free optimizer whose parameters are its gradient point y
        # (train mode); a jump then moves its z sequence by the same displacement, so y, z and the
        # averaged point x (y = (1 - b) z + b x) all move together.
        self.caster, self.spacing, self.schedule_free = caster, spacing, schedule_free
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.layout = nc.describe_model(model)
        self.snaps: list[torch.Tensor] = []
        self.seconds = 0.0

    def snapshot(self) -> None:
        self.snaps.append(torch.cat([p.detach().reshape(-1) for p in self.params]).clone())
        self.snaps = self.snaps[-(self.caster.context + 1):]

    @property
    def ready(self) -> bool:
        return len(self.snaps) == self.caster.context + 1

    @torch.no_grad()
    def jump(self, horizon: float) -> float:
        """Add the predicted displacement ``horizon`` spacings ahead; returns its norm relative
        to the weights'. Non-finite predictions are refused (weights untouched, returns nan)."""
        t0 = time.perf_counter()
        delta = self.caster.predict(torch.stack(self.snaps), self.layout, horizon)
        ok = bool(torch.isfinite(delta).all())
        if ok:
            offset = 0
            for p in self.params:
                d = delta[offset:offset + p.numel()].view_as(p)
                p.add_(d)
                if self.schedule_free is not None and "z" in self.schedule_free.state.get(p, {}):
                    self.schedule_free.state[p]["z"].add_(d)
                offset += p.numel()
        self.snaps = []
        self.seconds += time.perf_counter() - t0
        return float(delta.norm() / self.snaps_norm()) if ok else math.nan

    def snaps_norm(self) -> float:
        return float(torch.cat([p.detach().reshape(-1) for p in self.params]).norm().clamp_min(1e-12))


BASES = ("adam", "cosine", "muon", "sf")
MUON_GRID = (0.02, 0.04)  # Muon's own rate scale (the upper two of bench.e2e.MUON_LRS); AdamW trains the rest at cosine's rate
SF_FACTORS = (1.0, 2.0)  # schedule-free AdamW's rate, x the tuned cosine peak rate (two points: one core, a deadline)


def parse_arm(arm: str) -> tuple[str, bool, list[str]]:
    """``"cosine+nc:reset"`` -> ``("cosine", True, ["reset"])``: the base optimizer, whether the
    nowcaster jumps, and the options."""
    head, *options = arm.split(":")
    base, _, suffix = head.partition("+")
    if base not in BASES or suffix not in ("", "nc"):
        raise ValueError(f"arm {arm!r}: expected one of {BASES} with an optional '+nc' and ':' options")
    return base, suffix == "nc", options


def make_arm_optimizer(base: str, model: torch.nn.Module, lr: float, steps: int,
                       muon_lr: float | None = None) -> tuple[torch.optim.Optimizer, Any]:
    """The arm's optimizer and its rate multiplier at each step (``factor(step)``, step from 0).

    ``adam``: Adam at a constant ``lr``. ``cosine``: AdamW (weight decay 0.01), 5% linear warm-up
    then cosine decay to zero. ``muon``: ``torch.optim.Muon`` at ``muon_lr`` over the hidden
    matrices (:func:`bench.protocol.hidden_matrices`) and AdamW at ``lr`` over the rest, both on the
    cosine schedule. ``sf``: schedule-free AdamW (``schedulefree.AdamWScheduleFree``, the project's
    betas :data:`bench.protocol.SCHEDULE_FREE_BETAS`, weight decay 0.01) at a constant ``lr`` with
    its own warm-up over the same 5% of the steps."""
    from bench.protocol import SCHEDULE_FREE_BETAS, hidden_matrices
    from hybrid_trainer.combined_optimizer import CombinedOptimizer

    warm = max(1, int(0.05 * steps))

    def cosine(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warm) / max(1, steps - warm))))

    params = [p for p in model.parameters() if p.requires_grad]
    if base == "adam":
        return torch.optim.Adam(params, lr=lr), lambda step: 1.0
    if base == "cosine":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01), cosine
    if base == "muon":
        head = getattr(model, "head", None)  # the CNN's output layer is not a hidden matrix
        hidden = {id(p) for p in hidden_matrices(model) if p.ndim == 2 and (head is None or p is not head.weight)}
        if not hidden:
            raise ValueError("muon: the model has no hidden 2-D matrices (torch.optim.Muon takes 2-D weights only)")
        return CombinedOptimizer(
            torch.optim.Muon([p for p in params if id(p) in hidden], lr=muon_lr, weight_decay=0.01),
            torch.optim.AdamW([p for p in params if id(p) not in hidden], lr=lr, weight_decay=0.01)), cosine
    if base == "sf":
        import schedulefree

        opt = schedulefree.AdamWScheduleFree(params, lr=lr, warmup_steps=warm, betas=SCHEDULE_FREE_BETAS,
                                             weight_decay=0.01)
        opt.train()
        return opt, lambda step: 1.0
    raise ValueError(f"base must be one of {BASES}, got {base!r}")


def clear_moments(opt: torch.optim.Optimizer) -> None:
    """Forget the optimizer's per-parameter state (moments, momentum buffers, step counts)."""
    for part in getattr(opt, "parts", [opt]):
        part.state.clear()


def run_arm(spec: dict[str, Any], lr: float, cosine: bool | str, caster: nc.Nowcaster | None, moments: str,
            steps: int, spacing: int, call_every: int, eval_every: int, cap: int | None = None,
            muon_lr: float | None = None) -> dict[str, Any]:
    """One run of ``steps`` steps. ``cosine``: the base optimizer (``True``/``False`` = ``"cosine"``/
    ``"adam"``, or a name of :data:`BASES`). ``moments``: ``keep``, ``reset``, ``judged`` (the
    bench's :class:`NowcastJump`, recovery and trend over a third of ``call_every``) or ``trainer``
    (the controller ``HybridConfig(predictor="nowcast")`` builds, with its defaults)."""
    base = cosine if isinstance(cosine, str) else ("cosine" if cosine else "adam")
    horizons = tuple(min(k, cap) for k in SCHEDULE) if cap else SCHEDULE
    spec = dict(spec, opt="adamw" if base == "cosine" else "adam", cosine=base == "cosine", lr=lr, steps=steps)
    model = fam.make_model(spec)
    opt, factor = make_arm_optimizer(base, model, lr, steps, muon_lr)
    base_lrs = [g["lr"] for g in opt.param_groups]
    loss_fn, stream, plain_evaluate = fam.loss_fn(spec), fam.batches(spec), fam.validation(spec)
    if base == "sf":
        from bench.protocol import schedule_free_evaluation

        def evaluate(m):  # at schedule-free's averaged point, as the optimizer requires
            with schedule_free_evaluation(opt):
                return plain_evaluate(m)
    else:
        evaluate = plain_evaluate
    judged = None
    if caster is not None and moments in ("judged", "trainer"):
        if base == "sf":
            raise ValueError("judged jumps over schedule-free AdamW are not measured: the controller moves "
                             "the parameters but not the optimizer's z sequence")
        if moments == "trainer":
            from types import SimpleNamespace

            from hybrid_trainer.config import HybridConfig
            from hybrid_trainer.nowcast_jump import make_nowcast

            judged = make_nowcast(HybridConfig(predictor="nowcast"), model, opt, None, SimpleNamespace(active=False))
            judged.caster = caster
        else:
            judged = NowcastJump(model, opt, caster=caster, spacing=spacing, call_every=call_every,
                                 recovery_steps=call_every // 3, trend_steps=call_every // 3, schedule=horizons)
        caster = None
    if caster is not None and base == "sf" and moments == "reset":
        raise ValueError("moments='reset' is not measured for schedule-free AdamW (its state holds the z sequence)")
    jumper = Jumper(caster, model, spacing, opt if base == "sf" else None) if caster is not None else None
    curve, jumps = [], []
    train_s = 0.0
    calls = 0
    for step in range(steps + 1):
        if jumper is not None:
            if step > 0 and step % call_every == 0 and step < steps and jumper.ready and calls < len(horizons):
                pre = evaluate(model)
                k = horizons[calls]
                t0 = time.perf_counter()
                rel = jumper.jump(k)
                if moments == "reset":
                    clear_moments(opt)
                train_s += time.perf_counter() - t0
                calls += 1
                post = evaluate(model)
                jumps.append(dict(step=step, horizon=k, rel_norm=rel, pre_loss=pre[0], post_loss=post[0],
                                  pre_acc=pre[1], post_acc=post[1]))
                jumper.snapshot()  # the first snapshot of the new trajectory
            elif step % spacing == 0:
                jumper.snapshot()
        if step % eval_every == 0:
            loss, acc = evaluate(model)
            curve.append(dict(step=step, loss=loss, acc=acc, train_s=train_s))
        if step == steps:
            break
        t0 = time.perf_counter()
        f = factor(step)
        for group, base_lr in zip(opt.param_groups, base_lrs):
            group["lr"] = base_lr * f
        loss = loss_fn(model, next(stream))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if judged is not None:
            event = judged.after_step(step, loss.item())
            if event is not None:
                post = evaluate(model)
                jumps.append(dict(step=step + 1, event=event, post_loss=post[0], post_acc=post[1]))
        train_s += time.perf_counter() - t0
    if judged is not None:
        jumper = judged
        records = [dict(r.__dict__) for r in judged.records]
        for j, r in zip([j for j in jumps if j["event"] == "jump"], records):
            j.update(horizon=r["horizon"], rel_norm=r["rel_norm"], kept=r["kept"])
    final = curve[-1]
    return dict(lr=lr, muon_lr=muon_lr, curve=curve, jumps=jumps, final_loss=final["loss"], final_acc=final["acc"],
                best_loss=min(c["loss"] for c in curve), train_s=train_s,
                nowcaster_s=(jumper.nowcaster_seconds if isinstance(jumper, NowcastJump) else jumper.seconds)
                if jumper is not None else 0.0)


def call_cost(casters: dict[str, nc.Nowcaster], specs: dict[str, dict[str, Any]], repeats: int = 3) -> dict[str, Any]:
    """Seconds per nowcaster call (best of ``repeats``; features, model and interpolation), on
    each task's model and on a 1.07M-parameter MLP (784-1024-256-10), and one real training
    step of each task for scale."""
    models = {name: fam.make_model(dict(spec, seed=0)) for name, spec in specs.items()}
    torch.manual_seed(0)
    models["mlp-1.07M"] = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256),
                                              torch.nn.ReLU(), torch.nn.Linear(256, 10))
    out: dict[str, Any] = {}
    for name, model in models.items():
        layout = nc.describe_model(model)
        w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        window = w + torch.randn(5, w.numel()).cumsum(0) * 1e-3
        row = dict(params=layout.total)
        for variant, caster in casters.items():
            best = math.inf
            for _ in range(repeats):
                t0 = time.perf_counter()
                caster.predict(window, layout, 8)
                best = min(best, time.perf_counter() - t0)
            row[f"{variant}_s"] = best
        if name in specs:
            spec = dict(specs[name], seed=0, opt="adam", lr=1e-3, steps=10)
            opt, _ = fam.make_optimizer(spec, model)
            stream, loss_fn = fam.batches(spec), fam.loss_fn(spec)
            best = math.inf
            for _ in range(repeats + 2):
                t0 = time.perf_counter()
                loss = loss_fn(model, next(stream))
                opt.zero_grad()
                loss.backward()
                opt.step()
                best = min(best, time.perf_counter() - t0)
            row["train_step_s"] = best
        out[name] = row
    return out


def first_reach(curve: list[dict[str, Any]], target: float) -> tuple[int | None, float | None]:
    for c in curve:
        if c["loss"] <= target:
            return c["step"], c["train_s"]
    return None, None


# The full protocol: every arm on every seed (Muon's arms not on the tasks in NO_MUON). The summary
# lists whatever of it the result file does not hold yet.
PROTOCOL_ARMS = ("cosine", "cosine+nc:trainer", "cosine+nc:reset", "adam", "adam+nc",
                 "muon", "muon+nc:reset", "sf", "sf+nc")
PROTOCOL_SEEDS = (0, 1, 2)
NO_MUON = ("cnn",)


def missing_runs(results: dict[str, Any]) -> dict[str, dict[str, list[int]]]:
    """``{task: {arm: [seeds]}}`` of the protocol's runs (:data:`PROTOCOL_ARMS` x :data:`PROTOCOL_SEEDS`)
    that ``results`` does not hold; empty when every one ran."""
    missing: dict[str, dict[str, list[int]]] = {}
    for name, entry in results["tasks"].items():
        for arm in PROTOCOL_ARMS:
            if parse_arm(arm)[0] == "muon" and name in NO_MUON:
                continue
            seeds = [s for s in PROTOCOL_SEEDS if arm not in entry["seeds"].get(str(s), {})]
            if seeds:
                missing.setdefault(name, {})[arm] = seeds
    return missing


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.nowcast_heldout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="*", default=list(HELDOUT))
    parser.add_argument("--seeds", nargs="*", type=int, default=list(PROTOCOL_SEEDS))
    parser.add_argument("--tune-seed", type=int, default=99)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--spacing", type=int, default=nc.DEFAULT_SPACING)
    parser.add_argument("--call-every", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--arms", nargs="*",
                        default=list(PROTOCOL_ARMS),
                        help="base optimizer (adam, cosine, muon, sf), '+nc' for nowcast jumps, ':' options: "
                             "reset, judged, trainer, capN, weight")
    parser.add_argument("--no-muon", nargs="*", default=list(NO_MUON),
                        help="tasks without Muon arms (torch.optim.Muon takes 2-D matrices only; the CNN's "
                             "hidden layers are convolutions)")
    parser.add_argument("--nowcaster", default=None, help="neuron-aware weights (default: the shipped ones)")
    parser.add_argument("--weight-nowcaster", default=str(ROOT / "results-tmp" / "nowcaster_weight.pt"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--summarise", action="store_true", help="only rebuild the .md and .png from the .json")
    parser.add_argument("--out", default=None, help="results path without suffix (default: docs/results/"
                        "nowcast_heldout, or results-tmp/nowcast_heldout_quick with --quick)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.summarise:
        out = Path(args.out) if args.out else ROOT / "docs" / "results" / "nowcast_heldout"
        summarise(json.loads(out.with_suffix(".json").read_text()), out)
        return
    tasks = QUICK if args.quick else {k: HELDOUT[k] for k in args.tasks}
    if args.quick:
        args.steps, args.spacing, args.call_every, args.eval_every, args.seeds = 240, 10, 60, 20, [0]
        args.arms = [a for a in args.arms if "weight" not in a.split(":")[1:]]
    casters = {"neuron": nc.load_nowcaster(args.nowcaster)}
    if any("weight" in a.split(":")[1:] for a in args.arms):
        casters["weight"] = nc.load_nowcaster(args.weight_nowcaster)
    out = Path(args.out) if args.out else (ROOT / "results-tmp" / "nowcast_heldout_quick" if args.quick
                                           else ROOT / "docs" / "results" / "nowcast_heldout")
    json_path = out.with_suffix(".json")
    results = json.loads(json_path.read_text()) if json_path.exists() and not args.quick else {}
    earlier = results.get("commands") or ([results["command"]] if "command" in results else [])
    results.update(run_metadata("python -m bench.nowcast_heldout "
                                + " ".join(argv if argv is not None else __import__("sys").argv[1:])),
                   steps=args.steps, spacing=args.spacing, call_every=args.call_every, eval_every=args.eval_every,
                   schedule=list(SCHEDULE), threads=1,
                   nowcasters={k: dict(variant=v.variant, params=sum(p.numel() for p in v.parameters()),
                                       meta={m: v.meta.get(m) for m in ("command", "git_commit", "val_rel_error")})
                               for k, v in casters.items()})
    results.setdefault("tasks", {})
    results["commands"] = earlier + ([results["command"]] if results["command"] not in earlier else [])
    results["call_cost"] = {**results.get("call_cost", {}),  # tasks not run this time keep their figures
                            **call_cost(casters, {k: {kk: vv for kk, vv in v.items() if kk not in ("nominal_lr", "grid")}
                                                  for k, v in tasks.items()})}
    print("call cost:", json.dumps(results["call_cost"]), flush=True)
    for name, task in tasks.items():
        entry = results["tasks"].setdefault(name, dict(spec=task, tuning={}, seeds={}))
        base = {k: v for k, v in task.items() if k not in ("nominal_lr", "grid")}
        kw = dict(steps=args.steps, spacing=args.spacing, call_every=args.call_every, eval_every=args.eval_every)
        bases = {parse_arm(a)[0] for a in args.arms}
        if not entry["tuning"]:
            for lr in task["grid"]:
                r = run_arm(dict(base, seed=args.tune_seed), lr, "cosine", None, "keep", **kw)
                entry["tuning"][str(lr)] = r["final_loss"]
                print(f"{name} tune cosine lr {lr:g}: final val loss {r['final_loss']:.4f}", flush=True)
        best_lr = float(min(entry["tuning"], key=lambda k: entry["tuning"][k]))
        entry["cosine_lr"] = best_lr
        # Muon and schedule-free get their rates the same way: the best final validation loss over a
        # small grid on the tuning seed (Muon's rate for the hidden matrices; AdamW keeps cosine's
        # rate for the rest; schedule-free's rate as multiples of cosine's peak rate).
        grids = {"muon": [m for m in MUON_GRID], "sf": [round(best_lr * f, 10) for f in SF_FACTORS]}
        for opt_name in ("muon", "sf"):
            if opt_name not in bases or (opt_name == "muon" and name in args.no_muon):
                continue
            tuning = entry.setdefault(f"tuning_{opt_name}", {})
            for value in grids[opt_name]:
                if str(value) in tuning:
                    continue
                if opt_name == "muon":
                    r = run_arm(dict(base, seed=args.tune_seed), best_lr, "muon", None, "keep", muon_lr=value, **kw)
                else:
                    r = run_arm(dict(base, seed=args.tune_seed), value, "sf", None, "keep", **kw)
                tuning[str(value)] = r["final_loss"]
                print(f"{name} tune {opt_name} {value:g}: final val loss {r['final_loss']:.4f}", flush=True)
                json_path.parent.mkdir(parents=True, exist_ok=True)
                json_path.write_text(json.dumps(results, indent=1))
            entry[f"{opt_name}_lr"] = float(min(tuning, key=lambda k: tuning[k]))
        for seed in args.seeds:
            arms = entry["seeds"].setdefault(str(seed), {})
            for arm in args.arms:
                if arm in arms:
                    continue
                opt_name, jumps_on, options = parse_arm(arm)
                if opt_name == "muon" and name in args.no_muon:
                    continue
                variant = "weight" if "weight" in options else "neuron"
                caster = casters[variant] if jumps_on else None
                moments = next((o for o in options if o in ("reset", "judged", "trainer")), "keep")
                cap = next((int(o[3:]) for o in options if o.startswith("cap")), None)
                lr = {"adam": task["nominal_lr"], "cosine": best_lr, "muon": best_lr,
                      "sf": entry.get("sf_lr")}[opt_name]
                r = run_arm(dict(base, seed=seed), lr, opt_name, caster, moments, cap=cap,
                            muon_lr=entry.get("muon_lr") if opt_name == "muon" else None, **kw)
                arms[arm] = r
                print(f"{name} seed {seed} {arm}: final loss {r['final_loss']:.4f} acc {r['final_acc']:.4f}, "
                      f"{r['train_s']:.0f}s (nowcaster {r['nowcaster_s']:.2f}s); jumps "
                      + " ".join(f"{j.get('pre_loss', j.get('event'))}->{j['post_loss']:.2f}" for j in r["jumps"]),
                      flush=True)
                json_path.parent.mkdir(parents=True, exist_ok=True)
                json_path.write_text(json.dumps(results, indent=1))
    summarise(results, out, quick=args.quick)


def arm_runs(entry: dict[str, Any], arm: str,
             reference: str = "cosine") -> list[tuple[str, dict[str, Any], dict[str, Any] | None]]:
    """``(seed, the arm's run, that seed's ``reference`` run)`` for every seed of one task that ran ``arm``."""
    return [(s, arms[arm], arms.get(reference)) for s, arms in entry["seeds"].items() if arm in arms]


def speedups(runs: list[tuple[str, dict[str, Any], dict[str, Any] | None]],
             frac: float) -> tuple[list[int | None], list[float], list[float]]:
    """Against each seed's reference run (the tuned cosine run by default), to its validation loss
    at ``frac`` of its steps (1.0: its final loss): the step at which each run reached it (None:
    never), and the step and wall-clock speed-ups of the runs that did."""
    reach, sps, walls = [], [], []
    for _, r, ref in runs:
        if ref is None:
            continue
        idx = min(len(ref["curve"]) - 1, round(frac * (len(ref["curve"]) - 1)))
        target = ref["curve"][idx]["loss"] if frac < 1 else ref["final_loss"]
        c_step, c_s = first_reach(ref["curve"], target)
        a_step, a_s = first_reach(r["curve"], target)
        reach.append(a_step)
        if a_step:
            sps.append(c_step / a_step)
            walls.append(c_s / a_s if a_s else math.nan)
    return reach, sps, walls


GOAL_STEPS, GOAL_WALL, STOP_BELOW = 1.5, 1.3, 1.2  # the goal against tuned cosine, and the stop rule's bar
VERDICT_FRACS = (0.75, 1.0)  # targets the verdict reads: cosine's loss at 75% of its steps, and its final loss
TRAINER_ARM = "cosine+nc:trainer"  # what HybridConfig(predictor="nowcast") runs


def worst_case(runs, frac: float) -> tuple[float, float]:
    """The arm's step and wall-clock speed-up at ``frac`` as the verdict reads them: the geometric
    mean over seeds, and 0 when any seed never reached the target (a miss is no speed-up)."""
    reach, sps, walls = speedups(runs, frac)
    if not reach or any(x is None for x in reach):
        return 0.0, 0.0
    return _gmean(sps), _gmean(walls)


def _cell(xs: list[float], n: int) -> str:
    """Geometric mean [min–max] over the seeds that reached; '(k/n)' when not all did."""
    if not xs:
        return "–"
    spread = f" [{min(xs):.2f}–{max(xs):.2f}]" if len(xs) > 1 else ""
    return f"{_gmean(xs):.2f}×{spread}" + ("" if len(xs) == n else f" ({len(xs)}/{n})")


def _mean_sd(xs: list[float]) -> str:
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return f"{m:.4f} ± {sd:.4f}" if len(xs) > 1 else f"{m:.4f}"


def verdict(results: dict[str, Any]) -> list[str]:
    """The goal and the stop rule, read from the runs: per task, the trainer's arm and the best
    nowcast arm (the highest step speed-up at the 75% target) against tuned cosine."""
    lines = [f"Goal: at least {GOAL_STEPS}× fewer steps and {GOAL_WALL}× less wall-clock (nowcaster included) "
             f"than the tuned cosine run, on the held-out tasks. Stop rule: less than {STOP_BELOW}× against tuned "
             "cosine on every held-out task. Read at two targets (cosine's loss at 75% of its steps, T75, and its "
             "final loss, T100); a seed that never reaches a target counts as no speed-up (0×).", "",
             "The last column separates the nowcaster's share from its optimizer's: the same arm's step speed-up at "
             "T75 / T100 over its own optimizer's plain loop (targets from that loop's run), geometric mean over the "
             "seeds that reached; '–': none did.", "",
             "| task | arm | steps T75 | wall T75 | steps T100 | wall T100 | goal met | below the stop bar "
             "| steps T75 / T100 over its own plain loop |",
             "|---|---|---|---|---|---|---|---|---|"]
    met, below = {}, {}
    for name, entry in results["tasks"].items():
        arms = []
        for seed_arms in entry["seeds"].values():
            arms += [a for a in seed_arms if "+nc" in a and a not in arms]
        if not arms:
            continue
        score = {a: worst_case(arm_runs(entry, a), 0.75)[0] for a in arms}
        def rank(a: str) -> tuple[float, float, int, float]:
            # ties (every arm missed a target in some seed: 0x) go to the arm that reached T75 in the
            # most seeds, then to the fastest there
            reach, sps, _ = speedups(arm_runs(entry, a), 0.75)
            return score[a], worst_case(arm_runs(entry, a), 1.0)[0], len(sps), _gmean(sps) if sps else 0.0

        best = max(arms, key=rank)
        for role, arm in (("trainer", TRAINER_ARM), ("best", best)):
            if arm not in arms:
                continue
            figs = [worst_case(arm_runs(entry, arm), f) for f in VERDICT_FRACS]
            goal = all(sp >= GOAL_STEPS and w >= GOAL_WALL for sp, w in figs)
            low = all(sp < STOP_BELOW for sp, _ in figs)
            met.setdefault(role, []).append(goal)
            below.setdefault(role, []).append(low)
            own = arm_runs(entry, arm, reference=parse_arm(arm)[0])
            over_own = " / ".join(_cell(speedups(own, f)[1], len(own)) for f in VERDICT_FRACS)
            lines.append(f"| {name} | {role}: `{arm}` | {figs[0][0]:.2f}× | {figs[0][1]:.2f}× | {figs[1][0]:.2f}× | "
                         f"{figs[1][1]:.2f}× | {'yes' if goal else 'no'} | {'yes' if low else 'no'} | {over_own} |")
    lines.append("")
    for role, label in (("trainer", f"the trainer's arm (`{TRAINER_ARM}`, what `HybridConfig(predictor=\"nowcast\")` "
                                    "does)"), ("best", "the best nowcast arm per task")):
        if role not in met:
            continue
        n, low = len(below[role]), sum(below[role])
        lines.append(f"- **VERDICT, {label}:** goal {'met' if all(met[role]) else 'NOT met'} "
                     f"({sum(met[role])} of {len(met[role])} tasks); stop rule "
                     + (f"**applies**: below {STOP_BELOW}× at both targets on every task"
                        if low == n else f"does **not** apply: {STOP_BELOW}× or more at T75 or T100 on {n - low} "
                                         f"of {n} tasks"))
    return lines


def summarise(results: dict[str, Any], out: Path, quick: bool = False) -> None:
    """Targets, speed-ups, the verdict and the markdown table + plot from ``results``."""
    commands = results.get("commands") or [results["command"]]
    lines = ["# Learned nowcasting on held-out tasks", "",
             "Commands (one CPU thread each; later runs add seeds and arms to the same file): "
             + ", ".join(f"`OMP_NUM_THREADS=1 {c}`" for c in commands), "",
             f"Last run: git commit {results['git_commit']}, {results['date']}, one CPU thread on a shared 2-core "
             f"machine (wall-clock noisy). {results['steps']} steps per run, snapshots every "
             f"{results['spacing']} steps, a jump every {results['call_every']} steps with horizons "
             f"{results['schedule']} (in snapshot spacings), validation every {results['eval_every']} steps; "
             f"`{TRAINER_ARM}` runs the controller `HybridConfig(predictor=\"nowcast\")` builds with its defaults "
             "(a jump every 300 steps, horizons capped at 16, judged after 100 steps against the pre-jump trend "
             "and rolled back when it does not beat it).",
             "", "Targets: the tuned cosine run's validation loss at 50% / 75% / 100% of its steps (per seed). "
             "Speed-up = the cosine run's steps (or training seconds, nowcaster included, evaluation excluded) to "
             "the target over the arm's: geometric mean over seeds [min–max]; '(k/n)': only k of n seeds reached "
             "it; '–' = not reached.", "",
             "Arms: `adam` constant-rate Adam (NiNo's baseline); `cosine` AdamW with 5% warm-up and cosine decay "
             "(rate tuned); `muon` Muon over the hidden matrices + AdamW over the rest on the same schedule (Muon's "
             "rate tuned; not on the CNN: `torch.optim.Muon` takes 2-D matrices only); `sf` schedule-free AdamW "
             "(rate tuned), evaluated at its averaged point; `+nc` adds nowcast jumps; `:reset` clears the "
             "optimizer state at each jump; `sf+nc` jumps the weights schedule-free trains (its gradient point y) "
             "and moves its z sequence by the same displacement, so its averaged point moves with them (moments "
             "kept).", "", "## Verdict", ""] + verdict(results) + [""]
    if not quick:
        missing = missing_runs(results)
        lines += ["## Not run yet", ""] + ([f"- {name}: " + "; ".join(
            f"`{arm}` seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}" for arm, seeds in arms.items())
            for name, arms in missing.items()] if missing else [
            f"Every arm of the protocol ran on seeds {', '.join(map(str, PROTOCOL_SEEDS))} of every task."]) + [""]
    cost = results.get("call_cost", {})
    if cost:
        variants = [k[:-2] for k in next(iter(cost.values())) if k.endswith("_s") and k != "train_step_s"]
        lines += ["## Cost of one nowcaster call (best of 3, one thread; noisy shared machine)", "",
                  "| model | parameters | " + " | ".join(f"{v} call (s)" for v in variants) + " | one training step (s) |",
                  "|---|---|" + "---|" * len(variants) + "---|"]
        for name, row in cost.items():
            step = f"{row['train_step_s']:.4f}" if "train_step_s" in row else "–"
            lines.append(f"| {name} | {row['params']:,} | " + " | ".join(f"{row[v + '_s']:.3f}" for v in variants)
                         + f" | {step} |")
        lines.append("")
    for name, entry in results["tasks"].items():
        lines += [f"## {name}: {json.dumps(entry['spec'])}", "",
                  f"- cosine peak rate tuned on seed 99 over {entry['spec']['grid']}: final val loss "
                  + ", ".join(f"{k}: {v:.4f}" for k, v in entry["tuning"].items()) + f" -> {entry.get('cosine_lr')}"]
        for opt_name, label in (("muon", "Muon rate (AdamW at cosine's rate for the rest)"),
                                ("sf", "schedule-free rate")):
            if entry.get(f"tuning_{opt_name}"):
                lines.append(f"- {label} tuned on seed 99: final val loss "
                             + ", ".join(f"{float(k):g}: {v:.4f}" for k, v in entry[f"tuning_{opt_name}"].items())
                             + f" -> {entry.get(f'{opt_name}_lr')}")
        lines += ["", "| arm | seeds | final val loss | final acc | steps to T50 ; T75 ; T100 (per seed) | "
                  "step speed-up vs cosine T50 / T75 / T100 | wall speed-up T50 / T75 / T100 | train s | "
                  "nowcaster s (calls) |", "|---|---|---|---|---|---|---|---|---|"]
        arm_names = []
        for arms in entry["seeds"].values():
            arm_names += [a for a in arms if a not in arm_names]
        for arm in arm_names:
            runs = arm_runs(entry, arm)
            steps_cells, sp_cells, wall_cells = [], [], []
            for frac in (0.5, 0.75, 1.0):
                reach, sps, walls = speedups(runs, frac)
                steps_cells.append("/".join(str(x) if x is not None else "–" for x in reach))
                sp_cells.append(_cell(sps, len(runs)))
                wall_cells.append(_cell(walls, len(runs)))
            n = len(runs)
            mean = lambda key: sum(r[key] for _, r, _ in runs) / n  # noqa: E731
            calls = sum(len([j for j in r["jumps"] if j.get("event", "jump") == "jump"]) for _, r, _ in runs)
            lines.append(f"| {arm} | {n} | {_mean_sd([r['final_loss'] for _, r, _ in runs])} | {mean('final_acc'):.4f} | "
                         f"{' ; '.join(steps_cells)} | {' / '.join(sp_cells)} | {' / '.join(wall_cells)} | "
                         f"{mean('train_s'):.0f} | {mean('nowcaster_s'):.2f} ({calls}) |")
        own = [(a, parse_arm(a)[0]) for a in arm_names if "+nc" in a and parse_arm(a)[0] in arm_names]
        if own:
            lines += ["", "The nowcaster over its own optimizer's plain loop (targets from that loop's run, same seed):",
                      "", "| arm | over | step speed-up T50 / T75 / T100 | wall speed-up T50 / T75 / T100 |",
                      "|---|---|---|---|"]
            for arm, plain in own:
                runs = arm_runs(entry, arm, reference=plain)
                cells = [speedups(runs, f) for f in (0.5, 0.75, 1.0)]
                lines.append(f"| {arm} | {plain} | " + " / ".join(_cell(c[1], len(runs)) for c in cells) + " | "
                             + " / ".join(_cell(c[2], len(runs)) for c in cells) + " |")
        jump_rows = []
        for seed, arms in entry["seeds"].items():
            for arm, r in arms.items():
                if r["jumps"] and "pre_loss" in r["jumps"][0]:
                    jump_rows.append(f"| {arm} | {seed} | " + " ".join(
                        f"{j['pre_loss']:.2f}→{j['post_loss']:.2f}" for j in r["jumps"]) + " |")
                elif r["jumps"]:  # judged: the loss after the jump, and after the verdict
                    jump_rows.append(f"| {arm} | {seed} | " + " ".join(
                        f"{j['step']}: {j['event']} {j['post_loss']:.2f}" for j in r["jumps"]) + " |")
        if jump_rows:
            lines += ["", "Validation loss right before → right after each jump (judged arms: the loss right after "
                      "the jump and right after the verdict, kept or rolled back):", "", "| arm | seed | jumps |",
                      "|---|---|---|"] + jump_rows
        lines.append("")
    if not quick:
        out.with_suffix(".md").write_text("\n".join(lines) + "\n")
        plot(results, out.with_suffix(".png"))
    else:
        print("\n".join(lines))


def _gmean(xs: list[float]) -> float:
    xs = [x for x in xs if x and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = results["tasks"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
    for ax, (name, entry) in zip(axes[0], tasks.items()):
        seed, arms = next(iter(entry["seeds"].items()))
        for arm, r in arms.items():
            ax.plot([c["step"] for c in r["curve"]], [c["loss"] for c in r["curve"]], label=arm)
        ys = [c["loss"] for r in arms.values() for c in r["curve"]]
        ax.set_ylim(min(ys) * 0.97, sorted(ys)[int(0.9 * len(ys))] * 1.1)
        ax.set_title(f"{name} (seed {seed})")
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()

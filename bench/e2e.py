"""End-to-end benchmark: HybridTrainer vs a tuned plain AdamW loop on real data.

    python -m bench.e2e [--quick] [--tasks charlm fashion digits] [--seeds 3] [--device cpu|cuda] [--out docs/results]

Protocol (shared/design.md §5):
* Every arm of a task starts from the same initialisation and sees the same batches in the same
  order, per seed. All arms of a task run in one process, interleaved chunk by chunk
  (``eval_every`` steps of one arm, then of the next), so machine noise hits them alike.
  ``torch.set_num_threads`` is fixed and reported.
* Arms: AdamW at the learning rate picked by a small sweep (recorded in the output), the same
  loop at 2× that rate (repeating updates resembles a larger step: the honest competitor), and
  HybridTrainer at the tuned rate (default config; ``no-predict``: prediction off, what the
  trainer's safety layer alone costs; ``aggressive``, ``conservative`` and ``forced``, which
  predicts at every decision whatever it is worth, on request). ``weight-average``: the
  trainer evaluated at its lag-corrected weight average, at the rate a second sweep (1×, 2×, 4×
  the tuned one, final loss at the average) picks, with its control, the AdamW loop at that rate
  evaluated at the same average, so a gain is attributed to averaging, not to the trainer.
  ``schedule-free``: the trainer (default config) over schedule-free AdamW (the ``schedulefree``
  package) at the rate and warm-up a third sweep picks, with its control, the plain loop over the
  same optimizer; both are evaluated at the optimizer's averaged weights (``optimizer.eval()``).
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
import contextlib
import datetime as dt
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from hybrid_trainer import CombinedOptimizer, HybridConfig, HybridTrainer
from hybrid_trainer.averaging import WeightAverage

from .tasks import Task, get_task

HYBRID_STEP_FACTOR = 1.5
PHASE_COLOURS = {"WARMUP": "#dddddd", "FULL": "#cfe2f3", "PREDICT": "#d9ead3", "CORRECT": "#fce5cd"}


@dataclass
class ArmSpec:
    name: str
    lr: float
    config: HybridConfig | None = None  # None: plain loop
    average: bool = False  # plain loop evaluated at its lag-corrected weight average (a control)
    # Schedule-free AdamW (``schedulefree.AdamWScheduleFree``) with this many warm-up steps instead
    # of AdamW; None: AdamW. Evaluated at its averaged weights (optimizer.eval()).
    schedule_free_warmup: int | None = None
    # Muon (``torch.optim.Muon``) at this rate over the hidden matrices (:func:`hidden_matrices`)
    # and AdamW at ``lr`` over the rest, as one ``CombinedOptimizer``; None: AdamW alone.
    muon_lr: float | None = None

    @property
    def schedule_free(self) -> bool:
        return self.schedule_free_warmup is not None

    @property
    def muon(self) -> bool:
        return self.muon_lr is not None

    @property
    def hybrid(self) -> bool:
        return self.config is not None


@dataclass
class ArmRun:
    """One arm on one seed, advanced chunk by chunk."""

    spec: ArmSpec
    task: Task
    seed: int
    budget: int
    model: torch.nn.Module = field(init=False)
    curve: list[dict] = field(default_factory=list)  # eval points
    phases: list[tuple[float, str]] = field(default_factory=list)  # (time at step start, phase)
    train_time: float = 0.0
    steps: int = 0
    backward: int = 0
    forward: int = 0

    def __post_init__(self):
        self.model = self.task.make_model(self.seed)
        self.optimizer = make_optimizer(self.spec, self.model)
        self.stream = self.task.batches(self.seed)
        self.trainer = (HybridTrainer(self.model, self.optimizer, self.task.loss_fn, self.spec.config)
                        if self.spec.hybrid else None)
        self.average = WeightAverage(list(self.model.parameters())) if self.spec.average else None
        self._eval()

    @property
    def done(self) -> bool:
        return self.steps >= self.budget

    def run_chunk(self, n: int, record_phases: bool) -> None:
        n = min(n, self.budget - self.steps)
        batches = [next(self.stream) for _ in range(n)]  # data loading is not training time
        start = train_clock(self.task.device)
        if self.trainer is None:
            for batch in batches:
                self.plain_step(batch)
            self.backward += n
            self.forward += n
        else:
            for batch in batches:
                if record_phases:  # host clock, no sync: each trainer step reads its loss, so it is close
                    self.phases.append((self.train_time + time.perf_counter() - start, self.trainer.controller.phase.value))
                self.trainer.step(batch)
            s = self.trainer.stats
            self.backward, self.forward = s.backward_passes, s.forward_passes
        self.train_time += train_clock(self.task.device) - start
        self.steps += n
        self._eval()

    def plain_step(self, batch) -> None:
        """One step of the plain AdamW loop (subclasses add to it, e.g. ``bench.lr_control``)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.task.loss_fn(self.model, batch).backward()
        self.optimizer.step()
        if self.average is not None:
            self.average.update()

    def _eval(self) -> None:
        self.model.eval()
        if self.spec.schedule_free:
            averaged = schedule_free_evaluation(self.optimizer)
        elif self.average is not None:
            averaged = self.average.swapped_in()
        elif self.trainer is not None and self.trainer.weight_average is not None:
            averaged = self.trainer.averaged_weights()
        else:
            averaged = contextlib.nullcontext()
        with averaged:
            val = self.task.val_loss(self.model)
        self.model.train()
        self.curve.append(dict(step=self.steps, time=self.train_time, val_loss=val,
                               backward=self.backward, forward=self.forward))

    def hybrid_stats(self) -> dict[str, Any] | None:
        if self.trainer is None:
            return None
        s = self.trainer.statistics()
        keep = ("predicted_steps", "predicted_steps_kept", "predicted_steps_rolled_back", "verifications",
                "verifications_accepted", "predict_phases", "predict_phases_rejected", "backward_saved_fraction",
                "prediction_enabled", "prediction_disabled_reason", "predicted_step_worth", "time_by_phase_s",
                "steps_by_phase", "dynamics_error_by_horizon", "loss_noise_std", "divergence_rollbacks",
                "required_worth", "prediction_overhead")
        s["cost_seconds"] = None if self.trainer.cost is None else dict(self.trainer.cost.seconds)
        keep = keep + ("cost_seconds",)
        return {k: s[k] for k in keep}


def hidden_matrices(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Muon's share of a model: the weight of every ``nn.Linear`` except an output layer (the last
    module of an ``nn.Sequential`` model). Embeddings, positions, biases, norms and an output
    layer stay with AdamW, as Muon's authors train them; the char-LM's output is its tied
    embedding, so all its ``nn.Linear`` weights are hidden."""
    output = model[-1] if isinstance(model, torch.nn.Sequential) else None
    return [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not output]


def make_optimizer(spec: ArmSpec, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW at ``spec.lr`` (with :data:`ADAMW_OPTIONS`) over ``model``'s parameters, or what the
    arm asks instead: schedule-free AdamW, or Muon over the hidden matrices with AdamW over the rest."""
    params = list(model.parameters())
    if spec.muon:
        hidden = {id(p) for p in hidden_matrices(model)}
        return CombinedOptimizer(
            torch.optim.Muon([p for p in params if id(p) in hidden], lr=spec.muon_lr, weight_decay=ADAMW_WEIGHT_DECAY),
            torch.optim.AdamW([p for p in params if id(p) not in hidden], lr=spec.lr, **ADAMW_OPTIONS))
    if not spec.schedule_free:
        return torch.optim.AdamW(params, lr=spec.lr, **ADAMW_OPTIONS)
    import schedulefree  # the bench extra; only schedule-free arms need it

    optimizer = schedulefree.AdamWScheduleFree(params, lr=spec.lr, warmup_steps=spec.schedule_free_warmup,
                                               betas=SCHEDULE_FREE_BETAS, weight_decay=ADAMW_WEIGHT_DECAY)
    optimizer.train()
    return optimizer


@contextlib.contextmanager
def schedule_free_evaluation(optimizer: torch.optim.Optimizer):
    """The parameters at schedule-free's averaged point for the block, then back at the point its
    gradients are taken (the library's ``eval()``/``train()`` pair; the pair is what every
    schedule-free loop runs around evaluation, so plain and hybrid arms pay it alike)."""
    optimizer.eval()
    try:
        yield
    finally:
        optimizer.train()


def train_clock(device: torch.device) -> float:
    """``time.perf_counter()`` (s) once all work queued on ``device`` has run: CUDA kernels run
    asynchronously, so an unsynchronised clock would miss them (or charge them to evaluation)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# ------------------------------------------------------------------------------ analysis ----
def interpolate(curve: list[dict], key: str, x: float, value: str = "val_loss") -> float:
    """Linear interpolation of ``value`` at ``key == x`` along an eval curve (clamped to its ends)."""
    pts = [(p[key], p[value]) for p in curve]
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]


def first_crossing(curve: list[dict], target: float) -> dict | None:
    """Time/passes when the validation loss first reaches ``target`` (linear within an interval)."""
    for p0, p1 in zip(curve, curve[1:]):
        if p1["val_loss"] <= target:
            if p0["val_loss"] <= target:
                return dict(time=p0["time"], backward=p0["backward"], forward=p0["forward"], step=p0["step"])
            f = (p0["val_loss"] - target) / (p0["val_loss"] - p1["val_loss"])
            return {k: p0[k] + f * (p1[k] - p0[k]) for k in ("time", "backward", "forward", "step")}
    return None


def mean_std(values: list[float]) -> dict[str, float | None]:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": statistics.fmean(vals), "std": statistics.pstdev(vals) if len(vals) > 1 else 0.0, "n": len(vals)}


def summarise_against_plain(task, runs: dict[str, list[dict]]) -> tuple[dict, dict[str, list[dict | None]]]:
    """What every arm of a plain-loop comparison reports, against the ``"plain"`` arm.

    ``runs``: arm → per-seed dicts whose ``curve`` has ``step``, ``time``, ``val_loss``,
    ``backward``, ``forward``. Target: plain's mean validation loss at 80% of ``task.steps``.
    Returns ``(dict(target_val_loss, target_step, arms={arm: summary}), crossings)`` where
    ``crossings[arm]`` holds each seed's first crossing of the target (None where missed), for
    arm-specific fields the caller adds."""
    target_step = int(0.8 * task.steps)
    target = sum(interpolate(r["curve"], "step", target_step) for r in runs["plain"]) / len(runs["plain"])
    crossings = {arm: [first_crossing(r["curve"], target) for r in seeds] for arm, seeds in runs.items()}
    summary = {}
    for arm, seeds in runs.items():
        pairs = list(zip(crossings[arm], crossings["plain"]))
        summary[arm] = dict(
            train_s=mean_std([r["curve"][-1]["time"] for r in seeds]),
            final_val_loss=mean_std([r["curve"][-1]["val_loss"] for r in seeds]),
            time_to_target_s=mean_std([c["time"] if c else None for c in crossings[arm]]),
            reached_target=sum(c is not None for c in crossings[arm]),
            speedup_vs_plain=mean_std([b["time"] / c["time"] if c and b else None for c, b in pairs]))
    return dict(target_val_loss=target, target_step=target_step, arms=summary), crossings


def plot_seed_curves(runs: dict[str, list[dict]], target: float, title: str, path: Path) -> None:
    """Validation loss over training seconds, one colour per arm and one line per seed, the
    target dashed (``runs``: arm → per-seed dicts whose ``curve`` has ``time`` and ``val_loss``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for index, (arm, seeds) in enumerate(runs.items()):
        for k, r in enumerate(seeds):
            ax.plot([p["time"] for p in r["curve"]], [p["val_loss"] for p in r["curve"]], color=f"C{index}",
                    alpha=0.8, lw=1.2, label=arm if k == 0 else None)
    ax.axhline(target, color="grey", ls="--", lw=0.8, label="target")
    ax.set_xlabel("training seconds (1 thread)")
    ax.set_ylabel("validation loss")
    ax.set_ylim(top=min(ax.get_ylim()[1], 1.5 * target))
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def analyse(task: Task, arms: list[ArmSpec], runs: dict[str, list[ArmRun]], baseline: str) -> dict:
    target_step = int(0.8 * task.steps)
    target = statistics.fmean(interpolate(r.curve, "step", target_step) for r in runs[baseline])
    per_arm = {}
    for spec in arms:
        seeds = []
        for run, base in zip(runs[spec.name], runs[baseline]):
            cross = first_crossing(run.curve, target)
            base_cross = first_crossing(base.curve, target)
            t_eq = base.train_time
            val_eq = interpolate(run.curve, "time", t_eq)
            base_eq = interpolate(base.curve, "time", t_eq)
            seeds.append(dict(
                seed=run.seed, steps=run.steps, train_time_s=run.train_time, final_val_loss=run.curve[-1]["val_loss"],
                time_to_target_s=None if cross is None else cross["time"],
                backward_to_target=None if cross is None else cross["backward"],
                forward_to_target=None if cross is None else cross["forward"],
                speedup_vs_baseline=(base_cross["time"] / cross["time"]) if cross and base_cross else None,
                val_loss_at_equal_time=val_eq,
                loss_gap_pct_at_equal_time=100.0 * (val_eq - base_eq) / base_eq,
                ran_past_equal_time=run.train_time >= t_eq,
                backward_passes=run.backward, forward_passes=run.forward,
                hybrid=run.hybrid_stats(), curve=run.curve,
            ))
        summary = {k: mean_std([s[k] for s in seeds]) for k in (
            "time_to_target_s", "backward_to_target", "forward_to_target", "speedup_vs_baseline",
            "val_loss_at_equal_time", "loss_gap_pct_at_equal_time", "final_val_loss", "train_time_s")}
        summary["reached_target"] = sum(s["time_to_target_s"] is not None for s in seeds)
        if spec.hybrid:
            summary["backward_saved_pct"] = mean_std([100 * s["hybrid"]["backward_saved_fraction"] for s in seeds])
            summary["verifications_accepted"] = sum(s["hybrid"]["verifications_accepted"] for s in seeds)
            summary["verifications_rejected"] = sum(s["hybrid"]["verifications"] - s["hybrid"]["verifications_accepted"]
                                                    for s in seeds)
        per_arm[spec.name] = dict(lr=spec.lr, muon_lr=spec.muon_lr, hybrid=spec.hybrid,
                                  config=None if spec.config is None else spec.config.to_dict(),
                                  summary=summary, seeds=seeds)
    return dict(target_val_loss=target, target_definition=f"mean tuned-baseline val loss at step {target_step} "
                                                          f"(80% of {task.steps})", arms=per_arm)


# ------------------------------------------------------------------------------ running ----
def run_arms(task: Task, arms: list[ArmSpec], seeds: list[int], desc: str,
             make_run: type[ArmRun] = ArmRun) -> dict[str, list[ArmRun]]:
    """Every arm on every seed, interleaved chunk by chunk (``make_run``: an :class:`ArmRun`
    subclass for experiments whose plain loop does more, e.g. ``bench.lr_control``)."""
    runs: dict[str, list[ArmRun]] = {a.name: [] for a in arms}
    total_chunks = sum(math.ceil(_budget(task, a) / task.eval_every) for a in arms) * len(seeds)
    with tqdm(total=total_chunks, desc=desc, unit="chunk", file=sys.stderr, disable=None) as bar:
        for seed in seeds:
            current = [make_run(a, task, seed, _budget(task, a)) for a in arms]
            while not all(r.done for r in current):
                for r in current:  # interleaved: one chunk of each arm in turn
                    if not r.done:
                        r.run_chunk(task.eval_every, record_phases=(seed == seeds[0]))
                        bar.update(1)
            for r in current:
                runs[r.spec.name].append(r)
    return runs


def _budget(task: Task, arm: ArmSpec) -> int:
    return int(task.steps * HYBRID_STEP_FACTOR) if arm.hybrid else task.steps


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


def sweep_lr(task: Task, seed: int, lrs: list[float] | None = None, average: bool = False
             ) -> tuple[float, dict[str, float]]:
    """The learning rate of ``lrs`` (default: the task's grid) with the lowest final validation
    loss of a plain AdamW run, evaluated at its weight average when ``average``."""
    lrs = task.lr_grid if lrs is None else lrs
    arms = [ArmSpec(f"sweep lr={lr:g}", lr, average=average) for lr in lrs]
    runs = run_arms(task, arms, [seed], desc=f"{task.name}: lr sweep" + (" (weight average)" if average else ""))
    finals = {a.name.split("=")[1]: runs[a.name][0].curve[-1]["val_loss"] for a in arms}
    best = min(lrs, key=lambda lr: finals[f"{lr:g}"])
    return best, finals


# Extra AdamW arguments for every arm and sweep (``--fused-adamw``: {"fused": True}). A fused
# optimizer lets the trainer launch its update before reading its guard's values (the update is
# skipped on the device when they are not finite), which a GPU step otherwise waits for.
ADAMW_OPTIONS: dict[str, object] = {}

PRESETS = ("default", "conservative", "aggressive", "no-predict", "weight-average", "schedule-free", "muon", "forced",
           "muon-forced")
MUON_PRESETS = ("muon", "muon-forced")  # the presets whose optimizer is Muon + AdamW
# Schedule-free AdamW (Defazio et al. 2024, the ``schedulefree`` package): its gradients are taken
# between an SGD-like iterate and the running average of it, and the average is what it evaluates.
# Betas (0.95, 0.95) from ``python -m bench.schedule_free`` (charlm seed 0: the target crossed at
# step 267, against 286-290 with beta2 0.999; AdamW with beta2 0.95 got slower, so the baseline
# keeps the defaults); the weight decay matches AdamW's default. Rate and warm-up come from a
# sweep (:func:`sweep_schedule_free`).
SCHEDULE_FREE_BETAS = (0.95, 0.95)
ADAMW_WEIGHT_DECAY = 0.01
SCHEDULE_FREE_LR_FACTORS = (2.5, 5, 7.5)  # × the tuned AdamW rate
SCHEDULE_FREE_WARMUP_FRACTIONS = (0, 1 / 3)  # × the step budget
# Muon (Jordan et al. 2024; ``torch.optim.Muon``): momentum SGD whose update of each hidden weight
# matrix is orthogonalised by a Newton-Schulz iteration. Its rate is on another scale than
# AdamW's (torch's default adjustment), so it gets its own grid; AdamW trains the rest.
MUON_LRS = (0.01, 0.02, 0.04)
MUON_ADAMW_LR_FACTORS = (1, 2)  # × the tuned AdamW rate, for the parameters Muon does not train
# Prediction at every phase decision, whatever it is worth, and never switched off: what the
# worth gate saves a run from (the ``forced`` preset), and the warm-up's way to reach every kernel.
FORCED_PREDICTION = dict(min_predicted_worth=-1.0, confidence_threshold=0.0, cost_aware=False,
                         max_consecutive_rejections=10**6, max_consecutive_declines=10**6)
# Rates swept (× the tuned one) for runs evaluated at their weight average: the average removes
# the oscillation a larger rate adds, so its best rate can be higher than the raw iterate's.
AVERAGE_LR_FACTORS = (1, 2, 4)


def preset_config(name: str) -> HybridConfig:
    """``no-predict`` is the trainer with prediction off: what its safety layer alone costs;
    ``weight-average`` the default config evaluated at its lag-corrected weight average;
    ``forced`` the default config predicting at every phase decision (:data:`FORCED_PREDICTION`);
    ``schedule-free`` and ``muon`` the default config over another optimizer, ``muon-forced``
    the forced one over Muon + AdamW."""
    if name == "default":
        return HybridConfig()
    if name in ("forced", "muon-forced"):
        return HybridConfig(**FORCED_PREDICTION)
    if name == "no-predict":
        return HybridConfig(predict=False)
    if name == "weight-average":
        return HybridConfig(weight_average=True)
    if name in ("schedule-free", "muon"):  # the default config; the arm's optimizer is what differs
        return HybridConfig()
    if name in PRESETS:
        return getattr(HybridConfig, name)()
    raise ValueError(f"--presets: each must be one of {PRESETS}, got {name!r}")


def training_step(task: Task, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  trainer: HybridTrainer | None) -> Callable[[Any], None]:
    """One training step on a batch: ``trainer.step``, or the plain loop's zero_grad, backward and
    optimizer step when ``trainer`` is None (the diagnosis benchmarks time both the same way)."""
    if trainer is not None:
        return trainer.step

    def plain(batch) -> None:
        optimizer.zero_grad(set_to_none=True)
        task.loss_fn(model, batch).backward()
        optimizer.step()

    return plain


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


# ------------------------------------------------------------------------------ reporting ----
def format_mean_std(ms: dict, digits: int = 3, pct: bool = False) -> str:
    if ms["mean"] is None:
        return "not reached"
    unit = "%" if pct else ""
    return f"{ms['mean']:.{digits}f}{unit} ± {ms['std']:.{digits}f}" if ms["n"] > 1 else f"{ms['mean']:.{digits}f}{unit}"


def _num(value, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def markdown(results: list[dict], meta: dict) -> str:
    cell = format_mean_std
    lines = [f"End-to-end benchmark, `{meta['command']}` ({meta['date']}, {meta['device']}, "
             f"torch {meta['torch']}, {meta['threads']} thread(s)). Mean ± std over seeds.", ""]
    for r in results:
        lines += [f"### {r['task']}: {r['data_source']}", "",
                  f"Target val loss {r['target_val_loss']:.4f} ({r['target_definition']}); tuned lr "
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


def seed_style(arm_index: int, seed_index: int, name: str) -> dict:
    """Line style of one seed's curve: the arm's colour, the first seed bold and labelled."""
    first = seed_index == 0
    return dict(color=f"C{arm_index}", lw=1.6 if first else 0.8, alpha=1.0 if first else 0.5,
                label=name if first else None)


def plot_loss_curves(ax, result: dict) -> None:
    """Validation loss vs training wall-clock of every arm and seed, with the target line."""
    for i, (name, arm) in enumerate(result["arms"].items()):
        for j, seed in enumerate(arm["seeds"]):
            ax.plot([p["time"] for p in seed["curve"]], [p["val_loss"] for p in seed["curve"]], **seed_style(i, j, name))
    ax.axhline(result["target_val_loss"], color="black", ls="--", lw=0.8, label="target")
    ax.set_xlabel("training wall-clock (s)")
    ax.set_ylabel("validation loss")
    lows = [p["val_loss"] for a in result["arms"].values() for s in a["seeds"] for p in s["curve"]]
    ax.set_ylim(min(lows) * 0.98, result["target_val_loss"] + 3 * (result["target_val_loss"] - min(lows)) + 1e-3)


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
    args = parser.parse_args(argv)
    if args.fused_adamw:
        ADAMW_OPTIONS["fused"] = True
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"argument --device: cuda asked for, but torch {torch.__version__} sees no CUDA GPU "
                     "(torch.cuda.is_available() is False)")

    torch.set_num_threads(args.threads)
    tasks = args.tasks or (["digits", "charlm"] if args.quick else ["charlm", "fashion", "digits"])
    presets = args.presets or ["default", "weight-average", "schedule-free", "muon", "no-predict"]
    for name in presets:
        preset_config(name)  # a bad name fails here, not after the first task's runs
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.e2e" + (" --quick" if args.quick else "") + (
        f" --tasks {' '.join(args.tasks)}" if args.tasks else "") + (f" --seeds {args.seeds}" if args.seeds != 3 else "") + (
        f" --presets {' '.join(args.presets)}" if args.presets else "") + (
        f" --device {args.device}" if args.device != "cpu" else "") + (" --fused-adamw" if args.fused_adamw else "")
    meta = dict(command=command, date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                device=f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"
                if args.device == "cpu" else torch.cuda.get_device_name(0),
                torch=torch.__version__, threads=torch.get_num_threads(), python=platform.python_version())
    results = []
    suffix = ("_quick" if args.quick else "") + ("_cuda" if args.device == "cuda" else "") + (
        "_fused" if args.fused_adamw else "")
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

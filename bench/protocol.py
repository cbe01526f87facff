"""The comparison protocol every benchmark and experiment shares, and the metadata every result
file records.

Protocol: every arm of a task starts from the same initialisation and sees the same batches in the
same order, per seed; all arms of a task run in one process, interleaved chunk by chunk
(``eval_every`` steps of one arm, then of the next), so machine noise hits them alike. An arm is an
:class:`ArmSpec` (a plain loop, or ``HybridTrainer`` with a config, over AdamW, schedule-free AdamW
or Muon + AdamW); :func:`run_arms` runs them, :func:`analyse` and :func:`summarise_against_plain`
measure each against a baseline arm's target (its validation loss at 80% of its budget).
:func:`run_metadata` is what every result file written by ``bench`` or ``experiments`` records: the
command, the date, the git commit and whether the working tree had uncommitted changes.

Used by ``bench.e2e`` (the end-to-end benchmark), the diagnosis benchmarks (``bench.ddp``,
``bench.host_ops``, ``bench.launch_overhead``, ``bench.step_times``) and the research probes in
``experiments``.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from hybrid_trainer import CombinedOptimizer, HybridConfig, HybridTrainer
from hybrid_trainer.averaging import WeightAverage

from .tasks import Task

HYBRID_STEP_FACTOR = 1.5
REPO_ROOT = Path(__file__).resolve().parent.parent
# Where results are written; a change there does not make the code that wrote them differ from its commit.
RESULT_DIRS = ("docs/results", "experiments/results")
# A copied tree (a lent GPU machine's, whose .git is the one copied at the session's start): the
# commit it was copied from, and whether that tree had uncommitted changes ("0" or "1"), set by
# whoever made the copy.
COPIED_FROM_ENV, COPIED_DIRTY_ENV = "HYBRID_BENCH_GIT_COMMIT", "HYBRID_BENCH_GIT_DIRTY"


@functools.lru_cache(maxsize=None)
def git_state(root: Path = REPO_ROOT) -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the repository at ``root``: the full hash of ``HEAD``, and whether any
    file outside the result folders (:data:`RESULT_DIRS`) differs from it or is new and not ignored.
    ``(None, None)`` outside a git checkout (an installed copy) or without git.

    :data:`COPIED_FROM_ENV`, when set, is the commit the tree was copied from and wins over what
    git says there (dirtiness from :data:`COPIED_DIRTY_ENV`, ``0`` or ``1``, else unknown): a lent
    GPU machine gets the working tree as it is, but a ``.git`` copied when the session began, so its
    git named the session's first commit and the later commits' changes as uncommitted.

    Read once per process and cached, so a run that writes results and then records metadata
    again still reports the tree it started from."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout

    copied = os.environ.get(COPIED_FROM_ENV, "").strip()
    if copied:
        return copied, {"0": False, "1": True}.get(os.environ.get(COPIED_DIRTY_ENV, "").strip())
    try:
        commit = git("rev-parse", "HEAD").strip()
        status = git("status", "--porcelain", "--", ".", *(f":(exclude){d}" for d in RESULT_DIRS))
    except (OSError, subprocess.SubprocessError):
        return None, None
    return commit, bool(status.strip())


def cpu_description() -> str:
    """The host CPU in words: its model name, the vector instructions torch's CPU kernels use on
    it and its cores, e.g. ``"AMD EPYC (AVX2), 2 cores"``. Result files of one benchmark made on
    two hosts can differ for that alone (a bf16 matrix product took 38x an fp32 one's time on an
    AVX2 host: :func:`machine_speed`)."""
    return f"{_cpu_model_name()} ({torch.backends.cpu.get_cpu_capability()}), {os.cpu_count()} cores"


def machine_speed(read_mb: int = 128, repeats: int = 5) -> dict[str, Any]:
    """How fast this host runs the two kinds of work a training step's overhead is made of, so that
    figures from two hosts can be told apart: ``python_ns`` (one iteration of a plain Python loop
    adding to a local, in ns: the trainer's bookkeeping scales with it) and ``read_gb_s`` (one
    thread's ``sum`` over a ``read_mb`` MB float32 tensor, in GB/s: the guard's pass over the
    gradients and a snapshot's copy scale with it), each the median of ``repeats``; ``cpu``, the
    processor's model name. Two of this project's CI hosts of one model name differed 2.3x in the
    first. Takes about a second."""
    def python_loop() -> float:
        started, total = time.perf_counter_ns(), 0
        for i in range(200_000):
            total += i
        return (time.perf_counter_ns() - started) / 200_000

    data = torch.ones(read_mb * 2**20 // 4, dtype=torch.float32)

    def read() -> float:
        started = time.perf_counter()
        data.sum().item()
        return data.numel() * 4 / (time.perf_counter() - started) / 1e9

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        read()  # pages the tensor in
        reads = [read() for _ in range(repeats)]
    finally:
        torch.set_num_threads(threads)
    return dict(cpu=_cpu_model_name(), cores=os.cpu_count(), isa=torch.backends.cpu.get_cpu_capability(),
                python_ns=round(statistics.median(python_loop() for _ in range(repeats)), 2),
                read_gb_s=round(statistics.median(reads), 2),
                bf16_matmul_vs_fp32=round(bf16_matmul_vs_fp32(repeats=repeats), 2))


def bf16_matmul_vs_fp32(size: int = 256, repeats: int = 5) -> float:
    """The time of a bf16 ``size`` x ``size`` matrix product over an fp32 one's on one thread
    (each the median of ``repeats``). Where the CPU has no bf16 instructions (no AVX512_BF16 or
    AMX), torch's bf16 product is far slower than fp32's, and so is Muon's Newton-Schulz
    iteration, which ``torch.optim.Muon`` runs in bf16: the end-to-end benchmark's Muon arms
    then say more about the host than about the optimizer. Its order is what tells hosts apart:
    on one AVX2 host, calls a few minutes apart read 38, 57 and 67 (the fp32 product takes about
    0.3 ms, so a few microseconds of noise move the ratio)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = {}
        for dtype in (torch.float32, torch.bfloat16):
            a = torch.randn(size, size).to(dtype)
            a @ a  # first call: any one-time set-up out of the timing
            timed = []
            for _ in range(repeats):
                started = time.perf_counter()
                a @ a
                timed.append(time.perf_counter() - started)
            times[dtype] = statistics.median(timed)
    finally:
        torch.set_num_threads(threads)
    return times[torch.bfloat16] / max(times[torch.float32], 1e-12)


def _cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_results(out: Path, name: str, results: dict[str, Any], text: str) -> None:
    """Write a bench's ``results`` to ``out/name.json`` and its report ``text`` to ``out/name.md``
    (``out`` made if missing), and print the report."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / f"{name}.md").write_text(text)
    print(text)


def run_metadata(command: str, **extra: Any) -> dict[str, Any]:
    """What every result file written by ``bench`` and ``experiments`` records about its run:
    ``command`` (how to reproduce it), ``date`` (UTC, ISO 8601), ``git_commit`` and ``git_dirty``
    (:func:`git_state`; a dirty tree means the figures may come from uncommitted code), the
    ``torch`` and ``python`` versions, and whatever the caller adds in ``extra`` (which may not
    replace those keys)."""
    if not isinstance(command, str) or not command.strip():
        raise ValueError(f"command: the command line that reproduces the result, got {command!r}")
    commit, dirty = git_state()
    meta: dict[str, Any] = dict(command=command.strip(),
                                date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                                git_commit=commit, git_dirty=dirty, torch=torch.__version__,
                                python=platform.python_version())
    clash = sorted(set(meta) & set(extra))
    if clash:
        raise ValueError(f"extra: {clash} are recorded by run_metadata itself")
    meta.update(extra)
    return meta




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
        """One step of the plain AdamW loop (subclasses add to it, e.g. ``experiments.lr_control``)."""
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
def guard_as_on_a_gpu():
    """Inside: a trainer built here has its guard as on a GPU, whose reads wait for the device
    (``step_guard.reads_are_free`` false: its checks queued and, with ``read_every`` > 1, read
    once per block), and the good state's finiteness check takes a GPU's way (one multi-tensor
    norm of every tensor, ``resume_check._multi_tensor_norm_pays``, where a CPU takes one
    ``aminmax`` per tensor). For counting and stepping on a CPU what a GPU's host runs; both
    are put back on exit."""
    from hybrid_trainer import resume_check, step_guard

    free, multi_tensor = step_guard.reads_are_free, resume_check._multi_tensor_norm_pays
    step_guard.reads_are_free = lambda device: False
    resume_check._multi_tensor_norm_pays = lambda device: True
    try:
        yield
    finally:
        step_guard.reads_are_free, resume_check._multi_tensor_norm_pays = free, multi_tensor


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
    subclass for experiments whose plain loop does more, e.g. ``experiments.lr_control``)."""
    runs: dict[str, list[ArmRun]] = {a.name: [] for a in arms}
    total_chunks = sum(math.ceil(_budget(task, a) / task.eval_every) for a in arms) * len(seeds)
    # tqdm draws its bar on a terminal only; written to a log (nohup, CI) the bar is off and a
    # line per seed says how far the run is instead: the full benchmark runs for over an hour.
    lines = not sys.stderr.isatty()
    started = time.perf_counter()
    with tqdm(total=total_chunks, desc=desc, unit="chunk", file=sys.stderr, disable=None) as bar:
        for index, seed in enumerate(seeds, 1):
            current = [make_run(a, task, seed, _budget(task, a)) for a in arms]
            while not all(r.done for r in current):
                for r in current:  # interleaved: one chunk of each arm in turn
                    if not r.done:
                        r.run_chunk(task.eval_every, record_phases=(seed == seeds[0]))
                        bar.update(1)
            for r in current:
                runs[r.spec.name].append(r)
            if lines:
                print(f"{desc}: seed {seed} done ({index} of {len(seeds)}, {len(arms)} arm(s)), "
                      f"{time.perf_counter() - started:.0f} s so far", file=sys.stderr, flush=True)
    return runs

def _budget(task: Task, arm: ArmSpec) -> int:
    return int(task.steps * HYBRID_STEP_FACTOR) if arm.hybrid else task.steps


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

PRESETS = ("default", "conservative", "aggressive", "no-predict", "no-predict-graph", "weight-average", "schedule-free",
           "muon", "forced", "muon-forced")
MUON_PRESETS = ("muon", "muon-forced")  # the presets whose optimizer is Muon + AdamW
# Schedule-free AdamW (Defazio et al. 2024, the ``schedulefree`` package): its gradients are taken
# between an SGD-like iterate and the running average of it, and the average is what it evaluates.
# Betas (0.95, 0.95) from ``python -m experiments.schedule_free`` (charlm seed 0: the target crossed at
# step 267, against 286-290 with beta2 0.999; AdamW with beta2 0.95 got slower, so the baseline
# keeps the defaults); the weight decay matches AdamW's default. Rate and warm-up come from a
# sweep (``bench.e2e.sweep_schedule_free``).
SCHEDULE_FREE_BETAS = (0.95, 0.95)
ADAMW_WEIGHT_DECAY = 0.01
# Prediction at every phase decision, whatever it is worth, and never switched off: what the
# worth gate saves a run from (the ``forced`` preset), and the warm-up's way to reach every kernel.
FORCED_PREDICTION = dict(min_predicted_worth=-1.0, confidence_threshold=0.0, cost_aware=False,
                         max_consecutive_rejections=10**6, max_consecutive_declines=10**6)


def preset_config(name: str) -> HybridConfig:
    """``no-predict`` is the trainer with prediction off: what its safety layer alone costs;
    ``no-predict-graph`` the same with its steady step replayed from a CUDA graph
    (``cuda_graph=True``; on a CPU it steps as ``no-predict`` does, and says so);
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
    if name == "no-predict-graph":
        return HybridConfig(predict=False, cuda_graph=True)
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


# ------------------------------------------------------------------------------ reporting ----
def format_mean_std(ms: dict, digits: int = 3, pct: bool = False) -> str:
    if ms["mean"] is None:
        return "not reached"
    unit = "%" if pct else ""
    return f"{ms['mean']:.{digits}f}{unit} ± {ms['std']:.{digits}f}" if ms["n"] > 1 else f"{ms['mean']:.{digits}f}{unit}"




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


if __name__ == "__main__":  # python -m bench.protocol: this host's figures, as result files record them
    print(cpu_description())
    print(json.dumps(machine_speed(), indent=1))

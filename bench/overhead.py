"""What does the trainer cost next to a plain loop, in time and in peak memory?

    python -m bench.overhead [--models tiny mlp-1ms fashion charlm mlp-50m] [--device cpu|cuda] [--quick]
                             [--memory-only | --arms ARM [ARM ...] | --breakdown-only] [--fused-adamw]
                             [--slices N] [--runs N]

Every model is trained by the plain loop (``zero_grad``, ``loss.backward()``, ``optimizer.step()``:
no read of the loss) and by ``HybridTrainer`` in four configurations (``predict=False``, the
default, ``weight_average=True``, and ``predict=False`` with the guard reading every 16 steps,
``read_every=16``, a GPU's default), all with AdamW (torch's default implementation for the device;
``fused=True`` with ``--fused-adamw``, results named ``*_fused``),
the same initial weights, the same batches in the same order and the same seed.

* **Time**: the arms are stepped in interleaved chunks (the order rotated each round), so the
  machine's load falls on all of them alike; up to ``IN_PROCESS_PARAMS`` parameters every arm
  lives in this process, above it each arm in a process of its own, stepped only when told
  (:class:`ProcessArm`: all arms of such a model in one process would hold too much memory at
  once), and timed beside the plain loop alone, one pair after another (``in_pairs`` of
  :func:`time_interleaved`: an arm idles one chunk between its chunks, not one per other arm,
  which let this machine page out its snapshot file). On CUDA a chunk is timed as a whole between two
  synchronisations (each of its steps gets the chunk's mean), so the trainer's own waits on the
  device are in its time. Per arm the median over chunks (``--chunk`` steps, by default
  ``PERIOD``: one good-state period) of the chunk's mean step time, after ``--warmup`` untimed
  steps, and for an arm whose prediction can still run, untimed steps until it is off (and two
  arms that are not trainers: the plain loop plus the gradient norm and its read, the least a
  per-step NaN guard costs; the plain loop making its two calls as the trainer does). Every
  chunk's timed steps span one period, so each holds exactly one good-state snapshot and its
  cost is in every chunk's mean, where a median over single steps, or over shorter chunks,
  would leave it out (the guard's read of a block with ``read_every=16`` falls 3 or 4 times in
  a chunk); the per-step median is recorded beside it. On a CPU a step's time is the thread's
  CPU time (``time.thread_time``): with one thread per process that is all of the step's work,
  without the time other processes held the core. For the trainer also the median over its real steps only (the default
  config's predicted steps skip the backward, which is a saving, not an overhead). The overhead
  is the median over rounds of the arm's chunk mean minus the plain loop's in the same round,
  with a distribution-free 95% interval (:func:`paired_overhead`); the ratio is the plain step
  plus the overhead over the plain step. The ≥50M model
  takes ``BIG_WARMUP`` untimed and ``BIG_STEPS`` timed steps per arm in chunks of ``BIG_CHUNK``:
  a first step not timed (``BIG_SETTLE``), then one period timed. Interleaved, an arm that
  frees its gradients at the end of its step (the trainer) paid ~0.2-0.4 s of page faults on
  its first step after another arm's chunk, which neither arm pays when it runs alone
  (:func:`_timed_chunk`). Smaller models' chunks (in one process) are ``SMALL_SETTLE + PERIOD``
  steps, the first ``SMALL_SETTLE`` untimed in every arm alike: an arm's first steps after
  another arm's pay for the switch, the trainer's more than the plain loop's.
* **While prediction can still run** (``--explore-steps``, every model): the arms above are timed
  once prediction is off (up to ``--explore-steps`` untimed steps beyond ``--warmup``). That part
  is timed apart: a fresh plain loop and a fresh
  default trainer from their first step, interleaved chunk by chunk as above, until the trainer
  has switched prediction off; both arms' times summed over those steps (:func:`exploration`).
* **Peak memory**: each arm in a fresh subprocess. The data and batches are made first and the
  arm runs a few throwaway steps (on the model itself, on a tiny one of the same kind for the
  ≥50M model), so that the code it executes is paged in (a code page first touched by an arm
  would count as its memory); freed heap goes back to the system (``malloc_trim``); then the
  peak resident set size is reset (``/proc/self/clear_refs``) and the RSS read as the baseline; the model, optimizer and trainer are built and ``--memory-steps`` steps run; the
  arm's training memory is the peak (``VmHWM``) minus the baseline. RSS is what a user meets
  (every allocation the process touches, Python objects and allocator slack included); a
  snapshot written to a file sits in the kernel's page cache, reclaimable once written back, and
  is not in it. On CUDA the figure is ``torch.cuda.max_memory_allocated`` above the baseline
  instead. Ratios are trainer over plain; extra bytes the difference. The child also counts the
  bytes the trainer holds in tensors beyond the plain loop's (:mod:`hybrid_trainer.footprint`).
* **Exact tensor peak** (CPU): each arm again in a fresh process, the same warm-up, then the
  peak of live tensor bytes from before the model is built to the last step, summed from every
  allocation and free of torch's CPU allocator (:class:`TensorPeak`). RSS moves by several MB
  between runs of one arm, which on the small models' 4–70 MB peaks is more than the goal's 3%;
  the tensor peak does not move. The memory ratio is the RSS one where the plain loop's peak RSS
  is at least ``RSS_RESOLVES_BYTES``, the tensor one below.

``--slices N`` splits each round's chunks into N turns per arm (``chunk / N`` steps each; each
arm's chunk is still one good-state period of its own steps), so that the arms' chunks span the
same stretch of the round: a host whose speed drifts within a round then slows them alike. Above
``IN_PROCESS_PARAMS`` each turn begins with its own untimed step (the switch of arms' cost) and
times ``(chunk - 1) / N`` steps; a snapshot that falls on an untimed step is then not timed, so a
chunk's timed steps hold none, one or two (about one in eleven untimed with N = 5: the snapshot's
share of the timed steps is that much lower, ~0.04% of the 51M MLP's step).

``--runs N`` times each model N times, one run after another, each in a fresh process
(:func:`time_in_fresh_processes`), and takes the overhead as the median of the runs' own with its
95% interval over runs (:func:`pool_runs`, :func:`paired_overhead`; at least 6 runs for one):
the rounds of one process pin down that process's overhead, but on this project's CI host runs
minutes apart differed by far more than their intervals (the tiny MLP +25, +53 and +55 µs, each
about ±5), and only an interval over fresh processes counts what differs between them.

``--memory-only`` re-measures memory and keeps each model's time figures from the existing
results file (the report says which run they came from). ``--arms A [B ...]`` times only those
arms beside the plain loop (more rounds of one arm, say) and keeps the model's other arms, its
memory figures, breakdown and exploration from the existing results file: each kept arm is
still taken against the plain loop of its own run's rounds (``plain_chunk_means_us``), and the
report names the run every kept figure came from. ``--breakdown-only`` times the ``predict=False``
arm part by part again, on any model (the whole-step pairs of the models above
``IN_PROCESS_PARAMS`` cannot resolve a 2% goal on a noisy host; their parts, the Gram hooks inside
the forward and backward counted as the trainer's, can), and keeps every other figure.

Writes ``<out>/overhead.{json,md}`` (``overhead_quick`` with ``--quick``; ``_cuda`` on CUDA),
each recording the git commit and whether the tree was dirty, and per model the host's speed
(:func:`bench.protocol.machine_speed`: a Python loop step and one thread's memory read). The
trainer's bookkeeping scales with the first and its pass over the gradients with the second, and
two of this project's CI hosts of one CPU model differed 2.3x in the first, so figures merged from
two hosts (``--merge``) say which host each came from.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from bench.protocol import machine_speed, run_metadata

ROOT = Path(__file__).resolve().parent.parent
ARMS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "predict=False": dict(predict=False),
    "default": {},
    "weight_average": dict(weight_average=True),
    # The guard reads a block of 16 steps at once (what a GPU gets by default; a CPU reads every step).
    "predict=False, read_every=16": dict(predict=False, read_every=16),
}
# Not a trainer: the plain loop plus the least any per-step NaN guard does (the global gradient
# norm, one pass over the gradients, and a read of it and the loss). The trainer's overhead above
# this arm's is its own bookkeeping; this arm's above the plain loop is the floor of the guard.
GUARD_FLOOR = "plain + norm and read (guard floor)"
# Not a trainer either: the plain loop making the two calls the way the trainer makes them, the
# gradients set to None instead of zero_grad() and the update called without torch's profiler
# scope (hybrid_trainer.optimizer_call). The trainer's overhead above this arm's is what it costs
# beyond what it saves on those two calls; this arm's below the plain loop is that saving.
LEAN_PLAIN = "plain, no profiler scopes"
TIMED_ONLY = (GUARD_FLOOR, LEAN_PLAIN)  # arms timed beside ARMS, never run for memory
# A second plain loop, the same code as the first: what it measures over the plain loop is the
# protocol's own error, which the other arms' intervals must be read against. Timed only when
# named in --arms. Why: above IN_PROCESS_PARAMS each arm steps in a process of its own, and on the
# 51M MLP two runs of the same protocol on nearly the same code gave predict=False +1.2%
# [-1.3, +2.4] and -2.9% [-3.9, -1.1] (16 and 32 rounds), intervals that exclude each other; its
# first rounds, stepped on weights bit-equal to the plain loop's (no step refused yet), were
# already -2% to -3%. In one process it is not zero either: beside the tiny and 1 ms MLPs (the
# run at c5c9177, 128 rounds each) the second loop measured +9 us [+5, +13] and +28 us [+9, +46];
# where its interval excludes zero, time_goal takes it off the arm's overhead before the verdict.
# Most of that was the switch of arms (SMALL_SETTLE: the rotation always stepped the second loop
# right after the trainer); with a chunk's first steps untimed, over 9 fresh processes, the tiny
# MLP's measured +4 us [-6, +9].
PLAIN_AGAIN = "plain again (noise floor)"
# The trainer with prediction off and its steady step replayed from a CUDA graph
# (hybrid_trainer.captured_step), against the same eager plain loop. Timed only when named in
# --arms: on a CPU it steps as predict=False does (there is no graph to capture).
CUDA_GRAPH = "predict=False, cuda_graph"
OPT_IN = (PLAIN_AGAIN, CUDA_GRAPH)
OPT_IN_CONFIGS: dict[str, dict[str, Any]] = {CUDA_GRAPH: dict(predict=False, cuda_graph=True)}
IN_PROCESS_PARAMS = 5_000_000  # above this, each arm is stepped in a process of its own (ProcessArm)
# Timed steps per chunk: one good-state period (HybridConfig.good_state_every), so that every
# chunk's timed steps hold exactly one snapshot whatever their offset, and the median over rounds
# counts it. With chunks of 16 a snapshot fell in one chunk of three, which the median all but
# leaves out; on the 51M model (chunks of 5 whose first step was untimed) it fell on the untimed
# step every time, so its cost was never timed there. Written out rather than read from
# HybridConfig: importing hybrid_trainer here would load the kernels before main() picks their
# backend (tests/test_overhead_bench.py checks that the two agree).
PERIOD = 50
# Above IN_PROCESS_PARAMS (steps of ~0.5 s on one core): untimed steps, timed steps, the untimed
# first steps of each chunk (_timed_chunk's settle: they come on top of the period's timed steps);
# and distinct batches, so that none repeats within an arm's run (warm-up, up to ~100 steps until
# the default config switches prediction off, and the timed steps): on this model a batch seen
# again 64 steps later gave a loss 4x lower and a gradient norm 20x the median, which the guard
# refused as an explosion and rolled back (5 times in 60 timed steps, 45 in the exploration's
# 220), so the arms timed the guard's rollbacks rather than its steady cost.
BIG_WARMUP, BIG_STEPS, BIG_SETTLE, BIG_BATCHES = 20, 12 * PERIOD, 1, 1024
BIG_CHUNK = BIG_SETTLE + PERIOD
# Up to IN_PROCESS_PARAMS (every arm in this process): the first steps of each chunk, or of each
# slice, run untimed in every arm alike (the default chunk is then SMALL_SETTLE + PERIOD steps, its
# timed ones still one good-state period). Why: an arm's first steps after another arm's pay for
# the switch (what the other arm evicted), by an amount that depends on the arm's own working set
# and on which arm ran before it, and a user's loop switches to no other model between steps.
# Median step by its place in a turn of 10 (--slices 5, 64 rounds, this project's CI host): tiny
# MLP plain 1121, 1063, 1046, 1037, then ~1025 µs; predict=False 1264, 1145, 1120, 1084, then
# ~1055; the second plain loop, which the rotation always steps right after the trainer, 1199,
# 1079, 1063, 1050, then ~1030. Timed from the first step, those turns made the trainer +63 and
# +46 µs over the plain loop in two runs, against +30 and +33 in chunks of 50 unsliced, and the
# second plain loop +13 µs in each of 8 fresh processes. On the 1 ms MLP the first five steps
# were slower.
SMALL_SETTLE = 5
# --breakdown-only on a model above IN_PROCESS_PARAMS: steps timed part by part (two good-state
# periods, so the snapshot's share is in the mean).
BIG_BREAKDOWN_STEPS = 2 * PERIOD
# Timed steps per arm by model (others: --steps or 8 periods). Overheads of tens of µs on steps
# under ~6 ms need many rounds: the 95% interval of Fashion-MNIST's was 80 µs wide over 200 rounds
# of 16 steps and 210 µs over 100, against the 120 µs its 2% goal allows (128 rounds of 50 steps
# here; its arms take ~40 s each); the char-LM's interval over 25 rounds of 16 steps spanned 3.8%.
MODEL_STEPS = {"tiny": 128 * PERIOD, "mlp-1ms": 128 * PERIOD, "fashion": 128 * PERIOD, "charlm": 32 * PERIOD}
# The arms with prediction are warmed up until it is off (at most this many steps beyond --warmup),
# so that the table times them as they run from then on; exploration() times the steps before.
UNTIL_OFF_MAX = 400
# Distinct batches by model (others: --batches or 64, cycled). Fashion-MNIST gets one epoch of its
# 60k training images in batches of 128: its 64 cycled 300 times drew a gradient spike on a
# falling loss that the guard refused on 2,216 of 19,200 timed steps, which is the guard's rollback
# and not its steady cost; over one epoch's 468 none of 6,400 was refused.
MODEL_BATCHES = {"fashion": 468}
# The CPU time goals of the trainer with predict=False: a fixed cost per step of at
# most GOAL_FIXED_US, and at most GOAL_RATIO of the plain step where it takes GOAL_LONG_STEP_US or more.
GOAL_FIXED_US, GOAL_RATIO, GOAL_LONG_STEP_US = 50.0, 1.02, 5000.0
# On a GPU: predict=False at least GOAL_GPU_SPEED times the plain loop's speed (steps per second),
# i.e. an overhead of at most 1 / GOAL_GPU_SPEED - 1 of the plain step (3.1%), whatever its length.
GOAL_GPU_SPEED = 0.97
# A refused step skips the update and a rollback discards steps: above this share of its timed
# steps refused, the arm's time is not the guard's steady cost and no verdict is drawn from it
# (Fashion-MNIST's 64 batches cycled 300 times: 2,216 refusals in 19,200 steps).
REFUSED_SHARE_LIMIT = 0.01


@dataclass
class Workload:
    """A model, its loss and a fixed list of batches (cycled)."""

    name: str
    make_model: Callable[[int], nn.Module]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    batches: list[Any]
    lr: float
    details: dict[str, Any]


def _classifier_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def synthetic_mlp(name: str, width_in: int, hidden: list[int], classes: int, batch_size: int, n_batches: int,
                  device: torch.device) -> Workload:
    """An MLP learning a fixed random teacher's labels (so the loss does fall and the trainer's
    phases run as on real data); inputs Gaussian, batches drawn once on CPU."""
    gen = torch.Generator().manual_seed(1234)
    teacher = torch.randn(width_in, classes, generator=gen)
    batches = []
    for _ in range(n_batches):
        x = torch.randn(batch_size, width_in, generator=gen)
        batches.append((x.to(device), (x @ teacher).argmax(1).to(device)))

    def make_model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        layers, width = [], width_in
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        return nn.Sequential(*layers, nn.Linear(width, classes)).to(device)

    return Workload(name, make_model, _classifier_loss, batches, 1e-3,
                    dict(kind="synthetic MLP", width_in=width_in, hidden=hidden, classes=classes,
                         batch_size=batch_size))


def task_workload(name: str, n_batches: int, device: torch.device) -> Workload:
    from .tasks import get_task

    task = get_task(name, device=device)
    stream = task.batches(0)
    return Workload(name, task.make_model, task.loss_fn, [next(stream) for _ in range(n_batches)],
                    task.lr_grid[len(task.lr_grid) // 2], dict(kind="bench.tasks", data=task.data_source,
                                                               **task.details))


def make_workload(name: str, n_batches: int, device: torch.device) -> Workload:
    """``mlp-1ms``: a step of about a millisecond on one CPU core; ``mlp-50m``: 4 layers 3584
    wide (51M parameters); ``tiny`` (676 parameters): the trainer's fixed cost, with next to
    nothing for the guard's pass over the gradients to read; ``small``: a ``--quick`` size."""
    if name == "mlp-1ms":
        return synthetic_mlp(name, 256, [256, 256], 10, 32, n_batches, device)
    if name == "mlp-50m":
        return synthetic_mlp(name, 3584, [3584, 3584, 3584], 3584, 8, n_batches, device)
    if name == "tiny":
        return synthetic_mlp(name, 16, [32], 4, 8, n_batches, device)
    if name == "small":
        return synthetic_mlp(name, 64, [256, 256], 10, 16, n_batches, device)
    if name in ("fashion", "charlm"):
        return task_workload(name, n_batches, device)
    raise ValueError(f"--models: unknown model {name!r}; one of mlp-1ms, fashion, charlm, mlp-50m, tiny, small")


# --fused-adamw: every arm's AdamW is fused=True (the implementation whose update the guard can
# skip on the device, so that a GPU step reads nothing back; hybrid_trainer.deferred_checks).
# An environment variable, so that the arms' processes and the memory children get it too.
FUSED_ENV = "HYBRID_BENCH_FUSED_ADAMW"
# Set, it takes hybrid_trainer.blas_dots's BLAS routines away in every arm (the guard's dots go
# through torch.dot, as before that module): recorded in the result's command, which it changes.
TORCH_DOTS_ENV = "HYBRID_TRAINER_TORCH_DOTS"


def adamw_options() -> dict[str, Any]:
    """AdamW's keyword arguments in every arm: ``fused=True`` under ``--fused-adamw``, else none
    (torch's default implementation for the device: foreach on a GPU)."""
    return dict(fused=True) if os.environ.get(FUSED_ENV) == "1" else {}


def _arm_step(arm: str, workload: Workload, device: torch.device, seed: int = 0):
    """(step function, trainer or None, model) of one arm, freshly built."""
    from hybrid_trainer import HybridConfig, HybridTrainer

    model = workload.make_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr, **adamw_options())
    if arm == GUARD_FLOOR:
        from hybrid_trainer.step_guard import read_by_dots, squares_read

        params = [p for p in model.parameters() if p.requires_grad]
        by_dots = read_by_dots(params)

        def floor(batch) -> None:
            optimizer.zero_grad(set_to_none=True)
            loss = workload.loss_fn(model, batch)
            loss.backward()
            # The cheapest exact read of the gradients' squares, as StepGuard.read_step_values
            # reads them: on a CPU one dot product per gradient where they are large enough
            # (read_by_dots), else one multi-tensor norm, read value by value and combined on the host.
            if math.isfinite(loss.item()) and math.isfinite(squares_read([p.grad for p in params], by_dots)):
                optimizer.step()
        return floor, None, model
    if arm == LEAN_PLAIN:
        from hybrid_trainer.optimizer_call import OptimizerStep

        params, update = list(model.parameters()), OptimizerStep(optimizer)

        def lean(batch) -> None:
            for p in params:
                p.grad = None
            workload.loss_fn(model, batch).backward()
            update()
        return lean, None, model
    # A trainer arm's config; None for the plain loop and the second one; KeyError for no arm.
    config = ARMS[arm] if arm in ARMS else None if arm == PLAIN_AGAIN else OPT_IN_CONFIGS[arm]
    if config is None:
        def plain(batch) -> None:
            optimizer.zero_grad(set_to_none=True)
            workload.loss_fn(model, batch).backward()
            optimizer.step()
        plain.optimizer = optimizer  # type: ignore[attr-defined]  (the memory report reads its state)
        return plain, None, model
    trainer = HybridTrainer(model, optimizer, workload.loss_fn, HybridConfig(seed=seed, **config))
    return trainer.step, trainer, model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _phase(trainer) -> str:
    return "plain" if trainer is None else trainer.controller.phase.value


def _time_summary(times_s: list[float | None], phases: list[str], chunk: int, settle: int = 0) -> dict[str, Any]:
    """Step-time statistics of one arm; ``times_s`` holds None for a step run untimed (the first
    ``settle`` of each chunk of ``chunk``)."""
    timed = [(t, p) for t, p in zip(times_s, phases) if t is not None]
    times_s, phases = [t for t, _ in timed], [p for _, p in timed]
    per_chunk = chunk - settle
    real = [t for t, p in zip(times_s, phases) if p != "PREDICT"]
    # Median over chunks of the chunk's mean step: what happens every N steps (a good-state
    # snapshot, a block read) is in every chunk's mean, where a per-step median would drop it.
    chunk_means = [statistics.fmean(times_s[i:i + per_chunk]) for i in range(0, len(times_s) - per_chunk + 1, per_chunk)]
    return dict(steps=len(times_s), chunk=chunk, settle=settle, chunk_median_us=1e6 * statistics.median(chunk_means),
                chunk_means_us=[1e6 * m for m in chunk_means],
                median_us=1e6 * statistics.median(times_s),
                mean_us=1e6 * statistics.fmean(times_s),
                real_steps=len(real), real_median_us=1e6 * statistics.median(real) if real else None,
                phases={p: phases.count(p) for p in sorted(set(phases))})


# =================================================================================== time ====
class LocalArm:
    """An arm stepped in this process: its step function, its trainer (None for a loop that is
    not one) and what its timed steps recorded (``times``: seconds; ``phases``; ``on``: whether
    prediction could still run when each began)."""

    def __init__(self, arm: str, workload: Workload, device: torch.device):
        self.workload, self.device = workload, device
        self.step, self.trainer, _ = _arm_step(arm, workload, device)
        self.position = 0
        self.times: list[float] = []
        self.phases: list[str] = []
        self.on: list[bool] = []

    @property
    def prediction_enabled(self) -> bool:
        return self.trainer is not None and self.trainer.controller.prediction_enabled

    @property
    def disabled_reason(self) -> str | None:
        return None if self.trainer is None else self.trainer.controller.disabled_reason

    @property
    def refusals(self) -> dict[str, int]:
        """The guard's refused steps and rollbacks so far (zeros for a loop that is not a trainer)."""
        stats = None if self.trainer is None else self.trainer.stats
        return {key: 0 if stats is None else getattr(stats, key) for key in ("skipped_steps", "divergence_rollbacks")}

    def state(self) -> dict[str, Any]:
        """What a :class:`ProcessArm` mirrors after each command."""
        return dict(prediction_enabled=self.prediction_enabled, disabled_reason=self.disabled_reason,
                    refusals=self.refusals)

    def run(self, steps: int, timed: bool = True, settle: int = 0) -> None:
        """Step ``steps`` times on the next batches (cycled); record each step when ``timed``,
        the first ``settle`` of them untimed (:func:`_timed_chunk`)."""
        batches = self.workload.batches
        if not timed:
            for _ in range(steps):
                self.step(batches[self.position % len(batches)])
                self.position += 1
            return
        _timed_chunk(self, steps, settle)

    def close(self) -> None:
        pass


def _arm_worker(conn, model_name: str, n_batches: int, arm: str, device_name: str) -> None:
    """A :class:`ProcessArm`'s process: builds the arm, then runs each ``(steps, timed, settle)``
    it receives (:meth:`LocalArm.run`) and sends back what those steps recorded and the arm's
    state, until it receives None."""
    import traceback

    try:
        torch.set_num_threads(1)
        device = torch.device(device_name)
        local = LocalArm(arm, make_workload(model_name, n_batches, device), device)
        conn.send(local.state())
        while (command := conn.recv()) is not None:
            steps, timed, settle = command
            done = len(local.times)
            local.run(steps, timed, settle)
            conn.send(dict(local.state(), times=local.times[done:], phases=local.phases[done:], on=local.on[done:]))
    except BaseException:
        conn.send(dict(error=traceback.format_exc()))


class ProcessArm:
    """An arm stepped in a process of its own, one command at a time: the arms of a model too big
    to share a process are still interleaved in time (the machine's drift falls on all of them
    alike). Only the commanded arm runs; the others wait on their pipe. Same interface and records
    as :class:`LocalArm`."""

    def __init__(self, arm: str, workload: Workload, device: torch.device):
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no heap shared with this one
        self.arm = arm
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_arm_worker, daemon=True,
                                        args=(child, workload.name, len(workload.batches), arm, str(device)))
        self._process.start()
        child.close()
        self.times: list[float] = []
        self.phases: list[str] = []
        self.on: list[bool] = []
        self._mirror(self._reply())

    def _mirror(self, reply: dict[str, Any]) -> None:
        self.prediction_enabled, self.disabled_reason = reply["prediction_enabled"], reply["disabled_reason"]
        self.refusals = reply["refusals"]

    def _reply(self) -> dict[str, Any]:
        try:
            reply = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the process of arm {self.arm!r} ended (exit code {self._process.exitcode})") from None
        if "error" in reply:
            raise RuntimeError(f"the process of arm {self.arm!r} failed:\n{reply['error']}")
        return reply

    def run(self, steps: int, timed: bool = True, settle: int = 0) -> None:
        self._conn.send((steps, timed, settle))
        reply = self._reply()
        self.times += reply["times"]
        self.phases += reply["phases"]
        self.on += reply["on"]
        self._mirror(reply)

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()


def _timed_chunk(a: LocalArm, chunk: int, settle: int = 0) -> None:
    """Step arm ``a`` ``chunk`` times, appending each step's time (None for the first ``settle``
    steps, run untimed), the phase it ran in and whether prediction could still run when it
    began. On a CPU a step's time is the thread's CPU time: with one thread per process the
    step's whole work, and not the time another process held the core (helpers and CI share
    this machine). On CUDA the chunk's timed steps are timed as a whole between two
    synchronisations and each gets their mean: a sync after every step would hide the trainer's
    own waits on the device, which are what a GPU run must show.

    ``settle``: interleaved, an arm's first step after another arm's chunk can pay for the
    switch rather than for itself. On the 51M MLP, a loop that frees its gradients at the end of
    its step (the trainer does; the plain loop frees them at the start of the next) paid ~0.4 s
    more kernel time in page faults on that step, the same number of faults, whether the other
    arm ran in its process or in another one, and not after a pause alone."""
    batches, device = a.workload.batches, a.device
    n = len(batches)

    def next_batch():
        a.phases.append(_phase(a.trainer))
        a.on.append(a.prediction_enabled)
        a.position += 1
        return batches[(a.position - 1) % n]

    for _ in range(settle):
        a.step(next_batch())
        a.times.append(None)
    if device.type == "cuda":
        _sync(device)
        started = time.perf_counter()
        for _ in range(chunk - settle):
            a.step(next_batch())
        _sync(device)
        a.times += [(time.perf_counter() - started) / (chunk - settle)] * (chunk - settle)
        return
    for _ in range(chunk - settle):
        batch = next_batch()
        started = time.thread_time()
        a.step(batch)
        a.times.append(time.thread_time() - started)


def make_arms(names: list[str], workload: Workload, device: torch.device, separate: bool) -> dict[str, Any]:
    """Arms by name, each a :class:`ProcessArm` (``separate``) or a :class:`LocalArm`; if one
    cannot be built, those already started are closed."""
    arms: dict[str, Any] = {}
    try:
        for name in names:
            arms[name] = (ProcessArm if separate else LocalArm)(name, workload, device)
    except BaseException:
        for arm in arms.values():
            arm.close()
        raise
    return arms


def big_batches(warmup: int, until_off_max: int, steps: int, chunk: int, settle: int, slices: int) -> int:
    """Distinct batches a model above IN_PROCESS_PARAMS needs so that no arm sees one twice: its
    warm-up, the steps until prediction is off (at most ``until_off_max``) and every step of its
    rounds, the untimed first step of each chunk or slice included; at least BIG_BATCHES. A run
    of 32 rounds in 5 slices (1,760 steps an arm) cycled 1,024 batches, and the guard refused 48
    of the trainer's 1,600 timed steps as spikes."""
    timed_per_chunk = chunk - settle
    rounds = -(-steps // timed_per_chunk)
    return max(BIG_BATCHES, warmup + until_off_max + rounds * (timed_per_chunk + settle * slices))


def _check_settle(chunk: int, settle: int) -> None:
    if not 0 <= settle < chunk:
        raise ValueError(f"settle: untimed steps per chunk must be in [0, chunk={chunk}), got {settle}")


def _check_slices(chunk: int, settle: int, slices: int) -> None:
    """Slices split a chunk's timed steps evenly, each slice after ``settle`` untimed steps of its
    own (:func:`_interleave`)."""
    if slices < 1 or (chunk - settle) % slices:
        raise ValueError(f"slices: a divisor of the chunk's {chunk - settle} timed steps (chunk {chunk}, "
                         f"{settle} untimed), got {slices}")


def _warm(runner, warmup: int, until_off_max: int) -> int:
    """Run ``runner`` ``warmup`` steps untimed, then on (untimed) while its prediction can still
    run, at most ``until_off_max`` steps more. Returns the steps it ran."""
    runner.run(warmup, timed=False)
    warmed = warmup
    while runner.prediction_enabled and warmed < warmup + until_off_max:
        runner.run(PERIOD // 5, timed=False)  # in tens: the gate decides at the end of a FULL phase (20 steps)
        warmed += PERIOD // 5
    return warmed


def _interleave(runners: dict[str, Any], rounds: int, chunk: int, settle: int, progress, slices: int = 1) -> None:
    """``rounds`` rounds, each stepping every runner one chunk, the order rotated each round.

    ``slices`` > 1: a round steps every runner ``(chunk - settle) // slices`` timed steps in
    turn, each turn after ``settle`` untimed ones, ``slices`` times, the order rotated each slice.
    Each runner's chunk is still ``chunk`` consecutive steps of its own (one good-state period,
    so one snapshot), but the runners' chunks now span the same stretch of the round, so a drift
    of the host's speed within a round falls on them alike. On this project's second CI host the
    plain loop's 50-step chunk means on the char-LM ranged 98-154 ms within one run, which left a
    64-round interval 6.7% of the step wide; on the 51M MLP consecutive 50-step chunks (~50 s
    each) differed by up to 10% of the step."""
    _check_slices(chunk, settle, slices)
    names = list(runners)
    turn_steps = settle + (chunk - settle) // slices
    for r in range(rounds):
        for s in range(slices):
            turn = r + s
            for name in names[turn % len(names):] + names[:turn % len(names)]:
                runners[name].run(turn_steps, settle=settle)
        progress.update(1)


def _arm_summary(name: str, runner, chunk: int, settle: int, warmed: int,
                 refusals_before: dict[str, int], slices: int = 1) -> dict[str, Any]:
    """Arm ``name``'s time summary (:func:`_time_summary`), with its
    warm-up steps, the slices its chunks were stepped in (:func:`_interleave`) and the guard's
    refusals while timed: a rollback reads the good state back (and the steps it discards were
    still paid for), which the plain loop never does."""
    out = dict(_time_summary(runner.times, runner.phases, chunk, settle), warmup_steps=warmed, slices=slices)
    out["refusals"] = {k: v - refusals_before[k] for k, v in runner.refusals.items()}
    if ARMS.get(name) is not None:  # a trainer arm with a config
        out["prediction_enabled_at_end"] = runner.prediction_enabled
    return out


def time_interleaved(workload: Workload, device: torch.device, warmup: int, steps: int, chunk: int,
                     progress, separate: bool = False, arms: list[str] | None = None,
                     settle: int = 0, until_off_max: int = UNTIL_OFF_MAX,
                     in_pairs: bool = False, slices: int = 1) -> dict[str, dict[str, Any]]:
    """Per arm (``arms``; every arm and the guard floor by default): step times, the arms
    stepped in interleaved chunks, the order rotated each round; in this process, or each in a
    process of its own (``separate``); ``steps`` timed steps per arm, each chunk's first
    ``settle`` steps run untimed besides. Before timing, ``warmup`` untimed steps per arm, and
    an arm whose prediction can still run goes on untimed until it is off (at most
    ``until_off_max`` steps more; :func:`exploration` times those steps).

    ``in_pairs``: each arm is timed beside the plain loop alone: one plain loop throughout, the
    other arms built, timed and closed one after another (``progress`` counts the rounds of
    every pair). Each arm's summary keeps the plain loop's chunk means of its own rounds
    (``plain_chunk_means_us``, which :func:`paired_overhead` pairs it with). An arm then waits
    one chunk between its chunks rather than one per other arm. On the 51M model (chunks of
    ~25 s) seven arms made each wait ~150 s, longer than the 60 s after which this machine's
    kernel pages out file cache nobody touched (a DAMON ``pageout`` scheme), so each snapshot
    rewrote its 617 MB file into fresh pages: 1.3 s, against 0.06 s right after
    (``bench.snapshot_file``). Paired, an arm's snapshots still come ~51 s apart (its chunk and
    the plain loop's), twice a run's ~25 s: rewritten every 50 s the file cost 162 ms (median of
    6, up to 542), every 25 s 72 ms (median of 10). So the pairs still charge a trainer arm more
    for its snapshots than a run pays, never less."""
    _check_settle(chunk, settle)
    names = arms or [*ARMS, *TIMED_ONLY]
    rounds = -(-steps // (chunk - settle))
    if not in_pairs:
        runners = make_arms(names, workload, device, separate)
        try:
            warmed = {name: _warm(runner, warmup, until_off_max) for name, runner in runners.items()}
            before = {name: dict(runner.refusals) for name, runner in runners.items()}
            _interleave(runners, rounds, chunk, settle, progress, slices)
            return {name: _arm_summary(name, runners[name], chunk, settle, warmed[name], before[name], slices)
                    for name in names}
        finally:
            for runner in runners.values():
                runner.close()
    if "plain" not in names:
        raise ValueError(f"in_pairs: each arm is timed beside the plain loop, which arms={names} leaves out")
    plain = make_arms(["plain"], workload, device, separate)["plain"]
    try:
        plain_warmed = _warm(plain, warmup, until_off_max)
        plain_before = dict(plain.refusals)
        out: dict[str, dict[str, Any]] = {}
        for name in names:
            if name == "plain":
                continue
            arm = make_arms([name], workload, device, separate)[name]
            try:
                warmed = _warm(arm, warmup, until_off_max)
                before, start = dict(arm.refusals), len(plain.times)
                _interleave({"plain": plain, name: arm}, rounds, chunk, settle, progress, slices)
                out[name] = _arm_summary(name, arm, chunk, settle, warmed, before, slices)
                out[name]["plain_chunk_means_us"] = _time_summary(
                    plain.times[start:], plain.phases[start:], chunk, settle)["chunk_means_us"]
            finally:
                arm.close()
        out["plain"] = dict(_arm_summary("plain", plain, chunk, settle, plain_warmed, plain_before, slices),
                            in_pairs=True)
        return {name: out[name] for name in names}
    finally:
        plain.close()


def _timing_run_worker(conn, model_name: str, n_batches: int, device_name: str, options: dict[str, Any]) -> None:
    """One timing run in a fresh interpreter (``--runs``): builds the model's workload, measures
    the host's speed, runs :func:`time_interleaved` with ``options`` and sends back both."""
    import traceback

    from tqdm import tqdm

    try:
        torch.set_num_threads(1)
        device = torch.device(device_name)
        workload = make_workload(model_name, n_batches, device)
        machine = machine_speed()
        # A run's own process shows no bar: the parent counts the runs.
        timed = time_interleaved(workload, device, progress=tqdm(disable=True), **options)
        conn.send(dict(timed=timed, machine=machine))
    except BaseException:
        conn.send(dict(error=traceback.format_exc()))


def time_in_fresh_processes(workload: Workload, device: torch.device, runs: int, progress,
                            **options: Any) -> list[dict[str, Any]]:
    """``runs`` timing runs of ``workload``, one after another, each :func:`time_interleaved`
    with ``options`` in an interpreter of its own (``--runs``); per run its arms' summaries
    (``timed``) and the host's speed at its start (``machine``). ``progress`` counts runs.

    Why: within one process the arms' chunks are paired round by round, and the interval of the
    differences says how well the rounds pin down *that process's* overhead. Fresh processes
    differ by more: on this project's CI host three runs of the tiny MLP minutes apart measured
    +25, +53 and +55 µs with intervals about ±5 µs, and a second plain loop beside the first
    measured up to +28 µs in one process. Where an arm's code and data happen to sit in a
    process is fixed for the whole run and redrawn in the next; only an interval over runs
    counts it (:func:`paired_overhead`)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing inherited but the environment
    out = []
    for index in range(runs):
        receiver, sender = context.Pipe(duplex=False)
        # Not a daemon: a model above IN_PROCESS_PARAMS starts a process per arm from it.
        process = context.Process(target=_timing_run_worker,
                                  args=(sender, workload.name, len(workload.batches), str(device), options))
        process.start()
        sender.close()
        try:
            reply = receiver.recv()
        except EOFError:  # the process died before sending (killed, out of memory)
            process.join()
            reply = dict(error=f"it ended without a result (exit code {process.exitcode})")
        finally:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
                process.join()
            receiver.close()
        if "error" in reply:
            raise RuntimeError(f"timing run {index + 1} of {runs} ({workload.name}) failed:\n{reply['error']}")
        out.append(reply)
        progress.update(1)
    return out


def _summed(counts: list[dict[str, int]]) -> dict[str, int]:
    """Key by key sums of ``counts``; ``Counter.update`` keeps a zero count (``+`` would drop it)."""
    total: Counter[str] = Counter()
    for c in counts:
        total.update(c)
    return dict(total)


def pool_runs(runs: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each arm's time summary over several timing runs (``runs``: :func:`time_interleaved`'s
    result of each, in order). The runs themselves are kept (``runs``), and
    :func:`paired_overhead` takes the overhead from them run by run; for the table, the chunk
    means of every run end to end with their median, the median of the runs' per-step medians,
    and the steps, phases and refusals summed. An arm timed in pairs keeps its plain loop's
    chunk means end to end beside its own (``plain_chunk_means_us``)."""
    pooled: dict[str, dict[str, Any]] = {}
    for arm in runs[0]:
        parts = [run[arm] for run in runs]
        means = [m for part in parts for m in part["chunk_means_us"]]
        steps = sum(part["steps"] for part in parts)
        real = [part["real_median_us"] for part in parts if part["real_median_us"] is not None]
        out = dict(parts[0], runs=parts, steps=steps, chunk_means_us=means, chunk_median_us=statistics.median(means),
                   median_us=statistics.median(part["median_us"] for part in parts),
                   mean_us=sum(part["mean_us"] * part["steps"] for part in parts) / steps,
                   real_steps=sum(part["real_steps"] for part in parts),
                   real_median_us=statistics.median(real) if real else None,
                   phases=_summed([part["phases"] for part in parts]))
        if "refusals" in parts[0]:
            out["refusals"] = _summed([part["refusals"] for part in parts])
        if "plain_chunk_means_us" in parts[0]:
            out["plain_chunk_means_us"] = [m for part in parts for m in part["plain_chunk_means_us"]]
        if "prediction_enabled_at_end" in parts[0]:
            out["prediction_enabled_at_end"] = any(part["prediction_enabled_at_end"] for part in parts)
        pooled[arm] = out
    return pooled


def exploration(workload: Workload, device: torch.device, max_steps: int, chunk: int, progress,
                separate: bool = False, settle: int = 0) -> dict[str, Any]:
    """What the default config costs while prediction can still run, which the table's default
    arm (timed after ``--warmup`` steps) leaves out: a fresh plain loop and a fresh default
    trainer, stepped from their first step in interleaved chunks (timed as in
    :func:`time_interleaved`, in one process or in a process each) until the trainer has
    switched prediction off, or ``max_steps``. Sums both arms' times over the steps the trainer
    took with prediction on (the timed ones: each chunk's first ``settle`` steps run untimed, at
    the same positions in both arms); the trainer's mean step by phase beside the plain loop's."""
    _check_settle(chunk, settle)
    runners = make_arms(["plain", "default"], workload, device, separate)
    try:
        plain, default = runners["plain"], runners["default"]
        rounds = 0
        while default.prediction_enabled and len(default.times) < max_steps:
            for runner in (plain, default) if rounds % 2 == 0 else (default, plain):
                runner.run(chunk, settle=settle)
            rounds += 1
            progress.update(1)
        steps_on = sum(default.on)  # a prefix: once off, prediction stays off for the run
        timed = [i for i in range(steps_on) if default.times[i] is not None]
        plain_s, default_s = sum(plain.times[i] for i in timed), sum(default.times[i] for i in timed)
        phases = [default.phases[i] for i in timed]
        by_phase = {p: 1e6 * statistics.fmean([default.times[i] for i in timed if default.phases[i] == p])
                    for p in dict.fromkeys(phases)}
        return dict(steps_on=steps_on, timed_steps=len(timed), switched_off=not default.prediction_enabled,
                    max_steps=max_steps, chunk=chunk, settle=settle, plain_s=plain_s, default_s=default_s,
                    ratio=default_s / plain_s if plain_s > 0 else None, extra_s=default_s - plain_s,
                    plain_mean_us=1e6 * plain_s / len(timed) if timed else None, default_mean_us_by_phase=by_phase,
                    phases={p: default.phases[:steps_on].count(p) for p in dict.fromkeys(default.phases[:steps_on])},
                    timed_phases={p: phases.count(p) for p in dict.fromkeys(phases)},
                    disabled_reason=default.disabled_reason, refusals=default.refusals,
                    separate_processes=separate)
    finally:
        for runner in runners.values():
            runner.close()


def exploration_lines(results: dict[str, Any]) -> list[str]:
    """Markdown lines of each model's :func:`exploration`."""
    lines = []
    for model, r in results["models"].items():
        e = r.get("exploration")
        if not e or not e["steps_on"]:
            continue
        when = (f"off after {e['steps_on']} steps" if e["switched_off"]
                else f"still on after {e['steps_on']} steps (the most this run took)")
        phases = ", ".join(f"{p} {n}" for p, n in e["phases"].items())
        if e.get("settle"):
            phases += f"; timed: {e['timed_steps']}, the first step of each chunk of {e['chunk']} untimed"
        if (e.get("refusals") or {}).get("skipped_steps"):
            phases += (f"; {e['refusals']['skipped_steps']} steps refused, {e['refusals']['divergence_rollbacks']} "
                       "rollbacks")
        means = "; ".join(f"{p} {us:.0f}" for p, us in e["default_mean_us_by_phase"].items())
        over = "over the timed ones" if e.get("settle") else "in all"
        lines.append(f"- {model}: {when} ({phases}): {e['ratio']:.2f}× the plain loop's time over them, "
                     f"{e['extra_s']:+.2f} s {over} (mean step, µs: plain {e['plain_mean_us']:.0f}; default {means})")
    if lines:
        lines[:0] = ["", "The default config while prediction can still run (the table times it after that): a fresh "
                     "plain loop and a fresh default trainer from their first step, interleaved chunk by chunk, until "
                     "the trainer switched prediction off; both arms' time summed over those steps:", ""]
    return lines


# ============================================================================== breakdown ====
BREAKDOWN_PARTS = {  # label: (object path from the trainer, "" for the trainer itself; method)
    "gradient norm and read (guard)": ("guard", "read_step_values"),
    # read_every > 1 (a GPU's default): the parts of the deferred path, which the per-step
    # parts above do not see; a part an arm never reaches (guard.deferred is None with
    # read_every=1) is left out. The launches include the optimizer step they make.
    "gradient norms on the device (deferred)": ("guard", "grad_norms"),
    "checks queued + update (deferred, device-side skip)": ("guard.deferred", "launch"),
    "checks read + update (deferred)": ("guard.deferred", "launch_read"),
    "block read and judgment (deferred)": ("guard.deferred", "settle"),
    "end of step: counters, events, metrics": ("", "_end_step"),
    # The lean step (prediction off, per-step checks or waiting for the read) ends with its own
    # method and calls the monitor's check directly; the general path's guard.check calls it too.
    "end of lean step: counters, events, metrics": ("", "_end_steady_step"),
    "divergence check (guard)": ("guard.monitor", "check"),
    "accept: monitor + good state (guard)": ("guard", "accept"),
    # The good state's snapshot: inside accept on the general path; on the lean step marked due
    # there and taken at the start of the next step, its file written behind that step's forward
    # and backward, which the update then waits for (StepGuard.take_due_snapshot).
    "good-state snapshot (inside accept)": ("guard.good_state", "save"),
    "due good state taken: check + write launched (guard)": ("guard", "take_due_snapshot"),
    "wait for the good state's write (guard)": ("guard", "wait_for_snapshot"),
    "forecaster.observe": ("forecaster", "observe"),
    "loss trend": ("loss_trend", "update"),
    "controller.advance": ("controller", "advance"),
    # The large linear layers' Gram norms (a CPU's steady step; hybrid_trainer.gram_norm): their
    # hooks run inside the model's forward and backward (NESTED_PARTS), the check after them.
    "Gram norms: forward hooks": ("guard.gram", "_forward"),
    "Gram norms: backward hooks": ("guard.gram", "_output_grad"),
    "Gram norms: check": ("guard.gram", "finish"),
}
# Parts that run inside the forward, backward or optimizer step, whose wrapped time would hide
# them: the trainer's own time counts them back.
NESTED_PARTS = ("Gram norms: forward hooks", "Gram norms: backward hooks")


def breakdown(workload: Workload, arm: str, device: torch.device, warmup: int, steps: int,
              bar: Any = None) -> dict[str, Any]:
    """Where one arm's step time goes: the model's forward (``loss_fn``), ``backward`` and the
    optimizer step, timed by wrapping them, the trainer's own parts likewise; ``own_us`` is the
    step minus forward, backward and optimizer, plus the trainer's parts that ran inside them
    (:data:`NESTED_PARTS`), i.e. everything the trainer adds. The plain loop is timed the same
    way, in chunks of up to one good-state period taken in turn with the arm's: its step minus the
    same three parts (``plain_own_us``: ``zero_grad``, freeing the gradients, the loop itself) is
    what a loop costs outside them anyway, so ``own_over_plain_us``, the difference, is what the
    trainer adds over the plain loop outside them (what it saves inside them, as the update
    without torch's profiler scope, is not counted; the whole-step pairs count it). Mean µs per
    step over ``steps`` steps of each (each wrapper adds well under a µs). ``bar``: a progress bar
    (tqdm) advanced by each step of either loop."""
    spent: dict[str, float] = {}
    plain_spent: dict[str, float] = {}
    current = {"spent": spent}  # the book of the loop stepping now, which every wrapped call runs in

    def timed(label: str, fn):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                book = current["spent"]
                book[label] = book.get(label, 0.0) + time.perf_counter() - started
        return wrapper

    step, trainer, _ = _arm_step(arm, workload, device)
    trainer.loss_fn = timed("model forward", trainer.loss_fn)
    # The trainer's update through its own call (hybrid_trainer.optimizer_call), which skips torch's
    # profiler scope: a wrapper on the optimizer's ``step`` would send it through that scope.
    trainer.guard.step_optimizer = timed("optimizer step", trainer.guard.step_optimizer)
    for label, (path, method) in BREAKDOWN_PARTS.items():
        owner = trainer
        for name in filter(None, path.split(".")):
            owner = getattr(owner, name, None)
        if owner is not None:
            setattr(owner, method, timed(label, getattr(owner, method)))
    plain, _, _ = _arm_step("plain", dataclasses.replace(workload, loss_fn=timed("model forward", workload.loss_fn)),
                            device)
    plain.optimizer.step = timed("optimizer step", plain.optimizer.step)
    backward = torch.Tensor.backward
    torch.Tensor.backward = timed("backward", backward)
    totals = {"arm": 0.0, "plain": 0.0}
    try:
        n = len(workload.batches)
        for i in range(warmup):
            step(workload.batches[i % n])
            plain(workload.batches[i % n])
        spent.clear()
        plain_spent.clear()
        chunk = min(steps, PERIOD)
        for start in range(warmup, warmup + steps, chunk):
            for name, fn, book in (("arm", step, spent), ("plain", plain, plain_spent)):
                current["spent"] = book
                _sync(device)
                started = time.perf_counter()
                for i in range(start, min(start + chunk, warmup + steps)):
                    fn(workload.batches[i % n])
                    if bar is not None:
                        bar.update()
                _sync(device)
                totals[name] += time.perf_counter() - started
    finally:
        torch.Tensor.backward = backward
    core_parts = ("model forward", "backward", "optimizer step")
    per_step = {label: 1e6 * s / steps for label, s in sorted(spent.items(), key=lambda kv: -kv[1])}
    plain_parts = {label: 1e6 * s / steps for label, s in plain_spent.items()}
    step_us, plain_step_us = 1e6 * totals["arm"] / steps, 1e6 * totals["plain"] / steps
    own = step_us - sum(per_step.get(k, 0.0) for k in core_parts) + sum(per_step.get(k, 0.0) for k in NESTED_PARTS)
    plain_own = plain_step_us - sum(plain_parts.get(k, 0.0) for k in core_parts)
    return dict(arm=arm, steps=steps, step_us=step_us, own_us=own, parts_us=per_step,
                plain_step_us=plain_step_us, plain_own_us=plain_own, plain_parts_us=plain_parts,
                own_over_plain_us=own - plain_own)


# ================================================================================= memory ====
def _rss_bytes() -> int:
    return int(re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def _peak_rss_bytes() -> int:
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def _plain_state_bytes(model: nn.Module, optimizer_state: dict) -> dict[str, int]:
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = params  # every trained parameter gets a gradient of its size during the step
    opt = sum(v.numel() * v.element_size() for s in optimizer_state.values() for v in s.values()
              if isinstance(v, torch.Tensor))
    return dict(params=params, grads=grads, optimizer_state=opt)


WARM_UP_STEPS = 60  # past the trainer's WARMUP phase into recording, so those code paths run too


def warm_up_code(workload: Workload, arm: str, device: torch.device) -> None:
    """Run ``arm`` for a few steps and throw it away: the code a long run executes (torch's
    kernels, the trainer's) is then paged in before the baseline, as it is in any long run; a
    resident code page would otherwise count as training memory of whichever arm first ran it."""
    step, trainer, model = _arm_step(arm, workload, device)
    for i in range(WARM_UP_STEPS):
        step(workload.batches[i % len(workload.batches)])
    del step, trainer, model


def _return_free_heap() -> None:
    """Give the heap's free pages back to the system (glibc ``malloc_trim``), so that memory the
    warm-up freed is not reused by the measured arm without showing in its peak."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the warm-up's freed heap stays counted in the baseline
        pass


class TensorPeak:
    """Peak bytes of live CPU tensors while it is entered, exact at the allocator: every allocation
    and free of torch's CPU allocator is reported to the profiler (``profile_memory=True``) with
    its size; the running sum of those sizes, in time order, is the tensor bytes allocated since
    entry and still alive, and its maximum the peak. Only memory allocated while profiling is
    tracked (a block allocated before entry and freed inside is not reported), so enter before
    the measured objects are built. Python objects, allocator slack and code pages are not
    tensors and are not in it: that is what RSS adds."""

    def __enter__(self) -> "TensorPeak":
        from torch.profiler import ProfilerActivity, profile

        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profiler.__exit__(*exc)
        sizes = sorted((e.start_ns(), e.nbytes()) for e in self._profiler.profiler.kineto_results.events()
                       if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
        live = peak = 0
        for _, size in sizes:
            live += size
            peak = max(peak, live)
        self.peak_bytes, self.end_bytes, self.events = peak, live, len(sizes)
        del self._profiler


def memory_child(model_name: str, arm: str, device_name: str, steps: int, n_batches: int,
                 measure: str = "rss") -> dict:
    """Run in a fresh process: peak training memory of one arm. ``measure``: ``"rss"`` (peak RSS
    above the baseline; on CUDA the allocator's peak) or ``"tensors"`` (peak live tensor bytes,
    :class:`TensorPeak`; CPU only)."""
    from hybrid_trainer.footprint import trainer_tensor_bytes

    torch.set_num_threads(1)
    device = torch.device(device_name)
    if measure not in ("rss", "tensors") or (measure == "tensors" and device.type != "cpu"):
        raise ValueError(f"measure: 'rss', or 'tensors' on a CPU; got {measure!r} on {device}")
    workload = make_workload(model_name, n_batches, device)
    warm_up_code(workload if model_name != "mlp-50m" else make_workload("tiny", 8, device), arm, device)
    gc.collect()
    _return_free_heap()
    if measure == "tensors":
        with TensorPeak() as tensors:
            step, trainer, model = _arm_step(arm, workload, device)
            for i in range(steps):
                step(workload.batches[i % len(workload.batches)])
        result = dict(model=model_name, arm=arm, measure=measure, tensor_peak_bytes=tensors.peak_bytes,
                      tensor_end_bytes=tensors.end_bytes, allocator_events=tensors.events,
                      parameters=sum(p.numel() for p in model.parameters()), steps=steps)
        if trainer is not None:
            result["prediction_enabled_at_end"] = trainer.controller.prediction_enabled
        result["plain_state_bytes"] = _plain_state_bytes(model, (trainer or step).optimizer.state)
        return result
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again at the current RSS
        baseline = _rss_bytes()
    step, trainer, model = _arm_step(arm, workload, device)
    for i in range(steps):
        step(workload.batches[i % len(workload.batches)])
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _peak_rss_bytes()
    result = dict(model=model_name, arm=arm, baseline_bytes=baseline, peak_bytes=peak, training_bytes=peak - baseline,
                  parameters=sum(p.numel() for p in model.parameters()), steps=steps)
    if device.type == "cuda":  # at the end of the run, the trainer and its graph still alive
        try:
            result["allocated_by_pool"] = allocated_by_pool(torch.cuda.memory._snapshot(device))
        except Exception as error:  # a private API: its failure must not cost the run's figures
            result["allocated_by_pool"] = f"not read: {type(error).__name__}: {error}"
    if trainer is not None:
        result["trainer_tensor_bytes"] = trainer_tensor_bytes(trainer)
        result["prediction_enabled_at_end"] = trainer.controller.prediction_enabled
        result["plain_state_bytes"] = _plain_state_bytes(model, trainer.optimizer.state)
    return result


def allocated_by_pool(snapshot: dict[str, Any]) -> dict[str, Any]:
    """Bytes in use on a CUDA device, split by who holds them, from ``torch.cuda.memory._snapshot()``:
    ``graph_pools`` in the private pools of CUDA graphs (pool id other than ``(0, 0)``: what a
    captured step keeps between replays), ``by_stream`` in the default pool by the stream each
    segment was allocated on (``"0"`` the default stream; another, a side stream's: the cuBLAS
    workspace torch keeps per stream is allocated there). Where the replayed step's memory goes,
    measured rather than inferred."""
    graph_pools, by_stream = 0, {}
    for segment in snapshot.get("segments", []):
        used = segment["allocated_size"]
        if tuple(segment.get("segment_pool_id") or (0, 0)) != (0, 0):
            graph_pools += used
        else:
            key = str(segment.get("stream", 0))
            by_stream[key] = by_stream.get(key, 0) + used
    return dict(graph_pools=graph_pools, by_stream=by_stream)


def run_memory_child(model_name: str, arm: str, device: str, steps: int, n_batches: int,
                     measure: str = "rss") -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", HYBRID_KERNELS_BACKEND=os.environ.get("HYBRID_KERNELS_BACKEND", "eager"))
    env.pop("TRITON_INTERPRET", None)
    command = [sys.executable, "-m", "bench.overhead", "--child", model_name, arm, "--device", device,
               "--memory-steps", str(steps), "--batches", str(n_batches), "--child-measure", measure]
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"memory child {model_name}/{arm} ({measure}) failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ================================================================================ report ====
# Below this plain-loop peak RSS the memory ratio is the exact tensor peak's: one arm's peak RSS
# moved by several MB between runs (Python objects, allocator slack; Fashion-MNIST predict=False
# read 0.93, 1.22 and 1.43x on a 14 MB peak), more than the 3% the goal allows of a peak under
# ~250 MB. Above it RSS, what a user meets, resolves the goal and is the ratio.
RSS_RESOLVES_BYTES = 256e6


def memory_basis(plain: dict) -> str:
    """``"rss"`` or ``"tensors"``: which peak the model's memory ratio is taken from (see above)."""
    if not plain.get("tensors") or (plain.get("memory") or {}).get("training_bytes", 0) >= RSS_RESOLVES_BYTES:
        return "rss"
    return "tensors"


def median_interval_ranks(n: int, level: float = 0.95) -> tuple[int, int] | None:
    """0-based ranks ``(lo, hi)`` of ``n`` sorted values between which their population's median
    lies with probability at least ``level``, whatever the distribution: the largest ``k`` with
    ``2 P(Binomial(n, 1/2) < k) <= 1 - level`` gives ranks ``k - 1`` and ``n - k`` (the sign
    test's interval). None when ``n`` is too small for any (below 6 at 95%)."""
    tail, k = 0.0, 0
    while 2 * (tail + math.comb(n, k) / 2 ** n) <= 1 - level:
        tail += math.comb(n, k) / 2 ** n
        k += 1
    return None if k == 0 else (k - 1, n - k)


def paired_overhead(plain_time: dict, arm_time: dict) -> dict[str, Any] | None:
    """The arm's chunk means minus the plain loop's, round by round (each round steps every arm
    one chunk, so a pair shares the machine's state): their median and a distribution-free 95%
    interval for it (:func:`median_interval_ranks`). An arm timed in a pair with the plain loop
    is taken against that loop's chunks of its own rounds; ``plain_time`` may then be another
    such arm (over each one's own rounds). None without chunk means (results files from before
    they were kept).

    An arm timed in several fresh processes (``--runs``, :func:`pool_runs`): the median of its
    runs' overheads, each taken as above within its run, and the 95% interval over runs
    (``runs``, ``run_medians_us``; the min…max of 6 to 8 runs): what differs between processes
    is then in the interval, which the rounds of one process cannot show
    (:func:`time_in_fresh_processes`)."""
    if arm_time.get("runs"):  # timed in several processes (--runs): one overhead per run, the interval over runs
        # Run i of the arm against run i of the base: the same process where both were timed
        # together; where one was kept from another invocation (--arms), each run of each is taken
        # against its own plain loop (plain_chunk_means_us in every run), as below within a run.
        arm_runs, base_runs = arm_time["runs"], plain_time.get("runs")
        if (all("plain_chunk_means_us" in r for r in arm_runs) and "plain_chunk_means_us" not in plain_time
                and not any("plain_chunk_means_us" in r for r in base_runs or [])):
            # Each run carries its own plain loop and the base is the plain loop itself (of
            # whichever invocation, however many runs): nothing of the base's is subtracted.
            base_runs = [dict(chunk_means_us=r["plain_chunk_means_us"]) for r in arm_runs]
        if base_runs is None or len(base_runs) != len(arm_runs):
            return None
        per_run = [paired_overhead(p, a) for p, a in zip(base_runs, arm_runs)]
        if any(r is None for r in per_run):
            return None
        medians = [r["median_us"] for r in per_run]
        ordered = sorted(medians)
        ranks = median_interval_ranks(len(ordered))
        return dict(pairs=sum(r["pairs"] for r in per_run), runs=len(medians), run_medians_us=medians,
                    median_us=statistics.median(medians),
                    ci95_us=None if ranks is None else [ordered[ranks[0]], ordered[ranks[1]]])
    a, p = arm_time.get("chunk_means_us"), plain_time.get("chunk_means_us")
    if not a or not p:
        return None
    if plain_time.get("runs") and ("plain_chunk_means_us" not in arm_time or "plain_chunk_means_us" in plain_time):
        return None  # a base timed in several runs pairs with an arm of one run only as the plain loop itself
    if "plain_chunk_means_us" in arm_time:  # timed in a pair with the plain loop (time_interleaved's in_pairs)
        # Each against the plain loop of its own rounds; a base that is not the plain loop was
        # timed in a pair of its own, so it is taken over its own rounds' plain loop too.
        a = [x - y for x, y in zip(a, arm_time["plain_chunk_means_us"])]
        base = plain_time.get("plain_chunk_means_us")
        p = [0.0] * len(a) if base is None else [x - y for x, y in zip(p, base)]
    differences = sorted(x - y for x, y in zip(a, p))
    ranks = median_interval_ranks(len(differences))
    return dict(pairs=len(differences), median_us=statistics.median(differences),
                ci95_us=None if ranks is None else [differences[ranks[0]], differences[ranks[1]]])


def compare(plain: dict, arm: dict) -> dict[str, Any]:
    """Ratios and differences of one trainer arm against the plain loop, from the measurements:
    ``overhead_us`` the median of the round-by-round differences of chunk means with its 95%
    interval (``overhead_ci95_us``; :func:`paired_overhead`), the difference of the two arms'
    chunk medians where the chunk means were not kept; ``time_ratio`` the plain step plus the
    overhead over the plain step; ``rss_*`` from the peak RSS, ``tensor_*`` from the exact tensor
    peak, and ``memory_ratio`` / ``extra_bytes`` from the one :func:`memory_basis` picks
    (``memory_basis``)."""
    out: dict[str, Any] = {}
    if plain.get("time") and arm.get("time"):
        p, a = plain["time"], arm["time"]
        key = "chunk_median_us" if "chunk_median_us" in a and "chunk_median_us" in p else "median_us"
        paired = paired_overhead(p, a)
        out["overhead_us"] = paired["median_us"] if paired else a[key] - p[key]
        out["time_ratio"] = (p[key] + out["overhead_us"]) / p[key]
        if paired:
            out["overhead_pairs"], out["overhead_ci95_us"] = paired["pairs"], paired["ci95_us"]
            if "runs" in paired:
                out["overhead_runs"], out["overhead_run_medians_us"] = paired["runs"], paired["run_medians_us"]
        if a["real_median_us"] is not None:  # against the plain loop of the arm's own run (--arms keeps arms)
            plain_median = a.get("plain_median_us", p["median_us"])
            out["real_step_ratio"] = a["real_median_us"] / plain_median
            out["real_step_overhead_us"] = a["real_median_us"] - plain_median
    if plain.get("memory") and arm.get("memory"):
        p, a = plain["memory"]["training_bytes"], arm["memory"]["training_bytes"]
        out["rss_ratio"] = a / p if p > 0 else None
        out["rss_extra_bytes"] = a - p
    if plain.get("tensors") and arm.get("tensors"):
        p, a = plain["tensors"]["tensor_peak_bytes"], arm["tensors"]["tensor_peak_bytes"]
        out["tensor_ratio"] = a / p if p > 0 else None
        out["tensor_extra_bytes"] = a - p
    basis = memory_basis(plain)
    prefix = "rss" if basis == "rss" else "tensor"
    if f"{prefix}_ratio" in out:
        out["memory_basis"] = basis
        out["memory_ratio"], out["extra_bytes"] = out[f"{prefix}_ratio"], out[f"{prefix}_extra_bytes"]
    return out


def goal_verdict(overhead: float, interval: list[float] | None, goal: float) -> str:
    """``"met"``, ``"NOT met"`` or, where the 95% interval of the overhead spans the goal,
    ``"not resolved"`` (this run cannot tell); on the point figure alone without an interval."""
    if interval is None:
        return "met" if overhead <= goal else "NOT met"
    if interval[1] <= goal:
        return "met"
    return "NOT met" if interval[0] > goal else "not resolved (its 95% interval spans the goal)"


def time_goal(entry: dict[str, Any], device: str = "cpu", arm: str = "predict=False") -> dict[str, Any] | None:
    """A model's time goal for ``arm`` (``predict=False``, or another arm held to its goal) on ``device`` (``goal``, its text: the CPU's
    fixed or relative cost, a GPU's speed ratio), the verdict (:func:`goal_verdict`), the 95%
    interval as text (``shown``) and the noise floor (``noise``, :func:`noise_floor`), from its
    results entry; None where the arm or the plain loop was not timed.

    Where the model timed a second plain loop (:data:`PLAIN_AGAIN`) and its 95% interval excludes
    zero, the protocol has an error of its own: the verdict is drawn from the overhead less that
    loop's median, over the interval of the difference taken at its ends (the arm's low end less
    the noise's high end, and the other way round), so that both uncertainties count."""
    plain, c = arm_time(entry, "plain"), (entry["arms"].get(arm) or {}).get("vs_plain", {})
    if not plain or "overhead_us" not in c:
        return None
    step = plain.get("chunk_median_us", plain.get("median_us"))
    interval = c.get("overhead_ci95_us")
    timed = entry["arms"][arm]["time"]
    refused = (timed.get("refusals") or {}).get("skipped_steps", 0)
    unsteady = (f"not resolved (the guard refused {refused} of its {timed['steps']} timed steps)"
                if refused and refused > REFUSED_SHARE_LIMIT * timed["steps"] else None)
    overhead, raw = c["overhead_us"], interval
    noise = noise_floor(entry)
    taken_off = noise is not None and interval is not None and noise["ci95_us"] is not None and not (
        noise["ci95_us"][0] <= 0.0 <= noise["ci95_us"][1])
    if taken_off:  # the protocol's own error, detected: taken off, and its uncertainty added to the arm's
        overhead = overhead - noise["median_us"]
        interval = [interval[0] - noise["ci95_us"][1], interval[1] - noise["ci95_us"][0]]

    def said(relative: bool) -> str:
        def fmt(v: float) -> str:
            return f"{100 * v / step:+.1f}%" if relative else f"{v:+.0f} µs"
        if raw is None:
            return ""
        out = (f", 95% interval {100 * raw[0] / step:+.1f}…{100 * raw[1] / step:+.1f}%" if relative
               else f", 95% interval {raw[0]:+.0f}…{raw[1]:+.0f} µs")
        if taken_off:
            out += (f"; less the noise floor (two identical plain loops differed by {fmt(noise['median_us'])}): "
                    f"{fmt(overhead)} [{fmt(interval[0])}, {fmt(interval[1])}]")
        return out
    if device.startswith("cuda"):
        return dict(goal=f"≥ {GOAL_GPU_SPEED:.2f}× the plain loop's speed", step_us=step, shown=said(True),
                    noise=noise,
                    verdict=unsteady or goal_verdict(overhead, interval, (1 / GOAL_GPU_SPEED - 1) * step))
    if step >= GOAL_LONG_STEP_US:
        return dict(goal=f"≤ {100 * (GOAL_RATIO - 1):.0f}%", step_us=step, shown=said(True), noise=noise,
                    verdict=unsteady or goal_verdict(overhead, interval, (GOAL_RATIO - 1) * step))
    return dict(goal=f"≤ {GOAL_FIXED_US:.0f} µs", step_us=step, shown=said(False), noise=noise,
                verdict=unsteady or goal_verdict(overhead, interval, GOAL_FIXED_US))


def arm_time(entry: dict[str, Any], arm: str) -> dict[str, Any]:
    """The time figures of ``arm`` in a model's results entry (``{}`` where it was not timed)."""
    return (entry["arms"].get(arm) or {}).get("time") or {}


def noise_floor(entry: dict[str, Any]) -> dict[str, Any] | None:
    """The second plain loop's paired difference from the plain loop (:data:`PLAIN_AGAIN`,
    :func:`paired_overhead`: ``median_us``, ``ci95_us``) in a model's results entry; None where
    it was not timed."""
    again, plain = arm_time(entry, PLAIN_AGAIN), arm_time(entry, "plain")
    return None if not again or not plain else paired_overhead(plain, again)


def over_lean_calls(arms: dict[str, Any]) -> tuple[float, dict[str, Any] | None] | None:
    """(what the plain loop's two calls made leaner save against it, in µs; ``predict=False``'s
    paired overhead over that lean loop, :func:`paired_overhead`) from a model's arms; None
    where the lean loop was not timed."""
    lean = arms.get(LEAN_PLAIN) or {}
    if not lean.get("time") or "overhead_us" not in lean.get("vs_plain", {}):
        return None
    return lean["vs_plain"]["overhead_us"], paired_overhead(lean["time"], arms["predict=False"]["time"])


def goal_lines(results: dict[str, Any]) -> list[str]:
    """The time goals of ``results``' device, model by model, from the ``predict=False`` arm and the guard floor."""
    device = results.get("device", "cpu")
    on_gpu = device.startswith("cuda")
    goals = (f"at least {GOAL_GPU_SPEED:.2f}× the plain loop's speed (an overhead of at most "
             f"{100 * (1 / GOAL_GPU_SPEED - 1):.1f}% of its step)" if on_gpu else
             f"at most {GOAL_FIXED_US:.0f} µs per step, and at most {100 * (GOAL_RATIO - 1):.0f}% where the plain step "
             f"takes {GOAL_LONG_STEP_US / 1000:.0f} ms or more")
    out = [f"Time goals (`predict=False` over the plain loop, {'a GPU' if on_gpu else 'a CPU'}): "
           f"{goals}; the "
           "overhead is the median of the round-by-round differences of chunk means, with its 95% interval "
           "(distribution-free, the sign test's) where the run has one (timed in several runs: the median of the "
           "runs' overheads, the interval over runs); the guard floor (the plain loop plus the "
           "gradient norm and its read, the least a per-step NaN guard does) beside it, and the overhead over the "
           "plain loop making its two calls as the trainer does (gradients set to None, the update without torch's "
           "profiler scope; `hybrid_trainer.optimizer_call`), which is what the trainer costs beyond what it saves "
           "there:", ""]
    for model, r in results["models"].items():
        goal = time_goal(r, device)
        if goal is None:
            continue
        c, step = r["arms"]["predict=False"]["vs_plain"], goal["step_us"]
        floor = r["arms"].get(GUARD_FLOOR, {}).get("vs_plain", {}).get("overhead_us")
        floor_text = "" if floor is None else f"; guard floor {floor:+.0f} µs ({100 * floor / step:+.1f}%)"
        lean_text = ""
        lean = over_lean_calls(r["arms"])
        if lean is not None and lean[1] is not None:
            saved, paired = lean
            ci = paired["ci95_us"]
            lean_text = (f"; over the plain loop without profiler scopes ({saved:+.0f} µs against the plain loop): "
                         f"{paired['median_us']:+.0f} µs" + ("" if ci is None else f" [{ci[0]:+.0f}, {ci[1]:+.0f}]"))
        noise = goal["noise"]
        noise_text = "" if noise is None else (
            f"; a second plain loop (the noise floor) {noise['median_us']:+.0f} µs "
            f"({100 * noise['median_us'] / step:+.1f}%)" + ("" if noise["ci95_us"] is None else
                                                            " [{:+.0f}, {:+.0f}]".format(*noise["ci95_us"])))
        by_run = c.get("overhead_run_medians_us")
        runs_text = "" if not by_run else (
            f"; run by run {', '.join(f'{v:+.0f}' for v in by_run)} µs"
            + ("" if noise is None or not noise.get("run_medians_us") else
               f" (noise floor {', '.join(f'{v:+.0f}' for v in noise['run_medians_us'])})"))
        refused = r["arms"]["predict=False"]["time"].get("refusals") or {}
        refused_text = ("" if not refused.get("skipped_steps") else
                        f"; while timed the guard refused {refused['skipped_steps']} steps, rolling back "
                        f"{refused['divergence_rollbacks']} times")
        b = r.get("breakdown")
        own_text = ""
        if b and b.get("own_over_plain_us") is not None:
            own_text = (f"; its own time over the plain loop's outside forward, backward and optimizer, part by "
                        f"part (below; what it saves inside them not counted): {b['own_over_plain_us']:+.0f} µs, "
                        f"{100 * b['own_over_plain_us'] / b['plain_step_us']:+.1f}% of the plain step")
        elif b:
            own_text = (f"; its own time part by part (below) {b['own_us']:.0f} µs, "
                        f"{100 * b['own_us'] / b['step_us']:.1f}% of its step")
        out.append(f"- {model}: {c['overhead_us']:+.0f} µs ({100 * (c['time_ratio'] - 1):+.1f}%{goal['shown']}), "
                   f"goal {goal['goal']}: {goal['verdict']}{runs_text}{noise_text}{floor_text}{lean_text}{own_text}"
                   f"{refused_text}")
        replayed = time_goal(r, device, CUDA_GRAPH) if on_gpu else None
        if replayed is not None:  # the same goal, for the trainer's steady step replayed from a CUDA graph
            g = r["arms"][CUDA_GRAPH]["vs_plain"]
            out.append(f"- {model}, its steady step replayed from a CUDA graph (`{CUDA_GRAPH}`): {g['overhead_us']:+.0f} "
                       f"µs ({100 * (g['time_ratio'] - 1):+.1f}%{replayed['shown']}), goal {replayed['goal']}: "
                       f"{replayed['verdict']}")
    return out


def arms_to_measure(timed: list[str] | None, device: torch.device) -> list[str]:
    """The arms whose memory a run measures: every arm of :data:`ARMS` in a full run; with
    ``--arms`` (``timed``), whose memory figures it keeps, only the opt-in configs it names, on
    CUDA: a replayed step's graph keeps a memory pool of its own, which no kept arm shows (on a CPU
    that arm steps as ``predict=False`` does)."""
    if timed is None:
        return list(ARMS)
    return [a for a in timed if a in OPT_IN_CONFIGS and device.type == "cuda"]


def keep_untimed_arms(old: dict[str, Any], entry: dict[str, Any], timed: list[str]) -> None:
    """``--arms``: fill ``entry`` (a model's results from this run, holding the time figures of
    the arms it timed, ``timed``) from ``old`` (the model's entry in the existing results file):
    the time figures of every other arm, each with the chunk means and median of the plain loop
    of the run that timed it (``plain_chunk_means_us``, ``plain_median_us``: it is taken against
    that loop's rounds, not this run's) and that run (``time_run``); and the model's memory
    figures, breakdown and exploration, with the run that measured them (``memory_run``)."""
    old_plain = old["arms"]["plain"]["time"]
    for arm, figures in old["arms"].items():
        if arm != "plain" and arm not in timed and figures.get("time"):
            kept = dict(figures["time"])
            kept.setdefault("plain_chunk_means_us", old_plain["chunk_means_us"])
            kept.setdefault("plain_median_us", old_plain["median_us"])
            kept.setdefault("time_run", old.get("time_run") or old["run"])
            if kept.get("runs") and old_plain.get("runs"):  # --runs: each run beside its own run's plain loop
                kept["runs"] = [dict(r, plain_chunk_means_us=r.get("plain_chunk_means_us", p["chunk_means_us"]))
                                for r, p in zip(kept["runs"], old_plain["runs"])]
            entry["arms"].setdefault(arm, {})["time"] = kept
        for key in ("memory", "tensors"):
            if figures.get(key):
                entry["arms"].setdefault(arm, {})[key] = figures[key]
    for key in ("breakdown", "exploration"):
        if old.get(key):
            entry[key] = old[key]
    entry["memory_run"] = old.get("memory_run") or old["run"]
    entry["arms"] = {arm: entry["arms"][arm] for arm in [*old["arms"], *entry["arms"]]}  # the table's order as before


def _kept_said(results: dict[str, Any]) -> list[str]:
    """Where figures kept by ``--arms`` came from, model by model, for the markdown."""
    lines = []
    for model, r in results["models"].items():
        if not r.get("memory_run"):
            continue
        said = lambda run: f"`{run['command']}` at {run['date']}, commit {(run['git']['commit'] or '?')[:10]}"  # noqa: E731
        kept: dict[str, list[str]] = {}  # run -> the arms it timed
        for arm, a in r["arms"].items():
            if (a.get("time") or {}).get("time_run"):
                kept.setdefault(said(a["time"]["time_run"]), []).append(arm)
        timed = [arm for arm, a in r["arms"].items() if a.get("time") and not a["time"].get("time_run")]
        own = r.get("memory_of_this_run") or []
        lines.append(f"{model}: this run timed {', '.join(timed)}"
                     + (f" and measured the memory of {', '.join(own)}" if own else "")
                     + f"; {'other ' if own else ''}memory figures, breakdown and exploration from "
                     f"{said(r['memory_run'])}"
                     + "".join(f"; {', '.join(arms)}: timed by {run}, each against that run's plain loop"
                               for run, arms in kept.items()) + ".")
    return lines + [""] if lines else []


def _mb(n: float | None) -> str:
    return "–" if n is None else f"{n / 1e6:.1f}"


def _pairs_said(results: dict[str, Any]) -> str:
    """How the arms of the models timed in pairs with the plain loop were interleaved, for the
    markdown ('' where none was)."""
    paired = [m for m, r in results["models"].items()
              if arm_time(r, "plain").get("in_pairs")]
    if not paired:
        return ""
    return (f"; {', '.join(paired)}: each arm timed beside the plain loop alone, one pair after another, and "
            "taken against the plain loop's chunks of its own rounds, so that an arm idles one chunk between its "
            "chunks, not one per other arm (its snapshots still come twice as far apart as in a run)")


def _runs_said(results: dict[str, Any]) -> str:
    """How the models timed in several fresh processes (``--runs``) were, for the markdown ('' where
    none was): the runs, and the host's speed across their starts."""
    said = []
    for model, r in results["models"].items():
        runs = arm_time(r, "plain").get("runs")
        if not runs:
            continue
        machines = (r.get("run") or {}).get("run_machines") or []
        speed = "" if not machines else (
            f", a Python loop step {min(m['python_ns'] for m in machines):.0f}–{max(m['python_ns'] for m in machines):.0f} "
            f"ns and one thread's read {min(m['read_gb_s'] for m in machines):.1f}–"
            f"{max(m['read_gb_s'] for m in machines):.1f} GB/s at their starts")
        said.append(f"{model}: {len(runs)} runs{speed}")
    if not said:
        return ""
    return ("; timed in several runs, each in a fresh process, one after another (--runs; " + "; ".join(said)
            + "): the overhead is the median of the runs' own and its 95% interval is over runs (the runs' least "
            "and greatest for 6 to 8), so that what differs between processes, which the rounds of one cannot "
            "show, counts")


def _settle_said(results: dict[str, Any]) -> str:
    """Why a chunk's first steps went untimed, for the markdown ('' where no model's did)."""
    if not any(arm_time(r, "plain").get("settle") for r in results["models"].values()):
        return ""
    return ("; the first steps of each chunk, or of each slice, untimed in every arm alike, as they pay for the "
            "switch of arms rather than for the arm")


def _chunks_said(results: dict[str, Any]) -> str:
    """The timed steps per chunk of the models' runs, e.g. ``50 timed steps (mlp-50m: 1 untimed + 50)``."""
    said = {}
    for model, r in results["models"].items():
        t = arm_time(r, "plain")
        if "chunk" in t:
            settle = t.get("settle", 0)
            if t.get("slices", 1) > 1:
                said[model] = (f"{t['chunk'] - settle} timed steps in {t['slices']} slices between the other arms' "
                               f"(--slices)" + (f", each after {settle} untimed" if settle else ""))
            else:
                said[model] = (f"{settle} untimed + {t['chunk'] - settle}" if settle else f"{t['chunk']}") + " timed steps"
    common = max(set(said.values()), key=list(said.values()).count, default="? timed steps")
    others = [f"{m}: {v}" for m, v in said.items() if v != common]
    return common + (f" ({'; '.join(others)})" if others else "")


_CUDA_MEMORY_SAID = ("Memory, each arm in a fresh process: the peak of the device's caching allocator "
                     "(`torch.cuda.max_memory_allocated`) above its level after data loading, so what the trainer "
                     "keeps in host memory (its good-state snapshot, pinned) is not in it; the last column counts "
                     "the trainer's tensors wherever they live. The RSS columns hold the device figure; no tensor "
                     "peak on CUDA (the allocator's peak is exact). Ratios = trainer / plain.")


def _machine_said(machine: dict[str, Any] | None, after: dict[str, Any] | None = None) -> str:
    """The host's speed (:func:`bench.protocol.machine_speed`) as a clause, empty for results
    from before it was recorded: figures from hosts that differ in it are not comparable.
    ``after``: the speed measured again once the model's arms were timed, said beside it."""
    if not machine:
        return ""
    python_after = "" if not after else f" ({after['python_ns']:.0f} ns after the timing)"
    read_after = "" if not after else f" ({after['read_gb_s']:.1f} after)"
    return (f", on {machine['cpu']} ({machine['cores']} cores; a Python loop step {machine['python_ns']:.0f} ns"
            f"{python_after}, one thread reads {machine['read_gb_s']:.1f} GB/s{read_after})")


def markdown(results: dict[str, Any]) -> str:
    runs = {json.dumps(r["run"], sort_keys=True) for r in results["models"].values() if "run" in r}
    if len(runs) > 1:  # merged from several invocations: say which model came from which
        results = dict(results, command="; ".join(sorted({r["run"]["command"] for r in results["models"].values()
                                                           if "run" in r})))
    fused = " (fused)" if (results.get("settings") or {}).get("adamw", {}).get("fused") else ""
    on_gpu = str(results.get("device", "cpu")).startswith("cuda")
    # One model from one run: the header says the host's speed after its timing too (with more
    # models each has its own, said in the Runs line).
    only = list(results["models"].values())
    single_after = (only[0].get("run") or {}).get("machine_after_time") if len(only) == 1 else None
    lines = [f"Trainer overhead over the plain AdamW{fused} loop, `{results['command']}` ({results['date']}, commit "
             f"{(results['git']['commit'] or '?')[:10]}{' + uncommitted changes' if results['git']['dirty'] else ''}, "
             f"torch {results['torch']}, {results.get('gpu') or results['device']}, {results['threads']} thread(s)"
             f"{_machine_said(results.get('machine'), single_after)}).", "",
             f"Time: median over chunks of {_chunks_said(results)} of the chunk's mean step (each chunk's timed "
             "steps span one good-state period, so each pays one snapshot); "
             "overhead: median over rounds of the arm's chunk mean minus the plain loop's in the same round, with a "
             f"distribution-free 95% interval{_runs_said(results)}; "
             "arms interleaved chunk by chunk, in one process (models ≤ 5M parameters) or each in a "
             f"process of its own (larger{_pairs_said(results)}){_settle_said(results)}; arms with prediction timed once it is off; ratio = (plain step + overhead) / plain step. Real steps: the trainer's non-predicted "
             "steps. " + (_CUDA_MEMORY_SAID if on_gpu else
             "Memory, each arm in fresh processes: peak RSS above the baseline after data loading (what a "
             "user meets: tensors, Python objects, allocator slack), and the exact peak of live tensor bytes "
             "(every allocation and free of torch's CPU allocator, summed in time order from before the model is "
             "built: weights, gradients, optimizer state, activations and whatever the trainer adds); ratios = "
             "trainer / plain. The memory ratio is the RSS one where the plain loop's peak RSS is at least "
             f"{RSS_RESOLVES_BYTES / 1e6:.0f} MB, the tensor one below (basis R or T): one arm's peak RSS moves "
             "by several MB between runs, more than the 3% the goal allows of a smaller peak."), "",
             "| model | params | arm | step (µs) | overhead (µs) [95% interval] | ratio | real-step ratio | "
             f"{'peak device memory' if on_gpu else 'peak RSS'} (MB) | "
             "RSS ratio | tensor peak (MB) | tensor ratio | memory ratio (basis) | extra (MB) | trainer tensors (MB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    if len(runs) > 1:
        lines[1:1] = ["Runs: " + "; ".join(f"{m}: `{r['run']['command']}` at {r['run']['date']}, commit "
                                           f"{(r['run']['git']['commit'] or '?')[:10]}"
                                           f"{_machine_said(r['run'].get('machine'), r['run'].get('machine_after_time'))}"
                                           for m, r in results["models"].items() if "run" in r), ""]
    lines[1:1] = _kept_said(results)
    timed_elsewhere = {m: r["time_run"] for m, r in results["models"].items() if r.get("time_run")}
    if timed_elsewhere:
        per_step = [m for m in timed_elsewhere
                    if any(a.get("time") and "chunk_median_us" not in a["time"] for a in results["models"][m]["arms"].values())]
        lines[1:1] = ["Time figures (and breakdowns) of " + "; ".join(
            f"{m}: from `{t['command']}` at {t['date']}, commit {(t['git']['commit'] or '?')[:10]}"
            for m, t in timed_elsewhere.items()) + " (this run measured memory only)"
            + (f"; that run's step time for {', '.join(per_step)} is the median single step (it predates the chunk "
               "medians), and arms it did not have are untimed (–)" if per_step else "") + ".", ""]
    for model, r in results["models"].items():
        for arm, a in r["arms"].items():
            c = a.get("vs_plain", {})
            t = a.get("time") or {}
            held = (a.get("memory") or {}).get("trainer_tensor_bytes", {}).get("total")
            fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
            basis = {"rss": " R", "tensors": " T"}.get(c.get("memory_basis"), "")
            step_us = t.get("chunk_median_us", t.get("median_us"))
            ci = c.get("overhead_ci95_us")
            interval = "" if not ci else f" [{ci[0]:+.0f}, {ci[1]:+.0f}]"
            lines.append(f"| {model} | {r['parameters'] / 1e6:.2f}M | {arm} | {fmt(step_us, '.0f')} | "
                         f"{fmt(c.get('overhead_us'), '+.0f')}{interval} | {fmt(c.get('time_ratio'), '.3f')} | "
                         f"{fmt(c.get('real_step_ratio'), '.3f')} | {_mb((a.get('memory') or {}).get('training_bytes'))} | "
                         f"{fmt(c.get('rss_ratio'), '.3f')} | {_mb((a.get('tensors') or {}).get('tensor_peak_bytes'))} | "
                         f"{fmt(c.get('tensor_ratio'), '.3f')} | {fmt(c.get('memory_ratio'), '.3f')}{basis} | "
                         f"{_mb(c.get('extra_bytes'))} | {_mb(held)} |")
    lines += ["", *goal_lines(results), *exploration_lines(results)]
    for model, r in results["models"].items():
        b = r.get("breakdown")
        if b:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in b["parts_us"].items())
            nested = [k for k in NESTED_PARTS if k in b["parts_us"]]
            run = b.get("run")
            lines.append(f"- {model} / {b['arm']}: step {b['step_us']:.0f} µs, of which the trainer's own "
                         f"{b['own_us']:.0f} µs ({100 * b['own_us'] / b['step_us']:.1f}%: step minus forward, "
                         f"backward and optimizer{' plus ' + ' and '.join(nested) if nested else ''}); µs per step "
                         f"over {b['steps']} steps: {parts}"
                         + ("" if b.get("plain_own_us") is None else
                            f"; the plain loop, timed in turn: step {b['plain_step_us']:.0f} µs, of which "
                            f"{b['plain_own_us']:.0f} µs outside forward, backward and optimizer (`zero_grad`, the "
                            f"loop), so the trainer's own over it {b['own_over_plain_us']:+.0f} µs")
                         + (f" (from `{run['command']}` at {run['date']}, commit {(run['git']['commit'] or '?')[:10]}"
                            f"{_machine_said(run.get('machine'), None)})" if run else ""))
    if any(r.get("breakdown") for r in results["models"].values()):
        lines.insert(len(lines) - sum(1 for r in results["models"].values() if r.get("breakdown")),
                     "\nWhere a step's time goes (each part timed by wrapping it, one arm alone):\n")
    lines += ["", "Trainer tensors: bytes the trainer holds in tensors beyond the model, its gradients and the "
              "optimizer state, at the end of the memory run (`hybrid_trainer.footprint`), by holder:", ""]
    for model, r in results["models"].items():
        for arm, a in r["arms"].items():
            held = (a.get("memory") or {}).get("trainer_tensor_bytes")
            if held:
                parts = ", ".join(f"{k} {_mb(v)}" for k, v in sorted(held["by_holder"].items(), key=lambda kv: -kv[1])
                                  if v >= 1e4)
                lines.append(f"- {model} / {arm}: {_mb(held['total'])} MB ({parts or 'nothing over 10 kB'})")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few steps (tests)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per arm before timing")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per arm")
    parser.add_argument("--chunk", type=int, default=None,
                        help=f"steps per arm per interleaving round ({PERIOD}, one good-state period; {BIG_CHUNK} "
                             f"for models above {IN_PROCESS_PARAMS // 1_000_000}M parameters, the first untimed)")
    parser.add_argument("--slices", type=int, default=1,
                        help="step the arms in turn this many times a round, chunk/slices steps each, so that each "
                             "arm's chunk (still one period of its own steps) spans the same stretch of the round as "
                             "the others' (a divisor of the chunk; above "
                             f"{IN_PROCESS_PARAMS // 1_000_000}M parameters of its {PERIOD} timed steps, each slice "
                             "after an untimed step of its own)")
    parser.add_argument("--runs", type=int, default=1,
                        help="time each model this many times, each run in a fresh process, one after another (each "
                             "--steps long): the overhead is then the median of the runs' and its 95%% interval is "
                             "over runs (at least 6 for one), so that what differs between processes counts")
    parser.add_argument("--memory-steps", type=int, default=None, help="steps per memory run (fresh process)")
    parser.add_argument("--batches", type=int, default=None,
                        help=f"distinct batches, cycled (64; for models above {IN_PROCESS_PARAMS // 1_000_000}M "
                             f"parameters as many as an arm steps, at least {BIG_BATCHES}; by model: {MODEL_BATCHES})")
    parser.add_argument("--explore-steps", type=int, default=None,
                        help="most steps of the default config's run from its first step until prediction is off "
                             "(0: none)")
    parser.add_argument("--breakdown-steps", type=int, default=None,
                        help="steps of the predict=False arm timed part by part (models under 5M parameters; 0: none)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other models of an existing results file (each model records its own run)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    parser.add_argument("--memory-only", action="store_true",
                        help="measure memory only; the in-process time figures (and breakdown) of each model are kept "
                             "from the existing results file, which records the run they came from")
    parser.add_argument("--breakdown-only", action="store_true",
                        help="time the predict=False arm part by part only (any model size; "
                             f"{BIG_BREAKDOWN_STEPS} steps above {IN_PROCESS_PARAMS // 1_000_000}M parameters) and "
                             "keep each model's other figures from the existing results file")
    timeable = [a for a in [*ARMS, *TIMED_ONLY, *OPT_IN] if a != "plain"]
    parser.add_argument("--arms", nargs="+", default=None, metavar="ARM",
                        help="time only these arms beside the plain loop and keep the model's other figures (other "
                             f"arms' times, memory, breakdown, exploration) from the existing results file; of {timeable}")
    parser.add_argument("--fused-adamw", action="store_true",
                        help="AdamW(fused=True) in every arm, the plain loop's too (results named *_fused): on a GPU "
                             "the trainer's guard then reads nothing back between its block reads")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "ARM"), help=argparse.SUPPRESS)
    parser.add_argument("--child-measure", default="rss", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.chunk_given, args.batches_given = args.chunk is not None, args.batches is not None
    args.batches = args.batches if args.batches_given else 64
    args.chunk = args.chunk if args.chunk_given else PERIOD
    try:
        _check_slices(args.chunk, 0, args.slices)  # before any model is built
    except ValueError as error:
        parser.error(f"--{error}")
    if args.runs < 1:
        parser.error(f"--runs: at least 1, got {args.runs}")
    if args.runs > 1 and (args.memory_only or args.breakdown_only):
        parser.error("--runs repeats the timing; --memory-only and --breakdown-only time nothing")
    device = torch.device(args.device)
    if args.fused_adamw:
        os.environ[FUSED_ENV] = "1"  # read by adamw_options, here and in every child
    if args.child:
        print(json.dumps(memory_child(*args.child, args.device, args.memory_steps, args.batches, args.child_measure)))
        return 0
    if os.environ.get("TRITON_INTERPRET") == "1" and device.type == "cpu":
        os.environ.pop("TRITON_INTERPRET")  # children get the eager kernels; interpreted ones would distort time
    # A CPU times the eager path, the CPU product (the Triton interpreter is a test tool); a GPU
    # the kernels a user gets there ("auto": Triton for CUDA tensors). Children inherit it.
    os.environ.setdefault("HYBRID_KERNELS_BACKEND", "eager" if device.type == "cpu" else "auto")
    from tqdm import tqdm

    torch.set_num_threads(1)
    models = args.models or (["tiny", "small"] if args.quick else ["tiny", "mlp-1ms", "fashion", "charlm", "mlp-50m"])
    warmup = args.warmup if args.warmup is not None else (25 if args.quick else 60)
    default_steps = 20 if args.quick else 8 * PERIOD
    explore_steps = args.explore_steps if args.explore_steps is not None else (40 if args.quick else 400)
    memory_steps = args.memory_steps if args.memory_steps is not None else (30 if args.quick else 120)
    command = "python -m bench.overhead " + shlex.join(sys.argv[1:] if argv is None else argv)
    if os.environ.get(TORCH_DOTS_ENV) == "1":  # the guard's reads through torch.dot (hybrid_trainer.blas_dots)
        command = f"{TORCH_DOTS_ENV}=1 {command}"
    meta = run_metadata(command)
    results: dict[str, Any] = dict(meta, git=dict(commit=meta["git_commit"], dirty=meta["git_dirty"]), device=str(device),
                                   gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                                   host=platform.node(), machine=machine_speed(), threads=torch.get_num_threads(),
                                   models={},
                                   settings=dict(warmup=warmup, steps=args.steps or default_steps,
                                                 model_steps=None if args.quick or args.steps else MODEL_STEPS,
                                                 chunk=args.chunk, slices=args.slices, runs=args.runs,
                                                 explore_steps=explore_steps,
                                                 memory_steps=memory_steps, batches=args.batches,
                                                 model_batches=None if args.batches_given else MODEL_BATCHES,
                                                 adamw=adamw_options()))
    suffix = (("_quick" if args.quick else "") + ("" if device.type == "cpu" else f"_{device.type}")
              + ("_fused" if args.fused_adamw else ""))
    existing = args.out / f"overhead{suffix}.json"
    previous = json.loads(existing.read_text())["models"] if existing.exists() else {}
    untimed = [m for m in models if m not in previous]
    if args.memory_only and untimed:
        parser.error(f"--memory-only keeps the time figures of {existing}, which lacks {untimed}")
    if args.breakdown_only and (args.memory_only or args.arms is not None):
        parser.error("--breakdown-only keeps every figure but the breakdown; not with --memory-only or --arms")
    if args.breakdown_only and untimed:
        parser.error(f"--breakdown-only keeps the other figures of {existing}, which lacks {untimed}")
    if args.arms is not None:
        unknown = [a for a in args.arms if a not in timeable]
        if unknown:
            parser.error(f"--arms: unknown arm(s) {unknown}; of {timeable}")
        if args.memory_only:
            parser.error("--arms times arms and keeps the memory figures; --memory-only does the opposite")
        if untimed:
            parser.error(f"--arms keeps the other figures of {existing}, which lacks {untimed}")
    for name in models:
        workload = make_workload(name, args.batches if args.batches_given else MODEL_BATCHES.get(name, args.batches),
                                 device)
        n_params = sum(p.numel() for p in workload.make_model(0).parameters())
        big = n_params > IN_PROCESS_PARAMS
        if big:
            chunk = args.chunk if args.chunk_given else BIG_CHUNK
            settle = BIG_SETTLE if chunk > BIG_SETTLE else 0
        else:  # an explicit --chunk is timed from its first step
            chunk, settle = (args.chunk, 0) if args.chunk_given else (SMALL_SETTLE + PERIOD, SMALL_SETTLE)
        if big and not args.batches_given:
            workload = make_workload(name, big_batches(
                args.warmup if args.warmup is not None else BIG_WARMUP, explore_steps,
                args.steps if args.steps is not None else BIG_STEPS, chunk, settle, args.slices), device)
        if args.breakdown_only:  # the model's other figures as the run that measured them left them
            parts_steps = args.breakdown_steps or (BIG_BREAKDOWN_STEPS if big else 300)
            parts_warmup = args.warmup if args.warmup is not None else (BIG_WARMUP if big else warmup)
            with tqdm(total=2 * parts_steps, desc=f"{name}: breakdown", leave=False) as bar:
                entry = dict(previous[name], breakdown=breakdown(workload, "predict=False", device, parts_warmup,
                                                                 parts_steps, bar))
            entry["breakdown"]["run"] = dict(command=results["command"], date=results["date"], git=results["git"],
                                             machine=results["machine"])
            results["models"][name] = entry
            print(markdown(dict(results, models={name: entry})), flush=True)
            continue
        entry: dict[str, Any] = dict(parameters=n_params, details=workload.details, batches=len(workload.batches),
                                     arms={a: {} for a in ARMS})
        machine_after = None  # the host's speed once the arms are timed (a --memory-only run times none)
        run_machines = None  # with --runs, the host's speed at the start of each run
        if args.memory_only:  # time figures of the run that measured them, said so
            old = previous[name]
            for arm in [*ARMS, *TIMED_ONLY, *OPT_IN]:  # an arm the old run did not have stays untimed ("–")
                if (old["arms"].get(arm) or {}).get("time"):
                    entry["arms"].setdefault(arm, {})["time"] = old["arms"][arm]["time"]
            for key in ("breakdown", "exploration"):
                if old.get(key):
                    entry[key] = old[key]
            entry["time_run"] = old.get("time_run") or old["run"]
        else:
            if big:
                steps = args.steps if args.steps is not None else BIG_STEPS
                arm_warmup = args.warmup if args.warmup is not None else BIG_WARMUP
            else:
                steps = args.steps if args.steps is not None else (
                    default_steps if args.quick else MODEL_STEPS.get(name, default_steps))
                arm_warmup = warmup
            names = None if args.arms is None else ["plain", *args.arms]
            pairs = (len(ARMS) + len(TIMED_ONLY) if names is None else len(names)) - 1 if big else 1
            options = dict(warmup=arm_warmup, steps=steps, chunk=chunk, separate=big, arms=names, settle=settle,
                           until_off_max=explore_steps, in_pairs=big, slices=args.slices)
            if args.runs > 1:
                with tqdm(total=args.runs, desc=f"{name}: time, runs in fresh processes", leave=False) as bar:
                    done = time_in_fresh_processes(workload, device, args.runs, bar, **options)
                timed, run_machines = pool_runs([d["timed"] for d in done]), [d["machine"] for d in done]
            else:
                with tqdm(total=pairs * -(-steps // (chunk - settle)), desc=f"{name}: time", leave=False) as bar:
                    timed = time_interleaved(workload, device, progress=bar, **options)
            for arm, t in timed.items():
                if names is not None and arm != "plain":  # beside kept arms, each against its own run's plain loop
                    t.setdefault("plain_chunk_means_us", timed["plain"]["chunk_means_us"])
                    for run, plain_run in zip(t.get("runs", []), timed["plain"].get("runs", [])):
                        run.setdefault("plain_chunk_means_us", plain_run["chunk_means_us"])
                entry["arms"].setdefault(arm, {})["time"] = t
            # The host's speed again once the arms are timed: this project's CI hosts drift within the
            # hour (a Python loop step 37 ns in one run, 64 ns in the next), and the run's start says
            # nothing of a drift during its timing.
            machine_after = machine_speed()
            if names is not None:
                keep_untimed_arms(previous[name], entry, args.arms)
            parts_steps = args.breakdown_steps if args.breakdown_steps is not None else (10 if args.quick else 300)
            if parts_steps and not big and names is None:
                with tqdm(total=2 * parts_steps, desc=f"{name}: breakdown", leave=False) as bar:
                    entry["breakdown"] = breakdown(workload, "predict=False", device, warmup, parts_steps, bar)
        if not args.memory_only and args.arms is None and explore_steps:
            with tqdm(total=-(-explore_steps // chunk), desc=f"{name}: until prediction is off", leave=False) as bar:
                entry["exploration"] = exploration(workload, device, explore_steps, chunk, bar, separate=big,
                                                   settle=settle)
        n_batches = len(workload.batches)
        del workload
        gc.collect()
        big_memory_steps = min(memory_steps, 60) if big else memory_steps
        memory_arms = arms_to_measure(args.arms, device)
        if args.arms is not None and memory_arms:
            entry["memory_of_this_run"] = memory_arms
        for arm in tqdm(memory_arms, desc=f"{name}: memory", leave=False):
            entry["arms"][arm]["memory"] = run_memory_child(name, arm, args.device, big_memory_steps, n_batches)
            if device.type == "cpu":  # on CUDA the allocator's own peak is exact already
                entry["arms"][arm]["tensors"] = run_memory_child(name, arm, args.device, big_memory_steps, n_batches,
                                                                 measure="tensors")
        plain = entry["arms"]["plain"]
        for arm, a in entry["arms"].items():
            if arm != "plain":
                a["vs_plain"] = compare(plain, a)
        entry["run"] = dict(command=results["command"], date=results["date"], git=results["git"],
                            machine=results["machine"])
        if machine_after is not None:
            entry["run"]["machine_after_time"] = machine_after
        if run_machines is not None:  # --runs: the host's speed at each run's start
            entry["run"]["run_machines"] = run_machines
        results["models"][name] = entry
        print(markdown(dict(results, models={name: entry})), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge and previous:
        kept = {k: v for k, v in previous.items() if k not in results["models"]}
        results["models"] = {**kept, **results["models"]}
    (args.out / f"overhead{suffix}.json").write_text(json.dumps(results, indent=1))
    (args.out / f"overhead{suffix}.md").write_text(markdown(results))
    print(f"wrote {args.out}/overhead{suffix}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

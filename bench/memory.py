"""Memory benchmark on CPU: gradient checkpointing, compact update history, and no leak.

    python -m bench.memory [--quick] [--out docs/results]

All three parts run in one invocation on real data:

a. **Gradient checkpointing** on the benchmark transformer (``bench.tasks`` charlm, full-size
   config, its batch size), every ``GPTBlock`` checkpointed vs none, on the same model and batch:

   * activation bytes, two precise counts taken during one forward (graph alive, before backward):
     - *profiler*: net bytes allocated by the CPU allocator during the forward and still live at
       its end (``torch.profiler`` with ``profile_memory=True``, summed over all events): every
       activation kept for backward, whoever holds it, plus the logits and the loss;
     - *saved tensors*: bytes of the distinct storages autograd saves for backward
       (``saved_tensors_hooks``) plus the block inputs that checkpointing keeps for its
       recomputation, parameters excluded;
   * peak RSS increase of one fwd+bwd step, each variant in a fresh subprocess (the peak is reset
     through ``/proc/self/clear_refs`` after the data are loaded), a secondary, noisier figure;
   * compute overhead: median fwd+bwd step time, variants interleaved step by step.
b. **Compact history**: bytes of the predictor's update history (``direction="linear"``, K =
   ``HybridConfig.history_size`` updates, int8 per 256-element block through
   ``hybrid_kernels.quantize_int8``) vs the same history in fp32, for the charlm model, and the
   relative L2 round-trip error of a real AdamW update recorded by the predictor.
c. **No leak**: plain AdamW and HybridTrainer on the digits task, advanced in interleaved chunks in
   one process. Process RSS (psutil) is read before and after every chunk; the growth charged to an
   arm is the sum of its own chunks' RSS changes after its warm-up chunks. Criterion:
   ``growth_hybrid - growth_plain <= 0.01 * rss_end`` (``rss_end``: process RSS at the end). Every
   parameter's ``data_ptr`` is compared with its original after every step of every arm; a change
   is a reallocation and must never happen (updates are in place). With the defaults the trainer
   may switch prediction off early on this task, so a third arm, ``hybrid_always_predict`` (give-up
   rules disabled), keeps the PREDICT path running for the whole run under the same criterion.

Kernels run through their eager PyTorch reference (``HYBRID_KERNELS_BACKEND=eager``); the benchmark
refuses to run with ``TRITON_INTERPRET`` set (interpreted kernels would distort time and memory).

Output: ``<out>/memory_cpu.json``, ``memory_cpu.md`` and ``memory_cpu.png`` (``_quick`` suffix with
``--quick``).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import psutil
import torch
from tqdm import tqdm

import hybrid_kernels as hk
from hybrid_trainer import HybridConfig, HybridTrainer
from hybrid_trainer.grad_checkpoint import GradientCheckpointing
from hybrid_trainer.predictor import DeltaPredictor

from .protocol import cpu_description, run_metadata
from .tasks import GPTBlock, get_task

MB = 1e6  # figures are reported in decimal megabytes
HISTORY_BLOCK = 256  # int8 block size of the predictor's history (elements)
LEAK_DYNAMICS_HIDDEN = 64  # GRU width of the hybrid arm in the leak test (default 256), to bound time
LEAK_TOLERANCE = 0.01  # allowed extra growth of the hybrid arm, as a fraction of the final RSS


def _rss() -> int:
    """Resident set size of this process in bytes."""
    return psutil.Process().memory_info().rss


# ======================================================================= a. checkpointing ====
def _parameter_storages(model: torch.nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def saved_activation_bytes(model: torch.nn.Module, loss_fn, batch, checkpointing: GradientCheckpointing) -> int:
    """Bytes of distinct non-parameter storages kept for backward by one forward (see module doc).

    Tensors saved by autograd are seen through ``saved_tensors_hooks``; inside a checkpointed
    module the checkpoint's own (inner) hooks take them and keep nothing, and what the checkpoint
    does keep, the module's inputs, is seen through forward pre-hooks on the wrapped modules.
    """
    params = _parameter_storages(model)
    kept: dict[int, int] = {}

    def remember(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        remember(t)
        return t

    def on_input(_module, args, kwargs):
        if checkpointing.active and torch.is_grad_enabled():
            for a in list(args) + list(kwargs.values()):
                if isinstance(a, torch.Tensor):
                    remember(a)

    named = dict(model.named_modules())
    handles = [named[n].register_forward_pre_hook(on_input, with_kwargs=True) for n in checkpointing.wrapped]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_fn(model, batch)
    finally:
        for h in handles:
            h.remove()
    del loss
    return sum(kept.values())


def profiler_forward_bytes(model: torch.nn.Module, loss_fn, batch) -> int:
    """Net bytes allocated during one forward and still live at its end (graph alive)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = loss_fn(model, batch)
    net = sum(event.self_cpu_memory_usage for event in prof.events())
    del loss
    return int(net)


def _peak_rss_probe(variant: str) -> dict[str, int]:
    """Run in a fresh subprocess: peak RSS increase of fwd+bwd steps of the charlm model."""
    torch.set_num_threads(1)
    task = get_task("charlm")
    model = task.make_model(0)
    batch = next(task.batches(0))
    checkpointing = GradientCheckpointing(model, module_type=GPTBlock)
    checkpointing.active = variant == "checkpoint"
    gc.collect()
    status = Path("/proc/self/status")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    before = _rss()
    for _ in range(3):
        model.zero_grad(set_to_none=False)  # grads stay allocated: their memory is not the difference
        task.loss_fn(model, batch).backward()
    peak = int(re.search(r"VmHWM:\s+(\d+) kB", status.read_text()).group(1)) * 1024
    return {"rss_before": before, "rss_peak": peak, "peak_increase": peak - before}


def _run_probe(variant: str) -> dict[str, int] | None:
    env = dict(os.environ, OMP_NUM_THREADS="1", HYBRID_KERNELS_BACKEND="eager")
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-m", "bench.memory", "--rss-probe", variant], env=env,
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
    if done.returncode != 0:
        print(f"peak-RSS probe ({variant}) failed: {done.stderr[-500:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_checkpointing(timing_steps: int) -> dict[str, Any]:
    task = get_task("charlm")
    model = task.make_model(0)
    batch = next(task.batches(0))
    checkpointing = GradientCheckpointing(model, module_type=GPTBlock)
    variants = {"plain": False, "checkpoint_every_block": True}

    activations = {}
    for name, active in variants.items():
        checkpointing.active = active
        activations[name] = dict(saved_tensor_bytes=saved_activation_bytes(model, task.loss_fn, batch, checkpointing),
                                 profiler_forward_bytes=profiler_forward_bytes(model, task.loss_fn, batch))

    grads = {}
    for name, active in variants.items():  # the same gradients, or the comparison is void
        checkpointing.active = active
        model.zero_grad(set_to_none=True)
        task.loss_fn(model, batch).backward()
        grads[name] = [p.grad.clone() for p in model.parameters()]
    max_grad_diff = max(float((a - b).abs().max()) for a, b in zip(*grads.values()))
    del grads

    times: dict[str, list[float]] = {name: [] for name in variants}
    for step in tqdm(range(timing_steps + 2), desc="checkpointing: timing", file=sys.stderr, disable=None):
        for name, active in (variants.items() if step % 2 == 0 else reversed(variants.items())):
            checkpointing.active = active
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            task.loss_fn(model, batch).backward()
            elapsed = time.perf_counter() - start
            if step >= 2:  # the first two rounds warm up caches and the allocator
                times[name].append(elapsed)
    checkpointing.remove()

    probes = {name: _run_probe("checkpoint" if active else "plain") for name, active in variants.items()}
    medians = {name: statistics.median(t) for name, t in times.items()}
    plain, ckpt = activations["plain"], activations["checkpoint_every_block"]
    return dict(
        model=dict(task="charlm", **task.details, parameters=sum(p.numel() for p in model.parameters())),
        checkpointed=[f"blocks.{i}" for i in range(task.details["n_layers"])],
        activations=activations,
        activation_reduction_pct={key: 100.0 * (1 - ckpt[key] / plain[key]) for key in plain},
        peak_rss=probes,
        step_time_median_s=medians,
        step_time_samples=timing_steps,
        compute_overhead_pct=100.0 * (medians["checkpoint_every_block"] / medians["plain"] - 1),
        # Per-round ratios cancel load drifts that hit both variants of a round alike (the machine is shared).
        compute_overhead_pct_paired=100.0 * (statistics.median(
            c / p for c, p in zip(times["checkpoint_every_block"], times["plain"])) - 1),
        max_abs_grad_difference=max_grad_diff,
        data_source=task.data_source,
    )


# ===================================================================== b. compact history ====
def measure_history(train_steps: int) -> dict[str, Any]:
    task = get_task("charlm")
    model = task.make_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    params = [p for p in model.parameters() if p.requires_grad]
    history_size = HybridConfig().history_size
    predictor = DeltaPredictor(params, direction="linear", history_size=history_size)
    stream = task.batches(0)
    for _ in range(train_steps):
        optimizer.zero_grad(set_to_none=True)
        task.loss_fn(model, next(stream)).backward()
        before = torch.cat([p.detach().reshape(-1) for p in params])
        predictor.begin_step()
        optimizer.step()
        predictor.end_step()
    update = torch.cat([p.detach().reshape(-1) for p in params]) - before  # the last real update, fp32

    stored = predictor.state_dict()["history"]  # what the predictor actually keeps: (int8 codes, scales)
    int8_bytes = sum(c.numel() * c.element_size() + s.numel() * s.element_size() for c, s in stored)
    numel = update.numel()
    fp32_bytes = len(stored) * numel * 4
    codes, scales = stored[-1]
    restored = hk.dequantize_int8(codes, scales, "block", block_size=HISTORY_BLOCK)
    own_codes, own_scales = hk.quantize_int8(update, "block", block_size=HISTORY_BLOCK)
    own_restored = hk.dequantize_int8(own_codes, own_scales, "block", block_size=HISTORY_BLOCK)
    return dict(
        parameters=numel, history_size=len(stored), block_size=HISTORY_BLOCK, train_steps=train_steps,
        optimizer="AdamW lr=2e-3", fp32_bytes=fp32_bytes, int8_bytes=int8_bytes,
        compression_ratio=fp32_bytes / int8_bytes,
        round_trip_rel_l2=float((restored - update).norm() / update.norm()),
        round_trip_rel_l2_direct=float((own_restored - update).norm() / update.norm()),
        update_norm=float(update.norm()),
    )


# ============================================================================== c. no leak ====
def _live_tensors() -> int:
    """Tensor objects tracked by the garbage collector: a leak-proof count, unlike RSS."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on deprecated torch module attributes warns
        warnings.simplefilter("ignore")
        return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


class _LeakArm:
    """One arm of the leak test: a digits MLP trained by AdamW, plainly or through HybridTrainer."""

    def __init__(self, task, config: HybridConfig | None, seed: int):
        self.task = task
        self.model = task.make_model(seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.trainer = None if config is None else HybridTrainer(self.model, self.optimizer, task.loss_fn, config)
        self.stream = task.batches(seed)
        self.params = list(self.model.parameters())
        self.pointers = [p.data_ptr() for p in self.params]
        self.reallocations = 0
        self.steps = 0
        self.growth_after_warmup = 0
        self.rss_trace: list[tuple[int, int]] = []  # (step, process RSS after the chunk)

    def run(self, n: int) -> None:
        for _ in range(n):
            batch = next(self.stream)
            if self.trainer is None:
                self.optimizer.zero_grad(set_to_none=True)
                self.task.loss_fn(self.model, batch).backward()
                self.optimizer.step()
            else:
                self.trainer.step(batch)
            for i, p in enumerate(self.params):
                if p.data_ptr() != self.pointers[i]:
                    self.reallocations += 1
                    self.pointers[i] = p.data_ptr()  # count each reallocation once
            self.steps += 1


def measure_leak(steps: int = 2000, chunk: int = 100, warmup_chunks: int = 2,
                 dynamics_hidden: int = LEAK_DYNAMICS_HIDDEN, seed: int = 0, progress: bool = True,
                 always_predict_arm: bool = True) -> dict[str, Any]:
    """Plain AdamW vs HybridTrainer, ``steps`` steps each in interleaved chunks (see module doc).

    ``always_predict_arm`` adds a third arm, HybridTrainer with its give-up rules disabled, judged
    by the same criterion. Returns RSS figures in bytes, per-arm growth after warm-up,
    reallocation counts and the verdicts.
    """
    if steps < chunk * (warmup_chunks + 1):
        raise ValueError(f"steps={steps} leaves no chunk of {chunk} after {warmup_chunks} warm-up chunks")
    task = get_task("digits")
    configs = {"plain": None, "hybrid": HybridConfig(dynamics_hidden=dynamics_hidden)}
    if always_predict_arm:
        # With the defaults the trainer may switch prediction off early (it judges it not worth
        # it), after which its PREDICT path no longer runs; this arm keeps predicting throughout
        # so a leak on that path would show.
        configs["hybrid_always_predict"] = HybridConfig(
            dynamics_hidden=dynamics_hidden, confidence_threshold=0.0, min_predicted_worth=-1.0,
            cost_aware=False, max_consecutive_declines=10**9, max_consecutive_rejections=10**9)
    arms = {name: _LeakArm(task, config, seed) for name, config in configs.items()}
    n_chunks = math.ceil(steps / chunk)
    rss_after_warmup = tensors_after_warmup = None
    with tqdm(total=len(arms) * steps, desc="leak: plain vs hybrid", unit="step", file=sys.stderr,
              disable=None if progress else True) as bar:
        for index in range(n_chunks):
            if index == warmup_chunks:
                rss_after_warmup, tensors_after_warmup = _rss(), _live_tensors()
            for arm in arms.values():
                n = min(chunk, steps - arm.steps)
                before = _rss()
                arm.run(n)
                after = _rss()
                if index >= warmup_chunks:
                    arm.growth_after_warmup += after - before
                arm.rss_trace.append((arm.steps, after))
                bar.update(n)
    rss_end, tensors_end = _rss(), _live_tensors()
    growth = {name: arm.growth_after_warmup for name, arm in arms.items()}
    allowed = LEAK_TOLERANCE * rss_end
    hybrid_arms = {}
    for name, arm in arms.items():
        if arm.trainer is None:
            continue
        stats = arm.trainer.statistics()
        hybrid_arms[name] = dict(
            config=arm.trainer.config.to_dict(), steps_by_phase=stats["steps_by_phase"],
            predicted_steps=stats["predicted_steps"], prediction_enabled=stats["prediction_enabled"],
            prediction_disabled_reason=stats["prediction_disabled_reason"],
            extra_growth=growth[name] - growth["plain"], within_tolerance=growth[name] - growth["plain"] <= allowed)
    return dict(
        task="digits", data_source=task.data_source, steps_per_arm=steps, chunk_steps=chunk,
        warmup_steps=warmup_chunks * chunk,
        hybrid_config=hybrid_arms["hybrid"]["config"],
        hybrid_config_note=f"HybridConfig defaults except dynamics_hidden={dynamics_hidden} (default 256), "
                           "to bound the time of the run",
        rss_after_warmup=rss_after_warmup, rss_end=rss_end,
        growth_plain=growth["plain"], growth_hybrid=growth["hybrid"], growth_by_arm=growth,
        extra_growth_hybrid=growth["hybrid"] - growth["plain"],
        allowed_extra_growth=allowed,
        within_tolerance=all(h["within_tolerance"] for h in hybrid_arms.values()),
        criterion="growth_hybrid - growth_plain <= 0.01 * rss_end; growth_<arm> = sum over the arm's chunks "
                  "after warm-up of (process RSS after the chunk - before it); rss_end = process RSS at the end",
        live_tensors_after_warmup=tensors_after_warmup, live_tensors_end=tensors_end,
        reallocations={name: arm.reallocations for name, arm in arms.items()},
        reallocation_check="data_ptr() of every parameter compared with its previous value after every step",
        rss_trace={name: arm.rss_trace for name, arm in arms.items()},
        hybrid_arms=hybrid_arms,
    )


# ============================================================================== reporting ====
def markdown(result: dict) -> str:
    meta, ck, hist, leak = result["meta"], result["checkpointing"], result["history"], result["leak"]
    act = ck["activations"]
    rss = ck["peak_rss"]

    def rss_cell(name):
        return f"{rss[name]['peak_increase'] / MB:.1f}" if rss.get(name) else "n/a"

    lines = [
        f"Memory benchmark, `{meta['command']}` ({meta['date']}, {meta['device']}, torch {meta['torch']}, "
        f"{meta['threads']} thread(s), kernels: {meta['kernel_backend']}). MB = 10^6 bytes.", "",
        f"### a. Gradient checkpointing: charlm CharGPT ({ck['model']['n_layers']} blocks, d_model "
        f"{ck['model']['d_model']}, context {ck['model']['context']}, batch {ck['model']['batch_size']}, "
        f"{ck['model']['parameters']:,} parameters; {ck['data_source']})", "",
        "| variant | activations, profiler (MB) | activations, saved tensors (MB) | peak RSS increase of a "
        "step (MB) | median fwd+bwd (ms) |",
        "|---|---|---|---|---|",
    ]
    for name in ("plain", "checkpoint_every_block"):
        lines.append(f"| {name} | {act[name]['profiler_forward_bytes'] / MB:.2f} | "
                     f"{act[name]['saved_tensor_bytes'] / MB:.2f} | {rss_cell(name)} | "
                     f"{1e3 * ck['step_time_median_s'][name]:.1f} |")
    red = ck["activation_reduction_pct"]
    lines += ["", f"Activation memory −{red['profiler_forward_bytes']:.1f}% (profiler), "
                  f"−{red['saved_tensor_bytes']:.1f}% (saved tensors); compute overhead "
                  f"{ck['compute_overhead_pct']:+.1f}% (ratio of medians of {ck['step_time_samples']} interleaved steps each; "
                  f"median of per-round ratios {ck['compute_overhead_pct_paired']:+.1f}%); "
                  f"max |grad difference| {ck['max_abs_grad_difference']:.3g}. "
                  "Profiler figure: net bytes allocated during the forward and live at its end (includes logits "
                  "and loss); saved tensors: distinct non-parameter storages autograd keeps for backward plus the "
                  "inputs kept by the checkpoints; peak RSS: fresh subprocess per variant, noisier.", "",
              "### b. Compact update history (charlm model)", "",
              f"{hist['history_size']} updates of {hist['parameters']:,} parameters: fp32 "
              f"{hist['fp32_bytes'] / MB:.2f} MB vs int8 (block {hist['block_size']}) {hist['int8_bytes'] / MB:.2f} MB "
              f"({hist['compression_ratio']:.2f}× smaller). Round-trip relative L2 error of a real AdamW update "
              f"(after {hist['train_steps']} steps) as stored by the predictor: {hist['round_trip_rel_l2']:.4f}.", "",
              f"### c. No leak: {leak['steps_per_arm']} plain AdamW and {leak['steps_per_arm']} HybridTrainer steps "
              f"({leak['task']}, interleaved chunks of {leak['chunk_steps']})", "",
              f"Arm `hybrid`: {leak['hybrid_config_note']}. Arm `hybrid_always_predict` (if present): the same "
              "with the give-up rules off (confidence_threshold 0, min_predicted_worth -1, cost_aware off, no "
              "decline/rejection limit), so the PREDICT path runs throughout.", "",
              "| arm | RSS growth after warm-up (MB) | extra vs plain (MB) | parameter reallocations | phases | "
              "predicted steps |",
              "|---|---|---|---|---|---|"]
    for name, grown in leak["growth_by_arm"].items():
        h = leak["hybrid_arms"].get(name)
        phases = "–" if h is None else ", ".join(f"{k} {v}" for k, v in h["steps_by_phase"].items()) + (
            "" if h["prediction_enabled"] else " (prediction switched off by the trainer)")
        extra = "–" if h is None else f"{h['extra_growth'] / MB:+.2f}"
        predicted = "–" if h is None else h["predicted_steps"]
        lines.append(f"| {name} | {grown / MB:.2f} | {extra} | {leak['reallocations'][name]} | {phases} | {predicted} |")
    lines += ["",
              f"Process RSS {leak['rss_after_warmup'] / MB:.1f} MB after warm-up ({leak['warmup_steps']} steps per arm), "
              f"{leak['rss_end'] / MB:.1f} MB at the end; live tensors {leak['live_tensors_after_warmup']} → "
              f"{leak['live_tensors_end']}. Criterion `{leak['criterion']}` (each hybrid arm): allowed "
              f"{leak['allowed_extra_growth'] / MB:.2f} MB → **{'pass' if leak['within_tolerance'] else 'FAIL'}**; "
              f"reallocations must be 0 → **{'pass' if not any(leak['reallocations'].values()) else 'FAIL'}**."]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ck, leak = result["checkpointing"], result["leak"]
    fig, (ax_act, ax_rss) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = ["plain", "checkpoint_every_block"]
    width = 0.38
    for i, (key, label) in enumerate((("profiler_forward_bytes", "profiler"), ("saved_tensor_bytes", "saved tensors"))):
        values = [ck["activations"][n][key] / MB for n in names]
        ax_act.bar([j + (i - 0.5) * width for j in range(2)], values, width, label=label)
    ax_act.set_xticks(range(2), [f"{n}\n{1e3 * ck['step_time_median_s'][n]:.0f} ms/step" for n in names])
    ax_act.set_ylabel("activation memory of one forward (MB)")
    ax_act.set_title("charlm: gradient checkpointing", fontsize=9)
    ax_act.legend(fontsize=8)
    for name, trace in leak["rss_trace"].items():
        ax_rss.plot([s for s, _ in trace], [r / MB for _, r in trace], marker=".", label=name)
    ax_rss.axvline(leak["warmup_steps"], color="grey", ls="--", lw=0.8, label="end of warm-up")
    ax_rss.set_xlabel("steps of the arm")
    ax_rss.set_ylabel("process RSS after the arm's chunk (MB)")
    ax_rss.set_title("digits: plain AdamW vs HybridTrainer, interleaved", fontsize=9)
    ax_rss.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="CPU memory benchmark: checkpointing, compact history, no leak")
    parser.add_argument("--quick", action="store_true", help="fewer steps (under a minute)")
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--rss-probe", choices=["plain", "checkpoint"], help=argparse.SUPPRESS)  # internal
    args = parser.parse_args(argv)

    if os.environ.get("TRITON_INTERPRET"):
        print("bench.memory: unset TRITON_INTERPRET (interpreted kernels distort time and memory)", file=sys.stderr)
        return 2
    os.environ["HYBRID_KERNELS_BACKEND"] = "eager"  # the CPU production path
    torch.set_num_threads(1)
    if args.rss_probe:
        print(json.dumps(_peak_rss_probe(args.rss_probe)))
        return 0

    started = time.perf_counter()
    timing_steps, history_steps, leak_steps, leak_chunk = (6, 6, 300, 50) if args.quick else (20, 20, 2000, 100)
    command = "python -m bench.memory" + (" --quick" if args.quick else "")
    meta = run_metadata(command, device=cpu_description(), threads=torch.get_num_threads(),
                        omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
                kernel_backend="eager (HYBRID_KERNELS_BACKEND=eager, no TRITON_INTERPRET)")
    print("a. gradient checkpointing (charlm)", file=sys.stderr)
    checkpointing = measure_checkpointing(timing_steps)
    print("b. compact history (charlm)", file=sys.stderr)
    history = measure_history(history_steps)
    print("c. no leak (digits)", file=sys.stderr)
    leak = measure_leak(leak_steps, leak_chunk)
    meta["wall_s"] = time.perf_counter() - started
    result = dict(meta=meta, checkpointing=checkpointing, history=history, leak=leak)

    args.out.mkdir(parents=True, exist_ok=True)
    stem = "memory_cpu" + ("_quick" if args.quick else "")
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (args.out / f"{stem}.md").write_text(text + "\n")
    plot(result, args.out / f"{stem}.png")
    print("\n" + text)
    print(f"wrote {args.out}/{stem}.json, .md and .png in {meta['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

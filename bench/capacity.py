"""How large a model trains in a given memory: bytes of training state per parameter, step time
of each memory technique, the planner's choices, and a ≥ 4B-parameter run (loss parity:
``bench.capacity_parity``).

    python -m bench.capacity                       # speed + sweep + planner (≈ 15 min on 2 cores)
    python -m bench.capacity --part sweep          # one part: speed | sweep | planner | eager-sweep
    python -m bench.capacity --part eager-sweep    # 25M/125M/350M GPTs, low-bit update eager (≈ 14 min, one process peaks at 5.7 GiB)
    python -m bench.capacity --big                 # the big run (≈ 25 min, ~13 GiB; run under flock /tmp/cpu.lock)

Parts (results in docs/results/capacity.{json,md,png}; the big run in capacity_big.{json,md}):

* **sweep**: a Llama-shaped model (RMSNorm, rotary attention, SwiGLU; char vocabulary of the King
  James text) at three sizes, trained for a few steps under ``HybridTrainer(predict=False,
  good_state_every=0)`` in each configuration, each arm in a **fresh subprocess** whose peak RSS
  (``VmHWM``, reset through ``/proc/self/clear_refs`` after the model is built) is read after the
  steps. Bytes/param = slope of the peak against the parameter count (least squares over the three
  sizes); the planner's predicted peak is recorded beside each measurement. The subprocesses run
  with ``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc returns freed buffers at once and the RSS
  follows the live tensors (otherwise its heap keeps freed chunks and the peak depends on history).
* **eager-sweep**: fp32 AdamW and the smallest configuration at 25M, 127M and 354M parameters
  with the low-bit update eager at every size; the peak of the construction and of the training
  steps read separately, and the steps' peak less the measured activations (training state alone).
* **planner**: the largest sweep model under ``memory_budget`` set to several budgets: what it
  chose, predicted and measured peak.
* **big** (``--big``): a Llama-shaped model of ≥ 4B parameters built in bf16, the planner choosing
  under ``--budget`` (default 14.5GiB), trained for ``--steps`` steps of 1 × 64 tokens of the
  King James text; first at 0.5B and 1B parameters to check the plan against the measured peak.
  It refuses to start unless ``MemAvailable`` exceeds the plan's predicted peak by 3 GiB.

Timings come from a shared 2-core machine: noisy; the ratios matter more than the absolute values.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from bench.protocol import run_metadata

ROOT = Path(__file__).resolve().parent.parent
GIB = 1024 ** 3
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}

# ----------------------------------------------------------------------------- the model ----
# (d_model, layers, ffn, heads); parameters ≈ layers · (4 d² + 3 d · ffn) + 2 · vocab · d
SWEEP_SHAPES = {"S": (256, 4, 688, 4), "M": (384, 6, 1024, 6), "L": (512, 10, 1376, 8)}
BIG_SHAPES = {"0.5B": (1536, 16, 4096, 12), "1B": (2048, 18, 5504, 16), "4B": (3072, 36, 8192, 24)}
CONTEXT = 64


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding over the last dimension of [B, H, T, Dh] (Su et al. 2021)."""
    t, dh = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, dh, 2, dtype=torch.float32) / dh))
    angles = torch.arange(t, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class LlamaBlock(nn.Module):
    def __init__(self, d: int, ffn: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = RMSNorm(d), RMSNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (proj(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for proj in (self.q, self.k, self.v))
        a = nn.functional.scaled_dot_product_attention(_rotary(q), _rotary(k), v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """A Llama-shaped decoder over characters (untied embedding and output head)."""

    def __init__(self, vocab: int, d: int, layers: int, ffn: int, heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(LlamaBlock(d, ffn, heads) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def llama_parameters(vocab: int, d: int, layers: int, ffn: int, heads: int) -> int:
    return layers * (4 * d * d + 3 * d * ffn + 2 * d) + 2 * vocab * d + d


def lm_loss(model, batch):
    x, y = batch
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def kjv_codes() -> tuple[torch.Tensor, torch.Tensor, int]:
    """(train, val) character codes of the King James text (``bench.tasks``' split) and the vocabulary size."""
    from .tasks import load_kjv_text, split_blocks

    text, _ = load_kjv_text()
    vocab = sorted(set(text))
    codes = torch.tensor(np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64))
    lookup = torch.full((int(codes.max()) + 1,), -1, dtype=torch.long)
    lookup[torch.tensor([ord(c) for c in vocab])] = torch.arange(len(vocab))
    train, val = split_blocks(lookup[codes])
    return train, val, len(vocab)


def text_batches(data: torch.Tensor, batch: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(CONTEXT)
    while True:
        starts = torch.randint(0, len(data) - CONTEXT - 1, (batch,), generator=gen)
        idx = starts[:, None] + offsets[None, :]
        yield data[idx], data[idx + 1]


# --------------------------------------------------------------------------------- arms ----
# name → (optimizer kind, HybridConfig memory knobs). Every arm: predict=False, good_state_every=0.
ARMS: dict[str, tuple[str, dict[str, Any]]] = {
    "fp32 AdamW": ("adamw", dict(optimizer_state_bits=None, step_in_backward=False, weight_dtype="float32")),
    "step in backward": ("adamw", dict(optimizer_state_bits=None, step_in_backward=True, weight_dtype="float32")),
    "8-bit state": ("adamw", dict(optimizer_state_bits=8, step_in_backward=False, weight_dtype="float32")),
    "4-bit state": ("adamw", dict(optimizer_state_bits=4, step_in_backward=False, weight_dtype="float32")),
    "bf16 weights (SR)": ("adamw", dict(optimizer_state_bits=None, step_in_backward=False, weight_dtype="bfloat16")),
    "in-backward + 8-bit + bf16": ("adamw", dict(optimizer_state_bits=8, step_in_backward=True, weight_dtype="bfloat16")),
    "in-backward + 4-bit + bf16": ("adamw", dict(optimizer_state_bits=4, step_in_backward=True, weight_dtype="bfloat16")),
    "torchao AdamW8bit": ("torchao8", {}),
    "torchao AdamW4bit": ("torchao4", {}),
    "bitsandbytes AdamW8bit": ("bnb8", {}),
    "GaLore AdamW": ("galore", {}),
    "APOLLO AdamW": ("apollo", {}),
}
THIRD_PARTY_UNAVAILABLE = {
    "torchao CPUOffloadOptimizer": "AssertionError: CPU Offload currently only supports CUDA & XPU "
                                   "(torchao 0.18 on this CPU-only machine; nothing to offload to)",
}


def make_optimizer(kind: str, model: nn.Module, lr: float, weight_decay: float = 0.0):
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if kind in ("torchao8", "torchao4"):
        import torchao.optim as ao

        return (ao.AdamW8bit if kind == "torchao8" else ao.AdamW4bit)(params, lr=lr, weight_decay=weight_decay)
    if kind == "bnb8":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    if kind in ("galore", "apollo"):
        low_rank = [m.weight for m in model.modules() if isinstance(m, nn.Linear) and min(m.weight.shape) >= 32]
        ids = {id(p) for p in low_rank}
        rest = [p for p in params if id(p) not in ids]
        rank = max(4, min(min(p.shape) for p in low_rank) // 4)
        if kind == "galore":
            from galore_torch import GaLoreAdamW

            return GaLoreAdamW([{"params": rest}, {"params": low_rank, "rank": rank, "update_proj_gap": 200,
                                                    "scale": 0.25, "proj_type": "std"}], lr=lr,
                               weight_decay=weight_decay)
        from apollo_torch import APOLLOAdamW

        return APOLLOAdamW([{"params": rest}, {"params": low_rank, "rank": rank, "proj": "random",
                                                "scale_type": "channel", "scale": 1, "update_proj_gap": 200,
                                                "proj_type": "std"}], lr=lr, weight_decay=weight_decay)
    raise ValueError(f"optimizer kind {kind!r}")


# ------------------------------------------------------------------ one arm, one process ----
def _vm_hwm() -> int:
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def _rss() -> int:
    return int(re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def probe(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the model, reset the peak, construct the trainer (the plan), run ``steps`` steps;
    return parameters, plan, peak and step times. Meant for a fresh process."""
    from hybrid_trainer import HybridConfig, HybridTrainer

    torch.set_num_threads(1)
    train, _, vocab = kjv_codes()
    shape = tuple(spec["shape"])
    torch.manual_seed(spec.get("seed", 0))
    if spec.get("build_bf16"):
        torch.set_default_dtype(torch.bfloat16)  # a model too large for fp32 is built in bf16 directly
    model = Llama(vocab, *shape)
    torch.set_default_dtype(torch.float32)
    n = sum(p.numel() for p in model.parameters())
    batches = text_batches(train, spec.get("batch", 1), seed=spec.get("seed", 0))
    example = next(batches)
    kind, knobs = ARMS[spec["arm"]] if spec["arm"] in ARMS else ("adamw", {})
    knobs = dict(knobs, **spec.get("knobs", {}))
    optimizer = make_optimizer(kind, model, lr=spec.get("lr", 3e-4))
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    rss_before = _rss()
    config = HybridConfig(predict=False, good_state_every=0, cost_aware=False, **knobs)
    warmup = spec.get("warmup", 0)  # linear warm-up over this many steps (Adam's first steps move every weight by lr)
    scheduler = (torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
                 if warmup else None)
    started = time.perf_counter()
    trainer = HybridTrainer(model, optimizer, lm_loss, config, scheduler=scheduler, example_batch=example)
    construct_s = time.perf_counter() - started
    plan = trainer.memory_plan
    # The construction's own peak (the activation probe's forward, a model built in fp32 still
    # resident before its bf16 conversion), then the peak of the training steps alone.
    construct_peak = _vm_hwm()
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    rss_before_steps = _rss()
    losses, times = [], []
    for _ in range(spec.get("steps", 3)):
        started = time.perf_counter()
        result = trainer.step(next(batches))
        times.append(time.perf_counter() - started)
        losses.append(result.loss)
        if spec.get("verbose"):
            print(json.dumps({"step": len(losses), "loss": result.loss, "seconds": times[-1],
                              "rss_peak_gib": _vm_hwm() / GIB}), file=sys.stderr, flush=True)
    step_peak = _vm_hwm()
    return {"arm": spec["arm"], "shape": list(shape), "parameters": n, "rss_before_trainer": rss_before,
            "peak_rss": max(construct_peak, step_peak), "construct_peak_rss": construct_peak,
            "step_peak_rss": step_peak, "rss_before_steps": rss_before_steps,
            "predicted_peak": plan.predicted_peak_bytes, "plan": plan.to_dict(),
            "optimizer": type(trainer.optimizer).__name__, "losses": losses, "step_seconds": times,
            "construct_seconds": construct_s}


def run_probe(spec: dict[str, Any], timeout: float = 1800, tune_malloc: bool = True) -> dict[str, Any]:
    """``probe(spec)`` in a fresh process. ``tune_malloc``: glibc returns every freed buffer over
    64 KiB at once, so the RSS of a small model follows its live tensors; it costs time (each
    temporary is a fresh mapping: the low-bit update's chunk temporaries made it ~3x slower),
    so the big run, whose tensors are far above glibc's own mapping threshold, runs without."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HYBRID_KERNELS_BACKEND="eager", **(MALLOC_ENV if tune_malloc else {}))
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-m", "bench.capacity", "--probe", json.dumps(spec)], env=env,
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    if done.returncode != 0:
        return {"arm": spec["arm"], "shape": spec["shape"], "error": done.stderr.strip().splitlines()[-1][:400]
                if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------- parts ----
def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and intercept."""
    slope, intercept = np.polyfit(np.asarray(xs, dtype=float), np.asarray(ys, dtype=float), 1)
    return float(slope), float(intercept)


def sweep(arms: list[str], steps: int) -> dict[str, Any]:
    rows = []
    for arm in arms:
        for size, shape in SWEEP_SHAPES.items():
            row = run_probe({"arm": arm, "shape": list(shape), "steps": steps})
            row["size"] = size
            rows.append(row)
            status = row.get("error") or (f"{row['parameters'] / 1e6:.1f}M params, peak {row['peak_rss'] / 2**20:.0f} MiB, "
                                          f"predicted {row['predicted_peak'] / 2**20:.0f} MiB")
            print(f"sweep {arm:28s} {size}: {status}", flush=True)
    fits = {}
    for arm in arms:
        ok = [r for r in rows if r["arm"] == arm and "error" not in r]
        if len(ok) >= 2:
            slope, intercept = fit_line([r["parameters"] for r in ok], [r["peak_rss"] for r in ok])
            pslope, _ = fit_line([r["parameters"] for r in ok], [r["predicted_peak"] for r in ok])
            largest = max(ok, key=lambda r: r["parameters"])
            fits[arm] = {"bytes_per_param": slope, "intercept_bytes": intercept, "predicted_bytes_per_param": pslope,
                         "plan_bytes_per_param": largest["plan"]["bytes_per_param"],
                         "step_seconds_largest": statistics.median(largest["step_seconds"][1:] or largest["step_seconds"]),
                         "max_abs_prediction_error": max(abs(r["predicted_peak"] - r["peak_rss"]) / r["peak_rss"] for r in ok),
                         "largest_model_in_24GiB": (24 * GIB - intercept) / slope if slope > 0 else None}
    base = fits.get("fp32 AdamW", {}).get("step_seconds_largest")
    for arm, fit in fits.items():
        fit["step_time_factor"] = fit["step_seconds_largest"] / base if base else None
    return {"rows": rows, "fits": fits, "steps": steps}


# GPT sizes of the eager re-measurement: 25M, 127M and 354M parameters (d, layers, ffn, heads).
EAGER_SHAPES = {"25M": (512, 8, 1376, 8), "125M": (1024, 10, 2752, 16), "350M": (1024, 28, 2752, 16)}
# label → (arm, model built in bf16): a model meant for bf16 weights is built in bf16 directly
# (as the big run does; building it in fp32 holds 4 bytes/param until the trainer converts it).
EAGER_ARMS = {"fp32 AdamW": ("fp32 AdamW", False),
              "in-backward + 4-bit + bf16": ("in-backward + 4-bit + bf16", True),
              "in-backward + 4-bit + bf16, model built in fp32": ("in-backward + 4-bit + bf16", False)}


def eager_sweep(labels: list[str], steps: int) -> dict[str, Any]:
    """The sweep at :data:`EAGER_SHAPES` with the low-bit update eager at every size (no
    torch.compile, whose resident runtime would enter at the sizes that compile only). Each probe
    refuses to start unless ``MemAvailable`` exceeds its fp32-AdamW-sized need by 3 GiB. Fitted
    per label: the slope of the whole peak, of the training steps' peak, and of the steps' peak
    less the activations the planner's probe measured (training state alone)."""
    os.environ["HYBRID_LOWBIT_COMPILE"] = "0"
    _, _, vocab = kjv_codes()
    rows = []
    for label in labels:
        arm, build_bf16 = EAGER_ARMS[label]
        for size, shape in EAGER_SHAPES.items():
            n = llama_parameters(vocab, *shape)
            need = int(n * (18 if arm == "fp32 AdamW" else 7)) + 3 * GIB
            if mem_available() < need:
                rows.append({"label": label, "arm": arm, "size": size, "parameters": n,
                             "error": f"refused: MemAvailable {mem_available() / GIB:.1f} GiB < {need / GIB:.1f} GiB"})
                print(f"eager {label} {size}: {rows[-1]['error']}", flush=True)
                continue
            row = run_probe({"arm": arm, "shape": list(shape), "steps": steps, "build_bf16": build_bf16})
            row.update(label=label, size=size, built_in="bfloat16" if build_bf16 else "float32")
            rows.append(row)
            print(f"eager {label:48s} {size}: " + (row.get("error") or (
                f"{row['parameters'] / 1e6:.1f}M params, peak {row['peak_rss'] / 2**20:.0f} MiB (steps "
                f"{row['step_peak_rss'] / 2**20:.0f}, construction {row['construct_peak_rss'] / 2**20:.0f}), predicted "
                f"{row['predicted_peak'] / 2**20:.0f} MiB, activations {row['plan']['breakdown']['activations'] / 2**20:.0f} MiB")),
                  flush=True)
    fits = {}
    for label in labels:
        ok = [r for r in rows if r["label"] == label and "error" not in r]
        if len(ok) < 2:
            continue
        xs = [r["parameters"] for r in ok]
        whole, intercept = fit_line(xs, [r["peak_rss"] for r in ok])
        step, step_intercept = fit_line(xs, [r["step_peak_rss"] for r in ok])
        state, _ = fit_line(xs, [r["step_peak_rss"] - r["plan"]["breakdown"]["activations"] for r in ok])
        acts, _ = fit_line(xs, [r["plan"]["breakdown"]["activations"] for r in ok])
        predicted, _ = fit_line(xs, [r["predicted_peak"] for r in ok])
        largest = max(ok, key=lambda r: r["parameters"])
        fits[label] = {"bytes_per_param": whole, "intercept_bytes": intercept, "step_bytes_per_param": step,
                       "step_intercept_bytes": step_intercept, "state_bytes_per_param": state,
                       "activation_bytes_per_param": acts, "predicted_bytes_per_param": predicted,
                       "plan_bytes_per_param": largest["plan"]["bytes_per_param"],
                       "max_abs_prediction_error": max(abs(r["predicted_peak"] - r["peak_rss"]) / r["peak_rss"] for r in ok),
                       "step_seconds_largest": statistics.median(largest["step_seconds"][1:] or largest["step_seconds"])}
    base = fits.get("fp32 AdamW", {}).get("step_seconds_largest")
    for fit in fits.values():
        fit["step_time_factor"] = fit["step_seconds_largest"] / base if base else None
    return {"rows": rows, "fits": fits, "steps": steps, "shapes": EAGER_SHAPES}


def planner_part(budgets_mib: list[int], steps: int) -> list[dict[str, Any]]:
    shape = SWEEP_SHAPES["L"]
    rows = []
    for budget in budgets_mib:
        row = run_probe({"arm": "planner", "shape": list(shape), "steps": steps,
                         "knobs": {"memory_budget": f"{budget}MiB"}})
        row["budget_mib"] = budget
        rows.append(row)
        print(f"planner {budget} MiB: " + (row.get("error") or f"{row['plan']['techniques']} predicted "
              f"{row['predicted_peak'] / 2**20:.0f} MiB measured {row['peak_rss'] / 2**20:.0f} MiB"), flush=True)
    return rows


# ------------------------------------------------------------------ optimizer speed/fidelity ----
SPEED_OPTIMIZERS = {
    "torch AdamW (fp32, foreach)": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01),
    "LowBitAdamW 8-bit eager": lambda p: _lowbit(p, 8, False),
    "LowBitAdamW 8-bit compiled": lambda p: _lowbit(p, 8, True),
    "LowBitAdamW 4-bit eager": lambda p: _lowbit(p, 4, False),
    "LowBitAdamW 4-bit compiled": lambda p: _lowbit(p, 4, True),
    "LowBitAdamW 4-bit eager, block 256": lambda p: _lowbit(p, 4, False, 256),
    "LowBitAdamW 4-bit eager, block 512": lambda p: _lowbit(p, 4, False, 512),
    "torchao AdamW8bit": lambda p: __import__("torchao.optim", fromlist=["x"]).AdamW8bit(p, lr=1e-3, weight_decay=0.01),
    "torchao AdamW4bit": lambda p: __import__("torchao.optim", fromlist=["x"]).AdamW4bit(p, lr=1e-3, weight_decay=0.01),
    "bitsandbytes AdamW8bit": lambda p: __import__("bitsandbytes").optim.AdamW8bit(p, lr=1e-3, weight_decay=0.01),
}


def _lowbit(params, bits, compiled, block_size=None):
    from hybrid_trainer.lowbit_adamw import LowBitAdamW

    return LowBitAdamW(params, lr=1e-3, weight_decay=0.01, state_bits=bits, compiled=compiled, block_size=block_size)


def optimizer_speed(numel: int = 4 * 2 ** 20, fidelity_numel: int = 1 << 17, fidelity_steps: int = 50) -> dict:
    """ns per parameter of one optimizer step on one fp32 tensor of ``numel`` values (median of 5
    after 3 warm-up steps: torch.compile and torchao's compile happen in the warm-up), and the
    update fidelity: relative error and cosine of the summed update after ``fidelity_steps``
    steps on a noisy gradient stream against torch's fp32 AdamW on the same stream."""
    torch.set_num_threads(1)
    out = {}
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(fidelity_numel, generator=gen) * 0.02
    spread = torch.rand(fidelity_numel, generator=gen) * 2
    stream = [torch.randn(fidelity_numel, generator=gen) * spread * 1e-2 + 1e-3 for _ in range(fidelity_steps)]
    ref = nn.Parameter(w0.clone())
    ref_opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.01)
    for g in stream:
        ref.grad = g.clone()
        ref_opt.step()
    du_ref = ref.detach() - w0
    for name, make in SPEED_OPTIMIZERS.items():
        try:
            p = nn.Parameter(torch.randn(numel) * 0.02)
            opt = make([p])
            p.grad = torch.randn(numel) * 1e-2
            times = []
            for i in range(8):
                started = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - started)
            q = nn.Parameter(w0.clone())
            qopt = make([q])
            for g in stream:
                q.grad = g.clone()
                qopt.step()
            du = q.detach() - w0
            out[name] = {"ns_per_param": 1e9 * statistics.median(times[3:]) / numel,
                         "update_rel_error": float((du - du_ref).norm() / du_ref.norm()),
                         "update_cosine": float(nn.functional.cosine_similarity(du, du_ref, dim=0))}
        except Exception as error:  # noqa: BLE001 - reported
            out[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
        print(f"speed {name:32s} {out[name]}", flush=True)
    return {"numel": numel, "fidelity_numel": fidelity_numel, "fidelity_steps": fidelity_steps, "rows": out}


# ------------------------------------------------------------------------------ big run ----
def mem_available() -> int:
    return int(re.search(r"MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text()).group(1)) * 1024


def big(budget: str, steps: int, sizes: list[str], lr: float = 1e-4, warmup: int = 5) -> list[dict[str, Any]]:
    from hybrid_trainer.memory_plan import parse_bytes

    _, _, vocab = kjv_codes()
    rows = []
    for size in sizes:
        shape = BIG_SHAPES[size]
        n = llama_parameters(vocab, *shape)
        # Refuse before starting what could reach the OOM killer: the budget (which the plan
        # must meet) plus a margin must be free now.
        need = parse_bytes(budget) + 3 * GIB if size == "4B" else int(n * 4.2) + 3 * GIB
        available = mem_available()
        if available < need:
            rows.append({"size": size, "parameters": n, "error": f"refused: MemAvailable {available / GIB:.1f} GiB "
                                                                  f"< {need / GIB:.1f} GiB needed"})
            print(rows[-1]["error"], flush=True)
            continue
        # The smaller models check the prediction for the techniques the 4B plan needs (at their
        # size the budget would let the planner choose plain fp32); the 4B model is planned.
        knobs = {"memory_budget": budget} if size == "4B" else \
            {"step_in_backward": True, "optimizer_state_bits": 4, "weight_dtype": "bfloat16"}
        spec = {"arm": "planner", "shape": list(shape), "steps": steps if size == "4B" else 3, "build_bf16": True,
                "knobs": knobs, "lr": lr, "warmup": warmup, "verbose": True}
        print(f"big run {size}: {n / 1e9:.2f}B parameters, budget {budget}", flush=True)
        row = run_probe(spec, timeout=3 * 3600, tune_malloc=False)
        row["size"] = size
        rows.append(row)
        if "error" in row:
            print(f"  failed: {row['error']}", flush=True)
        else:
            print(f"  {row['plan']['techniques']}: predicted {row['predicted_peak'] / GIB:.2f} GiB, measured "
                  f"{row['peak_rss'] / GIB:.2f} GiB; losses {[round(x, 3) for x in row['losses']]}", flush=True)
    return rows


# ------------------------------------------------------------------------------ reports ----
def markdown(result: dict[str, Any]) -> str:
    lines = ["# Capacity: bytes per parameter, loss parity, step time", "",
             f"`python -m bench.capacity` at commit `{result['commit'][:10]}`, {result['date']}, "
             f"{result['machine']}. Timings on a shared 2-core machine: noisy.", ""]
    sw = result.get("sweep")
    if sw:
        lines += ["## Bytes of training state per parameter (slope of peak RSS over three model sizes)", "",
                  f"Llama-shaped char models ({', '.join(f'{k} {v}' for k, v in SWEEP_SHAPES.items())} as "
                  f"(d, layers, ffn, heads)), batch 1 × {CONTEXT} tokens, {sw['steps']} steps under "
                  "HybridTrainer(predict=False, good_state_every=0); each arm in a fresh process.", "",
                  "| configuration | measured bytes/param | planner's bytes/param (state) | predicted slope | worst |predicted − measured| / measured | step time (largest) | × fp32 | largest model in 24 GiB |",
                  "|---|---|---|---|---|---|---|---|"]
        for arm, fit in sw["fits"].items():
            largest = fit["largest_model_in_24GiB"]
            lines.append(f"| {arm} | {fit['bytes_per_param']:.2f} | {fit['plan_bytes_per_param']:.2f} | "
                         f"{fit['predicted_bytes_per_param']:.2f} | {100 * fit['max_abs_prediction_error']:.1f}% | "
                         f"{1e3 * fit['step_seconds_largest']:.0f} ms | {fit['step_time_factor'] or float('nan'):.2f} | "
                         + (f"{largest / 1e9:.2f}B |" if largest else "n/a |"))
        for note in sw.get("notes", []):
            lines.append(f"\nNote: {note}.")
        errors = [r for r in sw["rows"] if "error" in r]
        for r in errors:
            lines.append(f"\n{r['arm']} ({r['shape']}): {r['error']}")
        for name, why in THIRD_PARTY_UNAVAILABLE.items():
            lines.append(f"\n{name}: does not run here: {why}")
        lines.append("")
    if result.get("planner"):
        lines += ["## The planner at several budgets (largest sweep model)", "",
                  "| budget | chosen | predicted peak | measured peak | error |", "|---|---|---|---|---|"]
        for r in result["planner"]:
            if "error" in r:
                lines.append(f"| {r['budget_mib']} MiB | {r['error'][:200]} | | | |")
            else:
                lines.append(f"| {r['budget_mib']} MiB | {', '.join(r['plan']['techniques']) or 'plain'} | "
                             f"{r['predicted_peak'] / 2**20:.0f} MiB | {r['peak_rss'] / 2**20:.0f} MiB | "
                             f"{100 * (r['predicted_peak'] / r['peak_rss'] - 1):+.1f}% |")
        lines.append("")
    sp = result.get("speed")
    if sp:
        lines += ["## Optimizer step speed and update fidelity on this CPU (1 thread)", "",
                  f"One step on one {sp['numel'] / 2**20:.0f}M-value fp32 tensor (ns/param, median of 5 after 3 "
                  f"warm-up steps); fidelity: the summed update of {sp['fidelity_steps']} steps on a noisy gradient "
                  "stream against torch's fp32 AdamW (relative error, cosine).", "",
                  "| optimizer | ns/param | update rel. error | update cosine |", "|---|---|---|---|"]
        for name, r in sp["rows"].items():
            if "error" in r:
                lines.append(f"| {name} | {r['error'][:120]} | | |")
            else:
                lines.append(f"| {name} | {r['ns_per_param']:.1f} | {r['update_rel_error']:.3f} | {r['update_cosine']:.4f} |")
        lines.append("")
    eager = result.get("eager_sweep")
    if eager:
        lines += ["## Bytes per parameter at GPT sizes, low-bit update eager (no torch.compile)", "",
                  f"`python -m bench.capacity --part eager-sweep`: Llama-shaped char models "
                  f"({', '.join(f'{k} {tuple(v)}' for k, v in eager['shapes'].items())} as (d, layers, ffn, heads)), "
                  f"batch 1 × {CONTEXT} tokens, {eager['steps']} steps, each in a fresh process. Peak RSS read twice: "
                  "over the trainer's construction (activation probe, bf16 conversion) and over the training "
                  "steps alone; 'state' = the steps' peak less the activations the planner's probe measured.", "",
                  "| configuration | model built in | whole peak (B/param) | steps' peak | state (steps − activations) | "
                  "activations | planner's state count | predicted slope | worst prediction error | s/step (largest) | × fp32 |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for label, fit in eager["fits"].items():
            built = next(r["built_in"] for r in eager["rows"] if r.get("label") == label and "built_in" in r)
            lines.append(f"| {EAGER_ARMS.get(label, (label,))[0]} | {built} | {fit['bytes_per_param']:.2f} | "
                         f"{fit['step_bytes_per_param']:.2f} | {fit['state_bytes_per_param']:.2f} | "
                         f"{fit['activation_bytes_per_param']:.2f} | {fit['plan_bytes_per_param']:.2f} | "
                         f"{fit['predicted_bytes_per_param']:.2f} | {100 * fit['max_abs_prediction_error']:.1f}% | "
                         f"{fit['step_seconds_largest']:.1f} | {fit['step_time_factor'] or float('nan'):.2f} |")
        lines += ["", "Reading it: a model built in fp32 for bf16 training holds 4 bytes/param until the trainer "
                  "converts it, so its construction peak (and the whole-peak slope) is larger; the planner's "
                  "activation probe then runs on the fp32 model, so its 'activations' (fp32) exceed the bf16 build's "
                  "and that row's 'state' column is too small by the difference: compare the steps' "
                  "peak column, which is the same for both builds. Step times ran with glibc returning every freed "
                  "buffer over 64 KiB at once (so the RSS follows the live tensors): the eager low-bit update's "
                  "chunk temporaries each become a fresh mapping, which makes its steps several times slower than "
                  "in a normal process (`python -m bench.capacity --part speed` times the update alone)."]
        lines += ["", "| configuration | model built in | size | parameters | construction peak | steps' peak | "
                  "activations (probe) | predicted peak |", "|---|---|---|---|---|---|---|---|"]
        for r in eager["rows"]:
            if "error" in r:
                lines.append(f"| {r['label']} | | {r['size']} | {r.get('parameters', 0) / 1e6:.1f}M | {r['error'][:150]} | | | |")
                continue
            lines.append(f"| {EAGER_ARMS.get(r['label'], (r['label'],))[0]} | {r['built_in']} | {r['size']} | "
                         f"{r['parameters'] / 1e6:.1f}M | {r['construct_peak_rss'] / 2**20:.0f} MiB | "
                         f"{r['step_peak_rss'] / 2**20:.0f} MiB | {r['plan']['breakdown']['activations'] / 2**20:.0f} MiB | "
                         f"{r['predicted_peak'] / 2**20:.0f} MiB |")
        lines.append("")
    if (Path(__file__).resolve().parent.parent / "docs" / "results" / "capacity_parity.md").exists():
        lines += ["## Loss parity", "", "In `capacity_parity.md` (`python -m bench.capacity_parity`).", ""]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sw = result["sweep"]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    xs = np.linspace(0, 6e9, 50)
    for arm, fit in sw["fits"].items():
        ok = [r for r in sw["rows"] if r["arm"] == arm and "error" not in r]
        line, = ax.plot(xs / 1e9, (fit["bytes_per_param"] * xs + fit["intercept_bytes"]) / GIB, lw=1,
                        label=f"{arm} ({fit['bytes_per_param']:.1f} B/param)")
        ax.scatter([r["parameters"] / 1e9 for r in ok], [r["peak_rss"] / GIB for r in ok], color=line.get_color(), s=12)
    eager = result.get("eager_sweep") or {}
    for label, fit in eager.get("fits", {}).items():
        ok = [r for r in eager["rows"] if r.get("label") == label and "error" not in r]
        line, = ax.plot(xs / 1e9, (fit["bytes_per_param"] * xs + fit["intercept_bytes"]) / GIB, lw=1.5, ls=":",
                        label=f"{label}, eager, 25M-350M ({fit['bytes_per_param']:.1f} B/param)")
        ax.scatter([r["parameters"] / 1e9 for r in ok], [r["peak_rss"] / GIB for r in ok], color=line.get_color(),
                   s=18, marker="s")
    for r in result.get("big", []):
        if "error" not in r:
            ax.scatter([r["parameters"] / 1e9], [r["peak_rss"] / GIB], marker="*", s=150, color="k", zorder=5)
            ax.annotate(f"measured {r['size']}", (r["parameters"] / 1e9, r["peak_rss"] / GIB), fontsize=8)
    ax.axhline(24, color="r", ls="--", label="this machine: 24 GiB")
    ax.set_xlabel("parameters (billions)")
    ax.set_ylabel("peak memory (GiB), lines: fitted to the sweep")
    ax.set_ylim(0, 40)
    ax.set_xlim(0, 6)
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title("Peak memory of a training step against model size (CPU RSS)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def rewrite_reports(out: Path) -> None:
    """capacity.md and capacity.png again from capacity.json (and capacity_big.json)."""
    result = json.loads((out / "capacity.json").read_text())
    big_path = out / "capacity_big.json"
    if big_path.exists():
        result["big"] = json.loads(big_path.read_text()).get("big", [])
    (out / "capacity.md").write_text(markdown(result))
    if result.get("sweep"):
        plot(result, out / "capacity.png")
    if big_path.exists():
        (out / "capacity_big.md").write_text(big_markdown(json.loads(big_path.read_text())))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--part", choices=["all", "speed", "sweep", "planner", "eager-sweep"], default="all")
    parser.add_argument("--eager-labels", nargs="*", default=list(EAGER_ARMS),
                        help="eager-sweep configurations (default: all of EAGER_ARMS)")
    parser.add_argument("--arms", nargs="*", default=None, help="sweep arms (default: all)")
    parser.add_argument("--sweep-steps", type=int, default=4)
    parser.add_argument("--eager-lowbit", action="store_true",
                        help="sweep with the low-bit update eager at every size (no torch.compile overhead at one size only)")
    parser.add_argument("--big", action="store_true", help="the ≥ 4B run (after 0.5B and 1B checks)")
    parser.add_argument("--big-sizes", nargs="*", default=["0.5B", "1B", "4B"])
    parser.add_argument("--budget", default="14.5GiB", help="memory_budget of the big run")
    parser.add_argument("--steps", type=int, default=20, help="steps of the 4B run")
    parser.add_argument("--lr", type=float, default=1e-4, help="peak learning rate of the big run (AdamW)")
    parser.add_argument("--warmup", type=int, default=5, help="linear warm-up steps of the big run")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results"))
    parser.add_argument("--reports-only", action="store_true", help="rewrite the .md/.png from the .json files")
    args = parser.parse_args(argv)
    if args.reports_only:
        rewrite_reports(Path(args.out))
        return 0
    if args.probe:
        print(json.dumps(probe(json.loads(args.probe))))
        return 0
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["HYBRID_KERNELS_BACKEND"] = "eager"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = run_metadata("python -m bench.capacity " + shlex.join(argv if argv is not None else sys.argv[1:]),
                        machine=f"{os.cpu_count()} CPU cores, torch {torch.__version__}, 1 thread")
    meta["commit"] = meta["git_commit"] or "unknown"  # the name the reports read
    if args.big:
        rows = big(args.budget, args.steps, args.big_sizes, args.lr, args.warmup)
        result = dict(meta, big=rows)
        (out / "capacity_big.json").write_text(json.dumps(result, indent=1))
        (out / "capacity_big.md").write_text(big_markdown(result))
        print(big_markdown(result))
        return 0
    path = out / "capacity.json"
    result = json.loads(path.read_text()) if path.exists() and args.part != "all" else {}
    result.update(meta)
    arms = args.arms or list(ARMS)
    if args.part in ("all", "speed"):
        result["speed"] = optimizer_speed()
    if args.part in ("all", "sweep"):
        if args.eager_lowbit:  # every size eager: torch.compile's resident overhead would enter at the largest only
            os.environ["HYBRID_LOWBIT_COMPILE"] = "0"
        fresh = sweep(arms, args.sweep_steps)
        if args.arms and result.get("sweep"):  # replace these arms in the stored sweep
            kept = [r for r in result["sweep"]["rows"] if r["arm"] not in arms]
            result["sweep"]["rows"] = kept + fresh["rows"]
            result["sweep"]["fits"].update(fresh["fits"])
            base = result["sweep"]["fits"].get("fp32 AdamW", {}).get("step_seconds_largest")
            for fit in result["sweep"]["fits"].values():
                fit["step_time_factor"] = fit["step_seconds_largest"] / base if base else None
            result["sweep"].setdefault("notes", []).append(
                f"re-measured {arms}{' with the low-bit update eager at every size' if args.eager_lowbit else ''}")
        else:
            result["sweep"] = fresh
    if args.part == "eager-sweep":
        fresh = eager_sweep(args.eager_labels, args.sweep_steps)
        if set(args.eager_labels) != set(EAGER_ARMS) and result.get("eager_sweep"):  # replace these labels
            kept = [r for r in result["eager_sweep"]["rows"] if r["label"] not in args.eager_labels]
            fresh["rows"] = kept + fresh["rows"]
            fresh["fits"] = {**{k: v for k, v in result["eager_sweep"]["fits"].items()
                                if k not in args.eager_labels}, **fresh["fits"]}
        result["eager_sweep"] = fresh
    if args.part in ("all", "planner"):
        result["planner"] = planner_part([1100, 850, 780, 720, 670, 500], args.sweep_steps)
    result.pop("parity", None)  # loss parity lives in capacity_parity.json (bench.capacity_parity)
    big_path = out / "capacity_big.json"
    if big_path.exists():
        result["big"] = json.loads(big_path.read_text()).get("big", [])
    path.write_text(json.dumps(result, indent=1))
    (out / "capacity.md").write_text(markdown(result))
    if result.get("sweep"):
        plot(result, out / "capacity.png")
    print(markdown(result))
    return 0


def big_markdown(result: dict[str, Any]) -> str:
    lines = ["# The big run: a Llama-shaped model trained on this CPU with the planner choosing", "",
             f"`{result['command']}` at commit `{result['commit'][:10]}`, {result['date']}, {result['machine']}.", "",
             "| model | parameters | chosen | predicted peak | measured peak RSS | bytes/param (peak / params) | s/step (median) | losses |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["big"]:
        if "error" in r:
            lines.append(f"| {r['size']} | {r.get('parameters', 0) / 1e9:.2f}B | {r['error'][:200]} | | | | | |")
            continue
        secs = statistics.median(r["step_seconds"][1:] or r["step_seconds"])
        lines.append(f"| {r['size']} {tuple(r['shape'])} | {r['parameters'] / 1e9:.3f}B | "
                     f"{', '.join(r['plan']['techniques'])} | {r['predicted_peak'] / GIB:.2f} GiB | "
                     f"{r['peak_rss'] / GIB:.2f} GiB | {r['peak_rss'] / r['parameters']:.2f} | {secs:.1f} | "
                     f"{r['losses'][0]:.3f} → {r['losses'][-1]:.3f} ({len(r['losses'])} steps) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

"""Host cost per call of the kernel wrappers against their device time, and of a trainer step
against the plain loop's, on a GPU.

    python -m bench.launch_overhead [--out docs/results]

Small calls on a GPU are set by the host: Python, allocations and Triton's launch path, not the
kernels. In one process this measures, per call (µs, after a synchronize, 2000 calls):

* ``flash_attention`` forward, split: the kernel's device time (CUDA-graph replay), a bare launch
  of the compiled kernel from Python with preallocated outputs (Triton's launch path alone), the
  launcher ``_forward_triton`` (adds allocations and argument work), the public function (adds
  checks and dispatch), and SDPA's whole call; then forward+backward against SDPA's, and the
  device time of every kernel of one forward+backward from ``torch.profiler``;
* ``quantize_int8`` per granularity, per call and device time, and a plain ``x.to(torch.int8)``;
* a Fashion-MNIST training step (ms, 200 steps after 100): the plain AdamW loop, HybridTrainer
  with ``predict=False`` and with its defaults, with foreach and with fused AdamW.

Writes ``<out>/launch_overhead_<gpu>.{json,md}``. Needs CUDA. The figures in docs/gpu.md's
second-session section came from the throwaway probe this module was written from.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
from pathlib import Path

import torch

from .protocol import run_metadata
from .kernels import device_tag

fa = importlib.import_module("hybrid_kernels.flash_attention")  # the module, not the re-exported function

FLASH_SHAPES = [(4, 8, 256, 64), (2, 8, 1024, 64)]
QUANTIZE_ELEMENTS = 1 << 20


def per_call_us(fn, calls: int = 2000) -> float:
    """Mean wall time of one call (µs) over ``calls`` calls, device work included."""
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / calls * 1e6


def device_us(fn) -> float:
    """Median device time of one call (µs) from CUDA-graph replays: no host cost."""
    from triton.testing import do_bench_cudagraph

    return 1e3 * do_bench_cudagraph(fn, rep=50, return_mode="median")


def flash_forward_split(shape: tuple[int, int, int, int]) -> dict[str, float]:
    import triton

    from hybrid_kernels import flash_attention

    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(3))
    batch, heads, seq, head_dim = shape
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.empty_like(q)
    stats = torch.empty((2, batch, heads, seq), device="cuda")
    cfg = fa._kernel_config(head_dim, q.dtype)
    n_query_blocks = triton.cdiv(seq, cfg["BLOCK_M"])

    def bare_launch():
        fa._flash_fwd_kernel[(n_query_blocks * batch * heads,)](
            q, k, v, out, out, stats, stats.numel() // 2,
            *fa._strides(q), *fa._strides(k), *fa._strides(v), *fa._strides(out),
            heads, 1, seq, seq, scale * fa.LOG2E, n_query_blocks,
            HEAD_DIM=head_dim, CAUSAL=False, UPCAST=False, STORE_RESIDUAL=False,
            DOT_PRECISION=fa._dot_precision(q.dtype), **cfg)

    with torch.no_grad():
        return {
            "kernel, device time": device_us(bare_launch),
            "bare Triton launch": per_call_us(bare_launch),
            "_forward_triton": per_call_us(lambda: fa._forward_triton(q, k, v, False, scale, for_backward=False)),
            "flash_attention": per_call_us(lambda: flash_attention(q, k, v)),
            "SDPA": per_call_us(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)),
        }


def flash_forward_backward(shape: tuple[int, int, int, int]) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Per-call µs of forward+backward (ours, SDPA) and each one's kernels' device µs per call."""
    from torch.profiler import ProfilerActivity, profile

    from hybrid_kernels import flash_attention

    leaves = [torch.randn(shape, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3)]
    dout = torch.randn(shape, device="cuda", dtype=torch.float16)
    calls = {"flash_attention": lambda: torch.autograd.grad(flash_attention(*leaves), leaves, dout),
             "SDPA": lambda: torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(*leaves), leaves, dout)}
    per_call = {name: per_call_us(fn, calls=500) for name, fn in calls.items()}
    kernels = {}
    for name, fn in calls.items():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
        kernels[name] = {e.key: e.device_time_total / 50 for e in prof.key_averages() if e.device_time_total > 0
                         and not e.key.startswith(("autograd::", "aten::", "_FlashAttention"))}
    return per_call, kernels


def quantize_rows() -> dict[str, dict[str, float]]:
    from hybrid_kernels import quantize_int8

    x = torch.randn(QUANTIZE_ELEMENTS, device="cuda")
    rows = {}
    for granularity in ("tensor", "row", "block"):
        data = x.view(1024, -1) if granularity == "row" else x
        fn = (lambda d=data, g=granularity: quantize_int8(d, g))
        rows[granularity] = {"per call": per_call_us(fn), "device time": device_us(fn)}
    rows["x.to(torch.int8)"] = {"per call": per_call_us(lambda: x.to(torch.int8)), "device time": device_us(lambda: x.to(torch.int8))}
    return rows


def trainer_step_ms(fused: bool) -> dict[str, float]:
    from hybrid_trainer import HybridTrainer

    from .protocol import preset_config, training_step
    from .tasks import get_task

    task = get_task("fashion", device="cuda")
    result = {}
    for arm in ("AdamW loop", "no-predict", "default"):
        model = task.make_model(0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
        trainer = None if arm == "AdamW loop" else HybridTrainer(model, optimizer, task.loss_fn, preset_config(arm))
        stream = task.batches(0)
        batches = [next(stream) for _ in range(300)]
        step = training_step(task, model, optimizer, trainer)
        for batch in batches[:100]:
            step(batch)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for batch in batches[100:]:
            step(batch)
        torch.cuda.synchronize()
        result[arm] = (time.perf_counter() - started) / 200 * 1e3
    return result


def markdown(result: dict) -> str:
    lines = [f"Host cost per call on {result['device']}, `{result['command']}` ({result['date']}, torch "
             f"{result['torch']}, triton {result['triton']}). µs per call unless named.", ""]
    lines += ["| flash_attention forward, fp16 | " + " | ".join(result["flash_forward"][0]["times"]) + " |",
              "|---|" + "---|" * len(result["flash_forward"][0]["times"])]
    for row in result["flash_forward"]:
        lines.append(f"| {tuple(row['shape'])} | " + " | ".join(f"{v:.1f}" for v in row["times"].values()) + " |")
    lines += ["", "| forward+backward | flash_attention | SDPA | kernels, device µs per call |", "|---|---|---|---|"]
    for row in result["flash_forward_backward"]:
        kernels = "; ".join(f"{name}: " + ", ".join(f"{k[:40]} {v:.1f}" for k, v in sorted(ks.items(), key=lambda kv: -kv[1])[:4])
                            for name, ks in row["kernels"].items())
        lines.append(f"| {tuple(row['shape'])} | {row['per_call']['flash_attention']:.1f} | {row['per_call']['SDPA']:.1f} | {kernels} |")
    lines += ["", f"| quantize_int8, {QUANTIZE_ELEMENTS} fp32 | per call | device time |", "|---|---|---|"]
    lines += [f"| {name} | {r['per call']:.1f} | {r['device time']:.1f} |" for name, r in result["quantize"].items()]
    lines += ["", "| Fashion-MNIST step, ms | " + " | ".join(result["trainer_step_ms"]["foreach"]) + " |",
              "|---|" + "---|" * len(result["trainer_step_ms"]["foreach"])]
    for kind, row in result["trainer_step_ms"].items():
        lines.append(f"| AdamW {kind} | " + " | ".join(f"{v:.2f}" for v in row.values()) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: it measures launch and host costs there")
    torch.set_num_threads(1)
    tag, name = device_tag()
    result = run_metadata("python -m bench.launch_overhead", device=name, triton=__import__("triton").__version__)
    result["flash_forward"] = [dict(shape=list(s), times=flash_forward_split(s)) for s in FLASH_SHAPES]
    result["flash_forward_backward"] = []
    for shape in FLASH_SHAPES:
        per_call, kernels = flash_forward_backward(shape)
        result["flash_forward_backward"].append(dict(shape=list(shape), per_call=per_call, kernels=kernels))
    result["quantize"] = quantize_rows()
    result["trainer_step_ms"] = {"foreach": trainer_step_ms(fused=False), "fused": trainer_step_ms(fused=True)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"launch_overhead_{tag}.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (args.out / f"launch_overhead_{tag}.md").write_text(text)
    print(text)
    print(f"wrote {args.out}/launch_overhead_{tag}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time the flash-attention kernels over block sizes and launch hints on a GPU.

    python -m bench.tune_flash_attention [--out DIR] [--quick] [--shapes 2x8x1024x64 ...]
                                         [--blocks 64x128 128x64 ...] [--causal both|on|off]

For each shape (fp16, non-causal and causal) and each candidate configuration
(BLOCK_M, BLOCK_N, num_warps, num_stages), checks the Triton forward and backward against a
float32 SDPA reference (a configuration whose error exceeds twice fp16 SDPA's own error plus
1e-3 is marked wrong and never chosen) and times them by replaying a CUDA graph of the calls
(``triton.testing.do_bench_cudagraph``, median, ms): device time only. Plain ``do_bench``, which
the first runs used, also counts the time the GPU waits for the host to launch (the backward
makes three launches and four allocations per call), so where the host is the slower side it
timed the host path rather than the tiles. Prints, per shape and pass, the time of the configuration the package uses now
(``_kernel_config``) and of the fastest correct one, and writes every measurement to ``DIR/flash_tuning_<device>.json``.

``hybrid_kernels.flash_attention._kernel_config`` holds the configurations chosen from this
file; the table in docs/results names the run. Needs CUDA.
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import json
import math
import shlex
import sys
from pathlib import Path

import torch

# The module, not the package's re-exported function of the same name.
fa = importlib.import_module("hybrid_kernels.flash_attention")
from .protocol import run_metadata
from .kernels import device_tag

# (B, H, N, D). D = 64 only, fp16 only: each configuration compiles four kernels per
# (dtype, causal, D), and compiling, not timing, is what fills a tuning run.
SHAPES = [(2, 8, 1024, 64), (2, 16, 2048, 64), (4, 8, 256, 64)]
QUICK_SHAPES = [(2, 8, 1024, 64)]
BLOCKS = [(64, 64), (128, 64), (64, 128), (128, 128), (128, 32), (32, 128)]
WARPS = [4, 8]
STAGES = [2, 3]


def _error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    return float((actual.detach().float() - reference).norm() / reference.norm().clamp_min(1e-30))


def _reference(q, k, v, dout, causal: bool, scale: float):
    """float32 SDPA output and gradients (the accuracy yardstick)."""
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale)
    grads = torch.autograd.grad(out, leaves, dout.float())
    return out.detach(), grads


def _sdpa_errors(q, k, v, dout, causal, scale, ref_out, ref_grads) -> tuple[float, float]:
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale)
    grads = torch.autograd.grad(out, leaves, dout)
    return _error(out, ref_out), max(_error(g, r) for g, r in zip(grads, ref_grads))


def device_ms(fn) -> float:
    """Median device time of one call of ``fn`` (ms), from CUDA-graph replays (no launch cost)."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=100, return_mode="median")


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """``"2x8x1024x64"`` -> ``(2, 8, 1024, 64)`` (B, H, N, D)."""
    parts = text.lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"shape must be BxHxNxD with positive integers, got {text!r}")
    return tuple(int(p) for p in parts)


def parse_block(text: str) -> tuple[int, int]:
    """``"64x128"`` -> ``(64, 128)`` (BLOCK_M, BLOCK_N), powers of two from 16."""
    parts = text.lower().split("x")
    if (len(parts) != 2 or not all(p.isdigit() for p in parts)
            or not all(int(p) >= 16 and int(p) & (int(p) - 1) == 0 for p in parts)):
        raise argparse.ArgumentTypeError(f"block must be MxN, powers of two >= 16, got {text!r}")
    return int(parts[0]), int(parts[1])


def tune_shape(shape, dtype, causal: bool, configs: list[dict]) -> dict:
    batch, heads, seq, head_dim = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
    scale = 1.0 / math.sqrt(head_dim)
    ref_out, ref_grads = _reference(q, k, v, dout, causal, scale)
    sdpa_fwd_err, sdpa_bwd_err = _sdpa_errors(q, k, v, dout, causal, scale, ref_out, ref_grads)
    flops_fwd = 4 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
    rows = []
    for cfg in configs:
        row = dict(cfg)
        try:
            out, stats, residual = fa._forward_triton(q, k, v, causal, scale, True, config=cfg)
            grads = fa._backward_triton(dout, q, k, v, out, residual, stats, causal, scale, config=cfg)
            row["fwd_error"] = _error(out, ref_out)
            row["bwd_error"] = max(_error(g, r) for g, r in zip(grads, ref_grads))
            row["fwd_ok"] = row["fwd_error"] <= 2 * sdpa_fwd_err + 1e-3
            row["bwd_ok"] = row["bwd_error"] <= 2 * sdpa_bwd_err + 1e-3
            row["fwd_ms"] = device_ms(lambda: fa._forward_triton(q, k, v, causal, scale, False, config=cfg))
            row["bwd_ms"] = device_ms(
                lambda: fa._backward_triton(dout, q, k, v, out, residual, stats, causal, scale, config=cfg))
        except Exception as exc:  # out of shared memory or registers: record and go on
            row["failed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        rows.append(row)
    sdpa = {}
    with torch.no_grad():
        sdpa["fwd_ms"] = device_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def sdpa_forward_backward():
        # Forward inside the graph too: a backward captured alone would run on the forward's stream.
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale)
        return torch.autograd.grad(out, leaves, dout)

    sdpa["bwd_ms"] = device_ms(sdpa_forward_backward) - sdpa["fwd_ms"]
    return dict(shape=list(shape), dtype=str(dtype).removeprefix("torch."), causal=causal,
                flops_fwd=flops_fwd, sdpa=sdpa, sdpa_fwd_error=sdpa_fwd_err, sdpa_bwd_error=sdpa_bwd_err,
                current=dict(fwd=fa._kernel_config(head_dim, dtype), bwd=fa._kernel_config(head_dim, dtype, True)),
                rows=rows)


def _best(result: dict, pass_: str) -> dict | None:
    ok = [r for r in result["rows"] if r.get(f"{pass_}_ok")]
    return min(ok, key=lambda r: r[f"{pass_}_ms"]) if ok else None


def _same(row: dict, cfg: dict) -> bool:
    return all(row.get(key) == value for key, value in cfg.items())


def _label(cfg: dict) -> str:
    return f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}"


def summary(results: list[dict]) -> str:
    lines = ["| shape (B, H, N, D) | dtype | causal | pass | SDPA ms | current | current ms | best | best ms | "
             "best TFLOP/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        # "current": what _kernel_config gave when the file was written (older files: "default").
        current = res.get("current") or {"fwd": res["default"], "bwd": res["default"]}
        for pass_ in ("fwd", "bwd"):
            row = next((r for r in res["rows"] if _same(r, current[pass_])), {})
            current_ms = row.get(f"{pass_}_ms")
            best = _best(res, pass_)
            flops = res["flops_fwd"] * (1.0 if pass_ == "fwd" else 2.5)
            best_text = (f"{_label(best)} | {best[pass_ + '_ms']:.3f} | {flops / best[pass_ + '_ms'] / 1e9:.1f}"
                         if best else "none correct | - | -")
            lines.append(
                f"| {tuple(res['shape'])} | {res['dtype']} | {res['causal']} | {pass_} | {res['sdpa'][pass_ + '_ms']:.3f} | "
                f"{_label(current[pass_])} | {'-' if current_ms is None else f'{current_ms:.3f}'} | {best_text} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--quick", action="store_true", help="one shape, fp16, non-causal")
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=None,
                        help=f"BxHxNxD shapes (default: {' '.join('x'.join(map(str, s)) for s in SHAPES)})")
    parser.add_argument("--blocks", type=parse_block, nargs="+", default=None,
                        help=f"BLOCK_MxBLOCK_N tiles (default: {' '.join(f'{m}x{n}' for m, n in BLOCKS)})")
    parser.add_argument("--causal", choices=["both", "on", "off"], default="both")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: the configurations are GPU launch hints")
    configs = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
               for (m, n), w, s in itertools.product(args.blocks or BLOCKS, WARPS, STAGES)]
    causal_cases = {"both": (False, True), "on": (True,), "off": (False,)}[args.causal]
    cases = ([(s, torch.float16, False) for s in QUICK_SHAPES] if args.quick else
             [(s, torch.float16, c) for s in (args.shapes or SHAPES) for c in causal_cases])
    tag, name = device_tag()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"flash_tuning_{tag}.json"
    meta = run_metadata("python -m bench.tune_flash_attention " + shlex.join(sys.argv[1:] if argv is None else argv),
                        timer="triton.testing.do_bench_cudagraph (device time, median)", device=name,
                        triton=__import__("triton").__version__)
    results = []
    for shape, dtype, causal in cases:
        print(f"tuning {shape} {dtype} causal={causal} over {len(configs)} configurations", flush=True)
        results.append(tune_shape(shape, dtype, causal, configs))
        path.write_text(json.dumps(dict(meta=meta, results=results), indent=1))  # kept if a later case is cut off
    print(summary(results))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

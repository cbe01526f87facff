"""Time the flash-attention kernels over block sizes and launch hints on a GPU.

    python -m bench.tune_flash_attention [--out DIR] [--quick]

For each shape (fp16, non-causal and causal) and each candidate configuration
(BLOCK_M, BLOCK_N, num_warps, num_stages), checks the Triton forward and backward against a
float32 SDPA reference (a configuration whose error exceeds twice fp16 SDPA's own error plus
1e-3 is marked wrong and never chosen) and times them with ``triton.testing.do_bench``
(median, ms). Prints, per shape and pass, the time of the configuration the package uses now
(``_kernel_config``) and of the fastest correct one, and writes every measurement to ``DIR/flash_tuning_<device>.json``.

``hybrid_kernels.flash_attention._kernel_config`` holds the configurations chosen from this
file; the table in docs/results names the run. Needs CUDA.
"""
from __future__ import annotations

import argparse
import datetime as dt
import importlib
import itertools
import json
import math
import sys
from pathlib import Path

import torch

# The module, not the package's re-exported function of the same name.
fa = importlib.import_module("hybrid_kernels.flash_attention")
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


def tune_shape(shape, dtype, causal: bool, configs: list[dict]) -> dict:
    from triton.testing import do_bench

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
            row["fwd_ms"] = do_bench(lambda: fa._forward_triton(q, k, v, causal, scale, False, config=cfg),
                                     warmup=25, rep=100, return_mode="median")
            row["bwd_ms"] = do_bench(
                lambda: fa._backward_triton(dout, q, k, v, out, residual, stats, causal, scale, config=cfg),
                warmup=25, rep=100, return_mode="median")
        except Exception as exc:  # out of shared memory or registers: record and go on
            row["failed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        rows.append(row)
    sdpa = {}
    with torch.no_grad():
        sdpa["fwd_ms"] = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale), warmup=25, rep=100, return_mode="median")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale)
    sdpa["bwd_ms"] = do_bench(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True),
                              warmup=25, rep=100, return_mode="median")
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
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: the configurations are GPU launch hints")
    configs = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
               for (m, n), w, s in itertools.product(BLOCKS, WARPS, STAGES)]
    cases = ([(s, torch.float16, False) for s in QUICK_SHAPES] if args.quick else
             [(s, torch.float16, c) for s in SHAPES for c in (False, True)])
    tag, name = device_tag()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"flash_tuning_{tag}.json"
    meta = dict(command="python -m bench.tune_flash_attention" + (" --quick" if args.quick else ""),
                date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), device=name,
                torch=torch.__version__, triton=__import__("triton").__version__)
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

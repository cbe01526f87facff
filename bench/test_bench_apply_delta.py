"""apply_delta_ vs torch._foreach_add_ vs a per-parameter Python loop, on GPT-shaped parameter lists.

Bytes moved per call: read param + read delta + write param (int8: 1-byte codes + fp32 scales).
"""
import pytest
import torch

import hybrid_kernels as hk

from .conftest import sync, timed
from .shapes import MODELS, numel


def _lists(shapes, device, delta_dtype=torch.float32):
    params = [torch.randn(s, device=device) for s in shapes]
    deltas = [torch.randn(s, device=device).to(delta_dtype) * 1e-3 for s in shapes]
    return params, deltas


def _python_loop(params, deltas, alpha):
    for p, d in zip(params, deltas):
        p.add_(d, alpha=alpha)


IMPLS = {
    "hybrid_kernels.apply_delta_": lambda p, d: hk.apply_delta_(p, d, 1e-3),
    "hybrid_kernels.DeltaApplier (prepared)": None,  # built once per benchmark, below
    "torch._foreach_add_": lambda p, d: torch._foreach_add_(p, d, alpha=1e-3),
    "python loop of add_": lambda p, d: _python_loop(p, d, 1e-3),
}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("impl", list(IMPLS))
def test_apply_float_delta(benchmark, device, model, impl):
    params, deltas = _lists(MODELS[model], device)
    n = numel(MODELS[model])
    benchmark.group = f"apply_delta fp32 {model} ({len(params)} tensors)"
    benchmark.extra_info.update(impl=impl, elements=n, bytes=3 * 4 * n, baseline=impl == "torch._foreach_add_")
    fn = IMPLS[impl]
    if fn is None:
        applier = hk.DeltaApplier(params, deltas)
        fn = lambda p, d: applier(1e-3)  # noqa: E731

    def run():
        fn(params, deltas)
        sync()

    timed(benchmark, run)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("impl", ["hybrid_kernels.apply_delta_ (int8 row, fused)",
                                  "hybrid_kernels.DeltaApplier (int8 row, prepared)", "dequantize + add_ loop"])
def test_apply_int8_delta(benchmark, device, model, impl):
    params, deltas = _lists(MODELS[model], device)
    quantized = [hk.quantize_int8(d, "row") for d in deltas]
    codes, scales = [q for q, _ in quantized], [s for _, s in quantized]
    n = numel(MODELS[model])
    n_scales = sum(s.numel() for s in scales)
    benchmark.group = f"apply_delta int8-row {model} ({len(params)} tensors)"
    benchmark.extra_info.update(impl=impl, elements=n, bytes=8 * n + n + 4 * n_scales,
                                baseline=impl.startswith("dequantize"))

    if "DeltaApplier" in impl:
        applier = hk.DeltaApplier(params, codes, scales=scales, granularity="row")

        def run():
            applier(1e-3)
            sync()
    elif impl.startswith("hybrid"):
        def run():
            hk.apply_delta_(params, codes, 1e-3, scales=scales, granularity="row")
            sync()
    else:
        def run():
            for p, q, s in zip(params, codes, scales):
                p.add_(hk.dequantize_int8(q, s, "row"), alpha=1e-3)
            sync()

    timed(benchmark, run)

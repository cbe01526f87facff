"""quantize_int8 / dequantize_int8 throughput at 1M and 16M elements.

Bytes: quantize reads the input once and writes 1-byte codes (+ scales); dequantize the reverse.
"""
import pytest
import torch

import hybrid_kernels as hk

from .conftest import sync, timed

SIZES = {"1M": (1024, 1024), "16M": (4096, 4096)}


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_quantize(benchmark, device, size, granularity):
    x = torch.randn(SIZES[size], device=device)
    n = x.numel()
    benchmark.group = f"quantize_int8 fp32 {size}"
    benchmark.extra_info.update(impl=f"quantize_int8 {granularity}", elements=n, bytes=5 * n)

    def run():
        hk.quantize_int8(x, granularity, block_size=256)
        sync()

    timed(benchmark, run)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_dequantize(benchmark, device, size, granularity):
    x = torch.randn(SIZES[size], device=device)
    q, s = hk.quantize_int8(x, granularity, block_size=256)
    n = x.numel()
    benchmark.group = f"dequantize_int8 fp32 {size}"
    benchmark.extra_info.update(impl=f"dequantize_int8 {granularity}", elements=n, bytes=5 * n)

    def run():
        hk.dequantize_int8(q, s, granularity, block_size=256)
        sync()

    timed(benchmark, run)


# Yardsticks: a plain cast moves the same bytes as the op with no math (memory-bound ceiling).
CEILINGS = {"quantize": (torch.float32, torch.int8, "torch x.to(int8) (copy ceiling)"),
            "dequantize": (torch.int8, torch.float32, "torch q.to(float32) (copy ceiling)")}


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("op", list(CEILINGS))
def test_copy_ceiling(benchmark, device, op, size):
    source, target, label = CEILINGS[op]
    x = (torch.randn(SIZES[size], device=device) * 50).to(source)
    n = x.numel()
    benchmark.group = f"{op}_int8 fp32 {size}"
    benchmark.extra_info.update(impl=label, elements=n, bytes=5 * n, baseline=True)

    def run():
        x.to(target)
        sync()

    timed(benchmark, run)

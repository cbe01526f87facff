"""quantize_int8 / dequantize_int8 throughput at 1M and 16M elements.

Bytes: quantize reads the input once and writes 1-byte codes (+ scales); dequantize the reverse.
"""
import pytest
import torch

import hybrid_kernels as hk

from .conftest import sync

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

    benchmark(run)


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

    benchmark(run)


@pytest.mark.parametrize("size", list(SIZES))
def test_dequantize_copy_ceiling(benchmark, device, size):
    """Yardstick for dequantize: an int8 → fp32 cast moves the same bytes with no math."""
    q = torch.randint(-127, 128, SIZES[size], device=device).to(torch.int8)
    n = q.numel()
    benchmark.group = f"dequantize_int8 fp32 {size}"
    benchmark.extra_info.update(impl="torch q.to(float32) (copy ceiling)", elements=n, bytes=5 * n, baseline=True)

    def run():
        q.to(torch.float32)
        sync()

    benchmark(run)


@pytest.mark.parametrize("size", list(SIZES))
def test_quantize_copy_ceiling(benchmark, device, size):
    """Yardstick: an fp32 → int8 cast moves the same bytes with no math (memory-bound ceiling)."""
    x = torch.randn(SIZES[size], device=device)
    n = x.numel()
    benchmark.group = f"quantize_int8 fp32 {size}"
    benchmark.extra_info.update(impl="torch x.to(int8) (copy ceiling)", elements=n, bytes=5 * n, baseline=True)

    def run():
        x.to(torch.int8)
        sync()

    benchmark(run)

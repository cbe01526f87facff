"""flash_attention benchmarks (pytest-benchmark): forward and forward+backward.

Implementations per shape (``extra_info["impl"]``):

* ``flash_attention (<backend>)``: :func:`hybrid_kernels.flash_attention`; on CPU the SDPA
  fallback (``eager``), on CUDA the Triton kernels (``triton``); the backend is checked.
* ``torch SDPA``: ``torch.nn.functional.scaled_dot_product_attention`` (CUDA only; on CPU it is
  what the fallback runs).
* ``naive softmax(QK^T)V``: materializes the N x N scores; the group's reference (``baseline``).

Groups are named ``flash_attention <fwd|fwd+bwd> B.. H.. N.. D..``; ``extra_info`` also holds
``flops`` (of the measured call: 4*B*H*N^2*D forward, x3.5 forward+backward, the FlashAttention
convention; non-causal) and ``tflops`` from the mean time. fp32 on CPU, fp16 on CUDA. Runs without
TRITON_INTERPRET (bench/conftest.py refuses it).

Quick check: ``pytest bench/test_bench_flash_attention.py --benchmark-min-rounds=1 --benchmark-max-time=0.2``
"""
import math

import pytest
import torch

import hybrid_kernels
from hybrid_kernels import flash_attention

from .conftest import DEVICE, sync, timed

CUDA = DEVICE.type == "cuda"
DTYPE = torch.float16 if CUDA else torch.float32

SHAPES = [(4, 8, 256, 64), (2, 8, 1024, 64)]  # (batch, heads, seq_len, head_dim)
MODES = ["fwd", "fwd+bwd"]
FWD_BWD_FLOP_FACTOR = 3.5  # backward = 2.5 x forward (5 matmuls vs 2)


def _naive_attention(q, k, v):
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    return torch.softmax(scores, dim=-1) @ v


def _sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


IMPLS = {"hk": flash_attention, "naive": _naive_attention}
if CUDA:
    IMPLS["torch_sdpa"] = _sdpa
IMPL_NAMES = {"naive": "naive softmax(QK^T)V", "torch_sdpa": "torch SDPA"}


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-H{}-N{}-D{}".format(*s))
def test_bench_flash_attention(benchmark, shape, mode, impl):
    batch, heads, seq_len, head_dim = shape
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = (torch.randn(shape, device=DEVICE, dtype=DTYPE, generator=generator) for _ in range(3))
    fn = IMPLS[impl]
    flops = 4 * batch * heads * seq_len * seq_len * head_dim

    if mode == "fwd":
        def run():
            with torch.no_grad():
                out = fn(q, k, v)
            sync()
            return out
    else:
        flops = int(flops * FWD_BWD_FLOP_FACTOR)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        dout = torch.randn(shape, device=DEVICE, dtype=DTYPE, generator=generator)

        def run():
            out = fn(*leaves)
            grads = torch.autograd.grad(out, leaves, dout)
            sync()
            return grads

    run()  # warm-up: kernel compilation / allocator, outside the timing
    if impl == "hk":
        backend = hybrid_kernels.last_backend("flash_attention")
        assert backend == ("triton" if CUDA else "eager")
        name = f"flash_attention ({backend})"
    else:
        name = IMPL_NAMES[impl]
    benchmark.group = f"flash_attention {mode} B{batch} H{heads} N{seq_len} D{head_dim}"
    benchmark.extra_info["impl"] = name
    benchmark.extra_info["flops"] = flops
    benchmark.extra_info["baseline"] = impl == "naive"
    benchmark.extra_info["dtype"] = str(DTYPE).removeprefix("torch.")
    benchmark.extra_info["device"] = torch.cuda.get_device_name() if CUDA else "cpu"
    timed(benchmark, run)
    benchmark.extra_info["tflops"] = flops / benchmark.stats.stats.mean / 1e12

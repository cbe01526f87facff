"""Benchmarks time the real paths: eager on CPU, compiled Triton on a GPU, never the interpreter."""
import os

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise RuntimeError("bench/ must run without TRITON_INTERPRET: interpreter timings mean nothing")

import pytest  # noqa: E402
import torch  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def device():
    return DEVICE


def sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()



def timed(benchmark, fn):
    """``benchmark(fn)`` after one untimed call. On a GPU the first call compiles the Triton
    kernels (seconds); timed, it drove pytest-benchmark's calibration to one call per round and
    the minimum of five rounds, whose median was 2-3x a warm call (quantize_int8 'tensor' in
    docs/results/kernels_nvidia-h100-80gb-hbm3.md)."""
    fn()
    return benchmark(fn)

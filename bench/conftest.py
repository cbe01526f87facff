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

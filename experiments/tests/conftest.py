"""Test set-up for the research probes, as in tests/conftest.py: nothing above this file may import
hybrid_kernels, because Triton decides at decoration time whether a kernel is compiled or
interpreted, so TRITON_INTERPRET must be set first."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.pop("HYBRID_KERNELS_BACKEND", None)

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield

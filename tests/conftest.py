"""Test set-up. Nothing above this file may import hybrid_kernels: Triton decides at decoration
time whether a kernel is compiled or interpreted, so TRITON_INTERPRET must be set first."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.pop("HYBRID_KERNELS_BACKEND", None)  # tests choose backends explicitly

import pytest  # noqa: E402

from _environment import _environment_restored  # noqa: E402,F401  (autouse: every test)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def device():
    return torch.device(DEVICE)


@pytest.fixture
def eager_backend(monkeypatch):
    """Run the test body with the eager reference forced."""
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", "eager")

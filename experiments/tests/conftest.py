"""Test set-up for the research probes, as in tests/conftest.py: nothing above this file may import
hybrid_kernels, because Triton decides at decoration time whether a kernel is compiled or
interpreted, so TRITON_INTERPRET must be set first."""
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.pop("HYBRID_KERNELS_BACKEND", None)

import pytest  # noqa: E402

# The test helpers shared with tests/ (``_images``) live there; make them importable when only
# experiments/tests is collected, as pytest does for tests/ itself.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from _environment import _environment_restored  # noqa: E402,F401  (autouse: every test)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def eager_backend(monkeypatch):
    """Run the test body with the eager reference forced (the CPU path the probes time)."""
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", "eager")


def pytest_collection_modifyitems(config, items):
    """Every research test is slow-tier: they run the probes' training loops (``make test`` runs
    them, ``make test-fast`` leaves them out)."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.slow)

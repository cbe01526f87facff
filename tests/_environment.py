"""The environment put back after each test, shared by tests/ and experiments/tests (each
conftest imports the fixture, which makes it apply to every test it collects)."""
import os

import pytest


@pytest.fixture(autouse=True)
def _environment_restored():
    """A benchmark's ``main`` called by a test sets the environment for the processes it starts
    (``bench.overhead`` pops TRITON_INTERPRET and sets HYBRID_KERNELS_BACKEND=eager); left set, it
    sent a later test in the same worker down the eager path where it asserts the kernel's."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)

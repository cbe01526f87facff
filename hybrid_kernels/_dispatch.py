"""Which implementation serves a call: the Triton kernel or the eager PyTorch reference.

Rule (``choose_backend``):

* ``HYBRID_KERNELS_BACKEND=eager`` forces the eager reference everywhere (debugging).
* ``HYBRID_KERNELS_BACKEND=triton`` demands the kernel and raises where it cannot run.
* ``auto`` (default): Triton for CUDA tensors; for CPU tensors only when the kernels were
  decorated for the Triton interpreter (the test suite does that); eager otherwise.

Every call records the backend it used, so tests and users can ask what ran
(``last_backend(op)``, ``backend_counts()``).
"""
from __future__ import annotations

import os
from collections import Counter

import torch

from ._triton_compat import HAS_TRITON, INTERPRET

BACKEND_ENV = "HYBRID_KERNELS_BACKEND"
_VALID = ("auto", "eager", "triton")

_last: dict[str, str] = {}
_counts: Counter[tuple[str, str]] = Counter()


def requested_backend() -> str:
    value = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if value not in _VALID:
        raise ValueError(f"{BACKEND_ENV}={value!r}: expected one of {', '.join(_VALID)}")
    return value


def triton_can_run(device: torch.device) -> bool:
    return HAS_TRITON and (device.type == "cuda" or INTERPRET)


def choose_backend(op: str, device: torch.device) -> str:
    """Return "triton" or "eager" for a call of ``op`` on tensors living on ``device``."""
    wanted = requested_backend()
    if wanted == "eager":
        return "eager"
    if triton_can_run(device):
        return "triton"
    if wanted == "triton":
        why = "Triton is not installed" if not HAS_TRITON else (
            f"tensors are on {device.type} and TRITON_INTERPRET was not set before the kernels were imported")
        raise RuntimeError(f"{op}: {BACKEND_ENV}=triton but the Triton kernel cannot run here: {why}")
    return "eager"


def record(op: str, backend: str) -> None:
    _last[op] = backend
    _counts[(op, backend)] += 1


def last_backend(op: str) -> str | None:
    """The backend ("triton" or "eager") that served the most recent call of ``op``, or None."""
    return _last.get(op)


def backend_counts() -> dict[tuple[str, str], int]:
    """Calls served so far, keyed by (op, backend)."""
    return dict(_counts)


def reset_backend_counts() -> None:
    _last.clear()
    _counts.clear()

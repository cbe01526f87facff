"""A CPU tensor's dot product with itself from the BLAS routine torch calls, without torch's
dispatcher: the guard's per-step read of the gradients' squares on a CPU, and the finite check
of a good-state snapshot.

Why: the value is the same call either way. ``torch.dot`` on a contiguous float32 (float64) CPU
vector ends in BLAS's ``sdot`` (``ddot``), MKL's in torch's x86 builds, which export it from
``libtorch_cpu``. Around that call, ``torch.dot(g, g).item()`` parses its Python arguments,
passes autograd's wrapper, allocates a 0-d result, reads it back and frees it, and a matrix
needs a ``view(-1)`` first: ~1.7-2.7 µs a gradient (and 1.5 µs a view) on this project's CI
host, against ~1 µs for calling the routine here through ``ctypes``. On the 1 ms MLP (six
gradients) the read took 29 µs against 19 µs in a hot loop. In a training step, whose tensors
push the dispatcher's code out of the first-level caches, the gap is wider: Valgrind's cache
simulation put the trainer's cost over the plain loop at +262k estimated cycles a step with the
dots through torch and +136k with them here (``python -m experiments.step_instructions --model
mlp-1ms --cache-sim``; docs/trainer.md, "The gradient read past torch's dispatcher").
tests/test_blas_dots.py holds the values to torch.dot's bits.

When: only where ``libtorch_cpu`` exports ``sdot_`` and ``ddot_`` and both give, on probe
vectors, the very bits ``torch.dot`` gives (:func:`_verified`); elsewhere there is no routine and
the callers use ``torch.dot``. A BLAS built with 64-bit integers (ILP64) reads the length and stride from
the same 8-byte integers as one with 32-bit integers (LP64) on a little-endian host, where the low
half comes first; other hosts are not probed. :func:`self_dot_routine` takes only what the routine can:
a contiguous dense CPU tensor of one of those dtypes with fewer than 2**31 entries (:func:`takes`).
"""
from __future__ import annotations

import ctypes
import math
import os
import sys
from typing import Callable

import torch

INT_LIMIT = 2**31  # an LP64 BLAS takes the length as a 32-bit int
_ONE = ctypes.c_int64(1)  # the stride; never written, so shared by every thread


def _routine(library: ctypes.CDLL, name: str, result: type) -> Callable[[torch.Tensor], float]:
    """``name`` of ``library`` (Fortran BLAS interface: every argument by address) as a function
    of one tensor: its dot product with itself."""
    routine = getattr(library, name)  # AttributeError when not exported
    routine.restype = result
    routine.argtypes = (ctypes.POINTER(ctypes.c_int64), ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64),
                        ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64))
    length = ctypes.c_int64

    def self_dot(t: torch.Tensor) -> float:
        pointer = t.data_ptr()
        # ctypes passes the integers by address itself (the argument types are pointers to them).
        return routine(length(t.numel()), pointer, _ONE, pointer, _ONE)
    return self_dot


def _verified(routines: dict[torch.dtype, Callable[[torch.Tensor], float]]) -> bool:
    """Whether ``routines`` give torch.dot's bits on vectors of several lengths (BLAS routines
    split long vectors into blocks and lanes differently), and NaN for a vector holding one."""
    generator = torch.Generator().manual_seed(0)
    for dtype, routine in routines.items():
        for n in (1, 7, 64, 1000, 40_000):
            x = torch.randn(n, generator=generator, dtype=dtype) * 3
            if routine(x) != torch.dot(x, x).item():
                return False
        x[5] = float("nan")
        if not math.isnan(routine(x)):
            return False
    return True


def _load() -> dict[torch.dtype, Callable[[torch.Tensor], float]]:
    if sys.byteorder != "little" or os.environ.get("HYBRID_TRAINER_TORCH_DOTS") == "1":
        return {}
    try:
        library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        routines = {torch.float32: _routine(library, "sdot_", ctypes.c_float),
                    torch.float64: _routine(library, "ddot_", ctypes.c_double)}
    except (OSError, AttributeError):  # another platform's library name, or a BLAS without these symbols
        return {}
    return routines if _verified(routines) else {}


# Looked up and verified at import (a few small dots). ``HYBRID_TRAINER_TORCH_DOTS=1`` turns them
# off: the callers then use torch.dot, as where they are missing.
_ROUTINES = _load()


def self_dot_routine(dtype: torch.dtype) -> Callable[[torch.Tensor], float] | None:
    """The function giving a tensor's dot product with itself (the sum of the squares of its
    entries, as a Python float) for tensors of ``dtype``, or None where there is none (no
    verified routine for it): then the caller uses torch.

    It computes what ``torch.dot(t.view(-1), t.view(-1)).item()`` computes, bit for bit, for a
    contiguous dense CPU tensor ``t`` of ``dtype`` with fewer than :data:`INT_LIMIT` entries;
    the caller makes sure ``t`` is one (any other would be read wrongly). Non-finite where an
    entry is NaN or infinite, or where finite squares overflow the dtype."""
    return _ROUTINES.get(dtype)


def takes(t: torch.Tensor) -> bool:
    """Whether a routine of :func:`self_dot_routine` may read ``t`` (its dtype aside)."""
    return t.layout is torch.strided and t.device.type == "cpu" and t.is_contiguous() and t.numel() < INT_LIMIT

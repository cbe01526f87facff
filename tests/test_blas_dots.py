"""hybrid_trainer.blas_dots: BLAS's dot product called past torch's dispatcher gives torch.dot's
bits, and is offered only for what it can read."""
import math
import os
import subprocess
import sys

import pytest
import torch

from hybrid_trainer import blas_dots

needs_routines = pytest.mark.skipif(not blas_dots._ROUTINES, reason="this torch build exports no verified BLAS dot")


@needs_routines
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1,), (3,), (255,), (256, 256), (7, 11, 13), (0,), (100_003,)])
def test_self_dot_is_torch_dot_bit_for_bit(dtype, shape):
    generator = torch.Generator().manual_seed(sum(shape))
    t = torch.randn(shape, generator=generator, dtype=dtype) * 5
    flat = t.reshape(-1)
    assert blas_dots.self_dot_routine(dtype)(t) == torch.dot(flat, flat).item()


@needs_routines
def test_self_dot_reads_a_view_from_its_offset():
    base = torch.randn(10, 20)
    row = base[3]  # contiguous, a storage offset of 60 entries
    assert blas_dots.self_dot_routine(torch.float32)(row) == torch.dot(row, row).item()


@needs_routines
@pytest.mark.parametrize("bad, expect", [(float("nan"), "nan"), (float("inf"), "inf"), (-float("inf"), "inf"),
                                         (1e20, "inf")])  # 1e20 squared overflows float32
def test_self_dot_is_non_finite_for_a_non_finite_entry_or_an_overflow(bad, expect):
    t = torch.randn(1000)
    t[417] = bad
    value = blas_dots.self_dot_routine(torch.float32)(t)
    assert math.isnan(value) if expect == "nan" else value == math.inf


def test_routines_only_for_float32_and_float64():
    for dtype in (torch.float16, torch.bfloat16, torch.int32, torch.complex64):
        assert blas_dots.self_dot_routine(dtype) is None
    assert blas_dots.self_dot_routine(None) is None


@pytest.mark.parametrize("tensor, ok", [
    (torch.zeros(4, 5), True),
    (torch.zeros(5, 4).t(), False),  # not contiguous
    (torch.zeros(4, 5)[:, ::2], False),
    (torch.zeros(3, 3).to_sparse(), False),
])
def test_takes_only_contiguous_dense_cpu_tensors(tensor, ok):
    assert blas_dots.takes(tensor) is ok


def test_turned_off_by_the_environment_variable():
    code = "from hybrid_trainer import blas_dots; print(len(blas_dots._ROUTINES))"
    env = dict(os.environ, HYBRID_TRAINER_TORCH_DOTS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"


def test_a_routine_that_disagrees_with_torch_is_not_used():
    """The probe refuses routines whose bits differ from torch.dot's (a BLAS with another ABI)."""
    off_by_one = {torch.float32: lambda t: torch.dot(t, t).item() + 1.0}
    assert not blas_dots._verified(off_by_one)
    no_nan = {torch.float32: lambda t: float(torch.nan_to_num(t).dot(torch.nan_to_num(t)))}
    assert not blas_dots._verified(no_nan)
    assert blas_dots._verified({torch.float32: lambda t: torch.dot(t.reshape(-1), t.reshape(-1)).item()})

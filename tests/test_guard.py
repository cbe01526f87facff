"""Guard: fails when the kernel tests would silently run the eager fallback instead of a kernel.

A kernel module imported before TRITON_INTERPRET is set holds compiled-mode JITFunctions; the
dispatcher then sends CPU tensors to the eager path and every kernel test passes without running
a kernel. This test finds every @triton.jit function in hybrid_kernels and checks its mode.
"""
import importlib
import pkgutil

import pytest
import torch

import hybrid_kernels

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


def _kernels():
    found = {}
    for info in pkgutil.iter_modules(hybrid_kernels.__path__):
        module = importlib.import_module(f"hybrid_kernels.{info.name}")
        for name, obj in vars(module).items():
            inner = obj
            while hasattr(inner, "fn") and not isinstance(inner, (JITFunction, InterpretedFunction)):
                inner = inner.fn  # unwrap Autotuner / Heuristics
            if isinstance(inner, (JITFunction, InterpretedFunction)):
                found[f"{info.name}.{name}"] = inner
    return found


def test_package_has_kernels():
    names = set(_kernels())
    assert {"apply_delta._apply_delta_kernel", "int8_quant._quantize_kernel"} <= names


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels are compiled, not interpreted")
def test_every_kernel_is_interpreted_on_cpu():
    assert hybrid_kernels.INTERPRET
    compiled = [name for name, k in _kernels().items() if not isinstance(k, InterpretedFunction)]
    assert not compiled, f"decorated in compiled mode, so tests would take the eager path: {compiled}"


def test_cpu_calls_take_the_triton_path():
    hybrid_kernels.reset_backend_counts()
    hybrid_kernels.quantize_int8(torch.randn(10, device="cuda" if torch.cuda.is_available() else "cpu"))
    assert hybrid_kernels.last_backend("quantize_int8") == "triton"

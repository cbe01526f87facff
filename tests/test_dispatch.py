"""Backend selection, the HYBRID_KERNELS_BACKEND switch, and life without Triton."""
import os
import subprocess
import sys

import pytest
import torch

import hybrid_kernels as hk


def test_env_switch_forces_eager(monkeypatch, device):
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", "eager")
    hk.quantize_int8(torch.randn(5, device=device))
    assert hk.last_backend("quantize_int8") == "eager"


def test_counts_record_each_call(device):
    hk.reset_backend_counts()
    for _ in range(3):
        hk.quantize_int8(torch.randn(5, device=device))
    assert hk.backend_counts() == {("quantize_int8", "triton"): 3}


def test_invalid_switch_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", "cuda-please")
    with pytest.raises(ValueError, match="HYBRID_KERNELS_BACKEND='cuda-please'"):
        hk.quantize_int8(torch.randn(5))


def _run_python(code, **env):
    full_env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HYBRID_KERNELS_BACKEND")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
@pytest.mark.slow
def test_cpu_without_interpreter_runs_eager_and_refuses_forced_triton():
    code = (
        "import torch, hybrid_kernels as hk\n"
        "hk.quantize_int8(torch.randn(4)); print(hk.last_backend('quantize_int8'))\n"
        "import os; os.environ['HYBRID_KERNELS_BACKEND'] = 'triton'\n"
        "try:\n    hk.quantize_int8(torch.randn(4))\nexcept RuntimeError as e:\n    print('refused:', e)\n"
    )
    out = _run_python(code)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "eager"
    assert lines[1].startswith("refused:") and "TRITON_INTERPRET" in lines[1]


@pytest.mark.slow
def test_package_works_without_triton():
    """Triton wheels exist for Linux only; elsewhere every op must still run (eager)."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, hybrid_kernels as hk\n"
        "p = [torch.zeros(3)]; hk.apply_delta_(p, [torch.ones(3)], 2.0)\n"
        "q, s = hk.quantize_int8(torch.randn(8), 'block', block_size=4)\n"
        "print(hk.HAS_TRITON, hk.last_backend('apply_delta_'), p[0].tolist())\n"
    )
    out = _run_python(code, TRITON_INTERPRET="1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False eager [2.0, 2.0, 2.0]"

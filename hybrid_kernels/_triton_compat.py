"""One place for what differs between a GPU, the Triton interpreter and a machine without Triton.

* ``HAS_TRITON``: Triton imports (Linux wheels only; elsewhere every op runs its eager path).
* ``INTERPRET``: kernels in this process are decorated for the Triton interpreter. Triton reads
  ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a function, so this is evaluated once, when
  the first kernel module is imported, and must not change afterwards.
* ``rint``: fp32 round half to even without libdevice (the interpreter has none).
"""
from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # no Triton wheel for this platform: the eager path serves every call
    HAS_TRITON = False

    class _NoTritonLanguage:
        constexpr = object

    class _NoTriton:
        """Lets kernel modules be imported (decorators become no-ops); the kernels never run."""

        @staticmethod
        def jit(fn=None, **_kwargs):
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(int(n) - 1, 0).bit_length()

    triton = _NoTriton()  # type: ignore[assignment]
    tl = _NoTritonLanguage()  # type: ignore[assignment]

INTERPRET: bool = HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def rint(x):
    """Round fp32 half to even. Exact for |x| < 2**22: adding 1.5 * 2**23 pushes the fraction
    out of the mantissa, and IEEE addition rounds half to even (same as torch.round)."""
    return (x + 12582912.0) - 12582912.0

"""hybrid_kernels: the hot core of hybrid-trainer.

Every op follows one pattern, in one file per op (``apply_delta.py``, ``int8_quant.py``, ...):

1. **Triton kernel(s)** and their **launcher**: flat, contiguous tensors; all math in fp32.
2. **Eager reference** (``_<op>_eager``): plain PyTorch; the CPU production path and the
   oracle every kernel test compares against.
3. **Dispatch** (:mod:`hybrid_kernels._dispatch`): the Triton kernel serves CUDA tensors and,
   when the process decorated the kernels for the Triton interpreter (``TRITON_INTERPRET=1``
   before import, as the test suite does), CPU tensors; everything else runs eager.
   ``HYBRID_KERNELS_BACKEND=eager`` forces the eager path, ``=triton`` demands the kernel.
   ``last_backend(op)`` and ``backend_counts()`` say which path served a call.
4. **torch.library op** (``hybrid_kernels::<op>``) with a fake (meta) kernel, so the op is one
   opaque node under ``torch.compile``. In eager mode the public function calls the
   implementation directly: the dispatcher costs ~0.7 ms per call on a 200-tensor list (measured),
   more than the work itself on CPU.
5. **Public function** with argument checks: a wrong shape, dtype, device or length raises
   ``ValueError``/``TypeError`` naming the argument (and the list index).
"""
from ._dispatch import BACKEND_ENV, backend_counts, last_backend, reset_backend_counts
from ._triton_compat import HAS_TRITON, INTERPRET
from .adamw_lowbit import adamw_lowbit_update_
from .apply_delta import DeltaApplier, apply_delta_
from .attention_module import CausalSelfAttention
from .encode_state import StateHistory, encode_state
from .flash_attention import flash_attention
from .gru_cell import gru_cell
from .int8_quant import dequantize_int8, quantize_int8

__all__ = [
    "BACKEND_ENV",
    "CausalSelfAttention",
    "DeltaApplier",
    "HAS_TRITON",
    "INTERPRET",
    "StateHistory",
    "adamw_lowbit_update_",
    "apply_delta_",
    "backend_counts",
    "dequantize_int8",
    "encode_state",
    "flash_attention",
    "gru_cell",
    "last_backend",
    "quantize_int8",
    "reset_backend_counts",
]

"""Which torch ops a kernel wrapper issues on the host, outside the Triton interpreter.

On a GPU every one of them is a launch or an allocator call, and at small shapes those, not
the kernels, set the time of a call (docs/gpu.md). The interpreter's own bookkeeping ops
(copies in and out of its buffers) are left out by looking at who called.
"""
import sys

from torch.utils._python_dispatch import TorchDispatchMode


class HostOps(TorchDispatchMode):
    """Context manager; ``.ops`` lists the aten op names issued inside it, in order."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        from_interpreter = False
        while frame is not None:
            if "triton" in frame.f_code.co_filename and "interpreter" in frame.f_code.co_filename:
                from_interpreter = True
                break
            frame = frame.f_back
        if not from_interpreter:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

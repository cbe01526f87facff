"""Module buffers as they were before a step's forward, so that a refused step leaves no trace in them.

A train-mode forward updates batch-norm running statistics (and their counter) before the guard has seen
the loss. When the guard refuses the step, a NaN batch has by then written NaN into the running mean and
variance, and every later forward keeps it there (``0.9 * nan + 0.1 * x`` is NaN): training loss looks
normal, evaluation output is NaN for good. Restoring the last good state would undo it, but also the
weights' progress since; the statistics from just before the forward are the exact state the refused step
must leave, and they are small (two vectors per normalised layer), so a copy per step is cheap.

Cost: nothing for a model without buffers (a length check); one ``torch._foreach_copy_`` over the buffers
for a model with some (``python -m bench.buffer_guard`` measures both), and on a step whose checks wait
(:mod:`~hybrid_trainer.deferred_checks`) one in-place ``where`` a buffer after its update.
"""
from __future__ import annotations

from operator import attrgetter

import torch

_LAYOUT = attrgetter("shape", "dtype", "device")


class BufferGuard:
    """Keeps a copy of the buffers at ``slots`` (``(owning module, name)`` pairs from
    :func:`~hybrid_trainer.anchor.buffer_slots`) taken by :meth:`before_forward`, for :meth:`restore`.

    Buffers are looked up by name each time (a forward may reassign one), as in
    :class:`~hybrid_trainer.anchor.WeightAnchor`.
    """

    def __init__(self, slots: list[tuple[torch.nn.Module, str]]):
        self.slots = list(slots)
        self._saved: list[torch.Tensor] = []
        self._layout: list[tuple[torch.Size, torch.dtype, torch.device]] = []  # of the buffers _saved copies
        self._taken = False

    @property
    def active(self) -> bool:
        """Whether the model has buffers to keep (otherwise every method returns at once)."""
        return bool(self.slots)

    # No torch.no_grad(): buffers do not require grad, and entering it costs ~3 µs per call.
    def before_forward(self) -> None:
        """Copy the buffers as they are now (before the step's forward)."""
        if not self.slots:
            return
        buffers = [owner._buffers[name] for owner, name in self.slots]
        # The copies are remade only when a buffer's shape, dtype or device changed. The layouts
        # are read and compared in C (attrgetter, list equality): a generator comparing them pair
        # by pair took 8.1 µs for 12 buffers against 5.0 (timeit, one core), on every step.
        layout = list(map(_LAYOUT, buffers))
        if layout != self._layout:
            self._saved, self._layout = [torch.empty_like(b) for b in buffers], layout
        torch._foreach_copy_(self._saved, buffers)
        self._taken = True

    def restore(self) -> None:
        """Put the buffers back as :meth:`before_forward` found them (a refused step)."""
        if not self.slots or not self._taken:
            return
        for (owner, name), saved in zip(self.slots, self._saved):
            buffer = owner._buffers[name]
            if buffer.shape == saved.shape and buffer.dtype == saved.dtype:
                with torch.no_grad():  # rare (a refused step): a buffer registered with requires_grad
                    buffer.copy_(saved)
            else:  # reassigned with another shape by the forward: put the one from before back
                owner._buffers[name] = saved.clone()

    def restore_where(self, refused: torch.Tensor) -> None:
        """:meth:`restore` decided on the device: each buffer takes its saved value where
        ``refused`` (a 0-d tensor, 1 for a refused step, 0 otherwise) is 1, and keeps its own where
        it is 0, with no read of ``refused`` (a step whose checks wait, see
        :mod:`~hybrid_trainer.deferred_checks`). A buffer the forward reassigned with another
        shape cannot be chosen that way, and costs one read."""
        if not self.slots or not self._taken:
            return
        flag = refused.bool()
        # One op a buffer, written in place (``out=`` the buffer itself: an elementwise select
        # reads each entry before it writes it), and one no_grad for them all: a where and a copy
        # per buffer, each buffer in its own no_grad, were two launches and a context a buffer on
        # every step of a GPU (a ResNet-50 has 159 buffers).
        with torch.no_grad():  # a buffer registered with requires_grad: out= refuses it otherwise
            for (owner, name), saved in zip(self.slots, self._saved):
                buffer = owner._buffers[name]
                if buffer.shape == saved.shape and buffer.dtype == saved.dtype:
                    torch.where(flag, saved, buffer, out=buffer)
                elif bool(flag):
                    owner._buffers[name] = saved.clone()

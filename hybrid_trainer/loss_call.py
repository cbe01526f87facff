"""Calling the user's ``loss_fn``: micro-batches, autocast, and a clear error for a loss the
trainer cannot step on.

The trainer reads ``trainer.loss_fn`` at every call (a test or user may replace it after
construction), so these are functions of the loss function, not objects holding it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch


def micro_batches(batch: Any, grad_accumulation: int) -> Sequence[Any]:
    """``batch`` as the list of micro-batches one step runs: itself when ``grad_accumulation``
    is 1, else it must be a list of that many batches."""
    if grad_accumulation == 1:
        return [batch]
    # A list, not any sequence: a (inputs, targets) tuple is one batch, never two micro-batches.
    if not isinstance(batch, list) or len(batch) != grad_accumulation:
        raise ValueError(f"batch: with grad_accumulation={grad_accumulation}, pass a list of {grad_accumulation} "
                         f"micro-batches, got {type(batch).__name__}")
    return batch


def checked_loss(loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], model: torch.nn.Module, batch: Any,
                 autocast_dtype: str | None, device: torch.device) -> torch.Tensor:
    """``loss_fn(model, batch)`` under ``torch.autocast`` when ``autocast_dtype`` is set, as a
    0-d tensor; TypeError when it is not a one-element tensor, or (with gradients enabled) not
    attached to the graph."""
    if autocast_dtype is None:  # no context manager to build and enter on every step
        loss = loss_fn(model, batch)
    else:
        with torch.autocast(device.type, dtype=getattr(torch, autocast_dtype)):
            loss = loss_fn(model, batch)
    # Nearly every step: a 0-d tensor attached to the graph (three attribute reads, no call);
    # anything else goes through the checks below.
    if type(loss) is torch.Tensor and loss.requires_grad and loss.ndim == 0:
        return loss
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                        f"{'' if not isinstance(loss, torch.Tensor) else ' of shape ' + str(tuple(loss.shape))}")
    if torch.is_grad_enabled() and not loss.requires_grad:  # torch's own error names no culprit
        raise TypeError("loss_fn returned a loss detached from the model's parameters (no grad_fn): "
                        "return the tensor itself, not loss.item(), loss.detach() or one computed "
                        "under torch.no_grad()")
    # A view of a 0-d loss would only add a node to the autograd graph (~15 µs forward and
    # backward per step, a large share of a 1 ms step).
    return loss if loss.dim() == 0 else loss.reshape(())

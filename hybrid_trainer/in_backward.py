"""The optimizer step inside the backward pass: each parameter is updated as soon as its
gradient is complete (``register_post_accumulate_grad_hook``) and its gradient is freed at
once, so no step ever holds the gradients of the whole model (LOMO, arXiv 2306.09782; the
PyTorch tutorial "How to save memory by fusing the optimizer step into the backward pass").

What it rules out, and how the trainer handles each:

* **Global gradient clipping**: the global norm is known only after the last gradient, when
  every other parameter has already been updated. Refused (``HybridConfig.grad_clip`` must be
  None); the global norm is still measured (summed in the hooks) and reported after backward.
* **Gradient accumulation**: the hooks fire at every micro-batch's backward, and keeping the
  gradients between micro-batches is the memory this saves. Refused
  (``grad_accumulation`` must be 1).
* **The guard's finite check before any update**: replaced by three checks.
  (1) The loss is read before backward: a non-finite loss skips the backward, so nothing is
  updated. (2) Each hook checks its own gradient: a non-finite one is not applied, and no later
  hook of the step applies anything either. (3) Parameters whose finite gradients were applied
  before a later one came out non-finite are **undone** by the trainer from its last good state
  (``good_state_every > 0``: weights and optimizer state restored bit-exactly). Guarantee:
  NaN/Inf never reaches the weights or the optimizer state; with a good state kept, a step with
  any non-finite gradient leaves the model as the last good state; with ``good_state_every=0``
  such a step may stay partly applied (finite updates only), and the memory plan says so.
* **The update-recording of predicted steps** (``predict=True``): it brackets
  ``optimizer.step()``. Refused: the planner uses this technique with ``predict=False``.
"""
from __future__ import annotations

import math

import torch

__all__ = ["StepInBackward"]


class StepInBackward:
    """Hooks that step ``optimizer`` per parameter during backward.

    Args:
        params: the parameters to update (each must be in ``optimizer``).
        optimizer: an optimizer with ``step_param(p)`` (:class:`~hybrid_trainer.lowbit_adamw.LowBitAdamW`).

    Use: ``arm()`` before ``loss.backward()``, then ``finish()`` returns the global gradient
    norm of the step (non-finite if any gradient was) and whether some parameters were
    updated before a non-finite gradient was seen (then the step must be undone). Outside an
    armed backward the hooks do nothing (the gradients accumulate as usual).
    """

    def __init__(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer):
        if not callable(getattr(optimizer, "step_param", None)):
            raise TypeError(f"optimizer: {type(optimizer).__name__} has no step_param(p); the step inside the "
                            f"backward pass needs a per-parameter step (LowBitAdamW)")
        self.optimizer = optimizer
        self.params = list(params)
        self._armed = False
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]
        self.reset()

    def reset(self) -> None:
        self.norm_sq = 0.0
        self.updated = 0
        self.non_finite = False

    def arm(self) -> None:
        self.reset()
        self._armed = True

    def _hook(self, p: torch.Tensor) -> None:
        if not self._armed:
            return
        grad = p.grad
        if grad is not None and not self.non_finite:
            sq = float(torch.linalg.vector_norm(grad, dtype=torch.float32)) ** 2
            if math.isfinite(sq):
                self.norm_sq += sq
                self.optimizer.step_param(p, grad)
                self.updated += 1
            else:
                self.non_finite = True
        p.grad = None  # freed now: this is the memory the technique saves

    def finish(self) -> tuple[float, bool]:
        """``(global gradient norm, partly_applied)``; the norm is NaN when a gradient was not finite."""
        self._armed = False
        norm = float("nan") if self.non_finite else math.sqrt(self.norm_sq)
        return norm, self.non_finite and self.updated > 0

    def disarm(self) -> None:
        self._armed = False

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

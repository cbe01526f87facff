"""Calling the user's optimizer update as ``optimizer.step()`` does, without the profiler scope
torch opens around it while no profiler is recording.

Why: torch wraps every optimizer class's ``step`` (``Optimizer.profile_hook_step``) in
``torch.autograd.profiler.record_function``, whose enter and exit are two dispatcher calls that
build a TorchScript object whether or not a profiler is on: the same kind of cost as
``zero_grad``'s scope, which the trainer already avoids by setting the gradients to None. On one
CPU core the two scopes together cost a plain loop some 60-80 µs a step on the tiny and 1 ms MLPs
(``python -m bench.overhead``, its ``plain, no profiler scopes`` arm; docs/results/overhead.md),
more than the gradient pass of the trainer's NaN guard.

What the wrapper does besides the scope: it runs the optimizer-step pre- and post-hooks (torch's
global ones and the optimizer's own) around the update and calls ``_optimizer_step_code``, the
entry point the profiler's Python tracer watches. :class:`OptimizerStep` calls the wrapped update
itself only when none of that can matter: torch's wrapper is the class's ``step``, no profiler
records, no step hook is registered, and the instance's ``step`` is either the class's or the
LR scheduler's counting wrapper (whose flag it sets, so the scheduler does not warn that it was
stepped first). Anything else, a subclass with its own ``step`` outside torch's wrapper or a
``step`` replaced on the instance, is called as ``optimizer.step()``. The update is the same
call either way, so the weights and optimizer state are bit for bit the same
(tests/test_optimizer_call.py).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.optim import optimizer as torch_optimizer

# torch registers global step hooks into these dicts in place; they are never rebound.
_GLOBAL_PRE_HOOKS = torch_optimizer._global_optimizer_pre_hooks
_GLOBAL_POST_HOOKS = torch_optimizer._global_optimizer_post_hooks
_profiler_enabled = torch._C._autograd._profiler_enabled


def step_hooks_registered(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a step pre- or post-hook is registered, torch's global ones or ``optimizer``'s own
    (:meth:`OptimizerStep.lean` makes the same test inline: it runs every step)."""
    return bool(_GLOBAL_PRE_HOOKS or _GLOBAL_POST_HOOKS
                or optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks)


def unwrapped_step(step: Any) -> Callable[[torch.optim.Optimizer], Any] | None:
    """The update inside torch's profiling wrapper ``step`` (a class's ``step``), or None when
    ``step`` is not that wrapper."""
    if getattr(step, "hooked", False):
        return getattr(step, "__wrapped__", None)
    return None


class OptimizerStep:
    """``optimizer.step()`` for the trainer's real steps (module docstring): call it with no
    arguments; returns what the update returns."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._wrapper = type(optimizer).step
        # An Optimizer subclass that skipped Optimizer.__init__ has no hook dicts to look at.
        self._update = (unwrapped_step(self._wrapper) if hasattr(optimizer, "_optimizer_step_pre_hooks")
                        else None)

    def lean(self) -> bool:
        """Whether the next call goes straight to the update (no profiler, no hook, torch's
        wrapper still the class's ``step``)."""
        optimizer = self.optimizer
        if (self._update is None or _profiler_enabled() or _GLOBAL_PRE_HOOKS or _GLOBAL_POST_HOOKS
                or optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
                or type(optimizer).step is not self._wrapper):
            return False
        patched = optimizer.__dict__.get("step")
        # The LR scheduler's counting wrapper around the class's step is the only instance
        # replacement called past; any other one is the user's and runs.
        return patched is None or (getattr(patched, "_wrapped_by_lr_sched", False)
                                   and getattr(patched, "__wrapped__", None) is self._wrapper)

    def __call__(self) -> Any:
        optimizer = self.optimizer
        if not self.lean():
            return optimizer.step()
        if "step" in optimizer.__dict__:
            optimizer._opt_called = True  # what the scheduler's counting wrapper records
        return self._update(optimizer)

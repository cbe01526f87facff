"""Gradient checkpointing of chosen submodules, switchable at run time.

:class:`GradientCheckpointing` replaces the ``forward`` of each chosen submodule with an
instance-level wrapper. While the controller is ``active`` and autograd is recording, the wrapper
runs the original forward under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: the
module's internal activations are dropped after the forward and recomputed during backward, which
trades one extra forward of the module for the memory of everything it would have saved. Otherwise
(inactive, or under ``torch.no_grad()`` / ``torch.inference_mode()``) it calls the original forward
directly, so forward-only verification in PREDICT pays nothing.

Gradients are those of the unwrapped model: the recomputation runs the same ops on the same inputs
with the same RNG state (``checkpoint`` restores it), so on CPU they agree bit for bit.

Nothing is registered as a parameter or buffer, so ``state_dict`` is unchanged. The wrapper is a
small object holding its module (not a closure), so ``copy.deepcopy`` of a wrapped model gives a
copy whose wrappers point at the copied modules.
"""
from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

MAX_SUGGESTIONS = 5  # close matches listed in the error for an unknown module name


class _CheckpointedForward:
    """Instance-level ``forward`` of one wrapped module (see module docstring)."""

    def __init__(self, module: nn.Module, controller: GradientCheckpointing):
        self.module = module
        self.controller = controller
        # The class-level forward, called with the module explicitly: no bound method is kept,
        # so deepcopy maps ``self.module`` to the copied module through its memo.
        self.original = type(module).forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.controller.active and torch.is_grad_enabled():
            return checkpoint(self.original, self.module, *args, use_reentrant=False, **kwargs)
        return self.original(self.module, *args, **kwargs)


class GradientCheckpointing:
    """Run the forwards of chosen submodules of ``model`` under activation checkpointing.

    Args:
        model: the model whose submodules are wrapped (the model itself is named ``""``).
        modules: qualified names from ``model.named_modules()`` (e.g. ``"blocks.0"``).
        every_nth: keep every n-th of the candidate modules, counting from 1: with ``every_nth=2``
            the 2nd, 4th, ... candidates are wrapped (candidates in ``modules`` order, or in
            ``named_modules()`` order for ``module_type``).
        module_type: a class or tuple of classes; every instance in ``model`` is a candidate.

    Exactly one of ``modules`` and ``module_type`` must be given.

    Attributes:
        active: when False every wrapped module runs its plain forward (the trainer clears it
            outside FULL/CORRECT). Under ``torch.no_grad()`` forwards are always plain.
        wrapped: qualified names of the wrapped modules (empty after :meth:`remove`).
    """

    def __init__(self, model: nn.Module, modules: Sequence[str] | None = None, every_nth: int = 1,
                 module_type: type | tuple[type, ...] | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(every_nth, int) or isinstance(every_nth, bool) or every_nth < 1:
            raise ValueError(f"every_nth must be an int >= 1, got {every_nth!r}")
        if (modules is None) == (module_type is None):
            raise ValueError("give exactly one of modules (qualified names) or module_type "
                             f"(got modules={modules!r}, module_type={module_type!r})")
        named = dict(model.named_modules())
        if modules is not None:
            if isinstance(modules, str):
                raise TypeError(f"modules must be a sequence of names, not the string {modules!r}")
            candidates = []
            for name in modules:
                if name not in named:
                    close = difflib.get_close_matches(name, list(named), n=MAX_SUGGESTIONS)
                    hint = f"close matches: {close}" if close else "no close matches"
                    raise ValueError(f"module {name!r} is not in model.named_modules() ({hint})")
                if name in candidates:
                    raise ValueError(f"module {name!r} is listed twice")
                candidates.append(name)
        else:
            types = module_type if isinstance(module_type, tuple) else (module_type,)
            if not types or not all(isinstance(t, type) for t in types):
                raise TypeError(f"module_type must be a class or a tuple of classes, got {module_type!r}")
            candidates = [name for name, m in named.items() if isinstance(m, types)]
            if not candidates:
                raise ValueError(f"model has no submodule of type {module_type!r}")
        chosen = candidates[every_nth - 1::every_nth]
        for name in chosen:
            if "forward" in vars(named[name]):
                # Someone (another controller, a hook library) already replaced this forward;
                # stacking wrappers would make remove() order-dependent.
                raise ValueError(f"module {name!r} already has an instance-level forward")

        self.active = True
        self.wrapped: list[str] = []
        self._modules: dict[str, nn.Module] = {}
        for name in chosen:
            module = named[name]
            module.forward = _CheckpointedForward(module, self)
            self.wrapped.append(name)
            self._modules[name] = module

    def remove(self) -> None:
        """Restore the original forwards (idempotent)."""
        for module in self._modules.values():
            current = vars(module).get("forward")
            if isinstance(current, _CheckpointedForward) and current.controller is self:
                del module.forward
        self._modules.clear()
        self.wrapped = []

    def __repr__(self) -> str:
        return f"GradientCheckpointing(active={self.active}, wrapped={self.wrapped})"


def from_config(model: nn.Module, config) -> "GradientCheckpointing | None":
    """The gradient checkpointing ``config`` (a :class:`~hybrid_trainer.HybridConfig`) asks for
    on ``model`` (``checkpoint_modules`` or ``checkpoint_module_type``), or None."""
    if config.checkpoint_modules is None and config.checkpoint_module_type is None:
        return None
    module_type = None
    if config.checkpoint_module_type is not None:
        types = {type(m) for m in model.modules() if type(m).__name__ == config.checkpoint_module_type}
        if not types:
            names = sorted({type(m).__name__ for m in model.modules()})
            raise ValueError(f"HybridConfig.checkpoint_module_type={config.checkpoint_module_type!r}: no submodule "
                             f"of that class; the model has {names[:12]}")
        module_type = tuple(types)
    return GradientCheckpointing(model, modules=config.checkpoint_modules,
                                 every_nth=config.checkpoint_every_nth, module_type=module_type)

"""How many bytes of tensors does a trainer hold beyond what the plain loop holds?

The plain loop's memory is the model (parameters, buffers), its gradients and the optimizer's
state; :func:`trainer_tensor_bytes` walks everything else the trainer reaches through its
attributes (its collaborators, their lists, dicts and tuples) and sums the bytes of the distinct
tensor storages it finds, split by the collaborator that holds them and by where they live. It
counts what the trainer keeps in tensors, not the process's RSS: a snapshot written to a file is
not a tensor and is not counted, which is the point of writing it there.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch

# Reached through these, a tensor belongs to the plain loop (or the user), not to the trainer.
_NOT_THE_TRAINERS = ("model", "optimizer", "scheduler", "loss_fn", "scaler")


def _plain_loop_storages(trainer: Any) -> set[int]:
    """Storages of the model's parameters, buffers, gradients and the optimizer's state."""
    seen: set[int] = set()
    tensors: list[torch.Tensor] = []
    for p in getattr(trainer, "params", []):
        tensors.append(p)
        if p.grad is not None:
            tensors.append(p.grad)
    model = getattr(trainer, "model", None)
    if model is not None:
        tensors += list(model.parameters()) + list(model.buffers())
    optimizer = getattr(trainer, "optimizer", None)
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        seen.add(_storage_key(t))
    return seen


def _storage_key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr() or id(t)
    except RuntimeError:  # tensors without storage (meta, some subclasses)
        return id(t)


def _storage_bytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except RuntimeError:
        return t.numel() * t.element_size()


def trainer_tensor_bytes(trainer: Any, max_depth: int = 8) -> dict[str, Any]:
    """Bytes of the distinct tensor storages ``trainer`` holds beyond the plain loop's.

    Returns ``{"total": int, "by_device": {device: bytes}, "by_holder": {attribute: bytes}}``;
    ``by_holder`` is keyed by the trainer attribute through which a storage was first reached
    (e.g. ``"predictor"``, ``"good_state"``). Objects outside the ``hybrid_trainer`` and
    ``hybrid_kernels`` packages are not entered (besides containers), so the walk stays inside
    the trainer's own parts.
    """
    plain = _plain_loop_storages(trainer)
    seen_storages: set[int] = set()
    seen_objects: set[int] = set()
    alive: list[Any] = []
    by_device: Counter[str] = Counter()
    by_holder: Counter[str] = Counter()

    def visit(obj: Any, holder: str, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            key = _storage_key(obj)
            if key in plain or key in seen_storages:
                return
            seen_storages.add(key)
            size = _storage_bytes(obj)
            by_device[str(obj.device)] += size
            by_holder[holder] += size
            return
        if depth > max_depth or id(obj) in seen_objects or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
            return
        seen_objects.add(id(obj))
        alive.append(obj)  # an id is unique only while its object lives (temporary lists here)
        if isinstance(obj, dict):
            for value in obj.values():
                visit(value, holder, depth + 1)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for value in obj:
                visit(value, holder, depth + 1)
        elif isinstance(obj, torch.nn.Module):  # e.g. the dynamics model's networks
            visit(list(obj.parameters()) + list(obj.buffers()), holder, depth + 1)
        elif isinstance(obj, torch.optim.Optimizer):  # e.g. the dynamics model's own optimizer
            visit(list(obj.state.values()), holder, depth + 1)
        elif type(obj).__module__.split(".")[0] in ("hybrid_trainer", "hybrid_kernels"):
            attrs = getattr(obj, "__dict__", None)
            if attrs is None:
                attrs = {name: getattr(obj, name, None) for name in getattr(type(obj), "__slots__", ())}
            for name, value in attrs.items():
                visit(value, holder, depth + 1)

    for name, value in vars(trainer).items():
        if name not in _NOT_THE_TRAINERS:
            visit(value, name, 0)
    return {"total": sum(by_device.values()), "by_device": dict(by_device), "by_holder": dict(by_holder)}

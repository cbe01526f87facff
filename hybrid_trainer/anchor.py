"""Exact snapshots of weights, module buffers and optionally optimizer state, for bit-exact rollback.

Rollback never subtracts the applied deltas (float addition is not invertible); it copies the
saved values back. Copies are allocated once and refreshed with ``copy_``, so taking an anchor
allocates nothing after the first time, and restoring never reallocates a parameter.

Module buffers (batch-norm running statistics and their counters) are part of the snapshot: a
train-mode forward updates them, so a verification forward through rejected weights, or the
forward of a step whose loss spiked, would otherwise leave its trace after the weights went back.
Buffers are looked up by name at every snapshot and restore: a forward that reassigns one
(``self.mean = 0.9 * self.mean + ...``, as custom normalisers do) leaves a new tensor under the
name, and a reference taken once would keep snapshotting and restoring the discarded one.
"""
from __future__ import annotations

import torch


class WeightAnchor:
    """A saved copy of ``params`` (and of the optimizer's tensor state when asked).

    Args:
        params: the tensors to snapshot (model parameters, in a fixed order).
        device: where the copy lives (default: beside each parameter). ``"cpu"`` keeps GPU
            memory free at the cost of a device-to-host copy per snapshot.
        buffers: module buffers to snapshot with them, as ``(module, name)`` pairs (any dtype;
            see :func:`buffer_slots`).
    """

    def __init__(self, params: list[torch.Tensor], device: str | torch.device | None = None,
                 buffers: list[tuple[torch.nn.Module, str]] | None = None):
        self.params = params
        self.buffer_slots = list(buffers or [])
        self._device = None if device is None else torch.device(device)
        self._saved: list[torch.Tensor] | None = None
        self._buffers_saved: list[torch.Tensor] = []
        self._optimizer_saved: dict[int, dict[str, torch.Tensor | object]] | None = None
        self.step: int | None = None  # trainer step at which the snapshot was taken

    @property
    def is_set(self) -> bool:
        return self._saved is not None

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The tensors the model holds under the snapshotted buffer names now."""
        return [module._buffers[name] for module, name in self.buffer_slots]

    @torch.no_grad()
    def save(self, step: int, optimizer: torch.optim.Optimizer | None = None) -> None:
        if self._saved is None:
            self._saved = [torch.empty_like(p, device=self._device or p.device) for p in self.params]
        buffers = self.buffers
        if [(s.shape, s.dtype) for s in self._buffers_saved] != [(b.shape, b.dtype) for b in buffers]:
            self._buffers_saved = [torch.empty_like(b, device=self._device or b.device) for b in buffers]
        torch._foreach_copy_(self._saved, [p.detach() for p in self.params])
        for saved, buffer in zip(self._buffers_saved, buffers):
            saved.copy_(buffer)
        if optimizer is not None:
            self._save_optimizer(optimizer)
        else:
            self._optimizer_saved = None
        self.step = step

    def _save_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        saved = self._optimizer_saved if self._optimizer_saved is not None else {}
        for p in self.params:
            state = optimizer.state.get(p, {})
            slot = saved.setdefault(id(p), {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    buffer = slot.get(key)
                    if not isinstance(buffer, torch.Tensor) or buffer.shape != value.shape:
                        buffer = torch.empty_like(value, device=self._device or value.device)
                        slot[key] = buffer
                    buffer.copy_(value)
                else:
                    slot[key] = value
        self._optimizer_saved = saved

    @torch.no_grad()
    def restore(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Copy the snapshot back into the same storages (bit-exact, no reallocation)."""
        if self._saved is None:
            raise RuntimeError("WeightAnchor.restore() called before save()")
        torch._foreach_copy_([p.detach() for p in self.params], self._saved)
        for (module, name), saved in zip(self.buffer_slots, self._buffers_saved):
            buffer = module._buffers[name]
            if buffer.shape == saved.shape and buffer.dtype == saved.dtype:
                buffer.copy_(saved)
            else:  # reassigned with another shape since the snapshot: put the saved one back
                module._buffers[name] = saved.clone().to(buffer.device)
        if optimizer is not None and self._optimizer_saved is not None:
            for p in self.params:
                slot = self._optimizer_saved.get(id(p))
                if not slot:
                    optimizer.state.pop(p, None)
                    continue
                state = optimizer.state.setdefault(p, {})
                for key, value in slot.items():
                    if isinstance(value, torch.Tensor) and isinstance(state.get(key), torch.Tensor) \
                            and state[key].shape == value.shape:
                        state[key].copy_(value)
                    else:
                        state[key] = value.clone() if isinstance(value, torch.Tensor) else value

    def state_dict(self) -> dict:
        if self._saved is None:
            return {"step": None}
        state = {"step": self.step, "params": [t.clone() for t in self._saved],
                 "buffers": [t.clone() for t in self._buffers_saved]}
        if self._optimizer_saved is not None:
            state["optimizer"] = [
                {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in self._optimizer_saved.get(id(p), {}).items()}
                for p in self.params
            ]
        return state

    def load_state_dict(self, state: dict) -> None:
        self.step = state.get("step")
        if "params" not in state:
            self._saved, self._optimizer_saved = None, None
            return
        self._saved = [saved.to(self._device or p.device).clone() for saved, p in zip(state["params"], self.params)]
        # A checkpoint from before buffers were snapshotted: start from the model's current ones.
        saved_buffers = state.get("buffers") or [b.detach() for b in self.buffers]
        if len(saved_buffers) != len(self.buffers):
            raise ValueError(f"anchor state holds {len(saved_buffers)} module buffers, the model has {len(self.buffers)}")
        self._buffers_saved = [saved.to(self._device or b.device).clone() for saved, b in zip(saved_buffers, self.buffers)]
        if "optimizer" in state:
            self._optimizer_saved = {
                id(p): {k: (v.to(self._device or p.device) if isinstance(v, torch.Tensor) else v) for k, v in slot.items()}
                for p, slot in zip(self.params, state["optimizer"])
            }
        else:
            self._optimizer_saved = None


def buffer_slots(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """Where the buffers ``module`` saves in its ``state_dict`` (running statistics, counters)
    live, as ``(owning module, name)``, each buffer once: non-persistent buffers are caches the
    forward does not change (masks, rotary tables)."""
    seen: set[int] = set()
    slots = []
    for owner in module.modules():  # modules() yields a shared submodule once
        for name, tensor in owner._buffers.items():
            if tensor is not None and name not in owner._non_persistent_buffers_set and id(tensor) not in seen:
                seen.add(id(tensor))
                slots.append((owner, name))
    return slots

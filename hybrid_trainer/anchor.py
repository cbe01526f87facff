"""Exact snapshots of weights, module buffers and optionally optimizer state, for bit-exact rollback.

Rollback never subtracts the applied deltas (float addition is not invertible); it copies the
saved values back, into the same storages (restoring never reallocates a parameter).

Where the copy lives (``storage``):

* ``"device"``: beside each tensor, allocated once and refreshed with ``copy_``. The fastest to
  take and restore, and the costliest in memory: a snapshot with the optimizer state of AdamW
  is three times the weights, on the device that trains.
* ``"host"``: in host memory (page-locked on a GPU, so the device-to-host copy is queued without
  waiting; a restore or read waits for it). On a CPU the host *is* the device: same as ``"device"``.
* ``"file"``: written to an unlinked temporary file (``os.pwritev``: one system call for all
  tensors, straight from their memory, no staging copy) and read back in place with
  ``os.preadv``. The bytes go to the kernel's page cache and on to disk by its own background
  writeback; they are not the process's memory and the page cache may drop them once written.
  The file has no name, so nothing is left behind whatever ends the process.

A snapshot in a file costs a memory copy per save (about what ``"device"`` costs) and a read per
restore; it suits a snapshot taken rarely and restored more rarely still (the divergence
rollback's good state, every ``good_state_every`` real steps), not the predict phase's anchor,
which is taken at every verification. ``save(..., background=True)`` writes the file on the
process's snapshot thread (``os.pwritev`` releases the GIL), so that the write overlaps what the caller
does next; the module buffers are copied first, since a forward changes them. The caller must
not change the weights or optimizer state until :meth:`WeightAnchor.wait` returns (the trainer
waits before its next update); every method that reads or replaces the snapshot waits first.

Optimizer state held in a tensor subclass that wraps plain tensors (torchao's 8/4-bit
``OptimState``: codes, scales, a code map) is saved and restored through its inner tensors
(``__tensor_flatten__``), bit-exactly like any other state: such subclasses implement neither
``empty_like`` nor a byte view of themselves.

Module buffers (batch-norm running statistics and their counters) are part of the snapshot: a
train-mode forward updates them, so a verification forward through rejected weights, or the
forward of a step whose loss spiked, would otherwise leave its trace after the weights went back.
Buffers are looked up by name at every snapshot and restore: a forward that reassigns one
(``self.mean = 0.9 * self.mean + ...``, as custom normalisers do) leaves a new tensor under the
name, and a reference taken once would keep snapshotting and restoring the discarded one.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import os
import tempfile
import threading
from typing import Any

import torch

STORAGES = ("device", "host", "file")
_IOV_MAX = 1024  # buffers per pwritev/preadv call (Linux's IOV_MAX)
_CALL_BYTES = 1 << 30  # bytes per call: Linux moves at most ~2 GiB per read/write call


def _byte_view(t: torch.Tensor) -> memoryview:
    """Writable bytes of a contiguous CPU tensor (any dtype), sharing its memory. The view does
    not keep the memory alive: the caller holds ``t`` while it uses the view.

    Made from the tensor's address rather than through ``reshape``, ``view(uint8)`` and
    ``numpy()``: those are four dispatcher calls per tensor, which were most of a small model's
    snapshot (the tiny MLP's 16 tensors of weights and AdamW state)."""
    return memoryview((ctypes.c_char * t.nbytes).from_address(t.data_ptr())).cast("B")


class _FileTensors:
    """Tensors kept at fixed offsets of an unlinked temporary file: one ``pwritev`` to save
    them all, one ``preadv`` to read them back into tensors of the same shapes and dtypes."""

    def __init__(self, directory: str | None = None):
        self._file = tempfile.TemporaryFile(dir=directory)  # unlinked at once; closed with this object
        self.layout: list[tuple[torch.Size, torch.dtype, torch.device]] = []

    def __len__(self) -> int:
        return len(self.layout)

    def close(self) -> None:
        self._file.close()

    def write(self, tensors: list[torch.Tensor],
              background: bool = False) -> concurrent.futures.Future | None:
        """Write ``tensors`` from offset 0 (their layout replaces the last one); with
        ``background``, on the snapshot thread (:func:`_snapshot_thread`), whose future is
        returned: the caller keeps the tensors unchanged until its ``result()`` returns."""
        self.layout = [(t.shape, t.dtype, t.device) for t in tensors]
        # Held until the transfer is done (by this frame, or by the closure on the snapshot
        # thread): the byte views do not keep the tensors' memory alive.
        sources = [t if t.is_cpu and t.is_contiguous() else t.detach().cpu().contiguous() for t in tensors]
        if background:  # the views too are made there (~1.5 µs each through ctypes)
            return _snapshot_thread().submit(
                lambda: self._transfer(os.pwritev, [_byte_view(t) for t in sources if t.nbytes]))
        self._transfer(os.pwritev, [_byte_view(t) for t in sources if t.nbytes])
        return None

    def read_into(self, targets: list[torch.Tensor]) -> None:
        """Read every saved tensor into ``targets`` (same shapes and dtypes), bit-exact."""
        staged = []  # targets the file cannot be read into directly: read to the host, then copied
        views = []
        for t in targets:
            if t.nbytes == 0:
                continue
            if t.is_cpu and t.is_contiguous():
                views.append(_byte_view(t))
            else:
                host = torch.empty(t.shape, dtype=t.dtype)
                staged.append((t, host))
                views.append(_byte_view(host))
        self._transfer(os.preadv, views)
        for target, host in staged:
            target.copy_(host)

    def read(self, indices: list[int] | None = None) -> list[torch.Tensor]:
        """New CPU tensors holding the saved values (all of them, or those at ``indices``)."""
        tensors = [torch.empty(shape, dtype=dtype) for shape, dtype, _ in self.layout]
        self.read_into(tensors)
        return tensors if indices is None else [tensors[i] for i in indices]

    def _transfer(self, call, views: list[memoryview]) -> None:
        fd, offset, i = self._file.fileno(), 0, 0
        while i < len(views):
            batch, size = [], 0
            while i < len(views) and len(batch) < _IOV_MAX and (not batch or size + views[i].nbytes <= _CALL_BYTES):
                batch.append(views[i])
                size += views[i].nbytes
                i += 1
            done = call(fd, batch, offset)
            if done != size:  # a short transfer (rare): finish each buffer on its own
                self._finish(call, fd, batch, offset, done)
            offset += size

    @staticmethod
    def _finish(call, fd: int, batch: list[memoryview], offset: int, done: int) -> None:
        for view in batch:
            n = view.nbytes
            if done >= n:
                done -= n
                offset += n
                continue
            pos = done
            while pos < n:
                moved = call(fd, [view[pos:]], offset + pos)
                if moved <= 0:
                    raise OSError(f"snapshot file: {call.__name__} moved {moved} bytes at offset {offset + pos}")
                pos += moved
            done = 0
            offset += n


_WRITER: concurrent.futures.ThreadPoolExecutor | None = None
_WRITER_LOCK = threading.Lock()


def _snapshot_thread() -> concurrent.futures.ThreadPoolExecutor:
    """The process's snapshot thread, one for every background write of the process
    (``os.pwritev`` releases the GIL, so the caller's Python and torch's ops go on meanwhile):
    started at the first one; Python waits for its queued writes at exit. A thread started per
    write cost about as much as the 1 ms MLP's write it was to hide, on this project's CI host (a
    VM). After a ``fork`` the child starts its own."""
    global _WRITER
    with _WRITER_LOCK:
        if _WRITER is None:
            _WRITER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybrid-trainer-snapshot")
        return _WRITER


def _forget_snapshot_thread() -> None:
    global _WRITER, _WRITER_LOCK
    _WRITER, _WRITER_LOCK = None, threading.Lock()  # the parent's thread is not in the child


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_snapshot_thread)


class _FileSlot(int):
    """Marks an optimizer-state tensor kept in the file: its index there (a plain int stays a
    value, e.g. an optimizer's integer step count)."""


def _is_subclass_state(value: Any) -> bool:
    """A tensor subclass that wraps plain tensors (``__tensor_flatten__``), e.g. torchao's 8/4-bit
    optimizer state (``OptimState8bit``/``OptimState4bit``): it implements neither ``empty_like``
    nor ``view(dtype)``, so it is copied through its inner tensors instead."""
    return (isinstance(value, torch.Tensor) and type(value) not in (torch.Tensor, torch.nn.Parameter)
            and hasattr(value, "__tensor_flatten__"))


class _SubclassState:
    """The saved state of a tensor subclass (:func:`_is_subclass_state`): its inner tensors by the
    names ``__tensor_flatten__`` gives, each copied as a plain tensor (``"device"``/``"host"``) or
    kept at a :class:`_FileSlot` (``"file"``), and what ``__tensor_unflatten__`` needs to rebuild
    it. Restoring copies the inner tensors back into the optimizer's own object when it still has
    the saved class, attributes and inner shapes (bit-exact, no reallocation), else rebuilds one."""

    def __init__(self, value: torch.Tensor, inner: dict[str, Any]):
        self.cls = type(value)
        self.context = value.__tensor_flatten__()[1]
        self.size, self.stride = value.size(), value.stride()
        self.inner = inner

    @staticmethod
    def parts(value: torch.Tensor) -> dict[str, torch.Tensor]:
        """The inner tensors of ``value`` by name; each must be a plain tensor."""
        inner = {name: getattr(value, name) for name in value.__tensor_flatten__()[0]}
        for name, t in inner.items():
            if type(t) not in (torch.Tensor, torch.nn.Parameter):
                raise TypeError(f"optimizer state of type {type(value).__name__}: its inner tensor {name!r} is a "
                                f"{type(t).__name__}; only one level of tensor subclass can be snapshotted")
        return inner

    def fits(self, value: Any, layout: dict[str, tuple[torch.Size, torch.dtype]]) -> bool:
        """Whether ``value`` is an object of the saved class and attributes whose inner tensors
        have the shapes and dtypes of ``layout``, so the saved bits can be copied into it."""
        if type(value) is not self.cls or value.__tensor_flatten__()[1] != self.context:
            return False
        parts = self.parts(value)
        return parts.keys() == layout.keys() and all(
            (parts[n].shape, parts[n].dtype) == shape_dtype for n, shape_dtype in layout.items())

    def rebuild(self, inner: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.cls.__tensor_unflatten__(inner, self.context, self.size, self.stride)


class WeightAnchor:
    """A saved copy of ``params`` (and of the optimizer's tensor state when asked).

    Args:
        params: the tensors to snapshot (model parameters, in a fixed order).
        device: for ``storage="device"``, where the copy lives (default: beside each parameter).
        buffers: module buffers to snapshot with them, as ``(module, name)`` pairs (any dtype;
            see :func:`buffer_slots`).
        storage: ``"device"``, ``"host"`` or ``"file"`` (see the module docstring).
        directory: for ``storage="file"``, the folder of the temporary file (default: the
            system's temporary folder, ``TMPDIR``).
    """

    def __init__(self, params: list[torch.Tensor], device: str | torch.device | None = None,
                 buffers: list[tuple[torch.nn.Module, str]] | None = None, storage: str = "device",
                 directory: str | None = None):
        if storage not in STORAGES:
            raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
        self.params = params
        self.buffer_slots = list(buffers or [])
        self.storage = storage
        self.directory = directory
        self._device = None if device is None else torch.device(device)
        self._saved: list[torch.Tensor] | None = None  # "device"/"host": the copies
        self._file: _FileTensors | None = None  # "file": where the copies are
        self._is_set = False
        self._buffers_saved: list[torch.Tensor] = []
        self._buffer_layout: list[tuple[torch.Size, torch.dtype]] = []
        # Per parameter: {key: tensor copy ("device"/"host"), index into the file ("file"), or a
        # non-tensor value}; None when the optimizer was not snapshotted.
        self._optimizer_saved: list[dict[str, Any]] | None = None
        # "file": (param index, key, inner tensor name of a subclass state or None) per file slot
        self._optimizer_tensor_keys: list[tuple[int, str, str | None]] = []
        self._pending: torch.cuda.Event | None = None  # "host" on a GPU: the copy in flight
        self._writing: concurrent.futures.Future | None = None  # "file", save(background=True): the write in flight
        self.step: int | None = None  # trainer step at which the snapshot was taken

    @property
    def is_set(self) -> bool:
        return self._is_set

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The tensors the model holds under the snapshotted buffer names now."""
        return [module._buffers[name] for module, name in self.buffer_slots]

    def _home(self, t: torch.Tensor) -> torch.device:
        if self.storage == "host":
            return torch.device("cpu")
        return self._device or t.device

    def _copy_for(self, t: torch.Tensor) -> torch.Tensor:
        pinned = self.storage == "host" and t.device.type == "cuda"
        return torch.empty(t.shape, dtype=t.dtype, device=self._home(t), pin_memory=pinned)

    # -------------------------------------------------------------------------- save ----
    @torch.no_grad()
    def save(self, step: int, optimizer: torch.optim.Optimizer | None = None, background: bool = False) -> None:
        """Snapshot the weights, the module buffers and (with ``optimizer``) its state at
        ``step``. ``background`` (``"file"`` only; elsewhere the copy is as fast as a write could
        be started): the file is written from a thread while the caller goes on, and the weights
        and optimizer state must stay unchanged until :meth:`wait` (module docstring)."""
        self._join_write()  # one still in flight writes to the same file
        slots = self._optimizer_slots(optimizer) if optimizer is not None else None
        if self.storage == "file":  # only their bytes are read: no detached alias needed (a dispatcher call each)
            self._save_to_file(self.params, self.buffers, slots, background)
        else:
            self._save_to_memory([p.detach() for p in self.params], [b.detach() for b in self.buffers], slots)
        self._is_set = True
        self.step = step

    def _optimizer_slots(self, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
        return [dict(optimizer.state.get(p, {})) for p in self.params]

    def _save_to_memory(self, params, buffers, slots) -> None:
        if self._saved is None:
            self._saved = [self._copy_for(p) for p in params]
        if [(s.shape, s.dtype) for s in self._buffers_saved] != [(b.shape, b.dtype) for b in buffers]:
            self._buffers_saved = [self._copy_for(b) for b in buffers]
        non_blocking = self.storage == "host"
        torch._foreach_copy_(self._saved, params, non_blocking=non_blocking)
        for saved, buffer in zip(self._buffers_saved, buffers):
            saved.copy_(buffer, non_blocking=non_blocking)
        if slots is None:
            self._optimizer_saved = None
        else:
            previous = self._optimizer_saved or [{} for _ in slots]
            saved_slots = []
            for state, old in zip(slots, previous):
                slot = {}
                for key, value in state.items():
                    if _is_subclass_state(value):
                        slot[key] = self._save_subclass(value, old.get(key), non_blocking)
                    elif isinstance(value, torch.Tensor):
                        copy = old.get(key)
                        if not isinstance(copy, torch.Tensor) or copy.shape != value.shape or copy.dtype != value.dtype:
                            copy = self._copy_for(value)
                        copy.copy_(value, non_blocking=non_blocking)
                        slot[key] = copy
                    else:
                        slot[key] = value
                saved_slots.append(slot)
            self._optimizer_saved = saved_slots
        if non_blocking and any(p.device.type == "cuda" for p in params):
            self._pending = torch.cuda.Event()
            self._pending.record()

    def _save_subclass(self, value: torch.Tensor, old: Any, non_blocking: bool) -> _SubclassState:
        """A copy of each inner tensor of ``value``, into ``old``'s copies where they fit."""
        parts = _SubclassState.parts(value)
        if not (isinstance(old, _SubclassState)
                and old.fits(value, {n: (c.shape, c.dtype) for n, c in old.inner.items()})):
            old = _SubclassState(value, {n: self._copy_for(t) for n, t in parts.items()})
        for name, t in parts.items():
            old.inner[name].copy_(t, non_blocking=non_blocking)
        return old

    def _save_to_file(self, params, buffers, slots, background: bool = False) -> None:
        if self._file is None:
            self._file = _FileTensors(self.directory)
        # A write in the background copies the buffers first: the caller's next forward changes them.
        tensors = list(params) + ([b.detach().clone() for b in buffers] if background else list(buffers))
        self._buffer_layout = [(b.shape, b.dtype) for b in buffers]
        self._optimizer_tensor_keys = []
        if slots is None:
            self._optimizer_saved = None
        else:
            saved_slots = []
            for i, state in enumerate(slots):
                slot = {}
                for key, value in state.items():
                    if _is_subclass_state(value):
                        inner = {}
                        for name, t in _SubclassState.parts(value).items():
                            inner[name] = _FileSlot(len(tensors))
                            self._optimizer_tensor_keys.append((i, key, name))
                            tensors.append(t.detach())
                        slot[key] = _SubclassState(value, inner)
                    elif isinstance(value, torch.Tensor):
                        slot[key] = _FileSlot(len(tensors))
                        self._optimizer_tensor_keys.append((i, key, None))
                        tensors.append(value)
                    else:
                        slot[key] = value
                saved_slots.append(slot)
            self._optimizer_saved = saved_slots
        # Set again by the caller once the write is under way: one that fails leaves neither the
        # last snapshot nor this one in the file (a background write's failure: at _wait).
        self._is_set = False
        self._writing = self._file.write(tensors, background)

    def wait(self) -> None:
        """Wait until the snapshot is wholly written (a background write, a GPU's copy to the
        host); raises what a background write raised, after which no snapshot is set."""
        self._wait()

    def _wait(self) -> None:
        self._join_write()
        if self._pending is not None:
            self._pending.synchronize()
            self._pending = None

    def _join_write(self) -> None:
        if self._writing is not None:
            writing, self._writing = self._writing, None
            try:
                writing.result()  # raises what the write raised
            except BaseException:
                self._is_set = False  # the file holds part of this snapshot and part of the last
                raise

    # ----------------------------------------------------------------------- restore ----
    @torch.no_grad()
    def restore(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Copy the snapshot back into the same storages (bit-exact, no reallocation)."""
        self._wait()
        if not self._is_set:
            raise RuntimeError("WeightAnchor.restore() called before save()")
        if self.storage == "file":
            self._restore_from_file(optimizer)
            return
        torch._foreach_copy_([p.detach() for p in self.params], self._saved)
        for (module, name), saved in zip(self.buffer_slots, self._buffers_saved):
            _restore_buffer(module, name, saved)
        if optimizer is not None and self._optimizer_saved is not None:
            for p, slot in zip(self.params, self._optimizer_saved):
                if not slot:
                    optimizer.state.pop(p, None)
                    continue
                state = optimizer.state.setdefault(p, {})
                for key, value in slot.items():
                    current = state.get(key)
                    if isinstance(value, _SubclassState):
                        if value.fits(current, {n: (c.shape, c.dtype) for n, c in value.inner.items()}):
                            for name, part in _SubclassState.parts(current).items():
                                part.copy_(value.inner[name])
                        else:
                            state[key] = value.rebuild({n: c.to(p.device, copy=True) for n, c in value.inner.items()})
                    elif isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor) \
                            and current.shape == value.shape and current.dtype == value.dtype:
                        current.copy_(value)
                    elif isinstance(value, torch.Tensor):
                        state[key] = value.to(p.device, copy=True)
                    else:
                        state[key] = value

    def _restore_from_file(self, optimizer: torch.optim.Optimizer | None) -> None:
        targets = [p.detach() for p in self.params]
        # Buffers: in place where the model's has the saved shape and dtype, else a new tensor.
        buffer_targets = []
        for (module, name), (shape, dtype) in zip(self.buffer_slots, self._buffer_layout):
            buffer = module._buffers[name]
            buffer_targets.append(buffer if buffer.shape == shape and buffer.dtype == dtype
                                  else torch.empty(shape, dtype=dtype, device=buffer.device))
        targets += buffer_targets
        with_optimizer = optimizer is not None and self._optimizer_saved is not None
        # (param index, key, inner tensor name or None) -> the tensor the file is read into: the
        # optimizer's own where it has the saved shape and dtype (a subclass: the saved class and
        # attributes too), else a new one.
        restored: dict[tuple[int, str, str | None], torch.Tensor] = {}
        in_place: dict[tuple[int, str], bool] = {}
        for index, key, name in self._optimizer_tensor_keys:
            shape, dtype, device = self._file.layout[len(targets)]
            current = optimizer.state.get(self.params[index], {}).get(key) if with_optimizer else None
            if name is not None:
                if (index, key) not in in_place:
                    saved = self._optimizer_saved[index][key]
                    in_place[(index, key)] = saved.fits(current, {n: self._file.layout[slot][:2]
                                                                  for n, slot in saved.inner.items()})
                current = _SubclassState.parts(current)[name] if in_place[(index, key)] else None
            if not (isinstance(current, torch.Tensor) and current.shape == shape and current.dtype == dtype):
                current = torch.empty(shape, dtype=dtype, device=self.params[index].device)
            restored[(index, key, name)] = current
            targets.append(current)
        self._file.read_into(targets)  # params, buffers and optimizer tensors: one read
        for (module, name), target in zip(self.buffer_slots, buffer_targets):
            if module._buffers[name] is not target:  # reassigned with another shape since the snapshot
                module._buffers[name] = target
        if not with_optimizer:
            return
        for index, (p, slot) in enumerate(zip(self.params, self._optimizer_saved)):
            if not slot:
                optimizer.state.pop(p, None)
                continue
            state = optimizer.state.setdefault(p, {})
            for key, value in slot.items():
                if isinstance(value, _SubclassState):
                    if not in_place[(index, key)]:
                        state[key] = value.rebuild({n: restored[(index, key, n)] for n in value.inner})
                else:
                    state[key] = restored[(index, key, None)] if isinstance(value, _FileSlot) else value

    def release(self) -> None:
        """Free the snapshot's memory (or file); :attr:`is_set` is False until the next save."""
        try:
            self._wait()
        except OSError:  # a failed background write: the snapshot it left goes now anyway
            pass
        self._saved, self._buffers_saved, self._optimizer_saved = None, [], None
        self._optimizer_tensor_keys, self._buffer_layout = [], []
        if self._file is not None:
            self._file.close()
            self._file = None
        self._is_set = False

    # -------------------------------------------------------------------- checkpoint ----
    def _saved_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[dict] | None]:
        """(params, buffers, optimizer slots) of the snapshot as CPU copies (never copies on the
        device: a checkpoint written under memory pressure must not need more of it)."""
        if self.storage == "file":
            tensors = self._file.read()
            n, m = len(self.params), len(self._buffer_layout)
            slots = None if self._optimizer_saved is None else [
                {k: (tensors[v] if isinstance(v, _FileSlot) else
                     v.rebuild({name: tensors[i] for name, i in v.inner.items()}) if isinstance(v, _SubclassState) else v)
                 for k, v in slot.items()}
                for slot in self._optimizer_saved]
            return tensors[:n], tensors[n:n + m], slots
        self._wait()
        to_cpu = lambda t: t.to("cpu", copy=True)  # noqa: E731
        slots = None if self._optimizer_saved is None else [
            {k: (to_cpu(v) if isinstance(v, torch.Tensor) else
                 v.rebuild({name: to_cpu(t) for name, t in v.inner.items()}) if isinstance(v, _SubclassState) else v)
             for k, v in slot.items()}
            for slot in self._optimizer_saved]
        return [to_cpu(t) for t in self._saved], [to_cpu(t) for t in self._buffers_saved], slots

    def state_dict(self) -> dict:
        """The snapshot as CPU tensors (loadable onto any device)."""
        self._wait()
        if not self._is_set:
            return {"step": None}
        params, buffers, slots = self._saved_tensors()
        state = {"step": self.step, "params": params, "buffers": buffers}
        if slots is not None:
            state["optimizer"] = slots
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        step = state.get("step")
        if "params" not in state:
            self.release()
            self.step = step
            return
        # A checkpoint from before buffers were snapshotted: start from the model's current ones.
        saved_buffers = state.get("buffers") or [b.detach() for b in self.buffers]
        if len(saved_buffers) != len(self.buffers):
            raise ValueError(f"anchor state holds {len(saved_buffers)} module buffers, the model has {len(self.buffers)}")
        params = [saved.to(p.device) for saved, p in zip(state["params"], self.params)]
        buffers = [saved.to(b.device) for saved, b in zip(saved_buffers, self.buffers)]
        slots = None
        if "optimizer" in state:
            slots = [{k: (v.to(p.device) if isinstance(v, torch.Tensor) else v) for k, v in slot.items()}
                     for p, slot in zip(self.params, state["optimizer"])]
        self.release()
        if self.storage == "file":
            self._save_to_file(params, buffers, slots)
        else:
            self._save_to_memory(params, buffers, slots)
        self._is_set = True
        self.step = step


def _restore_buffer(module: torch.nn.Module, name: str, saved: torch.Tensor) -> None:
    buffer = module._buffers[name]
    if buffer.shape == saved.shape and buffer.dtype == saved.dtype:
        buffer.copy_(saved)
    else:  # reassigned with another shape since the snapshot: put the saved one back
        module._buffers[name] = saved.to(buffer.device, copy=True)


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

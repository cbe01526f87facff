"""Move optimizer state (and other registered tensors) off the accelerator while predicting.

During a PREDICT phase no optimizer step runs, so the optimizer's state (for Adam: two tensors the size of
the parameters) only occupies device memory. :class:`StateOffloader` copies each such tensor into a host
buffer (pinned when the tensor lives on CUDA) and swaps the tensor's storage with ``tensor.data = host``.
The tensor *object* stays the same, so every reference to it (``optimizer.state[p]["exp_avg"]``, a
caller's list) stays valid, and the device storage is released as soon as nothing else holds it. Before
the next real step :meth:`StateOffloader.prefetch` copies the values back into fresh device storage (on a
side CUDA stream, asynchronously) and :meth:`StateOffloader.wait` orders the compute stream after those
copies.

Only tensors that own their whole storage are moved. A view, or a tensor whose storage is shared with
another tensor, is left in place: moving one alias would silently split it from the others.

All sizes are in bytes.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

__all__ = ["StateOffloader", "CopyFn", "AllocateFn"]

#: ``copy_fn(destination, source, non_blocking)`` copies ``source`` into ``destination`` (same shape/dtype).
CopyFn = Callable[[torch.Tensor, torch.Tensor, bool], None]
#: ``allocate_fn(like, device, pin_memory)`` returns an uninitialised tensor shaped like ``like`` on ``device``.
AllocateFn = Callable[[torch.Tensor, torch.device, bool], torch.Tensor]


def _default_copy(destination: torch.Tensor, source: torch.Tensor, non_blocking: bool) -> None:
    destination.copy_(source, non_blocking=non_blocking)


def _is_dense_non_overlapping(tensor: torch.Tensor) -> bool:
    """True when the elements fill a block of memory exactly once (any dimension order)."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(tensor.shape, tensor.stride()) if s != 1),
                               key=lambda pair: pair[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _default_allocate(like: torch.Tensor, device: torch.device, pin_memory: bool) -> torch.Tensor:
    # Keep the strides (e.g. channels_last state of a conv weight) so that foreach/fused optimizer kernels
    # see the same layout after the round trip.
    if _is_dense_non_overlapping(like):
        return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=device,
                                   pin_memory=pin_memory)
    return torch.empty(like.shape, dtype=like.dtype, device=device, pin_memory=pin_memory)


def _storage_users(tensor: torch.Tensor) -> int | None:
    """How many tensors share ``tensor``'s storage, or None when this torch cannot tell."""
    counter = getattr(torch._C, "_storage_Use_Count", None)
    if counter is None:
        return None
    try:
        # The temporary storage object made by untyped_storage() holds one reference of its own.
        return int(counter(tensor.untyped_storage()._cdata)) - 1
    except Exception:  # noqa: BLE001 - private API: any failure only means "unknown"
        return None


@dataclass
class _Moved:
    """A tensor currently living off its home device."""

    tensor: torch.Tensor  # the object others hold; its .data is the host buffer while offloaded
    home: torch.device
    home_stride: tuple[int, ...]
    nbytes: int


class StateOffloader:
    """Moves optimizer state tensors (and any extra registered tensors) to (pinned, on CUDA) CPU memory
    while predicting and back before real steps.

    Args:
        optimizer: its ``state`` tensors are moved (collected at each :meth:`offload`, since optimizers
            create state lazily on their first step).
        extra: returns more tensors to move (e.g. history buffers unused while predicting). Do not return
            model parameters that the predicted steps update, nor views of other buffers (they are skipped).
        pin_memory: pin the host buffers; default: pin those whose tensor lives on CUDA (needed for
            asynchronous copies).
        enabled: None (default) moves the tensors that do not already live on ``target_device``, which on a
            CPU-only run is none: a no-op. True moves every eligible tensor even when it already lives on
            ``target_device`` (a host-to-host copy; this exercises the bookkeeping on CPU). False: no-op.
        target_device: where offloaded tensors live (default ``"cpu"``).
        copy_fn, allocate_fn: injectable copy and allocation (see :data:`CopyFn`, :data:`AllocateFn`).
        keep_host_buffers: keep each host buffer after :meth:`prefetch` and reuse it at the next
            :meth:`offload` (pinned allocations are slow), at the cost of host memory equal to the state.
        side_stream: on CUDA, run asynchronous prefetch copies on a side stream so they overlap with compute.

    Attributes:
        bytes_offloaded: bytes currently held off their home devices (0 when nothing is offloaded).
        skipped_aliased: number of candidate tensors left in place at the last :meth:`offload` because
            they are views or share their storage.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, extra: Callable[[], list[torch.Tensor]] | None = None,
                 pin_memory: bool | None = None, enabled: bool | None = None,
                 target_device: torch.device | str = "cpu", copy_fn: CopyFn | None = None,
                 allocate_fn: AllocateFn | None = None, keep_host_buffers: bool = True,
                 side_stream: bool = True):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if extra is not None and not callable(extra):
            raise TypeError("extra must be a callable returning a list of tensors")
        self.optimizer, self.extra = optimizer, extra
        self.pin_memory, self.enabled = pin_memory, enabled
        self.target_device = torch.device(target_device)
        self._copy = copy_fn or _default_copy
        self._allocate = allocate_fn or _default_allocate
        self.keep_host_buffers, self.side_stream = keep_host_buffers, side_stream
        self.bytes_offloaded = 0
        self.skipped_aliased = 0
        self._moved: list[_Moved] = []
        # id(tensor) -> (weak reference to the tensor, host buffer) kept between cycles; the weak reference
        # lets a replaced state tensor be freed and guards against a recycled id.
        self._host_buffers: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        # CUDA events of copies still in flight: (event, stream the copies ran on or None, tensors, kind).
        self._pending: list[tuple[object, object, list[torch.Tensor], str]] = []
        self._streams: dict[torch.device, object] = {}

    # -------------------------------------------------------------------------------- state ----
    @property
    def offloaded(self) -> bool:
        """True while at least one tensor lives off its home device."""
        return bool(self._moved)

    @property
    def offloaded_tensors(self) -> list[torch.Tensor]:
        """The tensor objects currently offloaded (the same objects the optimizer holds)."""
        return [record.tensor for record in self._moved]

    def _candidates(self) -> Iterable[torch.Tensor]:
        seen: set[int] = set()
        sources: list[object] = [value for state in self.optimizer.state.values() for value in state.values()]
        if self.extra is not None:
            sources = [*sources, *self.extra()]
        for value in sources:
            if isinstance(value, torch.Tensor) and id(value) not in seen:
                seen.add(id(value))
                yield value

    def _eligible(self, tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        if self.enabled is False:
            return []
        chosen: list[torch.Tensor] = []
        storages: dict[tuple, torch.Tensor | None] = {}  # None: storage seen twice, nothing over it moves
        self.skipped_aliased = 0
        for tensor in tensors:
            if tensor.layout is not torch.strided or tensor.device.type == "meta":
                continue
            if self.enabled is None and tensor.device == self.target_device:
                continue  # already where it would go
            owns_storage = (tensor._base is None and tensor.storage_offset() == 0
                            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())
            users = _storage_users(tensor)
            if not owns_storage or (users is not None and users > 1):
                self.skipped_aliased += 1
                continue
            key = (tensor.device, tensor.untyped_storage().data_ptr())
            if tensor.numel() and key in storages:  # two objects over one storage (users unknown)
                first = storages[key]
                if first is not None:
                    chosen = [t for t in chosen if t is not first]
                    self.skipped_aliased += 1
                    storages[key] = None
                self.skipped_aliased += 1
                continue
            storages[key] = tensor
            chosen.append(tensor)
        return chosen

    def _pin_for(self, home: torch.device) -> bool:
        if self.target_device.type != "cpu":
            return False
        return home.type == "cuda" if self.pin_memory is None else bool(self.pin_memory)

    def _host_buffer_for(self, tensor: torch.Tensor) -> torch.Tensor:
        cached = self._host_buffers.get(id(tensor))
        if cached is not None:
            ref, buffer = cached
            if ref() is tensor and buffer.shape == tensor.shape and buffer.dtype == tensor.dtype \
                    and buffer.stride() == tensor.stride():
                return buffer
        buffer = self._allocate(tensor, self.target_device, self._pin_for(tensor.device))
        if self.keep_host_buffers:
            self._host_buffers[id(tensor)] = (weakref.ref(tensor), buffer)
        return buffer

    # ---------------------------------------------------------------------------- transfers ----
    @torch.no_grad()
    def offload(self, non_blocking: bool = False) -> int:
        """Move the eligible tensors to ``target_device``; returns the bytes moved (0 if already offloaded).

        With ``non_blocking=True`` on CUDA the device-to-host copies are asynchronous: call :meth:`wait`
        before reading the host values. The device storage is released either way (the copies are ordered
        before any later work on the same stream)."""
        if self._moved:
            return 0  # idempotent: a second call must not copy the host buffers onto themselves
        self.wait()  # a prefetch still in flight must land before its destination is read
        self._forget_dead_buffers()
        events_by_device: dict[torch.device, list[torch.Tensor]] = {}
        moved_bytes = 0
        for tensor in self._eligible(self._candidates()):
            home = tensor.device
            buffer = self._host_buffer_for(tensor)
            self._copy(buffer, tensor.data, non_blocking)
            record = _Moved(tensor=tensor, home=home, home_stride=tuple(tensor.stride()),
                            nbytes=tensor.numel() * tensor.element_size())
            tensor.data = buffer  # the object keeps its identity; the device storage is dropped
            self._moved.append(record)
            moved_bytes += record.nbytes
            if home.type == "cuda":
                events_by_device.setdefault(home, []).append(buffer)
        if non_blocking:
            for home, buffers in events_by_device.items():
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(home))
                self._pending.append((event, None, buffers, "offload"))
        self.bytes_offloaded = moved_bytes
        return moved_bytes

    @torch.no_grad()
    def prefetch(self, non_blocking: bool = True) -> int:
        """Copy the offloaded tensors back to their home devices; returns the bytes moved (0 if none).

        On CUDA with ``non_blocking=True`` the copies come from pinned memory asynchronously (on a side
        stream when ``side_stream``) and a CUDA event is recorded: call :meth:`wait` before using the
        tensors (before ``optimizer.step()``)."""
        if not self._moved:
            return 0
        by_home: dict[torch.device, list[_Moved]] = {}
        for record in self._moved:
            by_home.setdefault(record.home, []).append(record)
        moved_bytes = 0
        for home, records in by_home.items():
            asynchronous = non_blocking and home.type == "cuda"
            stream = self._side_stream(home) if asynchronous and self.side_stream else None
            if stream is not None:
                # The host buffers may still be being written by an offload on the compute stream.
                stream.wait_stream(torch.cuda.current_stream(home))
            restored = []
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                for record in records:
                    host = record.tensor.data
                    # A storage-less stand-in describing the home layout (shape, strides, dtype).
                    layout = torch.empty_strided(record.tensor.shape, record.home_stride,
                                                 dtype=record.tensor.dtype, device="meta")
                    destination = self._allocate(layout, home, False)
                    self._copy(destination, host, asynchronous)
                    record.tensor.data = destination
                    restored.append(destination)
                    moved_bytes += record.nbytes
                if asynchronous:
                    event = torch.cuda.Event()
                    event.record(stream if stream is not None else torch.cuda.current_stream(home))
                    self._pending.append((event, stream, restored, "prefetch"))
        self._moved = []
        self.bytes_offloaded = 0
        return moved_bytes

    def wait(self) -> None:
        """Make the current CUDA stream wait for prefetches in flight (no host stall), and the host wait for
        asynchronous offloads; a no-op when nothing is in flight (always on CPU)."""
        for event, stream, tensors, kind in self._pending:
            if kind == "offload":
                event.synchronize()  # host code may read the host buffers next
                continue
            device = tensors[0].device if tensors else None
            current = torch.cuda.current_stream(device)
            current.wait_event(event)
            if stream is not None:
                # Allocated on the side stream but used on the compute stream: tell the caching allocator,
                # so the memory is not reused before the compute stream is done with it.
                for tensor in tensors:
                    tensor.record_stream(current)
        self._pending = []

    def release_host_buffers(self) -> None:
        """Drop the cached host buffers (not those of tensors offloaded right now)."""
        self._host_buffers = {}

    def _forget_dead_buffers(self) -> None:
        self._host_buffers = {key: (ref, buffer) for key, (ref, buffer) in self._host_buffers.items()
                              if ref() is not None}

    def _side_stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

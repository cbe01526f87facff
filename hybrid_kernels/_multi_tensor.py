"""Addressing many tensors from one Triton launch, in a way the interpreter can run.

A pointer table (``tl.load(ptrs).to(pointer_type)``) cannot be dereferenced by the Triton
interpreter, so a kernel built on one could only be tested on a GPU. Instead each list of
tensors (same device and dtype) is addressed as *element offsets from its lowest-addressed
tensor*, which a kernel adds to that base pointer: the same code runs compiled and interpreted.

``MultiTensorLayout`` builds the device-side tables once per set of addresses and sizes (the
trainer reuses its buffers, so the cache hits):

* ``meta`` int64 ``[T, L + 1 + E]``: per tensor, its offset in each of the L lists, its element
  count, then E caller-given integers (e.g. a quantization group size);
* ``chunk_tensor`` / ``chunk_start`` int64 ``[C]``: which tensor and which first element each
  program handles (programs are spread by size, not by tensor count);
* ``chunk_slot`` int64 ``[C]``: ``tensor * max_chunks + chunk``, for a deterministic per-tensor
  reduction of per-program partials without atomics.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

ALIGN = 16  # elements; offsets that are multiples of this let the GPU compiler vectorize
_CACHE_SIZE = 16


class MultiTensorLayout:
    """Device tables for ``lists`` of tensors (see the module docstring).

    Args:
        lists: L lists of T tensors each (tensor t of every list belongs together).
        chunk: elements handled by one program.
        extra: optional E lists of T integers appended to each tensor's ``meta`` row.
    """

    def __init__(self, lists: Sequence[Sequence[torch.Tensor]], chunk: int,
                 extra: Sequence[Sequence[int]] = ()):
        device = lists[0][0].device
        numels = [t.numel() for t in lists[0]]
        ptrs = [[t.data_ptr() for t in ts] for ts in lists]
        itemsizes = [ts[0].element_size() for ts in lists]
        self.base_index = [p.index(min(p)) for p in ptrs]  # lowest address: every offset is >= 0
        offsets = [[(q - min(p)) // size for q in p] for p, size in zip(ptrs, itemsizes)]
        # The kernels hint the first two lists as ALIGN-element aligned when this holds.
        self.aligned = all(o % ALIGN == 0 for column in offsets[:2] for o in column)
        counts = [-(-n // chunk) for n in numels]
        self.max_chunks = max(counts)
        meta, chunk_tensor, chunk_start, chunk_slot = [], [], [], []
        for t, n in enumerate(numels):
            meta.append([column[t] for column in offsets] + [n] + [int(e[t]) for e in extra])
            for c in range(counts[t]):
                chunk_tensor.append(t)
                chunk_start.append(c * chunk)
                chunk_slot.append(t * self.max_chunks + c)
        self.n_tensors, self.n_chunks = len(numels), len(chunk_tensor)

        def to_device(values):
            return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

        self.meta = to_device(meta)
        self.chunk_tensor = to_device(chunk_tensor)
        self.chunk_start = to_device(chunk_start)
        self.chunk_slot = to_device(chunk_slot)

    def bases(self, lists: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        """The tensor each list's offsets are measured from (pass these as the kernel's base pointers)."""
        return [ts[i] for ts, i in zip(lists, self.base_index)]

    def per_tensor_sum(self, partials: torch.Tensor) -> torch.Tensor:
        """Sum per-program partials ``[C, ...]`` per tensor → ``[T, ...]``, deterministically."""
        slots = partials.new_zeros((self.n_tensors * self.max_chunks, *partials.shape[1:]))
        slots[self.chunk_slot] = partials
        return slots.view(self.n_tensors, self.max_chunks, *partials.shape[1:]).sum(dim=1)


_cache: OrderedDict[tuple, MultiTensorLayout] = OrderedDict()


def cached_layout(lists: Sequence[Sequence[torch.Tensor]], chunk: int, extra: Sequence[Sequence[int]] = (),
                  build: Callable[..., MultiTensorLayout] = MultiTensorLayout) -> MultiTensorLayout:
    """The layout for these tensors' addresses and sizes, built once (LRU of 16)."""
    # map over the C-level methods: this key is built on every call, for every tensor.
    key = (lists[0][0].device, chunk,
           tuple(tuple(map(torch.Tensor.data_ptr, ts)) for ts in lists),
           tuple(ts[0].element_size() for ts in lists),
           tuple(map(torch.Tensor.numel, lists[0])),
           tuple(tuple(e) for e in extra))
    layout = _cache.get(key)
    if layout is None:
        layout = _cache[key] = build(lists, chunk, extra)
        if len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    else:
        _cache.move_to_end(key)
    return layout

"""In-place multi-tensor delta application: ``p_i += alpha_i * d_i`` for many tensors at once.

This is how predicted updates reach the weights: no copy of any parameter is ever made
(``data_ptr`` of every parameter is unchanged), and int8 deltas are dequantized inside the same
pass (``d = float32(q) * scale``, the :mod:`hybrid_kernels.int8_quant` convention).

Triton path, one launch per (device, parameter dtype, delta dtype, quantized) group:
the tensors of a group are addressed as *element offsets from the group's first tensor*
(``(t.data_ptr() - base.data_ptr()) / itemsize``), held in a small int64 table. A pointer
table (``tl.load(ptrs).to(pointer_type)``) would also give one launch, but the Triton
interpreter cannot dereference loaded pointers, so that design could only be tested on a GPU;
offsets from one base pointer run the same kernel on both. A second table maps each program to
(tensor, first element of its chunk), so programs are spread by size, not by tensor count.

Tensors the kernel cannot address as flat memory (a non-contiguous parameter, an offset that is
not a whole number of elements from the base) are updated in place by the eager path instead;
non-contiguous deltas are read through a contiguous copy (never a parameter copy).

Precision: the update is computed in fp32 and rounded once to the parameter dtype (bf16 on the
interpreter rounds toward zero: one bf16 ulp from torch's round-to-nearest-even).
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from operator import attrgetter

import numpy as np
import torch

from ._dispatch import choose_backend, record, triton_can_run
from ._multi_tensor import MultiTensorLayout, cached_layout
from ._triton_compat import INTERPRET, tl, triton
from .int8_quant import FLOAT_DTYPES, _dequantize_eager, group_size_for, scale_shape_for

_BLOCK = 8192 if INTERPRET else 1024  # elements per inner step of one program
_ITERS = 1 if INTERPRET else 8  # inner steps per program: chunk = _BLOCK * _ITERS elements

_launches: dict[str, int] = {"apply_delta_": 0}


def kernel_launches() -> int:
    """Triton launches made by ``apply_delta_`` so far in this process (tests check the count)."""
    return _launches["apply_delta_"]


# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _apply_span(p_ptr, d_ptr, s_ptr, idx, numel, group_size, alpha, sq,
                QUANTIZED: tl.constexpr, MASKED: tl.constexpr, WRITE_NORMS: tl.constexpr):
    if MASKED:
        mask = idx < numel
        if QUANTIZED:
            q = tl.load(d_ptr + idx, mask=mask, other=0).to(tl.float32)
            d = q * tl.load(s_ptr + idx // group_size, mask=mask, other=0.0)
        else:
            d = tl.load(d_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        step = alpha * d
        p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        tl.store(p_ptr + idx, (p + step).to(p_ptr.dtype.element_ty), mask=mask)
    else:
        if QUANTIZED:
            d = tl.load(d_ptr + idx).to(tl.float32) * tl.load(s_ptr + idx // group_size)
        else:
            d = tl.load(d_ptr + idx).to(tl.float32)
        step = alpha * d
        p = tl.load(p_ptr + idx).to(tl.float32)
        tl.store(p_ptr + idx, (p + step).to(p_ptr.dtype.element_ty))
    if WRITE_NORMS:
        sq += step * step
    return sq


@triton.jit
def _apply_delta_kernel(p_base, d_base, s_base, chunk_tensor_ptr, chunk_start_ptr, meta_ptr,
                        alpha_ptr, partial_sq_ptr,
                        QUANTIZED: tl.constexpr, WRITE_NORMS: tl.constexpr, ALIGNED: tl.constexpr,
                        BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(chunk_tensor_ptr + pid)
    start = tl.load(chunk_start_ptr + pid)
    p_off = tl.load(meta_ptr + t * 5)
    d_off = tl.load(meta_ptr + t * 5 + 1)
    s_off = tl.load(meta_ptr + t * 5 + 2)
    numel = tl.load(meta_ptr + t * 5 + 3)
    group_size = tl.load(meta_ptr + t * 5 + 4)
    if ALIGNED:
        p_off = tl.multiple_of(p_off, 16)
        d_off = tl.multiple_of(d_off, 16)
    alpha = tl.load(alpha_ptr + t)
    p_ptr = p_base + p_off
    d_ptr = d_base + d_off
    s_ptr = s_base + s_off
    offs = tl.arange(0, BLOCK)
    sq = tl.zeros([BLOCK], dtype=tl.float32)
    if start + BLOCK * ITERS <= numel:  # full chunk: unmasked, vectorizable loads
        for i in range(ITERS):
            sq = _apply_span(p_ptr, d_ptr, s_ptr, start + i * BLOCK + offs, numel, group_size,
                             alpha, sq, QUANTIZED, False, WRITE_NORMS)
    else:
        for i in range(ITERS):
            sq = _apply_span(p_ptr, d_ptr, s_ptr, start + i * BLOCK + offs, numel, group_size,
                             alpha, sq, QUANTIZED, True, WRITE_NORMS)
    if WRITE_NORMS:
        tl.store(partial_sq_ptr + pid, tl.sum(sq, axis=0))


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------
def _launch_group(params, deltas, scales, alphas: torch.Tensor, group_sizes, want_norms: bool,
                  layout: MultiTensorLayout | None = None):
    """One kernel launch for tensors sharing device and dtypes. Returns step norms or None.
    ``layout``: a layout already built for exactly these tensors (``DeltaApplier`` keeps one)."""
    device = params[0].device
    alphas = alphas.to(device, non_blocking=True)
    quantized = scales is not None
    lists = [params, deltas, scales if quantized else deltas]  # the scale pointer is unused when not quantized
    if layout is None:
        layout = cached_layout(lists, _BLOCK * _ITERS, extra=[group_sizes])
    base_p, base_d, base_s = layout.bases(lists)
    partial = torch.empty(layout.n_chunks if want_norms else 1, dtype=torch.float32, device=device)
    _apply_delta_kernel[(layout.n_chunks,)](
        base_p, base_d, base_s, layout.chunk_tensor, layout.chunk_start, layout.meta,
        alphas, partial, QUANTIZED=quantized, WRITE_NORMS=want_norms, ALIGNED=layout.aligned,
        BLOCK=_BLOCK, ITERS=_ITERS)
    _launches["apply_delta_"] += 1
    if not want_norms:
        return None
    return layout.per_tensor_sum(partial).sqrt()


def _offset_ok(t: torch.Tensor, base: torch.Tensor) -> bool:
    return (t.data_ptr() - base.data_ptr()) % t.element_size() == 0


_data_ptr, _is_contiguous, _numel = torch.Tensor.data_ptr, torch.Tensor.is_contiguous, torch.Tensor.numel
_dtype, _device, _shape = attrgetter("dtype"), attrgetter("device"), attrgetter("shape")


def _one_flat_group(params, deltas, scales) -> bool:
    """True when every tensor can go to a single launch: one device and one dtype per list,
    all contiguous and non-empty. The common case (a model's parameters and the trainer's
    delta buffers); checked with C-level ``map`` calls because on a GPU this host-side work,
    not the kernel, sets the cost of a call over ~100 tensors."""
    lists = (params, deltas) if scales is None else (params, deltas, scales)
    return (all(map(_numel, params)) and len(set(map(_device, params))) == 1
            and all(len(set(map(_dtype, ts))) == 1 and all(map(_is_contiguous, ts)) for ts in lists))


def _apply_triton(params, deltas, scales, alphas, group_sizes, want_norms: bool,
                  layout: MultiTensorLayout | None = None):
    """``layout``: built for exactly these lists, which form one flat group (``DeltaApplier``)."""
    if layout is not None or _one_flat_group(params, deltas, scales):
        # Same dtype per list: every address is a whole number of elements from any other, so
        # the per-tensor offset checks of the general path below always pass.
        return _launch_group(params, deltas, scales, alphas, group_sizes, want_norms, layout)
    norms = torch.zeros(len(params), dtype=torch.float32, device=params[0].device) if want_norms else None
    groups: dict[tuple, list[int]] = {}
    for i, (p, d) in enumerate(zip(params, deltas)):
        if p.numel():
            groups.setdefault((p.device, p.dtype, d.dtype), []).append(i)
    for idx in groups.values():
        # Deltas may be views: read them contiguously (a delta copy, never a parameter copy).
        ds = {i: deltas[i] if deltas[i].is_contiguous() else deltas[i].contiguous() for i in idx}
        ss = None if scales is None else {i: scales[i].contiguous() for i in idx}
        # The kernel addresses flat memory from the first contiguous parameter of the group;
        # anything else (a non-contiguous parameter) is updated in place by the eager path.
        flat = [i for i in idx if params[i].is_contiguous()]
        on_kernel = [i for i in flat if _offset_ok(params[i], params[flat[0]]) and _offset_ok(ds[i], ds[flat[0]])
                     and (ss is None or _offset_ok(ss[i], ss[flat[0]]))]
        kernel_set = set(on_kernel)
        on_eager = [i for i in idx if i not in kernel_set]
        for subset, run in ((on_kernel, _launch_group), (on_eager, _apply_eager)):
            if not subset:
                continue
            sub_norms = run([params[i] for i in subset], [ds[i] for i in subset],
                            None if ss is None else [ss[i] for i in subset],
                            alphas[subset], [group_sizes[i] for i in subset], want_norms)
            if want_norms:
                norms[subset] = sub_norms.to(norms.device)
    return norms


# --------------------------------------------------------------------------------------------
# Eager reference
# --------------------------------------------------------------------------------------------
def _apply_eager(params, deltas, scales, alphas: torch.Tensor, group_sizes, want_norms: bool):
    """``p += a * d`` per tensor with torch ops; returns fp32 step norms or None."""
    alpha_values = alphas.tolist()
    if scales is None:
        by_alpha: dict[float, list[int]] = {}
        for i, a in enumerate(alpha_values):
            by_alpha.setdefault(a, []).append(i)
        if len(by_alpha) == 1:  # the common case: one alpha for every tensor
            torch._foreach_add_(params, deltas, alpha=alpha_values[0])
        else:
            for a, idx in by_alpha.items():
                torch._foreach_add_([params[i] for i in idx], [deltas[i] for i in idx], alpha=a)
        if not want_norms:
            return None
        device = params[0].device
        norms = torch.stack([n.to(device) for n in torch._foreach_norm(deltas, 2, dtype=torch.float32)])
        return norms * alphas.abs().to(device)
    norms = torch.zeros(len(params), dtype=torch.float32, device=params[0].device)
    for i, (p, q, s, gs, a) in enumerate(zip(params, deltas, scales, group_sizes, alpha_values)):
        d = _dequantize_eager(q, s.reshape(-1), gs, torch.float32)
        p.add_(d, alpha=a)
        if want_norms:
            norms[i] = d.norm(dtype=torch.float32).to(norms.device) * abs(a)
        # Free the temporary before the next one is made: holding two large ones at a time made
        # the allocator return fresh pages each call, 2x slower at 100M parameters (measured).
        del d
    return norms if want_norms else None


# --------------------------------------------------------------------------------------------
# torch.library op and public function
# --------------------------------------------------------------------------------------------
def _apply_impl(params: list[torch.Tensor], deltas: list[torch.Tensor], alphas: torch.Tensor,
                scales: list[torch.Tensor] | None, group_sizes: list[int],
                out_norms: torch.Tensor | None, layout: MultiTensorLayout | None = None) -> None:
    if not params:
        return
    backend = choose_backend("apply_delta_", params[0].device)
    record("apply_delta_", backend)
    want_norms = out_norms is not None
    with torch.no_grad():
        if backend == "triton":
            norms = _apply_triton(params, deltas, scales, alphas, group_sizes, want_norms, layout)
            # The kernel writes through raw pointers, which autograd cannot see: bump each
            # parameter's version counter as an in-place torch op would, so a graph that saved
            # the old values raises at backward instead of returning gradients of stale values.
            # (A no-op for inference tensors, which have no counter; one C call for the list.)
            torch.autograd.graph.increment_version(params)
        else:
            norms = _apply_eager(params, deltas, scales, alphas, group_sizes, want_norms)
        if want_norms:
            out_norms.copy_(norms)


@torch.library.custom_op("hybrid_kernels::apply_delta_", mutates_args=("params", "out_norms"))
def _apply_delta_op(params: list[torch.Tensor], deltas: list[torch.Tensor], alphas: torch.Tensor,
                    scales: list[torch.Tensor], group_sizes: list[int],
                    out_norms: torch.Tensor | None) -> None:
    _apply_impl(params, deltas, alphas, scales or None, group_sizes, out_norms)


@_apply_delta_op.register_fake
def _(params, deltas, alphas, scales, group_sizes, out_norms):
    return None


def _describe(t) -> str:
    return type(t).__name__ if not isinstance(t, torch.Tensor) else f"{t.dtype} tensor"


_FLOAT_SET = frozenset(FLOAT_DTYPES)


def _float_lists_look_valid(params, deltas) -> bool:
    """Aggregate checks of float delta lists: much cheaper than the per-index loop, which runs
    only when these fail (to name the offending index) or for int8 deltas."""
    try:
        if not (set(map(_dtype, params)) <= _FLOAT_SET and set(map(_dtype, deltas)) <= _FLOAT_SET):
            return False
        if list(map(_shape, params)) != list(map(_shape, deltas)):
            return False
        if list(map(_device, params)) != list(map(_device, deltas)):
            return False
        # Distinct storage (empty or meta tensors may share address 0: the slow path sorts them out).
        return len(set(map(_data_ptr, params))) == len(params)
    except (AttributeError, TypeError):  # an element is not a tensor
        return False


def _check_each_tensor(params, deltas, scales, granularity, block_size) -> list[int]:
    """Per-index checks, raising on the first bad argument. Returns each tensor's group size."""
    seen: dict[int, int] = {}
    group_sizes = []
    for i, (p, d) in enumerate(zip(params, deltas)):
        if not isinstance(p, torch.Tensor) or p.dtype not in FLOAT_DTYPES:
            raise TypeError(f"params[{i}] must be a float32, float16 or bfloat16 tensor, got {_describe(p)}")
        if not isinstance(d, torch.Tensor):
            raise TypeError(f"deltas[{i}] must be a tensor, got {_describe(d)}")
        if scales is None and d.dtype not in FLOAT_DTYPES:
            raise TypeError(f"deltas[{i}] must be float32, float16 or bfloat16 (or int8 with scales=), got {d.dtype}")
        if scales is not None and d.dtype != torch.int8:
            raise TypeError(f"deltas[{i}] must be int8 when scales are given, got {d.dtype}")
        if d.shape != p.shape:
            raise ValueError(f"deltas[{i}] has shape {tuple(d.shape)} but params[{i}] has shape {tuple(p.shape)}")
        if d.device != p.device:
            raise ValueError(f"deltas[{i}] is on {d.device} but params[{i}] is on {p.device}")
        if p.numel() and not p.is_meta:
            if p.data_ptr() in seen:
                raise ValueError(f"params[{i}] and params[{seen[p.data_ptr()]}] share storage; "
                                 "the delta would be applied twice")
            seen[p.data_ptr()] = i
        if scales is not None:
            s = scales[i]
            if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
                raise TypeError(f"scales[{i}] must be a float32 tensor, got {_describe(s)}")
            if s.device != p.device:
                raise ValueError(f"scales[{i}] is on {s.device} but params[{i}] is on {p.device}")
            expected = scale_shape_for(p.shape, granularity, block_size)
            if tuple(s.shape) != expected:
                raise ValueError(f"scales[{i}] has shape {tuple(s.shape)} but granularity={granularity!r} "
                                 f"for params[{i}] of shape {tuple(p.shape)} needs {expected}")
            group_sizes.append(group_size_for(p.shape, granularity, block_size))
        else:
            group_sizes.append(1)
    return group_sizes


def _check_args(params, deltas, alpha, scales, granularity, block_size, out_norms):
    if isinstance(params, torch.Tensor) or not isinstance(params, Sequence):
        raise TypeError(f"params must be a list or tuple of tensors, got {type(params).__name__}")
    if isinstance(deltas, torch.Tensor) or not isinstance(deltas, Sequence):
        raise TypeError(f"deltas must be a list or tuple of tensors, got {type(deltas).__name__}")
    n = len(params)
    if len(deltas) != n:
        raise ValueError(f"deltas has {len(deltas)} tensors but params has {n}")
    if scales is not None and len(scales) != n:
        raise ValueError(f"scales has {len(scales)} tensors but params has {n}")
    if scales is None and _float_lists_look_valid(params, deltas):
        group_sizes = [1] * n
    else:
        group_sizes = _check_each_tensor(params, deltas, scales, granularity, block_size)
    _check_out_norms(out_norms, n)
    return _alphas_for(alpha, n), group_sizes


def _is_real(value) -> bool:
    """A real Python/NumPy number; not a bool (True as a step size is a bug, not 1.0)."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _alphas_for(alpha, n: int) -> torch.Tensor:
    """``alpha`` as a float32 tensor ``[n]``, rejecting a wrong length or non-finite values."""
    if isinstance(alpha, torch.Tensor):
        if alpha.shape != (n,):
            raise ValueError(f"alpha tensor must have shape ({n},), one value per tensor, got {tuple(alpha.shape)}")
        if alpha.dtype == torch.bool or alpha.is_complex():
            raise TypeError(f"alpha tensor must hold real numbers, got dtype {alpha.dtype}")
        alphas = alpha.detach().to(torch.float32)
    elif _is_real(alpha):
        if not math.isfinite(alpha):
            raise ValueError(f"alpha[0] is {alpha}: a non-finite step would corrupt params[0]")
        return torch.full((n,), float(alpha), dtype=torch.float32)
    elif isinstance(alpha, Sequence) and not isinstance(alpha, (str, bytes)):
        if len(alpha) != n:
            raise ValueError(f"alpha has {len(alpha)} values but params has {n}")
        for i, a in enumerate(alpha):  # float() would also take "1" or True: a typo, not a step size
            if not (_is_real(a) or (isinstance(a, torch.Tensor) and a.dim() == 0 and a.dtype != torch.bool
                                    and not a.is_complex())):
                raise TypeError(f"alpha[{i}] must be a real number, got {type(a).__name__} {a!r}")
        alphas = torch.tensor([float(a) for a in alpha], dtype=torch.float32)
    else:
        raise TypeError(f"alpha must be a float, a sequence of floats or a tensor, got {type(alpha).__name__}")
    if n and not bool(torch.isfinite(alphas).all()):
        bad = int((~torch.isfinite(alphas)).nonzero()[0])
        raise ValueError(f"alpha[{bad}] is {float(alphas[bad])}: a non-finite step would corrupt params[{bad}]")
    return alphas


def _check_out_norms(out_norms, n: int) -> None:
    if out_norms is not None:
        if not isinstance(out_norms, torch.Tensor) or out_norms.dtype != torch.float32:
            raise TypeError(f"out_norms must be a float32 tensor, got {_describe(out_norms)}")
        if out_norms.shape != (n,):
            raise ValueError(f"out_norms must have shape ({n},), got {tuple(out_norms.shape)}")


def apply_delta_(params: Sequence[torch.Tensor], deltas: Sequence[torch.Tensor],
                 alpha: float | Sequence[float] | torch.Tensor = 1.0, *,
                 scales: Sequence[torch.Tensor] | None = None, granularity: str = "tensor",
                 block_size: int = 256, out_norms: torch.Tensor | None = None) -> None:
    """Add ``alpha[i] * deltas[i]`` to ``params[i]`` in place, for every i, in one pass.

    Args:
        params: tensors to update (float32, float16 or bfloat16; any shapes; parameters or
            plain tensors). Updated in place: storage and ``data_ptr`` never change.
        deltas: one tensor per parameter, same shape and device. Either float (float32,
            float16, bfloat16; may differ from the parameter's dtype) or, with ``scales``,
            int8 codes from :func:`~hybrid_kernels.quantize_int8`, dequantized inside the pass.
        alpha: one float for all tensors, or one per tensor (a sequence or a float32 tensor of
            shape ``[len(params)]``). Must be finite.
        scales: float32 scales matching ``deltas`` (int8 mode), quantized with ``granularity``
            and ``block_size``.
        out_norms: optional float32 tensor of shape ``[len(params)]``; receives the L2 norm of
            each applied step ``alpha[i] * deltas[i]`` (fp32, deterministic).

    Raises:
        ValueError / TypeError naming the argument and index for mismatched lengths, shapes,
        devices or dtypes, non-finite alpha, or two params sharing storage.
    """
    alphas, group_sizes = _check_args(params, deltas, alpha, scales, granularity, block_size, out_norms)
    params, deltas = list(params), list(deltas)
    scales = None if scales is None else list(scales)
    if torch.compiler.is_compiling():
        _apply_delta_op(params, deltas, alphas, scales or [], group_sizes, out_norms)
    else:  # direct call: the dispatcher costs more than the work on CPU (see package docstring)
        _apply_impl(params, deltas, alphas, scales, group_sizes, out_norms)


class DeltaApplier:
    """``apply_delta_`` for a fixed set of tensors, checked and planned once.

    A call of ``apply_delta_`` inspects every tensor (dtype, shape, device, address) before its
    single launch; over ~100 tensors that host work costs more than the kernel on a GPU. A
    trainer applies steps to the same parameters from the same delta buffers every time, so
    this object does the checks and builds the kernel's tables in ``__init__``, and each call
    is one launch.

    The tensors must keep their storage while the applier is used: rebinding ``p.data``,
    ``resize_``, ``set_`` or ``module.to(dtype)`` (which rebinds ``p.data``) needs a new
    ``DeltaApplier``. Values may change freely. Each call compares every tensor's address and
    element count with those it was built for and raises ``RuntimeError`` naming the first tensor
    that moved or changed size: the kernel's tables hold the old addresses, so it would otherwise
    read and write freed memory (and the eager path could broadcast a resized delta silently).
    The check is not rebuilt around the change on purpose: a reallocated parameter usually means
    its delta buffer no longer matches it either, which the construction-time checks must see.

    Args: as :func:`apply_delta_` (``params``, ``deltas``, ``scales``, ``granularity``,
    ``block_size``); ``alpha`` and ``out_norms`` are given per call.
    """

    def __init__(self, params: Sequence[torch.Tensor], deltas: Sequence[torch.Tensor], *,
                 scales: Sequence[torch.Tensor] | None = None, granularity: str = "tensor", block_size: int = 256):
        _, self._group_sizes = _check_args(params, deltas, 1.0, scales, granularity, block_size, None)
        self.params, self.deltas = list(params), list(deltas)
        self.scales = None if scales is None else list(scales)
        self._named_lists = [("params", self.params), ("deltas", self.deltas)]
        if self.scales is not None:
            self._named_lists.append(("scales", self.scales))
        self._addresses = [list(map(_data_ptr, ts)) for _, ts in self._named_lists]
        self._numels = [list(map(_numel, ts)) for _, ts in self._named_lists]
        # The kernel's tables, when the lists form one flat group the kernel can address.
        self._layout = None
        if self.params and triton_can_run(self.params[0].device) and _one_flat_group(self.params, self.deltas, self.scales):
            lists = [self.params, self.deltas, self.scales if self.scales is not None else self.deltas]
            self._layout = MultiTensorLayout(lists, _BLOCK * _ITERS, extra=[self._group_sizes])

    def __len__(self) -> int:
        return len(self.params)

    def _check_unchanged(self) -> None:
        """Raise if a tensor was reallocated or resized since ``__init__``: C-level ``map`` over
        the lists and one list comparison each (about 0.1 us per tensor and list on a CPU host)."""
        for (name, ts), addresses, numels in zip(self._named_lists, self._addresses, self._numels):
            now_addresses, now_numels = list(map(_data_ptr, ts)), list(map(_numel, ts))
            if now_addresses == addresses and now_numels == numels:
                continue
            i = next(i for i, (a, b, m, n) in enumerate(zip(now_addresses, addresses, now_numels, numels))
                     if a != b or m != n)
            raise RuntimeError(
                f"DeltaApplier: {name}[{i}] changed since the applier was built (data_ptr {addresses[i]:#x} -> "
                f"{now_addresses[i]:#x}, numel {numels[i]} -> {now_numels[i]}): it was reallocated or resized "
                f"(p.data = ..., resize_, set_, module.to). Applying would read or write memory the tensor no "
                f"longer owns; build a new DeltaApplier for the current tensors.")

    def __call__(self, alpha: float | Sequence[float] | torch.Tensor = 1.0, *,
                 out_norms: torch.Tensor | None = None) -> None:
        """``params[i] += alpha[i] * deltas[i]`` in place (see :func:`apply_delta_`)."""
        n = len(self.params)
        alphas = _alphas_for(alpha, n)
        _check_out_norms(out_norms, n)
        if torch.compiler.is_compiling():  # the op re-plans from current addresses (cached_layout)
            _apply_delta_op(self.params, self.deltas, alphas, self.scales or [], self._group_sizes, out_norms)
        else:
            self._check_unchanged()
            _apply_impl(self.params, self.deltas, alphas, self.scales, self._group_sizes, out_norms, self._layout)


__all__ = ["DeltaApplier", "apply_delta_", "kernel_launches"]

"""Symmetric absmax int8 quantization: ``quantize_int8`` / ``dequantize_int8``.

Convention (identical on every backend, bit for bit):

* The flattened input is cut into contiguous *groups*: the whole tensor (``"tensor"``), each
  row of the last dimension (``"row"``), or consecutive ``block_size`` elements (``"block"``,
  the last block may be short).
* ``scale = absmax(group) / 127`` in fp32 (IEEE division), so codes use [-127, 127] and the
  grid is symmetric (``-128`` is never produced).
* ``q = clamp(round_half_to_even(x / scale), -127, 127)`` with IEEE division (not a reciprocal
  multiply): the same rule as ``torch.round``.
* A group whose absmax is 0 gets scale 0 and codes 0 (no NaN). An empty input gives empty codes
  and zero scales of the usual shape (``[5, 0]`` by row: five scales, each 0).
* A group holding NaN or Inf gets a non-finite scale (NaN codes become 0), so dequantizing it
  gives non-finite values: corruption stays visible instead of turning into plausible numbers.
* ``dequantize: x_hat = float32(q) * scale`` (one rounding), cast to the requested dtype.

Scale shapes: ``"tensor"`` → ``[]``; ``"row"`` → ``x.shape[:-1]``; ``"block"`` →
``[ceil(numel / block_size)]``. Scales are always float32 on the input's device.
"""
from __future__ import annotations

import math

import torch

from ._dispatch import choose_backend, record
from ._triton_compat import INTERPRET, rint, tl, triton

GRANULARITIES = ("tensor", "row", "block")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QMAX = 127.0

# Program sizes. Large blocks under the interpreter: its cost is per op, not per element.
_ELEMENTWISE_BLOCK = 8192 if INTERPRET else 1024
_ABSMAX_TILE = 8192 if INTERPRET else 4096  # elements one program reduces per loop iteration
# A single group larger than this (e.g. "tensor" granularity on a big input) is reduced as
# partial maxima over chunks of this many elements, then one max (one program would use one SM).
_TENSOR_PARTIAL_GROUP = 65536
# A single group reduced to at most this many partial maxima is quantized by a kernel that reads
# them itself (two launches in all); more partials take the separate max and scale ops.
_MAX_FUSED_PARTIALS = 1024  # 64M elements
# Groups up to this many elements are quantized in one pass (absmax, scale and codes from one
# read of x, one launch); longer groups take the two-pass path (absmax kernel, then codes).
_FUSED_MAX_GROUP = 8192


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _group_absmax_kernel(x_ptr, absmax_ptr, numel, group_size, n_groups,
                         GROUPS: tl.constexpr, BLOCK: tl.constexpr):
    """absmax of GROUPS consecutive groups per program; NaN anywhere in a group → NaN."""
    pid = tl.program_id(0)
    groups = pid * GROUPS + tl.arange(0, GROUPS)
    group_ok = groups < n_groups
    cols = tl.arange(0, BLOCK)
    row_base = groups.to(tl.int64) * group_size
    acc = tl.zeros([GROUPS, BLOCK], dtype=tl.float32)
    nan_seen = tl.zeros([GROUPS, BLOCK], dtype=tl.int32)
    for start in range(0, group_size, BLOCK):
        col = start + cols
        idx = row_base[:, None] + col[None, :]
        mask = group_ok[:, None] & (col[None, :] < group_size) & (idx < numel)
        v = tl.abs(tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32))
        nan_seen = nan_seen | (v != v).to(tl.int32)
        acc = tl.maximum(acc, v)
    group_max = tl.max(acc, axis=1)
    has_nan = tl.max(nan_seen, axis=1) > 0
    group_max = tl.where(has_nan, float("nan"), group_max)
    tl.store(absmax_ptr + groups, group_max, mask=group_ok)


@triton.jit
def _quantize_groups_kernel(x_ptr, scale_ptr, q_ptr, numel, group_size, n_groups,
                            GROUPS: tl.constexpr, BLOCK: tl.constexpr):
    """Scales and codes of GROUPS whole groups per program (group_size <= BLOCK), x read once.
    Same arithmetic as the two-pass path: NaN-propagating absmax, IEEE division by 127."""
    pid = tl.program_id(0)
    groups = pid * GROUPS + tl.arange(0, GROUPS)
    group_ok = groups < n_groups
    cols = tl.arange(0, BLOCK)
    idx = groups.to(tl.int64)[:, None] * group_size + cols[None, :]
    mask = group_ok[:, None] & (cols[None, :] < group_size) & (idx < numel)
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    a = tl.abs(x)
    has_nan = tl.max((a != a).to(tl.int32), axis=1) > 0
    absmax = tl.where(has_nan, float("nan"), tl.max(a, axis=1))
    scale = tl.div_rn(absmax, tl.full([GROUPS], 127.0, tl.float32))
    tl.store(scale_ptr + groups, scale, mask=group_ok)
    divisor = tl.where(scale > 0.0, scale, 1.0)
    q = rint(tl.div_rn(x, divisor[:, None]))
    q = tl.where(q != q, 0.0, q)  # NaN input → code 0 (its scale is already non-finite)
    q = tl.clamp(q, -127.0, 127.0)
    tl.store(q_ptr + idx, q.to(tl.int8), mask=mask)


@triton.jit
def _quantize_kernel(x_ptr, scale_ptr, q_ptr, numel, group_size, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < numel
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + idx // group_size, mask=mask, other=1.0)
    divisor = tl.where(scale > 0.0, scale, 1.0)
    q = rint(tl.div_rn(x, divisor))
    q = tl.where(q != q, 0.0, q)  # NaN input → code 0 (its scale is already non-finite)
    q = tl.clamp(q, -127.0, 127.0)  # clamp before the cast: out-of-range casts wrap or are UB
    tl.store(q_ptr + idx, q.to(tl.int8), mask=mask)


@triton.jit
def _quantize_from_partials_kernel(x_ptr, partial_ptr, n_partials, scale_ptr, q_ptr, numel,
                                   PARTIALS: tl.constexpr, BLOCK: tl.constexpr):
    """One group (the whole tensor) whose absmax is spread over ``n_partials`` partial maxima:
    every program reduces them itself (at most a few KB, read from cache), so the reduction and
    the scale need no launches of their own; program 0 stores the scale. NaN propagates."""
    pid = tl.program_id(0)
    offs = tl.arange(0, PARTIALS)[None, :]
    partial = tl.load(partial_ptr + offs, mask=offs < n_partials, other=0.0)
    has_nan = tl.max((partial != partial).to(tl.int32), axis=1) > 0
    absmax = tl.where(has_nan, float("nan"), tl.max(partial, axis=1))  # shape [1]
    scale = tl.div_rn(absmax, tl.full([1], 127.0, tl.float32))
    one = tl.arange(0, 1)
    tl.store(scale_ptr + one, scale, mask=(one + pid) == 0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < numel
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    divisor = tl.where(scale > 0.0, scale, 1.0)
    q = rint(tl.div_rn(x, divisor))
    q = tl.where(q != q, 0.0, q)  # NaN input → code 0 (its scale is already non-finite)
    q = tl.clamp(q, -127.0, 127.0)
    tl.store(q_ptr + idx, q.to(tl.int8), mask=mask)


@triton.jit
def _dequantize_kernel(q_ptr, scale_ptr, out_ptr, numel, group_size, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < numel
    q = tl.load(q_ptr + idx, mask=mask, other=0).to(tl.float32)
    scale = tl.load(scale_ptr + idx // group_size, mask=mask, other=0.0)
    tl.store(out_ptr + idx, (q * scale).to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Launchers (flat, contiguous tensors; group_size >= 1)
# --------------------------------------------------------------------------------------------
def _scales_from_absmax(absmax: torch.Tensor) -> torch.Tensor:
    """``absmax / 127`` with IEEE division, as the kernels compute it. Dividing a CUDA tensor by a
    Python scalar multiplies by its reciprocal instead, which is one ulp off for some inputs
    (seen on an H100); a tensor divisor makes torch divide."""
    return absmax / torch.full_like(absmax, QMAX)


def _launch_group_absmax(x: torch.Tensor, group_size: int) -> torch.Tensor:
    numel = x.numel()
    n_groups = -(-numel // group_size)
    out = torch.empty(n_groups, dtype=torch.float32, device=x.device)
    block = min(triton.next_power_of_2(group_size), _ABSMAX_TILE)
    groups_per_program = max(1, min(_ABSMAX_TILE // block, triton.next_power_of_2(n_groups)))
    grid = (triton.cdiv(n_groups, groups_per_program),)
    _group_absmax_kernel[grid](x, out, numel, group_size, n_groups,
                               GROUPS=groups_per_program, BLOCK=block)
    return out


def _quantize_groups_triton(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    numel = x.numel()
    n_groups = -(-numel // group_size)
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scales = torch.empty(n_groups, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(group_size)
    groups_per_program = max(1, min(_ABSMAX_TILE // block, triton.next_power_of_2(n_groups)))
    grid = (triton.cdiv(n_groups, groups_per_program),)
    _quantize_groups_kernel[grid](x, scales, q, numel, group_size, n_groups,
                                  GROUPS=groups_per_program, BLOCK=block,
                                  num_warps=8 if groups_per_program * block >= 4096 else 4)
    return q, scales


def _quantize_from_partials_triton(x: torch.Tensor, partials: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and the one scale of ``x`` (one group) from its chunks' maxima ``partials`` [P] fp32."""
    numel = x.numel()
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scale = torch.empty(1, dtype=torch.float32, device=x.device)
    n_partials = triton.next_power_of_2(partials.numel())
    # Every program re-reads the partials: wider programs keep that under a quarter of x's bytes.
    block = _ELEMENTWISE_BLOCK if n_partials <= _ELEMENTWISE_BLOCK // 4 else 4 * _ELEMENTWISE_BLOCK
    grid = (triton.cdiv(numel, block),)
    _quantize_from_partials_kernel[grid](x, partials, partials.numel(), scale, q, numel,
                                         PARTIALS=n_partials, BLOCK=block,
                                         num_warps=8 if block >= 4096 else 4)
    return q, scale


def _quantize_triton(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    numel = x.numel()
    if min(group_size, numel) <= _FUSED_MAX_GROUP:
        return _quantize_groups_triton(x, min(group_size, numel))
    if group_size >= numel > _TENSOR_PARTIAL_GROUP:
        # One big group: maxima of 64K-element chunks in parallel, then the max of those.
        partials = _launch_group_absmax(x, _TENSOR_PARTIAL_GROUP)
        if partials.numel() <= _MAX_FUSED_PARTIALS:
            return _quantize_from_partials_triton(x, partials)
        absmax = partials.amax().reshape(1)
    else:
        absmax = _launch_group_absmax(x, group_size)
    scales = _scales_from_absmax(absmax)
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    grid = (triton.cdiv(numel, _ELEMENTWISE_BLOCK),)
    _quantize_kernel[grid](x, scales, q, numel, group_size, BLOCK=_ELEMENTWISE_BLOCK)
    return q, scales


def _dequantize_triton(q: torch.Tensor, scales: torch.Tensor, group_size: int,
                       dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    numel = q.numel()
    grid = (triton.cdiv(numel, _ELEMENTWISE_BLOCK),)
    _dequantize_kernel[grid](q, scales, out, numel, group_size, BLOCK=_ELEMENTWISE_BLOCK)
    return out


# --------------------------------------------------------------------------------------------
# Eager references (the CPU path and the test oracle)
# --------------------------------------------------------------------------------------------
def _padded_groups(flat: torch.Tensor, group_size: int) -> torch.Tensor:
    n_groups = -(-flat.numel() // group_size)
    pad = n_groups * group_size - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(n_groups, group_size)


def _quantize_eager(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    numel = x.numel()
    groups = _padded_groups(x.reshape(-1).float(), group_size)
    # max(amax, -amin) avoids materialising |x|; both propagate NaN like the kernel does.
    scales = _scales_from_absmax(torch.maximum(groups.amax(dim=1), groups.amin(dim=1).neg()))
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = (groups / divisor[:, None]).round_()
    if not bool(torch.isfinite(scales).all()):
        q.nan_to_num_(nan=0.0)
    q.clamp_(-QMAX, QMAX)
    return q.reshape(-1)[:numel].to(torch.int8).view(x.shape), scales


def _dequantize_eager(q: torch.Tensor, scales: torch.Tensor, group_size: int,
                      dtype: torch.dtype) -> torch.Tensor:
    numel = q.numel()
    if numel == 0:  # rows of length 0 still have scales: no groups to pair them with
        return torch.empty(q.shape, dtype=dtype, device=q.device)
    # Padded as codes, widened once and scaled in place: one fp32 transient of the input's size,
    # where widening, then padding or multiplying out of place, held two at once (the trainer's
    # int8 direction reads a bucket at a time while the gradients are alive: bench.overhead).
    groups = _padded_groups(q.reshape(-1), group_size).to(torch.float32)
    groups.mul_(scales[:, None])
    return groups.reshape(-1)[:numel].to(dtype).view(q.shape)


# --------------------------------------------------------------------------------------------
# torch.library ops (graph capture under torch.compile) and the eager-mode direct call
# --------------------------------------------------------------------------------------------
def _quantize_impl(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    backend = choose_backend("quantize_int8", x.device)
    record("quantize_int8", backend)
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=torch.int8, device=x.device), torch.zeros(
            0, dtype=torch.float32, device=x.device)
    if backend == "triton":
        return _quantize_triton(x, group_size)
    return _quantize_eager(x, group_size)


def _dequantize_impl(q: torch.Tensor, scales: torch.Tensor, group_size: int,
                     dtype: torch.dtype) -> torch.Tensor:
    backend = choose_backend("dequantize_int8", q.device)
    record("dequantize_int8", backend)
    if q.numel() == 0:
        return torch.empty(q.shape, dtype=dtype, device=q.device)
    if backend == "triton":
        return _dequantize_triton(q, scales, group_size, dtype)
    return _dequantize_eager(q, scales, group_size, dtype)


@torch.library.custom_op("hybrid_kernels::quantize_int8", mutates_args=())
def _quantize_op(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_impl(x, group_size)


@_quantize_op.register_fake
def _(x, group_size):
    n_groups = (x.numel() + group_size - 1) // group_size
    return torch.empty_like(x, dtype=torch.int8), x.new_empty((n_groups,), dtype=torch.float32)


@torch.library.custom_op("hybrid_kernels::dequantize_int8", mutates_args=())
def _dequantize_op(q: torch.Tensor, scales: torch.Tensor, group_size: int,
                   dtype: torch.dtype) -> torch.Tensor:
    return _dequantize_impl(q, scales, group_size, dtype)


@_dequantize_op.register_fake
def _(q, scales, group_size, dtype):
    return torch.empty_like(q, dtype=dtype)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def group_size_for(shape: torch.Size | tuple[int, ...], granularity: str, block_size: int) -> int:
    """Length of one quantization group of a contiguous tensor of ``shape`` (always >= 1)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity == "tensor":
        return max(1, math.prod(shape))
    if granularity == "row":
        if len(shape) == 0:
            raise ValueError("granularity='row' needs a tensor with at least one dimension, got a 0-d tensor")
        return max(1, shape[-1])
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    return block_size


def scale_shape_for(shape: torch.Size | tuple[int, ...], granularity: str, block_size: int) -> tuple[int, ...]:
    """Shape of the scales ``quantize_int8`` returns for an input of ``shape``."""
    if granularity == "tensor":
        return ()
    if granularity == "row":
        group_size_for(shape, granularity, block_size)
        return tuple(shape[:-1])
    return (-(-math.prod(shape) // group_size_for(shape, granularity, block_size)),)


def quantize_int8(x: torch.Tensor, granularity: str = "tensor",
                  block_size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to int8 with symmetric absmax scales (convention in the module docstring).

    Args:
        x: float32, float16 or bfloat16 tensor of any shape, any device. A non-contiguous input
            is read through a contiguous copy.
        granularity: ``"tensor"`` (one scale), ``"row"`` (one scale per row of the last
            dimension) or ``"block"`` (one scale per ``block_size`` consecutive elements of the
            flattened tensor).
        block_size: elements per block for ``granularity="block"``.

    Returns:
        ``(q, scales)``: ``q`` int8 with the shape of ``x`` (contiguous); ``scales`` float32 of
        shape ``[]`` (tensor), ``x.shape[:-1]`` (row) or ``[ceil(numel / block_size)]`` (block).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    group_size = group_size_for(x.shape, granularity, block_size)
    x = x.detach().contiguous()
    if x.numel() == 0:
        # Empty in, empty out, with the scale shape of the granularity: rows of length 0 (x of
        # shape [5, 0], "row") still get their 5 scales, and so does "tensor" its one. An empty
        # group's absmax is 0, the identity of max over |x| >= 0, so its scale is 0 as for an
        # all-zero group; dequantizing gives back the empty tensor.
        record("quantize_int8", choose_backend("quantize_int8", x.device))
        return (torch.empty(x.shape, dtype=torch.int8, device=x.device),
                torch.zeros(scale_shape_for(x.shape, granularity, block_size), dtype=torch.float32, device=x.device))
    if torch.compiler.is_compiling():
        q, scales = _quantize_op(x, group_size)
    else:  # direct call: skips the dispatcher's per-call overhead in eager mode
        q, scales = _quantize_impl(x, group_size)
    return q, scales.view(scale_shape_for(x.shape, granularity, block_size))


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, granularity: str = "tensor",
                    block_size: int = 256, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_int8`: ``float32(q) * scale`` cast to ``dtype``.

    Args:
        q: int8 tensor as returned by ``quantize_int8``.
        scales: float32 scales as returned with it (shape checked against ``granularity``).
        granularity, block_size: the values used to quantize.
        dtype: output dtype (float32, float16 or bfloat16).

    Returns:
        A ``dtype`` tensor with the shape of ``q``.
    """
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8:
        raise TypeError(f"q must be an int8 tensor, got {getattr(q, 'dtype', type(q).__name__)}")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32:
        raise TypeError(f"scales must be a float32 tensor, got {getattr(scales, 'dtype', type(scales).__name__)}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    if scales.device != q.device:
        raise ValueError(f"scales is on {scales.device} but q is on {q.device}")
    group_size = group_size_for(q.shape, granularity, block_size)
    expected = scale_shape_for(q.shape, granularity, block_size)
    if tuple(scales.shape) != expected:
        raise ValueError(f"scales has shape {tuple(scales.shape)} but granularity={granularity!r} "
                         f"for q of shape {tuple(q.shape)} needs {expected}")
    q = q.contiguous()
    scales = scales.contiguous().view(-1)
    if torch.compiler.is_compiling():
        return _dequantize_op(q, scales, group_size, dtype)
    return _dequantize_impl(q, scales, group_size, dtype)

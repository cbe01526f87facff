"""AdamW update with block-wise quantized moments: ``adamw_lowbit_update_``.

One AdamW step of one parameter whose two moments live as 8-bit or 4-bit codes with one fp32
scale per block: the moments are dequantized, updated with the gradient, used for the weight
update and requantized, all in one pass (one launch on a GPU; chunk by chunk on a CPU, so the
transient fp32 copies stay a few MB whatever the parameter's size).

Why these codes (the approach of "Memory Efficient Optimizers with 4-bit States", Li et al.,
NeurIPS 2023, and of 8-bit Optimizers via Block-wise Quantization, Dettmers et al., ICLR 2022:
small blocks so one outlier spoils few values, a nonlinear code for the moments; the codes
themselves are this project's, chosen to be computable without a lookup table):

* **First moment m (signed)**: per block ``s = absmax(m)``; code ``q = round(Q · sqrt(|m| / s))``
  with the sign of m, ``Q = 127`` (int8) or ``7`` (4-bit); ``m̂ = s · sign(q) · (q / Q)²``. The
  square-root companding spends the codes where m is small (a linear code at 4 bits rounds
  most of a block's m to zero). Scale convention as :mod:`hybrid_kernels.int8_quant`: absmax
  per block in fp32, round half to even, an all-zero block gets scale 0 and codes 0.
* **Second moment v (unsigned)**: quantized as ``u = sqrt(v)`` (the RMS the update divides
  by), per block ``s = absmax(u)``, code ``c = clamp(round(L · sqrt(u / s) − 1), 0, L − 1)``
  with ``L = 256`` or ``16`` levels; ``û = s · ((c + 1) / L)²``. The grid has **no zero**
  (Li et al.: a v rounded to zero turns the update into m / eps, the main failure of 4-bit v):
  a u below the lowest level is rounded up to it, which can only make that step smaller.
* **4-bit packing**: the byte ``j`` of a block holds element ``j`` (low nibble) and element
  ``j + B/2`` (high nibble), so a kernel reads two contiguous halves; m's nibble is ``q + 8``.
* **bf16 weights**: the new weight is computed in fp32 and rounded to bf16 **stochastically**
  (add 16 random bits to the fp32 pattern, truncate): unbiased, so updates far below one bf16
  ulp still move the weight on average (Gupta et al. 2015; Zamirai et al. 2020). The random
  bits are a hash of ``(sr_key, element index)``, the same on every backend, so a run resumed
  from a checkpoint draws exactly the bits the uninterrupted run drew (``sr_key`` is derived
  from seed, step and parameter index by the caller).

Layouts (``n = param.numel()``, ``B = block_size``, ``nb = ceil(n / B)``; codes are padded to
``nb · B`` elements, the pad holds zeros): bits 8 → ``m_codes`` int8 ``[nb·B]``, ``v_codes``
uint8 ``[nb·B]``; bits 4 → both uint8 ``[nb·B/2]``; ``m_scales``, ``v_scales`` fp32 ``[nb]``.
State bytes per parameter: 2 + 8/B (int8) or 1 + 8/B (4-bit).
"""
from __future__ import annotations

import torch

from ._dispatch import choose_backend, record
from ._triton_compat import INTERPRET, rint, tl, triton

BITS = (8, 4)
M_MAX = {8: 127, 4: 7}  # largest |code| of the first moment
V_LEVELS = {8: 256, 4: 16}  # codes of the second moment
DEFAULT_BLOCK = {8: 256, 4: 128}
CHUNK_ELEMENTS = 1 << 16  # eager path: elements per chunk (fp32 temporaries of 256 KiB each, cache-sized)
_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1
_MIX = 0x45D9F3B
_PROGRAM_ELEMENTS = 8192 if INTERPRET else 2048  # elements per Triton program (whole blocks)


def state_shapes(numel: int, bits: int, block_size: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of the four state tensors of a parameter of ``numel`` elements."""
    nb = -(-numel // block_size)
    padded = nb * block_size
    if bits == 8:
        return {"m_codes": ((padded,), torch.int8), "m_scales": ((nb,), torch.float32),
                "v_codes": ((padded,), torch.uint8), "v_scales": ((nb,), torch.float32)}
    return {"m_codes": ((padded // 2,), torch.uint8), "m_scales": ((nb,), torch.float32),
            "v_codes": ((padded // 2,), torch.uint8), "v_scales": ((nb,), torch.float32)}


def sr_key(seed: int, step: int, index: int) -> int:
    """32-bit key of the stochastic rounding of parameter ``index`` at ``step`` (1-based)."""
    return (seed * _GOLDEN + step * 0x85EBCA77 + index * 0xC2B2AE3D + 0x27D4EB2F) & _MASK32


# --------------------------------------------------------------------------------------------
# Eager reference (the CPU path and the kernel's test oracle)
# --------------------------------------------------------------------------------------------
def random_bits16(index: torch.Tensor, key) -> torch.Tensor:
    """16 pseudo-random bits per element (int64 in [0, 65536)) from an int64 element ``index``:
    a multiply-xorshift integer hash of ``index`` and ``key`` (all products below 2**63)."""
    x = ((index * _GOLDEN) & _MASK32) ^ key
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    x = (x >> 16) ^ x
    return x & 0xFFFF


def stochastic_round_bf16(w32: torch.Tensor, index: torch.Tensor, key) -> torch.Tensor:
    """``w32`` (fp32) rounded to bf16 stochastically with the bits of :func:`random_bits16`."""
    bits = w32.view(torch.int32).to(torch.int64) + random_bits16(index, key)
    bits = (bits & -65536).to(torch.int32)  # low 16 bits cleared: the bf16 cast below is exact
    return bits.view(torch.float32).to(torch.bfloat16)


def dequantize_m(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """``[nb, B]`` fp32 first moment from its codes (``[nb, B]`` int8 or ``[nb, B/2]`` uint8)."""
    q = _unpack(codes).float() - 8.0 if bits == 4 else codes.float()
    return q * q.abs() * (scales[:, None] / float(M_MAX[bits] ** 2))


def dequantize_u(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """``[nb, B]`` fp32 ``sqrt(v)`` from its codes (``[nb, B]`` or ``[nb, B/2]`` uint8)."""
    c = (_unpack(codes) if bits == 4 else codes).float() + 1.0
    return c * c * (scales[:, None] / float(V_LEVELS[bits] ** 2))


def quantize_m(m: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of a ``[nb, B]`` fp32 first moment (see the module docstring)."""
    scales = m.abs().amax(dim=1)
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(torch.sqrt(m.abs() / divisor[:, None]) * float(M_MAX[bits])).copysign(m)
    if bits == 4:
        return _pack((q + 8.0).to(torch.uint8)), scales
    return q.to(torch.int8), scales


def quantize_u(u: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of a ``[nb, B]`` fp32 ``u = sqrt(v) >= 0`` (no zero level)."""
    levels = V_LEVELS[bits]
    scales = u.amax(dim=1)
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    c = torch.round(torch.sqrt(u / divisor[:, None]) * float(levels) - 1.0).clamp_(0.0, levels - 1.0)
    c = c.to(torch.uint8)
    return (_pack(c) if bits == 4 else c), scales


def _unpack(codes: torch.Tensor) -> torch.Tensor:
    return torch.cat([codes & 15, codes >> 4], dim=1)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    half = codes.shape[1] // 2
    return codes[:, :half] | (codes[:, half:] << 4)


def _update_blocks(w: torch.Tensor, g: torch.Tensor, m_codes, m_scales, v_codes, v_scales, index,
                   hyper: torch.Tensor, key: torch.Tensor | None, bits: int, pad: int = 0):
    """One AdamW step of ``nb`` whole blocks: ``w``, ``g`` are ``[nb, B]``; ``hyper`` is the fp32
    vector ``[lr, beta1, beta2, eps, decay, step_scale, inv_sqrt_bias2]`` (0-d tensors, not
    Python floats, so a compiled version of this function is not re-specialised every step).
    Returns the new weights (fp32, or bf16 stochastically rounded when ``key``, a 0-d int64
    tensor, is given) and the new codes and scales. The last ``pad`` elements are padding:
    their m and u are zeroed before requantizing."""
    lr, beta1, beta2, eps, decay, step_scale, inv_sqrt_bias2 = hyper.unbind()
    g = g.float()
    m = dequantize_m(m_codes, m_scales, bits) * beta1 + (1.0 - beta1) * g
    u = dequantize_u(v_codes, v_scales, bits)
    u = torch.sqrt(u * u * beta2 + (1.0 - beta2) * (g * g))
    w32 = w.float() * decay - step_scale * (m / (u * inv_sqrt_bias2 + eps))
    new_w = w32 if key is None else stochastic_round_bf16(w32, index, key)
    if pad:
        keep = torch.ones(m.numel(), dtype=torch.bool, device=m.device)
        keep[-pad:] = False
        keep = keep.view(m.shape)
        m, u = m * keep, u * keep
    return (new_w, *quantize_m(m, bits), *quantize_u(u, bits))


_compiled_blocks = None


def _blocks_fn(compiled: bool):
    """The block update, optionally through ``torch.compile`` (one fused C++ loop on a CPU:
    the eager chain of ~40 tensor ops streams every chunk through memory ~40 times)."""
    global _compiled_blocks
    if not compiled:
        return _update_blocks
    if _compiled_blocks is None:
        _compiled_blocks = torch.compile(_update_blocks, dynamic=False)
    return _compiled_blocks


def hyper_vector(lr, beta1, beta2, eps, weight_decay, bias1, bias2, device) -> torch.Tensor:
    """The fp32 ``hyper`` vector of :func:`_update_blocks` (the scalars a kernel receives)."""
    return torch.tensor([lr, beta1, beta2, eps, 1.0 - lr * weight_decay, lr / bias1, 1.0 / bias2 ** 0.5],
                        dtype=torch.float32, device=device)


def _update_eager(param, grad, m_codes, m_scales, v_codes, v_scales, bits, block, lr, beta1, beta2, eps,
                  weight_decay, bias1, bias2, key, compiled=False):
    flat_w, flat_g = param.view(-1), grad.reshape(-1)
    hyper = hyper_vector(lr, beta1, beta2, eps, weight_decay, bias1, bias2, param.device)
    key_t = None if key is None else torch.tensor(int(key), dtype=torch.int64)
    compiled_fn = _blocks_fn(compiled)
    numel = flat_w.numel()
    per_byte = 2 if bits == 4 else 1
    chunk_blocks = max(1, CHUNK_ELEMENTS // block)
    nb_total = m_scales.numel()
    for b0 in range(0, nb_total, chunk_blocks):
        b1 = min(nb_total, b0 + chunk_blocks)
        e0, e1 = b0 * block, min(numel, b1 * block)
        nb = b1 - b0
        w, g = flat_w[e0:e1], flat_g[e0:e1]
        pad = nb * block - (e1 - e0)
        if pad:  # the last block is short: pad it (the pad's m and u are kept at zero)
            w = torch.nn.functional.pad(w, (0, pad))
            g = torch.nn.functional.pad(g, (0, pad))
        index = None if key is None else torch.arange(e0, e0 + nb * block, dtype=torch.int64,
                                                      device=flat_w.device).view(nb, block)
        c0, c1 = b0 * block // per_byte, b1 * block // per_byte
        mq, vq = m_codes[c0:c1].view(nb, -1), v_codes[c0:c1].view(nb, -1)
        # Compiled for full chunks only (one shape, compiled once); a short last chunk (or a small
        # parameter) runs the same function eagerly rather than padded to a full chunk.
        blocks_fn = compiled_fn if nb == chunk_blocks else _update_blocks
        new_w, nmq, nms, nvq, nvs = blocks_fn(w.view(nb, block), g.view(nb, block), mq, m_scales[b0:b1], vq,
                                              v_scales[b0:b1], index, hyper, key_t, bits, pad)
        flat_w[e0:e1].copy_(new_w.view(-1)[: e1 - e0])
        mq.copy_(nmq)
        vq.copy_(nvq)
        m_scales[b0:b1].copy_(nms)
        v_scales[b0:b1].copy_(nvs)


# --------------------------------------------------------------------------------------------
# Triton kernel: one program updates GROUPS whole blocks (a [GROUPS, HALF] tile per half block)
# --------------------------------------------------------------------------------------------
@triton.jit
def _hash16(index, key):
    """:func:`random_bits16` in int64 arithmetic (same bits as the eager path)."""
    x = ((index * 0x9E3779B1) & 0xFFFFFFFF) ^ key
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    x = (x >> 16) ^ x
    return x & 0xFFFF


@triton.jit
def _half_update(w_ptr, g_ptr, idx, mask, m, u, lr, beta1, beta2, eps, decay, step_scale, inv_sqrt_bias2,
                 key, STOCHASTIC: tl.constexpr):
    """New fp32 m, u (sqrt v) and the stored weight for one half-block tile."""
    g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    m = m * beta1 + (1.0 - beta1) * g
    u = tl.sqrt(u * u * beta2 + (1.0 - beta2) * g * g)
    w = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    w = w * decay - step_scale * (m / (u * inv_sqrt_bias2 + eps))
    if STOCHASTIC:
        bits = w.to(tl.int32, bitcast=True).to(tl.int64) + _hash16(idx, key)
        w = (bits & -65536).to(tl.int32).to(tl.float32, bitcast=True)
    tl.store(w_ptr + idx, w.to(w_ptr.dtype.element_ty), mask=mask)
    return m, u


@triton.jit
def _adamw_lowbit_kernel(w_ptr, g_ptr, mq_ptr, ms_ptr, vq_ptr, vs_ptr, numel, n_blocks,
                         lr, beta1, beta2, eps, decay, step_scale, inv_sqrt_bias2, key,
                         BITS: tl.constexpr, M_MAX: tl.constexpr, LEVELS: tl.constexpr, HALF: tl.constexpr,
                         GROUPS: tl.constexpr, STOCHASTIC: tl.constexpr):
    pid = tl.program_id(0)
    blocks = pid * GROUPS + tl.arange(0, GROUPS)
    block_ok = blocks < n_blocks
    cols = tl.arange(0, HALF)
    base = blocks.to(tl.int64)[:, None] * (2 * HALF) + cols[None, :]  # element index, first half
    lo_idx, hi_idx = base, base + HALF
    tile_ok = block_ok[:, None] & (cols[None, :] < HALF)
    lo_mask, hi_mask = tile_ok & (lo_idx < numel), tile_ok & (hi_idx < numel)
    ms = tl.load(ms_ptr + blocks, mask=block_ok, other=0.0)[:, None] / (M_MAX * M_MAX)
    vs = tl.load(vs_ptr + blocks, mask=block_ok, other=0.0)[:, None] / (LEVELS * LEVELS)
    if BITS == 8:
        mq_lo = tl.load(mq_ptr + lo_idx, mask=tile_ok, other=0).to(tl.float32)
        mq_hi = tl.load(mq_ptr + hi_idx, mask=tile_ok, other=0).to(tl.float32)
        vq_lo = tl.load(vq_ptr + lo_idx, mask=tile_ok, other=0).to(tl.float32)
        vq_hi = tl.load(vq_ptr + hi_idx, mask=tile_ok, other=0).to(tl.float32)
    else:
        byte_idx = blocks.to(tl.int64)[:, None] * HALF + cols[None, :]
        mb = tl.load(mq_ptr + byte_idx, mask=tile_ok, other=136).to(tl.int32)
        vb = tl.load(vq_ptr + byte_idx, mask=tile_ok, other=0).to(tl.int32)
        mq_lo, mq_hi = (mb & 15).to(tl.float32) - 8.0, (mb >> 4).to(tl.float32) - 8.0
        vq_lo, vq_hi = (vb & 15).to(tl.float32), (vb >> 4).to(tl.float32)
    m_lo, m_hi = mq_lo * tl.abs(mq_lo) * ms, mq_hi * tl.abs(mq_hi) * ms
    u_lo, u_hi = (vq_lo + 1.0) * (vq_lo + 1.0) * vs, (vq_hi + 1.0) * (vq_hi + 1.0) * vs
    m_lo, u_lo = _half_update(w_ptr, g_ptr, lo_idx, lo_mask, m_lo, u_lo, lr, beta1, beta2, eps, decay,
                              step_scale, inv_sqrt_bias2, key, STOCHASTIC)
    m_hi, u_hi = _half_update(w_ptr, g_ptr, hi_idx, hi_mask, m_hi, u_hi, lr, beta1, beta2, eps, decay,
                              step_scale, inv_sqrt_bias2, key, STOCHASTIC)
    # Pad elements hold zero m and u (their gradient reads as 0): they do not move the absmax.
    m_lo, m_hi = tl.where(lo_mask, m_lo, 0.0), tl.where(hi_mask, m_hi, 0.0)
    u_lo, u_hi = tl.where(lo_mask, u_lo, 0.0), tl.where(hi_mask, u_hi, 0.0)
    # Requantize. Scales: absmax per block (both halves).
    m_scale = tl.maximum(tl.max(tl.abs(m_lo), axis=1), tl.max(tl.abs(m_hi), axis=1))
    u_scale = tl.maximum(tl.max(u_lo, axis=1), tl.max(u_hi, axis=1))
    tl.store(ms_ptr + blocks, m_scale, mask=block_ok)
    tl.store(vs_ptr + blocks, u_scale, mask=block_ok)
    m_div = tl.where(m_scale > 0.0, m_scale, 1.0)[:, None]
    u_div = tl.where(u_scale > 0.0, u_scale, 1.0)[:, None]
    qm_lo = rint(tl.sqrt(tl.abs(m_lo) / m_div) * M_MAX)
    qm_hi = rint(tl.sqrt(tl.abs(m_hi) / m_div) * M_MAX)
    qm_lo = tl.where(m_lo < 0.0, -qm_lo, qm_lo)
    qm_hi = tl.where(m_hi < 0.0, -qm_hi, qm_hi)
    qv_lo = tl.clamp(rint(tl.sqrt(u_lo / u_div) * LEVELS - 1.0), 0.0, LEVELS - 1.0)
    qv_hi = tl.clamp(rint(tl.sqrt(u_hi / u_div) * LEVELS - 1.0), 0.0, LEVELS - 1.0)
    qv_lo = tl.where(lo_mask, qv_lo, 0.0)
    qv_hi = tl.where(hi_mask, qv_hi, 0.0)
    if BITS == 8:
        tl.store(mq_ptr + lo_idx, qm_lo.to(tl.int8), mask=tile_ok)
        tl.store(mq_ptr + hi_idx, qm_hi.to(tl.int8), mask=tile_ok)
        tl.store(vq_ptr + lo_idx, qv_lo.to(tl.int32).to(tl.uint8), mask=tile_ok)
        tl.store(vq_ptr + hi_idx, qv_hi.to(tl.int32).to(tl.uint8), mask=tile_ok)
    else:
        mb = (qm_lo + 8.0).to(tl.int32) | ((qm_hi + 8.0).to(tl.int32) << 4)
        vb = qv_lo.to(tl.int32) | (qv_hi.to(tl.int32) << 4)
        tl.store(mq_ptr + byte_idx, mb.to(tl.uint8), mask=tile_ok)
        tl.store(vq_ptr + byte_idx, vb.to(tl.uint8), mask=tile_ok)


def _update_triton(param, grad, m_codes, m_scales, v_codes, v_scales, bits, block, lr, beta1, beta2, eps,
                   weight_decay, bias1, bias2, key):
    numel, n_blocks = param.numel(), m_scales.numel()
    groups = max(1, min(_PROGRAM_ELEMENTS // block, triton.next_power_of_2(n_blocks)))
    grid = (triton.cdiv(n_blocks, groups),)
    _adamw_lowbit_kernel[grid](
        param.view(-1), grad.reshape(-1), m_codes, m_scales, v_codes, v_scales, numel, n_blocks,
        float(lr), float(beta1), float(beta2), float(eps), float(1.0 - lr * weight_decay), float(lr / bias1),
        float(1.0 / bias2 ** 0.5), 0 if key is None else int(key),
        BITS=bits, M_MAX=float(M_MAX[bits]), LEVELS=float(V_LEVELS[bits]), HALF=block // 2, GROUPS=groups, STOCHASTIC=key is not None)


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------
def adamw_lowbit_update_(param: torch.Tensor, grad: torch.Tensor, m_codes: torch.Tensor, m_scales: torch.Tensor,
                         v_codes: torch.Tensor, v_scales: torch.Tensor, *, bits: int, block_size: int, step: int,
                         lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                         weight_decay: float = 0.0, sr_key: int | None = None, compiled: bool = False) -> None:
    """One AdamW step (decoupled weight decay, bias correction at ``step``, 1-based) of
    ``param`` in place, with its moments read from and written back to the quantized state.

    Args:
        param: contiguous float32 or bfloat16 tensor (any shape); bfloat16 needs ``sr_key``.
        grad: same number of elements, float32/float16/bfloat16.
        m_codes, m_scales, v_codes, v_scales: the state, shaped by :func:`state_shapes`
            (start at all zeros: m = 0, and v at the lowest level times a zero scale = 0).
        bits: 8 or 4. block_size: even, ≥ 2, a power of two (the Triton tile is a half block).
        sr_key: 32-bit key of the stochastic rounding of a bf16 parameter (:func:`sr_key`);
            None for float32 parameters.
        compiled: on the eager (CPU) path, run each chunk through ``torch.compile`` (one fused
            loop; the first call compiles for ~10 s, then ~10x faster than the chain of tensor
            ops on this project's CPU: ``python -m bench.capacity --optimizer-speed``).
    """
    if bits not in BITS:
        raise ValueError(f"bits={bits!r}: must be one of {BITS}")
    if not (isinstance(block_size, int) and block_size >= 2 and block_size & (block_size - 1) == 0):
        raise ValueError(f"block_size={block_size!r}: must be a power of two >= 2")
    if param.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"param: dtype {param.dtype}, expected float32 or bfloat16")
    if not param.is_contiguous():
        raise ValueError("param: must be contiguous (updated in place through a flat view)")
    if grad.numel() != param.numel():
        raise ValueError(f"grad: {grad.numel()} elements, param has {param.numel()}")
    if (param.dtype == torch.bfloat16) != (sr_key is not None):
        raise ValueError("sr_key: required for a bfloat16 param (stochastic rounding), None for float32")
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"step={step!r}: must be an int >= 1")
    expected = state_shapes(param.numel(), bits, block_size)
    for name, tensor in (("m_codes", m_codes), ("m_scales", m_scales), ("v_codes", v_codes), ("v_scales", v_scales)):
        shape, dtype = expected[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"{name}: {tuple(tensor.shape)} {tensor.dtype}, expected {shape} {dtype} for "
                             f"{param.numel()} elements at bits={bits}, block_size={block_size}")
        if tensor.device != param.device:
            raise ValueError(f"{name}: on {tensor.device}, param on {param.device}")
    args = (param, grad, m_codes, m_scales, v_codes, v_scales, bits, block_size, lr, beta1, beta2, eps,
            weight_decay, 1.0 - beta1 ** step, 1.0 - beta2 ** step, sr_key)
    backend = choose_backend("adamw_lowbit", param.device)
    record("adamw_lowbit", backend)
    with torch.no_grad():
        if backend == "triton":
            _update_triton(*args)
        else:
            _update_eager(*args, compiled=compiled)

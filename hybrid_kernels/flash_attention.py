"""Flash attention: ``flash_attention(q, k, v, causal=False, softmax_scale=None)``.

``out = softmax(q @ k^T * softmax_scale + mask) @ v`` per (batch, query head), computed block by
block with an online softmax, so the ``Nq x Nk`` score matrix never exists in memory.

Shapes and dtypes:

* ``q``: ``[B, Hq, Nq, D]``; ``k``, ``v``: ``[B, Hkv, Nk, D]`` with ``Hq % Hkv == 0``. Query head
  ``h`` reads kv head ``h // (Hq // Hkv)`` (grouped-query attention; ``Hkv == 1`` is multi-query
  attention), the same grouping as ``repeat_interleave(Hq // Hkv, dim=1)`` on k and v and as
  SDPA's ``enable_gqa=True``.
* ``D`` in {16, 32, 64, 128}; any ``Nq >= 0``, ``Nk >= 1`` (not only block multiples). Empty in,
  empty out: ``B == 0``, ``Nq == 0`` or ``Hq == 0`` (``Hkv`` may then be 0 too) give an empty
  output (and zero gradients for k and v); ``Hkv == 0`` with ``Hq > 0`` is a ``ValueError``.
* float32, float16 or bfloat16 (all three the same dtype). Softmax statistics and every
  accumulator are fp32; fp16/bf16 tensors feed ``tl.dot`` directly (fp32 accumulation), fp32
  tensors use IEEE fp32 dots (not TF32) so fp32 keeps fp32 accuracy on a GPU. On the Triton
  interpreter bf16 tiles are upcast to fp32 right after each load (its bf16 arithmetic is wrong).
* The output has the shape and dtype of ``q`` (contiguous on the Triton path).

Causal mask alignment: **top-left**, the convention of
``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``: query ``i`` sees keys
``j <= i``, counted from the start of both sequences, whatever ``Nq`` and ``Nk`` are. With
``Nq == Nk`` (training) this is the usual causal mask. With ``Nq != Nk`` it is *not*
FlashAttention's bottom-right alignment (query ``i`` sees ``j <= i + Nk - Nq``, the one for
decoding against a KV cache). Reason for the choice: every query row sees at least key 0, so no
row is ever fully masked (no 0/0 to define), and the CPU fallback is SDPA itself with
``is_causal=True``, so both backends agree by construction rather than through a hand-built mask.

Backends (:mod:`hybrid_kernels._dispatch`): the Triton kernels serve CUDA tensors and, in a process
whose kernels were decorated for the Triton interpreter, CPU tensors; everything else runs
``scaled_dot_product_attention`` (backward by torch autograd on that path).
``last_backend("flash_attention")`` / ``last_backend("flash_attention_backward")`` say which
served the last forward / backward.

Triton path:

* forward: one program per (query block, batch, query head). Key blocks that are fully visible
  and fully in range run without any masking; only the diagonal (causal) and ragged last blocks
  pay for the mask. Probabilities are ``exp2((s - m) * c)`` with raw scores ``s = q.k``, their
  running row max ``m`` and ``c = softmax_scale * log2(e)``: subtracting before scaling keeps
  the exponent of every large probability small and exact. Saves per row, for the backward,
  fp32 ``stats [2, B, Hq, Nq]``: ``m`` and ``1 / l`` with ``l = sum_j exp2((s_ij - m) * c)``.
  (Measured on fp32 with large scores, scale 0.5, D 32: the usual single log-sum-exp of the
  scaled scores gave dV 3.5x PyTorch's error, since its rounding, ~eps * |lse|, scales every P
  of the row alike; m and 1/l with scaling after the subtraction give 1.5-2.3x over 5 seeds.
  The rest comes from recomputing q.k in the backward, inherent to the method; at the default
  scale the ratio is <= 1.6x.) For fp16/bf16 with a backward it also saves the output's
  rounding residual (see the delta kernel).
* backward: ``delta = rowsum(dO * O)`` (preprocessing kernel), then two kernels that each
  recompute ``P = exp2((s - m) * c) / l`` tile by tile: one program per (key block, batch, kv head)
  accumulates ``dK`` and ``dV`` over *all query heads of its group* and all query blocks (so
  GQA needs no atomics and the result is deterministic), and one program per
  (query block, batch, query head) accumulates ``dQ``.

Under ``torch.compile`` the call goes through the ``hybrid_kernels::flash_attention_fwd`` /
``hybrid_kernels::flash_attention_bwd`` custom ops (fake kernels, ``register_autograd``), so it is
one opaque node in the graph (there the eager backend's backward is computed in closed form,
``_backward_eager``: torch autograd records nothing inside a custom op); in eager mode the
implementation is called directly.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._dispatch import choose_backend, record
from ._triton_compat import INTERPRET, tl, triton

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOG2E = 1.4426950408889634  # exp(x) == exp2(x * log2(e)); exp2 is the cheaper instruction on GPU

# SDPA grew `enable_gqa` in torch 2.5; older torch repeats the kv heads instead.
_SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


# --------------------------------------------------------------------------------------------
# Triton kernels
#
# Every tensor is addressed as base + batch * stride_b + head * stride_h + row * stride_n + dim:
# the head dimension must be contiguous (stride 1); the others are free, so q/k/v sliced out of
# a fused qkv projection need no copy. Out-of-range rows and columns are loaded as 0 and masked
# out of the softmax; programs never store outside the tensors.
# --------------------------------------------------------------------------------------------
@triton.jit
def _load_key_block(k_base, v_base, cols, dims, stride_kn, stride_vn, seq_k,
                    MASKED: tl.constexpr, UPCAST: tl.constexpr):
    """Keys and values of one key block ``[BLOCK_N, HEAD_DIM]``; rows past ``seq_k`` read as 0
    when MASKED (unmasked callers guarantee the block is in range)."""
    k_ptrs = k_base + cols[:, None] * stride_kn + dims[None, :]
    v_ptrs = v_base + cols[:, None] * stride_vn + dims[None, :]
    if MASKED:
        in_range = (cols < seq_k)[:, None]
        k = tl.load(k_ptrs, mask=in_range, other=0.0)
        v = tl.load(v_ptrs, mask=in_range, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if UPCAST:  # the interpreter computes bf16 on raw bits: upcast right after the load
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _fwd_key_blocks(acc, row_max, row_sum, q, k_base, v_base, stride_kn, stride_vn,
                    rows, key_start, key_end, seq_k, qk_scale_log2,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                    MASKED: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online-softmax update of one query block over key blocks [key_start, key_end).

    MASKED=False is only called on key blocks that are fully in range and fully visible to every
    row of the query block, so it skips the mask arithmetic entirely."""
    dims = tl.arange(0, HEAD_DIM)
    for key_block_start in range(key_start, key_end, BLOCK_N):
        cols = key_block_start + tl.arange(0, BLOCK_N)
        k, v = _load_key_block(k_base, v_base, cols, dims, stride_kn, stride_vn, seq_k, MASKED, UPCAST)
        col_in_range = cols < seq_k
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # raw q.k, [BLOCK_M, BLOCK_N]
        if MASKED:
            visible = col_in_range[None, :]
            if CAUSAL:
                visible = visible & (cols[None, :] <= rows[:, None])
            scores = tl.where(visible, scores, float("-inf"))
        # Key 0 is visible to every row and the first block processed holds it, so new_max is
        # finite from the first block on: exp2(-inf - finite) = 0, never NaN.
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # Subtract the max before scaling: the large probabilities have scores near the max, so
        # their exponent (s - m) * c is small and exact to a few ulps, whatever the score size.
        rescale = tl.exp2((row_max - new_max) * qk_scale_log2)
        probs = tl.exp2((scores - new_max[:, None]) * qk_scale_log2)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None]
        acc = tl.dot(probs.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        row_max = new_max
    return acc, row_max, row_sum


@triton.jit
def _flash_fwd_kernel(q_ptr, k_ptr, v_ptr, out_ptr, out_residual_ptr, stats_ptr, stats_plane,
                      stride_qb, stride_qh, stride_qn,
                      stride_kb, stride_kh, stride_kn,
                      stride_vb, stride_vh, stride_vn,
                      stride_ob, stride_oh, stride_on,
                      n_q_heads, kv_group_size, seq_q, seq_k, qk_scale_log2, n_query_blocks,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      CAUSAL: tl.constexpr, UPCAST: tl.constexpr, STORE_RESIDUAL: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    """out_residual (same layout as out) receives fp32 out minus its rounding to out's dtype."""
    # 1-D grid (query blocks fastest): no 65535 limit on batch * heads, and the programs of one
    # head, which share its K/V, run next to each other.
    # stats [2, B, Hq, Nq]: row maxima, then 1 / row sums (one tensor, no per-launch slicing on the host)
    row_max_ptr = stats_ptr
    inv_sum_ptr = stats_ptr + stats_plane
    pid = tl.program_id(0)
    query_block = pid % n_query_blocks
    batch_head = pid // n_query_blocks
    batch = (batch_head // n_q_heads).to(tl.int64)
    q_head = (batch_head % n_q_heads).to(tl.int64)
    kv_head = q_head // kv_group_size

    q_base = q_ptr + batch * stride_qb + q_head * stride_qh
    k_base = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_base = v_ptr + batch * stride_vb + kv_head * stride_vh
    out_base = out_ptr + batch * stride_ob + q_head * stride_oh

    query_start = query_block * BLOCK_M
    rows = query_start + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_in_range = rows < seq_q
    q = tl.load(q_base + rows[:, None] * stride_qn + dims[None, :], mask=row_in_range[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # Key blocks [0, unmasked_end) are in range and (causal) entirely left of the diagonal for
    # every row of this block; [unmasked_end, key_end) need the mask; keys past key_end are
    # invisible to the whole block (causal) and are skipped.
    unmasked_end = (seq_k // BLOCK_N) * BLOCK_N
    if CAUSAL:
        key_end = tl.minimum(seq_k, query_start + BLOCK_M)
        unmasked_end = tl.minimum(unmasked_end, ((query_start + 1) // BLOCK_N) * BLOCK_N)
    else:
        key_end = seq_k
    acc, row_max, row_sum = _fwd_key_blocks(
        acc, row_max, row_sum, q, k_base, v_base, stride_kn, stride_vn, rows, 0, unmasked_end, seq_k,
        qk_scale_log2, HEAD_DIM, BLOCK_N, CAUSAL, False, UPCAST, DOT_PRECISION)
    acc, row_max, row_sum = _fwd_key_blocks(
        acc, row_max, row_sum, q, k_base, v_base, stride_kn, stride_vn, rows, unmasked_end, key_end, seq_k,
        qk_scale_log2, HEAD_DIM, BLOCK_N, CAUSAL, True, UPCAST, DOT_PRECISION)

    inv_sum = 1.0 / row_sum
    acc = acc * inv_sum[:, None]
    out_offsets = rows[:, None] * stride_on + dims[None, :]
    out_rounded = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_base + out_offsets, out_rounded, mask=row_in_range[:, None])
    if STORE_RESIDUAL:
        residual = acc - out_rounded.to(tl.float32)
        tl.store(out_residual_ptr + batch * stride_ob + q_head * stride_oh + out_offsets,
                 residual.to(out_residual_ptr.dtype.element_ty), mask=row_in_range[:, None])
    stats_offsets = batch_head.to(tl.int64) * seq_q + rows
    tl.store(row_max_ptr + stats_offsets, row_max, mask=row_in_range)
    tl.store(inv_sum_ptr + stats_offsets, inv_sum, mask=row_in_range)


@triton.jit
def _bwd_delta_kernel(out_ptr, out_residual_ptr, dout_ptr, delta_ptr,
                      stride_ob, stride_oh, stride_on,
                      stride_rb, stride_rh, stride_rn,
                      stride_dob, stride_doh, stride_don,
                      n_q_heads, seq_q, n_query_blocks,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d] in fp32 (the softmax-backward term
    rowsum(P * dP), which equals rowsum(dO * O) because O = P V and dP = dO V^T).

    O is the forward's fp32 result, rebuilt as stored output + stored residual: delta from the
    fp16-rounded output alone gave dQ up to 2.2x the error of PyTorch's attention (measured),
    against 1.0x with the residual."""
    pid = tl.program_id(0)
    query_block = pid % n_query_blocks
    batch_head = pid // n_query_blocks
    batch = (batch_head // n_q_heads).to(tl.int64)
    q_head = (batch_head % n_q_heads).to(tl.int64)
    rows = query_block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_in_range = rows < seq_q
    out = tl.load(out_ptr + batch * stride_ob + q_head * stride_oh + rows[:, None] * stride_on + dims[None, :],
                  mask=row_in_range[:, None], other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        out += tl.load(out_residual_ptr + batch * stride_rb + q_head * stride_rh + rows[:, None] * stride_rn
                       + dims[None, :], mask=row_in_range[:, None], other=0.0).to(tl.float32)
    dout = tl.load(dout_ptr + batch * stride_dob + q_head * stride_doh + rows[:, None] * stride_don + dims[None, :],
                   mask=row_in_range[:, None], other=0.0).to(tl.float32)
    tl.store(delta_ptr + batch_head.to(tl.int64) * seq_q + rows, tl.sum(out * dout, axis=1), mask=row_in_range)


@triton.jit
def _dot_two_term(a, b, acc, TWO_TERM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + a @ b for an fp32 ``a`` and a ``b`` in the input dtype.

    TWO_TERM: ``a`` is written as hi + lo, both in b's dtype (fp16/bf16), and multiplied in two
    tensor-core dots. Rounding dS to fp16 once (FlashAttention's way) costs dQ and dK up to ~2.6x
    the error of PyTorch's fp32-accumulating attention (measured); hi + lo carries ~22 mantissa
    bits (fp16) for two cheap dots instead of one fp32 dot, which has no tensor-core path."""
    if TWO_TERM:
        hi = a.to(b.dtype)
        lo = (a - hi.to(tl.float32)).to(b.dtype)
        acc = tl.dot(hi, b, acc, input_precision=DOT_PRECISION)
        return tl.dot(lo, b, acc, input_precision=DOT_PRECISION)
    else:
        return tl.dot(a.to(b.dtype), b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _bwd_dkdv_query_blocks(dk, dv, k, v, q_base, dout_base, max_base, inv_sum_base, delta_base,
                           stride_qn, stride_don,
                           cols, query_start, query_end, seq_q, qk_scale_log2,
                           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr,
                           MASKED: tl.constexpr, UPCAST: tl.constexpr, TWO_TERM: tl.constexpr,
                           DOT_PRECISION: tl.constexpr):
    """Add the contributions of query blocks [query_start, query_end) of one query head to the dK
    and dV of one key block. Works on transposed tiles ([keys, queries]) so the products land in
    dK/dV's row layout without transposing the accumulators."""
    dims = tl.arange(0, HEAD_DIM)
    for query_block_start in range(query_start, query_end, BLOCK_M):
        rows = query_block_start + tl.arange(0, BLOCK_M)
        if MASKED:
            row_in_range = rows < seq_q
            q = tl.load(q_base + rows[:, None] * stride_qn + dims[None, :], mask=row_in_range[:, None], other=0.0)
            dout = tl.load(dout_base + rows[:, None] * stride_don + dims[None, :], mask=row_in_range[:, None],
                           other=0.0)
            row_max = tl.load(max_base + rows, mask=row_in_range, other=0.0)
            inv_sum = tl.load(inv_sum_base + rows, mask=row_in_range, other=0.0)
            delta = tl.load(delta_base + rows, mask=row_in_range, other=0.0)
        else:
            q = tl.load(q_base + rows[:, None] * stride_qn + dims[None, :])
            dout = tl.load(dout_base + rows[:, None] * stride_don + dims[None, :])
            row_max = tl.load(max_base + rows)
            inv_sum = tl.load(inv_sum_base + rows)
            delta = tl.load(delta_base + rows)
        if UPCAST:
            q = q.to(tl.float32)
            dout = dout.to(tl.float32)
        scores_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # raw k.q, [BLOCK_N, BLOCK_M]
        probs_t = tl.exp2((scores_t - row_max[None, :]) * qk_scale_log2) * inv_sum[None, :]
        if MASKED:
            # where(), not a multiply: a masked score may exceed the row max and overflow exp2.
            visible = row_in_range[None, :]
            if CAUSAL:
                visible = visible & (cols[:, None] <= rows[None, :])
            probs_t = tl.where(visible, probs_t, 0.0)
        dv = tl.dot(probs_t.to(dout.dtype), dout, dv, input_precision=DOT_PRECISION)
        dprobs_t = tl.dot(v, tl.trans(dout), input_precision=DOT_PRECISION)
        dscores_t = probs_t * (dprobs_t - delta[None, :])
        dk = _dot_two_term(dscores_t, q, dk, TWO_TERM, DOT_PRECISION)
    return dk, dv


@triton.jit
def _flash_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, dout_ptr, stats_ptr, stats_plane, delta_ptr, dk_ptr, dv_ptr,
                           stride_qb, stride_qh, stride_qn,
                           stride_kb, stride_kh, stride_kn,
                           stride_vb, stride_vh, stride_vn,
                           stride_dob, stride_doh, stride_don,
                           stride_dkb, stride_dkh, stride_dkn,
                           stride_dvb, stride_dvh, stride_dvn,
                           n_q_heads, n_kv_heads, kv_group_size, seq_q, seq_k, qk_scale_log2, softmax_scale,
                           n_key_blocks,
                           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           CAUSAL: tl.constexpr, UPCAST: tl.constexpr, TWO_TERM: tl.constexpr,
                           DOT_PRECISION: tl.constexpr):
    # stats [2, B, Hq, Nq]: row maxima, then 1 / row sums (one tensor, no per-launch slicing on the host)
    row_max_ptr = stats_ptr
    inv_sum_ptr = stats_ptr + stats_plane
    pid = tl.program_id(0)
    key_block = pid % n_key_blocks
    batch_kv_head = pid // n_key_blocks
    batch = (batch_kv_head // n_kv_heads).to(tl.int64)
    kv_head = (batch_kv_head % n_kv_heads).to(tl.int64)

    key_start = key_block * BLOCK_N
    cols = key_start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    col_in_range = cols < seq_k
    # Keys past seq_k load as 0; their dK/dV rows are computed but never stored.
    k = tl.load(k_ptr + batch * stride_kb + kv_head * stride_kh + cols[:, None] * stride_kn + dims[None, :],
                mask=col_in_range[:, None], other=0.0)
    v = tl.load(v_ptr + batch * stride_vb + kv_head * stride_vh + cols[:, None] * stride_vn + dims[None, :],
                mask=col_in_range[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    # Query blocks in three runs: [first, diagonal_end) straddle the causal diagonal (masked),
    # [diagonal_end, tail_start) see the whole key block and are in range (unmasked),
    # [tail_start, query_blocks_end) hold the ragged last rows (masked).
    query_blocks_end = ((seq_q + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    if CAUSAL:
        # Row i sees key j iff j <= i: rows before this key block see none of it, and rows
        # >= key_start + BLOCK_N - 1 see all of it.
        first = (key_start // BLOCK_M) * BLOCK_M
        diagonal_end = tl.minimum(((key_start + BLOCK_N - 1 + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, query_blocks_end)
    else:
        first = 0
        diagonal_end = 0
    tail_start = tl.maximum(diagonal_end, (seq_q // BLOCK_M) * BLOCK_M)

    # GQA: every query head of this kv head's group adds into the same accumulators.
    for group_member in range(kv_group_size):
        q_head = kv_head * kv_group_size + group_member
        batch_q_head = batch * n_q_heads + q_head
        q_base = q_ptr + batch * stride_qb + q_head * stride_qh
        dout_base = dout_ptr + batch * stride_dob + q_head * stride_doh
        max_base = row_max_ptr + batch_q_head * seq_q
        inv_sum_base = inv_sum_ptr + batch_q_head * seq_q
        delta_base = delta_ptr + batch_q_head * seq_q
        dk, dv = _bwd_dkdv_query_blocks(
            dk, dv, k, v, q_base, dout_base, max_base, inv_sum_base, delta_base, stride_qn, stride_don, cols,
            first, diagonal_end, seq_q, qk_scale_log2, HEAD_DIM, BLOCK_M, CAUSAL, True, UPCAST,
            TWO_TERM, DOT_PRECISION)
        dk, dv = _bwd_dkdv_query_blocks(
            dk, dv, k, v, q_base, dout_base, max_base, inv_sum_base, delta_base, stride_qn, stride_don, cols,
            diagonal_end, tail_start, seq_q, qk_scale_log2, HEAD_DIM, BLOCK_M, CAUSAL, False, UPCAST,
            TWO_TERM, DOT_PRECISION)
        dk, dv = _bwd_dkdv_query_blocks(
            dk, dv, k, v, q_base, dout_base, max_base, inv_sum_base, delta_base, stride_qn, stride_don, cols,
            tail_start, query_blocks_end, seq_q, qk_scale_log2, HEAD_DIM, BLOCK_M, CAUSAL, True, UPCAST,
            TWO_TERM, DOT_PRECISION)

    # dS was taken w.r.t. the scaled scores; the chain rule through q.k * softmax_scale adds it here.
    dk = dk * softmax_scale
    tl.store(dk_ptr + batch * stride_dkb + kv_head * stride_dkh + cols[:, None] * stride_dkn + dims[None, :],
             dk.to(dk_ptr.dtype.element_ty), mask=col_in_range[:, None])
    tl.store(dv_ptr + batch * stride_dvb + kv_head * stride_dvh + cols[:, None] * stride_dvn + dims[None, :],
             dv.to(dv_ptr.dtype.element_ty), mask=col_in_range[:, None])


@triton.jit
def _bwd_dq_key_blocks(dq, q, dout, row_max, inv_sum, delta, k_base, v_base, stride_kn, stride_vn,
                       rows, key_start, key_end, seq_k, qk_scale_log2,
                       HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                       MASKED: tl.constexpr, UPCAST: tl.constexpr, TWO_TERM: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    """Add key blocks [key_start, key_end) to the dQ of one query block."""
    dims = tl.arange(0, HEAD_DIM)
    for key_block_start in range(key_start, key_end, BLOCK_N):
        cols = key_block_start + tl.arange(0, BLOCK_N)
        k, v = _load_key_block(k_base, v_base, cols, dims, stride_kn, stride_vn, seq_k, MASKED, UPCAST)
        col_in_range = cols < seq_k
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        probs = tl.exp2((scores - row_max[:, None]) * qk_scale_log2) * inv_sum[:, None]
        if MASKED:
            visible = col_in_range[None, :]
            if CAUSAL:
                visible = visible & (cols[None, :] <= rows[:, None])
            probs = tl.where(visible, probs, 0.0)
        dprobs = tl.dot(dout, tl.trans(v), input_precision=DOT_PRECISION)
        dscores = probs * (dprobs - delta[:, None])
        dq = _dot_two_term(dscores, k, dq, TWO_TERM, DOT_PRECISION)
    return dq


@triton.jit
def _flash_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, dout_ptr, stats_ptr, stats_plane, delta_ptr, dq_ptr,
                         stride_qb, stride_qh, stride_qn,
                         stride_kb, stride_kh, stride_kn,
                         stride_vb, stride_vh, stride_vn,
                         stride_dob, stride_doh, stride_don,
                         stride_dqb, stride_dqh, stride_dqn,
                         n_q_heads, kv_group_size, seq_q, seq_k, qk_scale_log2, softmax_scale, n_query_blocks,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         CAUSAL: tl.constexpr, UPCAST: tl.constexpr, TWO_TERM: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    # stats [2, B, Hq, Nq]: row maxima, then 1 / row sums (one tensor, no per-launch slicing on the host)
    row_max_ptr = stats_ptr
    inv_sum_ptr = stats_ptr + stats_plane
    pid = tl.program_id(0)
    query_block = pid % n_query_blocks
    batch_head = pid // n_query_blocks
    batch = (batch_head // n_q_heads).to(tl.int64)
    q_head = (batch_head % n_q_heads).to(tl.int64)
    kv_head = q_head // kv_group_size

    query_start = query_block * BLOCK_M
    rows = query_start + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_in_range = rows < seq_q
    q = tl.load(q_ptr + batch * stride_qb + q_head * stride_qh + rows[:, None] * stride_qn + dims[None, :],
                mask=row_in_range[:, None], other=0.0)
    dout = tl.load(dout_ptr + batch * stride_dob + q_head * stride_doh + rows[:, None] * stride_don + dims[None, :],
                   mask=row_in_range[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        dout = dout.to(tl.float32)
    stats_offsets = batch_head.to(tl.int64) * seq_q + rows
    row_max = tl.load(row_max_ptr + stats_offsets, mask=row_in_range, other=0.0)
    inv_sum = tl.load(inv_sum_ptr + stats_offsets, mask=row_in_range, other=0.0)
    delta = tl.load(delta_ptr + stats_offsets, mask=row_in_range, other=0.0)
    k_base = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_base = v_ptr + batch * stride_vb + kv_head * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # Same key-block split as the forward pass.
    unmasked_end = (seq_k // BLOCK_N) * BLOCK_N
    if CAUSAL:
        key_end = tl.minimum(seq_k, query_start + BLOCK_M)
        unmasked_end = tl.minimum(unmasked_end, ((query_start + 1) // BLOCK_N) * BLOCK_N)
    else:
        key_end = seq_k
    dq = _bwd_dq_key_blocks(dq, q, dout, row_max, inv_sum, delta, k_base, v_base, stride_kn, stride_vn, rows,
                            0, unmasked_end, seq_k, qk_scale_log2, HEAD_DIM, BLOCK_N, CAUSAL, False, UPCAST, TWO_TERM,
                            DOT_PRECISION)
    dq = _bwd_dq_key_blocks(dq, q, dout, row_max, inv_sum, delta, k_base, v_base, stride_kn, stride_vn, rows,
                            unmasked_end, key_end, seq_k, qk_scale_log2, HEAD_DIM, BLOCK_N, CAUSAL, True, UPCAST, TWO_TERM,
                            DOT_PRECISION)
    dq = dq * softmax_scale
    tl.store(dq_ptr + batch * stride_dqb + q_head * stride_dqh + rows[:, None] * stride_dqn + dims[None, :],
             dq.to(dq_ptr.dtype.element_ty), mask=row_in_range[:, None])


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
# Configurations for 16-bit inputs with D = 64, from `python -m bench.tune_flash_attention` on an
# NVIDIA H100 (docs/results/flash_tuning_nvidia-h100-80gb-hbm3.json: device time from CUDA-graph
# replays, B=2, H=8, N=1024, 8 configurations). Forward 64 x 128 / 4 warps / 3 stages: 0.014 ms
# non-causal and 0.015 ms causal, SDPA (cuDNN) 0.014 ms; it was also the fastest non-causal
# forward of 24 in the earlier runs timed with plain do_bench (..._do_bench.json). Backward 128 x 64 / 4 warps / 2
# stages: 0.064 / 0.071 ms (non-causal / causal) against 0.088 / 0.090 ms for the 8-warp,
# 3-stage tiles chosen before from host-inclusive timings, SDPA 0.038 / 0.040 ms.
_TUNED_D64_16BIT = {"forward": {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3},
                    "backward": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}}


def _kernel_config(head_dim: int, dtype: torch.dtype, backward: bool = False) -> dict:
    """Block sizes and launch hints of the forward or the backward kernels.

    Under the interpreter the cost is per op, not per element, so few large programs are fastest
    (64 x 64 tiles). On a GPU, 16-bit inputs with D = 64 take the configurations tuned above;
    everything else keeps conservative untuned defaults: 64 x 64 tiles, 8 warps for D = 128, and
    2 pipeline stages where 3 would risk the shared-memory limit (fp32 tiles or D = 128)."""
    if not INTERPRET and head_dim == 64 and dtype in (torch.float16, torch.bfloat16):
        return dict(_TUNED_D64_16BIT["backward" if backward else "forward"])
    wide = head_dim >= 128 or dtype == torch.float32
    return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8 if head_dim >= 128 else 4,
            "num_stages": 2 if wide else 3}


def _dot_precision(dtype: torch.dtype) -> str:
    # TF32 would cost fp32 inputs ~1e-3 relative error on a GPU; fp16/bf16 dots ignore the flag.
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast_loads(dtype: torch.dtype) -> bool:
    # The interpreter does integer math on bf16 bit patterns; fp32 tiles are exact copies.
    return INTERPRET and dtype == torch.bfloat16


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride()[:3]  # one call, not three: launches are host-bound at small shapes


def _head_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _needs_residual(dtype: torch.dtype, for_backward: bool) -> bool:
    return for_backward and dtype != torch.float32


def _forward_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
                    for_backward: bool = True, config: dict | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(out, stats, out_residual)``: out ``[B, Hq, Nq, D]`` in q's dtype; stats
    ``[2, B, Hq, Nq]`` float32 (row max of the raw scores q.k, 1 / row sum); out_residual =
    fp32 result minus out, in q's dtype, shaped like out when q is fp16/bf16 and ``for_backward``,
    else an empty tensor (an fp32 out loses nothing; inference runs no backward).
    ``config`` replaces :func:`_kernel_config` (block sizes and launch hints; bench/tune_flash_attention.py)."""
    q, k, v = (_head_dim_contiguous(t) for t in (q, k, v))
    batch, n_q_heads, seq_q, head_dim = q.shape
    n_kv_heads, seq_k = k.shape[1], k.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    store_residual = _needs_residual(q.dtype, for_backward)
    # Allocated like `out`, so the kernel addresses both with out's strides.
    out_residual = torch.empty(q.shape if store_residual else (0,), dtype=q.dtype, device=q.device)
    stats = torch.empty((2, batch, n_q_heads, seq_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, stats, out_residual
    cfg = config or _kernel_config(head_dim, q.dtype)
    n_query_blocks = triton.cdiv(seq_q, cfg["BLOCK_M"])
    grid = (n_query_blocks * batch * n_q_heads,)
    _flash_fwd_kernel[grid](
        q, k, v, out, out_residual if store_residual else out, stats, stats.numel() // 2,
        *_strides(q), *_strides(k), *_strides(v), *_strides(out),
        n_q_heads, n_q_heads // n_kv_heads, seq_q, seq_k, softmax_scale * LOG2E, n_query_blocks,
        HEAD_DIM=head_dim, CAUSAL=causal, UPCAST=_upcast_loads(q.dtype), STORE_RESIDUAL=store_residual,
        DOT_PRECISION=_dot_precision(q.dtype), **cfg)
    return out, stats, out_residual


def _backward_triton(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     out_residual: torch.Tensor, stats: torch.Tensor, causal: bool,
                     softmax_scale: float, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` (shapes and dtypes of q, k, v) from the saved forward state
    (``out_residual`` may be empty: delta then uses the rounded output alone). ``config`` as in
    :func:`_forward_triton`."""
    dout, q, k, v, out = (_head_dim_contiguous(t) for t in (dout, q, k, v, out))
    batch, n_q_heads, seq_q, head_dim = q.shape
    n_kv_heads, seq_k = k.shape[1], k.shape[2]
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if dk.numel() == 0:
        return dq, dk, dv
    if dq.numel() == 0:  # no queries: nothing attends to the keys
        return dq, dk.zero_(), dv.zero_()
    cfg = config or _kernel_config(head_dim, q.dtype, backward=True)
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    upcast = _upcast_loads(q.dtype)
    common = dict(HEAD_DIM=head_dim, CAUSAL=causal, UPCAST=upcast, TWO_TERM=q.dtype != torch.float32 and not upcast,
                  DOT_PRECISION=_dot_precision(q.dtype), **cfg)
    qk_scale_log2 = softmax_scale * LOG2E
    kv_group_size = n_q_heads // n_kv_heads

    n_query_blocks = triton.cdiv(seq_q, block_m)
    delta = torch.empty((batch, n_q_heads, seq_q), dtype=torch.float32, device=q.device)
    has_residual = out_residual.shape == out.shape
    residual = _head_dim_contiguous(out_residual) if has_residual else out
    _bwd_delta_kernel[(n_query_blocks * batch * n_q_heads,)](
        out, residual, dout, delta, *_strides(out), *_strides(residual), *_strides(dout), n_q_heads, seq_q,
        n_query_blocks, HEAD_DIM=head_dim, BLOCK_M=block_m, HAS_RESIDUAL=has_residual, num_warps=cfg["num_warps"])

    n_key_blocks = triton.cdiv(seq_k, block_n)
    _flash_bwd_dkdv_kernel[(n_key_blocks * batch * n_kv_heads,)](
        q, k, v, dout, stats, stats.numel() // 2, delta, dk, dv,
        *_strides(q), *_strides(k), *_strides(v), *_strides(dout), *_strides(dk), *_strides(dv),
        n_q_heads, n_kv_heads, kv_group_size, seq_q, seq_k, qk_scale_log2, softmax_scale, n_key_blocks,
        **common)
    _flash_bwd_dq_kernel[(n_query_blocks * batch * n_q_heads,)](
        q, k, v, dout, stats, stats.numel() // 2, delta, dq,
        *_strides(q), *_strides(k), *_strides(v), *_strides(dout), *_strides(dq),
        n_q_heads, kv_group_size, seq_q, seq_k, qk_scale_log2, softmax_scale, n_query_blocks,
        **common)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# Eager reference (the CPU path): scaled_dot_product_attention, top-left causal like the kernels
# --------------------------------------------------------------------------------------------
def _attention_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                     softmax_scale: float) -> torch.Tensor:
    if q.numel() == 0:
        # No queries (B, Hq or Nq is 0; D >= 16): empty output, zero gradients for q, k and v,
        # without SDPA. PyTorch's CUDA SDPA cannot take empty inputs (torch 2.11 cu130, H100: its
        # backward fails an internal assert, `p.gQ_strideM() == grad_q.stride(1)` in
        # attention_backward.cu, and an fp16 causal call returned None). The `* 0` term keeps k and
        # v in the graph, so their gradients are zeros (not None), as the Triton backward gives.
        return q.new_zeros(q.shape) + (q.sum() + k.sum() + v.sum()) * 0
    kv_group_size = q.shape[1] // max(k.shape[1], 1)
    if kv_group_size > 1:
        if _SDPA_HAS_GQA:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale, enable_gqa=True)
        k = k.repeat_interleave(kv_group_size, dim=1)
        v = v.repeat_interleave(kv_group_size, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale)


def _softmax_stats_eager(q: torch.Tensor, k: torch.Tensor, causal: bool, softmax_scale: float) -> torch.Tensor:
    """The kernels' saved statistics ``[2, B, Hq, Nq]`` fp32: row max of the raw scores q.k and
    1 / sum exp(softmax_scale * (scores - max)). Materializes the scores: only the compiled-graph
    fallback uses it."""
    k = k.repeat_interleave(q.shape[1] // max(k.shape[1], 1), dim=1)
    scores = q.float() @ k.float().transpose(-2, -1)
    if causal:
        visible = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(dim=-1)
    return torch.stack([row_max, 1.0 / torch.exp((scores - row_max[..., None]) * softmax_scale).sum(dim=-1)])


def _backward_eager(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv in closed form, in fp32, cast to the inputs' dtype. Materializes the scores: only
    the compiled-graph fallback (the ``flash_attention_bwd`` op) uses it.

    Closed form, not ``torch.autograd.grad`` through a recomputed forward: this runs inside a
    custom op's implementation, which torch.library dispatches below the Autograd key
    (``_AutoDispatchBelowAutograd``), so no autograd graph is recorded there, even under
    ``torch.enable_grad()`` with leaves that require grad ("element 0 of tensors does not require
    grad"). With S = scale * q k^T (masked), P = softmax(S), O = P v:
    dP = dO v^T, dS = P * (dP - rowsum(P * dP)), dq = scale * dS k, dk = scale * dS^T q,
    dv = P^T dO; a kv head's dk and dv sum over the query heads of its group."""
    if q.numel() == 0:
        # No queries (B, Hq or Nq is 0): zero gradients, as the eager forward's graph gives.
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    n_kv_heads = k.shape[1]
    group = q.shape[1] // n_kv_heads
    q32, dout32 = q.float(), dout.float()
    k32 = k.float().repeat_interleave(group, dim=1)
    v32 = v.float().repeat_interleave(group, dim=1)
    scores = (q32 @ k32.transpose(-2, -1)) * softmax_scale
    if causal:  # top-left: query i sees keys j <= i (key 0 always, so no row is fully masked)
        visible = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    dprobs = dout32 @ v32.transpose(-2, -1)
    dscores = probs * (dprobs - (probs * dprobs).sum(dim=-1, keepdim=True))
    dq = (dscores @ k32) * softmax_scale
    dk = (dscores.transpose(-2, -1) @ q32) * softmax_scale
    dv = probs.transpose(-2, -1) @ dout32
    if group > 1:  # [B, Hq, Nk, D] -> [B, Hkv, group, Nk, D], summed over the group
        dk = dk.unflatten(1, (n_kv_heads, group)).sum(dim=2)
        dv = dv.unflatten(1, (n_kv_heads, group)).sum(dim=2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# --------------------------------------------------------------------------------------------
# Eager-mode autograd (Triton path)
# --------------------------------------------------------------------------------------------
class _FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, softmax_scale: float):
        out, stats, out_residual = _forward_triton(q, k, v, causal, softmax_scale, any(ctx.needs_input_grad[:3]))
        ctx.save_for_backward(q, k, v, out, out_residual, stats)
        ctx.causal = causal
        ctx.softmax_scale = softmax_scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, out_residual, stats = ctx.saved_tensors
        record("flash_attention_backward", "triton")
        dq, dk, dv = _backward_triton(dout, q, k, v, out, out_residual, stats, ctx.causal, ctx.softmax_scale)
        return dq, dk, dv, None, None


# --------------------------------------------------------------------------------------------
# torch.library ops (graph capture under torch.compile)
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("hybrid_kernels::flash_attention_fwd", mutates_args=())
def _flash_attention_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                            softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(out, stats, out_residual)`` as :func:`_forward_triton` does for a backward."""
    backend = choose_backend("flash_attention", q.device)
    record("flash_attention", backend)
    if backend == "triton":
        return _forward_triton(q, k, v, causal, softmax_scale)
    out = _attention_eager(q, k, v, causal, softmax_scale).contiguous()
    # A zero residual is exact enough for the eager backward, which recomputes from q, k, v.
    out_residual = torch.zeros_like(out) if _needs_residual(q.dtype, True) else out.new_empty((0,))
    return out, _softmax_stats_eager(q, k, causal, softmax_scale), out_residual


@_flash_attention_fwd_op.register_fake
def _(q, k, v, causal, softmax_scale):
    residual_shape = q.shape if _needs_residual(q.dtype, True) else (0,)
    stats_shape = (2, *q.shape[:3])
    return q.new_empty(q.shape), q.new_empty(stats_shape, dtype=torch.float32), q.new_empty(residual_shape)


@torch.library.custom_op("hybrid_kernels::flash_attention_bwd", mutates_args=())
def _flash_attention_bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, out_residual: torch.Tensor, stats: torch.Tensor, causal: bool,
                            softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    backend = choose_backend("flash_attention_backward", q.device)
    record("flash_attention_backward", backend)
    if backend == "triton":
        return _backward_triton(dout, q, k, v, out, out_residual, stats, causal, softmax_scale)
    return tuple(g.contiguous() for g in _backward_eager(dout, q, k, v, causal, softmax_scale))


@_flash_attention_bwd_op.register_fake
def _(dout, q, k, v, out, out_residual, stats, causal, softmax_scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale = inputs
    out, stats, out_residual = output
    ctx.save_for_backward(q, k, v, out, out_residual, stats)
    ctx.causal = causal
    ctx.softmax_scale = softmax_scale


def _fwd_op_backward(ctx, dout, _dstats, _dresidual):
    # stats and the residual are internal outputs (flash_attention returns only `out`): no gradient.
    q, k, v, out, out_residual, stats = ctx.saved_tensors
    dq, dk, dv = _flash_attention_bwd_op(dout, q, k, v, out, out_residual, stats, ctx.causal, ctx.softmax_scale)
    return dq, dk, dv, None, None


_flash_attention_fwd_op.register_autograd(_fwd_op_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def _check_inputs(q, k, v, causal, softmax_scale) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, seq_len, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has dtype {q.dtype}: all three must match")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    head_dim = q.shape[3]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q has head_dim {head_dim}; supported head dims are {SUPPORTED_HEAD_DIMS}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k has head_dim {k.shape[3]} but q has head_dim {head_dim}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k has batch size {k.shape[0]} but q has batch size {q.shape[0]}")
    n_q_heads, n_kv_heads = q.shape[1], k.shape[1]
    if n_kv_heads == 0 and n_q_heads > 0:
        raise ValueError(f"k and v have no heads (dim 1 is 0) but q has {n_q_heads}: every query head needs a "
                         "key/value head")
    if n_kv_heads > 0 and n_q_heads % n_kv_heads != 0:
        raise ValueError(f"q's head count ({n_q_heads}) must be a multiple of k's and v's head count "
                         f"({n_kv_heads}) for grouped-query attention")
    if k.shape[2] == 0:
        raise ValueError("k and v must hold at least one key (seq_len dim 2 is 0): softmax over no keys is undefined")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
                                      or not math.isfinite(softmax_scale) or softmax_scale <= 0):
        raise ValueError(f"softmax_scale must be a positive finite number or None, got {softmax_scale!r}")


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    softmax_scale: float | None = None) -> torch.Tensor:
    """Scaled dot-product attention with an online softmax (conventions in the module docstring).

    Args:
        q: ``[B, Hq, Nq, D]`` queries, float32 / float16 / bfloat16, D in {16, 32, 64, 128}.
        k, v: ``[B, Hkv, Nk, D]`` keys and values, same dtype and device as ``q``, ``Hq % Hkv == 0``,
            ``Nk >= 1``. Any strides; a head dimension that is not contiguous is copied.
        causal: top-left causal mask (query ``i`` sees keys ``j <= i``, as SDPA's ``is_causal``).
        softmax_scale: multiplier of ``q @ k^T`` before the softmax; default ``1 / sqrt(D)``.

    Returns:
        ``[B, Hq, Nq, D]`` tensor in ``q``'s dtype. Differentiable w.r.t. q, k and v.
    """
    _check_inputs(q, k, v, causal, softmax_scale)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
    if torch.compiler.is_compiling():
        return _flash_attention_fwd_op(q, k, v, causal, scale)[0]
    # Direct call in eager mode: no dispatcher round trip; the SDPA path keeps torch's own autograd.
    backend = choose_backend("flash_attention", q.device)
    record("flash_attention", backend)
    if backend == "triton":
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return _FlashAttentionFunction.apply(q, k, v, causal, scale)
        # Inference: no autograd node, nothing saved, no output residual written.
        return _forward_triton(q, k, v, causal, scale, for_backward=False)[0]
    return _attention_eager(q, k, v, causal, scale)

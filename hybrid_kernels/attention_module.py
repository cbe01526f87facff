"""``CausalSelfAttention``: the attention block of a GPT-style decoder, on :func:`flash_attention`.

``x [B, N, d_model] -> qkv projection -> causal flash attention (grouped-query when
n_kv_heads < n_heads) -> output projection -> [B, N, d_model]``.

q, k and v are views into the one fused projection output (head dimension contiguous), which the
Triton kernels read through strides without a copy. No dropout: the kernels have none, and
GPT-style pre-training commonly runs attention without it.
"""
from __future__ import annotations

import torch
from torch import nn

from .flash_attention import SUPPORTED_HEAD_DIMS, flash_attention


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with optional grouped-query (GQA) / multi-query (MQA) heads.

    Args:
        d_model: model width; ``head_dim = d_model // n_heads`` must be one of 16, 32, 64, 128.
        n_heads: query heads.
        n_kv_heads: key/value heads (default ``n_heads``); must divide ``n_heads``. ``1`` is MQA.
        bias: whether the qkv and output projections have biases.
        device, dtype: factory arguments for the parameters.

    Parameters: ``qkv`` (``Linear(d_model, (n_heads + 2 * n_kv_heads) * head_dim)``; its output is
    laid out as all query heads, then all key heads, then all value heads) and ``out_proj``
    (``Linear(d_model, d_model)``).
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if n_heads < 1 or n_kv_heads < 1:
            raise ValueError(f"n_heads and n_kv_heads must be positive, got {n_heads} and {n_kv_heads}")
        if d_model % n_heads != 0:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        head_dim = d_model // n_heads
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"d_model / n_heads gives head_dim {head_dim}; flash_attention supports head dims "
                             f"{SUPPORTED_HEAD_DIMS}")
        if n_heads % n_kv_heads != 0:
            raise ValueError(f"n_heads ({n_heads}) must be divisible by n_kv_heads ({n_kv_heads})")
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        factory = {"device": device, "dtype": dtype}
        self.qkv = nn.Linear(d_model, (n_heads + 2 * n_kv_heads) * head_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[batch, seq_len, d_model]`` → ``[batch, seq_len, d_model]`` (token ``t`` attends to
        tokens ``<= t``)."""
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be [batch, seq_len, {self.d_model}], got shape {tuple(x.shape)}")
        batch, seq_len, _ = x.shape
        q_width = self.n_heads * self.head_dim
        kv_width = self.n_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split([q_width, kv_width, kv_width], dim=-1)
        # [B, N, H, D] -> [B, H, N, D] views: strided, head dim contiguous, no copy.
        q = q.view(batch, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        y = flash_attention(q, k, v, causal=True)
        y = y.transpose(1, 2).reshape(batch, seq_len, q_width)
        return self.out_proj(y)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}"

"""LowBitAdamW: AdamW with block-wise 8-bit or 4-bit moments, bf16 weights with stochastic
rounding, and a per-parameter step for updates inside the backward pass.

State bytes per parameter (the moments; weights and gradients are the model's):

============  ==================================  ======================================
state_bits    state per parameter                 bytes/param
============  ==================================  ======================================
None          ``exp_avg``, ``exp_avg_sq`` fp32     8
8             int8 m + uint8 v codes, 2 fp32       2 + 8/block_size (2.03 at block 256)
              scales per block
4             two 4-bit codes per byte each,       1 + 8/block_size (1.06 at block 128)
              2 fp32 scales per block
============  ==================================  ======================================

The update itself is :func:`hybrid_kernels.adamw_lowbit.adamw_lowbit_update_` (a fused Triton
kernel on CUDA, chunked PyTorch on a CPU, optionally through ``torch.compile``). A bfloat16
parameter is updated in fp32 and rounded back **stochastically** with random bits derived
from ``(seed, step, parameter index)``: no random state to save, so a resumed run repeats the
uninterrupted one bit for bit. ``decoupled_weight_decay=False`` gives Adam's L2 penalty (added
to the gradient) instead of AdamW's decay of the weights.

:meth:`LowBitAdamW.step_param` updates one parameter from its ``.grad`` and advances only that
parameter's step count, which is what an update inside the backward pass needs
(:mod:`hybrid_trainer.in_backward`).
"""
from __future__ import annotations

import os
from typing import Any, Iterable

import torch

from hybrid_kernels import adamw_lowbit as lowbit

__all__ = ["LowBitAdamW", "COMPILE_MIN_NUMEL"]

# Parameters in all above which ``compiled=None`` turns torch.compile on: its ~5-10 s first call
# costs less than the eager chain of tensor ops from here on (7-17 vs 25-60 ns per parameter,
# ``python -m bench.capacity --optimizer-speed``).
COMPILE_MIN_NUMEL = 1 << 24
COMPILE_ENV = "HYBRID_LOWBIT_COMPILE"  # "0" or "1" overrides the size rule (benchmarks compare sizes alike)


def compiles_by_default(total_numel: int) -> bool:
    """Whether ``compiled=None`` compiles for parameters of ``total_numel`` values in all."""
    forced = os.environ.get(COMPILE_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    return total_numel >= COMPILE_MIN_NUMEL


class LowBitAdamW(torch.optim.Optimizer):
    """AdamW over ``params`` with quantized moments.

    Args:
        params: parameters or param groups (float32 or bfloat16 tensors).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        state_bits: 8, 4 or None (fp32 moments: the stochastic rounding of bf16 weights and the
            per-parameter step alone).
        block_size: elements per quantization block (None: 256 for 8 bits, 128 for 4).
        decoupled_weight_decay: True → AdamW; False → Adam's L2 penalty.
        seed: seed of the stochastic rounding of bf16 weights.
        compiled: run the CPU path through ``torch.compile``; None: when the parameters hold
            at least ``COMPILE_MIN_NUMEL`` values in all.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, state_bits: int | None = 8,
                 block_size: int | None = None, decoupled_weight_decay: bool = True, seed: int = 0,
                 compiled: bool | None = None):
        if state_bits not in (None, 8, 4):
            raise ValueError(f"state_bits={state_bits!r}: must be 8, 4 or None")
        if block_size is None:
            block_size = lowbit.DEFAULT_BLOCK[state_bits] if state_bits else 256
        if not (isinstance(block_size, int) and block_size >= 2 and block_size & (block_size - 1) == 0):
            raise ValueError(f"block_size={block_size!r}: must be a power of two >= 2")
        if not (isinstance(lr, (int, float)) and lr >= 0):
            raise ValueError(f"lr={lr!r}: must be a float >= 0")
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas={betas!r}: each must be in [0, 1)")
        if not eps > 0:
            raise ValueError(f"eps={eps!r}: must be > 0")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, state_bits=state_bits,
                        block_size=block_size, decoupled_weight_decay=decoupled_weight_decay, seed=seed)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype not in (torch.float32, torch.bfloat16):
                    raise TypeError(f"params: a {p.dtype} parameter; LowBitAdamW updates float32 or bfloat16")
        total = sum(p.numel() for group in self.param_groups for p in group["params"])
        self.compiled = compiles_by_default(total) if compiled is None else bool(compiled)
        self._index: dict[int, int] | None = None
        # The optimizer this one replaces (the memory plan's conversion): an LR scheduler built over
        # it shares its param groups and looks at it for the "optimizer stepped" mark.
        self.stands_in_for: torch.optim.Optimizer | None = None

    # ------------------------------------------------------------------------------ state ----
    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but every state tensor keeps its saved dtype (codes int8/uint8, scales and
        fp32 moments fp32): torch casts floating state to the parameter's dtype, which would
        round fp32 scales to bf16 for a bf16 parameter and break exact resume."""
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, saved in state_dict["state"].items():
            p = params[int(index)]
            for key, value in saved.items():
                if isinstance(value, torch.Tensor):
                    self.state[p][key] = value.to(device=p.device, copy=True)
        self._index = None

    def _param_index(self, p: torch.Tensor) -> int:
        if self._index is None or id(p) not in self._index:
            self._index = {id(q): i for i, q in enumerate(q for g in self.param_groups for q in g["params"])}
        return self._index[id(p)]

    def _group_of(self, p: torch.Tensor) -> dict:
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return group
        raise ValueError("step_param: the tensor is not a parameter of this optimizer")

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        if state:
            return state
        state["step"] = torch.zeros((), dtype=torch.int64)  # a tensor: snapshots copy it in place
        bits = group["state_bits"]
        if bits is None:
            state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        else:
            for name, (shape, dtype) in lowbit.state_shapes(p.numel(), bits, group["block_size"]).items():
                state[name] = torch.zeros(shape, dtype=dtype, device=p.device)
        return state

    def state_bytes(self) -> int:
        """Bytes of the moments held now (all parameters stepped so far; the 8-byte step
        counter per parameter tensor left out)."""
        return sum(t.numel() * t.element_size() for s in self.state.values() for k, t in s.items()
                   if isinstance(t, torch.Tensor) and k != "step")

    # ------------------------------------------------------------------------------- step ----
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, p.grad, group)
        return loss

    @torch.no_grad()
    def step_param(self, p: torch.Tensor, grad: torch.Tensor | None = None) -> None:
        """Update the one parameter ``p`` from ``grad`` (default ``p.grad``)."""
        grad = p.grad if grad is None else grad
        if grad is None:
            return
        self._update(p, grad, self._group_of(p))

    def _update(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> None:
        if grad.is_sparse:
            raise ValueError("LowBitAdamW: sparse gradients are not supported")
        state = self._init_state(p, group)
        state["step"] += 1
        step = int(state["step"])
        if self.stands_in_for is not None:
            self.stands_in_for._opt_called = True
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        if wd and not group["decoupled_weight_decay"]:  # Adam: L2 penalty on the gradient
            grad = grad.float() + wd * p.float()
            wd = 0.0
        key = (lowbit.sr_key(group["seed"], step, self._param_index(p)) if p.dtype == torch.bfloat16 else None)
        bits = group["state_bits"]
        if bits is None:
            self._update_fp32_moments(p, grad, state, lr, beta1, beta2, eps, wd, step, key)
            return
        lowbit.adamw_lowbit_update_(p.data, grad, state["m_codes"], state["m_scales"], state["v_codes"],
                                    state["v_scales"], bits=bits, block_size=group["block_size"], step=step,
                                    lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd, sr_key=key,
                                    compiled=self.compiled and p.device.type == "cpu")

    @staticmethod
    def _update_fp32_moments(p, grad, state, lr, beta1, beta2, eps, wd, step, key) -> None:
        """AdamW with fp32 moments, chunk by chunk (a bf16 weight is rounded stochastically)."""
        m, v = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
        w, g = p.data.view(-1), grad.reshape(-1)
        bias1, bias2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
        chunk = lowbit.CHUNK_ELEMENTS
        for start in range(0, w.numel(), chunk):
            end = min(w.numel(), start + chunk)
            gc = g[start:end].float()
            mc, vc = m[start:end], v[start:end]
            mc.mul_(beta1).add_(gc, alpha=1.0 - beta1)
            vc.mul_(beta2).addcmul_(gc, gc, value=1.0 - beta2)
            w32 = w[start:end].float()
            if wd:
                w32.mul_(1.0 - lr * wd)
            w32.addcdiv_(mc, vc.div(bias2).sqrt_().add_(eps), value=-lr / bias1)
            if key is None:
                w[start:end].copy_(w32)
            else:
                index = torch.arange(start, end, dtype=torch.int64, device=w.device)
                w[start:end].copy_(lowbit.stochastic_round_bf16(w32, index, key))

"""The update an optimizer step applied, recovered from the optimizer's state after the step.

The predictor records every real update ``u = θ_after − θ_before``. Measuring it needs a copy of
the weights taken before the step: one more fp32 copy of the model, live during the optimizer
step, when memory peaks. For torch's Adam and AdamW (single-tensor, foreach and fused
implementations alike) the update is known in closed form from the state the step leaves behind,
so it can be recomputed per tensor, a chunk at a time, after the step:

* ``a = lr / (1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + ε)`` with ``m = exp_avg``, ``v = exp_avg_sq``
  (``max_exp_avg_sq`` with ``amsgrad``), ``t`` the step count after the step;
* Adam (L2 weight decay, already inside ``m``): ``u = −a``;
* AdamW (decoupled, ``θ_after = θ_before·(1 − lr·wd) − a``): ``u = (−a − lr·wd·θ_after) / (1 − lr·wd)``.

It is the same arithmetic as torch's step (``torch.optim.adam._single_tensor_adam``), so it agrees
with ``θ_after − θ_before`` to fp32 rounding (the measured difference itself carries a rounding
error of up to half an ulp of θ: ``tests/test_update_recovery.py`` states the tolerance). The
hyper-parameters are captured before the step (a scheduler may change ``lr`` before the update is
read). Anything else (other optimizers, ``differentiable``, complex or non-fp32 parameters, a
GradScaler that may skip the step) keeps the measured before-copy.
"""
from __future__ import annotations

import math

import torch

# Elements recomputed at a time: the transient memory of the recovery (4 MB of fp32), small next
# to the copy of the weights it replaces, large enough that the per-chunk ops cost nothing.
CHUNK = 1 << 20


class AdamUpdateRecovery:
    """Recomputes, after an Adam/AdamW step, the update it applied to each of ``params``.

    Made by :meth:`for_optimizer` only (None when the closed form does not apply). Call
    :meth:`capture` right before ``optimizer.step()``, then :meth:`update_chunk` after it.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]):
        self.optimizer = optimizer
        self.params = params
        group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        self._groups = [group_of[id(p)] for p in params]
        self._captured: list[tuple[float, float, float, float, float, bool, bool] | None] = []

    @staticmethod
    def for_optimizer(optimizer: torch.optim.Optimizer | None,
                      params: list[torch.Tensor]) -> "AdamUpdateRecovery | None":
        """The recovery for ``optimizer`` over ``params``, or None where the closed form does not
        hold exactly (the caller then measures the update with a before-copy)."""
        if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            return None
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if not all(id(p) in owned and p.dtype == torch.float32 and p.is_contiguous() for p in params):
            return None
        if any(group.get("differentiable", False) for group in optimizer.param_groups):
            return None
        return AdamUpdateRecovery(optimizer, params)

    def capture(self) -> None:
        """Right before the step: each parameter's hyper-parameters, or None for a parameter
        without a gradient (the step leaves it alone: its update is zero)."""
        captured = []
        for p, group in zip(self.params, self._groups):
            if p.grad is None:
                captured.append(None)
                continue
            beta1, beta2 = group["betas"]
            captured.append((float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                             float(group["weight_decay"]), bool(group.get("decoupled_weight_decay", False))
                             or type(self.optimizer) is torch.optim.AdamW, bool(group["amsgrad"])))
        self._captured = captured

    def stepped(self, index: int) -> bool:
        """Whether the step updated parameter ``index`` (it had a gradient)."""
        return self._captured[index] is not None

    def plan(self, index: int) -> tuple | None:
        """Per-parameter constants of the closed form (one host read of the step count), or None
        for a parameter the step left alone."""
        captured = self._captured[index]
        if captured is None:
            return None
        lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad = captured
        state = self.optimizer.state[self.params[index]]
        t = float(state["step"])
        step_size = lr / (1 - beta1 ** t)
        bias_correction2_sqrt = math.sqrt(1 - beta2 ** t)
        second = state["max_exp_avg_sq"] if amsgrad else state["exp_avg_sq"]
        decay = lr * weight_decay if decoupled else 0.0
        return (state["exp_avg"].view(-1), second.view(-1), step_size, bias_correction2_sqrt, eps, decay)

    @torch.no_grad()
    def update_chunk(self, plan: tuple, index: int, start: int, stop: int) -> torch.Tensor:
        """The update of elements ``start:stop`` of parameter ``index`` (a new fp32 tensor)."""
        exp_avg, second, step_size, bias_correction2_sqrt, eps, decay = plan
        denom = second[start:stop].sqrt()
        denom.div_(bias_correction2_sqrt).add_(eps)  # the step's own order of operations
        update = torch.div(exp_avg[start:stop], denom, out=denom).mul_(-step_size)  # −a
        if decay:
            update.add_(self.params[index].view(-1)[start:stop], alpha=-decay).div_(1 - decay)
        return update

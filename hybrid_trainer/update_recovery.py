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

It is torch's step arithmetic (``torch.optim.adam._single_tensor_adam``) with the bias correction
of ``v`` folded into the scalars, so it agrees with ``θ_after − θ_before`` to fp32 rounding (the
measured difference itself carries a rounding error of up to an ulp of θ:
``tests/test_update_recovery.py`` states the tolerance). It costs about what the step's own
arithmetic costs (a square root per element, slow on a CPU), more than the copy it replaces:
memory is bought with time on recorded steps, which the worth gate counts as recording cost. The
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
# A model of fewer than 8 CHUNKs is cut into 8 buckets instead (at least MIN_CHUNK values, a
# multiple of CHUNK_ALIGN): a bucket the size of the whole model made the recording's fp32
# transients (the update, the direction read back, its quantization) three copies of the weights
# on the small models, more than the plain loop's own step transients (bench.overhead).
MIN_CHUNK = 1 << 14
CHUNK_ALIGN = 1 << 12  # a multiple of every block size the predictor quantizes in (256)


def chunk_for(total: int) -> int:
    """Bucket length for tensors of ``total`` values in all (see ``MIN_CHUNK``)."""
    return min(CHUNK, max(MIN_CHUNK, -(-total // (8 * CHUNK_ALIGN)) * CHUNK_ALIGN))


Bucket = tuple[int, int, list[tuple[int, int, int]]]


def flat_buckets(sizes: list[int]) -> list[Bucket]:
    """Tensors of ``sizes`` elements laid end to end, cut into buckets of at most
    ``chunk_for(sum(sizes))`` elements: ``(flat start, flat stop, pieces)``, a piece ``(tensor
    index, start, stop)`` within its tensor. Consecutive small tensors share a bucket; a large one
    is split over several, at multiples of the chunk from its start (so a piece starts on a block
    boundary of any block size dividing ``CHUNK_ALIGN``: the predictor's int8 direction relies on that)."""
    chunk = chunk_for(sum(sizes))
    buckets: list[Bucket] = []
    pieces: list[tuple[int, int, int]] = []
    bucket_start = offset = 0
    for index, numel in enumerate(sizes):
        for start in range(0, numel, chunk):
            stop = min(start + chunk, numel)
            if offset + stop - start - bucket_start > chunk:
                buckets.append((bucket_start, offset, pieces))
                pieces, bucket_start = [], offset
            pieces.append((index, start, stop))
            offset += stop - start
    if pieces:
        buckets.append((bucket_start, offset, pieces))
    return buckets


def bucket_pieces(buckets: list[Bucket], device: torch.device) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Per bucket of :func:`flat_buckets`: its pieces' lengths (to split it) and the tensor index
    each piece belongs to (a long tensor on ``device``, to sum per tensor)."""
    lengths = [[stop - start for _, start, stop in pieces] for _, _, pieces in buckets]
    owners = [torch.tensor([index for index, _, _ in pieces], dtype=torch.long, device=device)
              for _, _, pieces in buckets]
    return lengths, owners


class AdamUpdateRecovery:
    """Recomputes, after an Adam/AdamW step, the update it applied to each of ``params``.

    Made by :meth:`for_optimizer` only (None when the closed form does not apply). Call
    :meth:`capture` right before ``optimizer.step()``, then :meth:`bucket_update` for each of
    :attr:`buckets` after it.

    The parameters, laid end to end as in the predictor's flat buffers, are cut into *buckets*
    of at most ``CHUNK`` elements: consecutive small tensors share one, a large one is split
    over several. Each bucket is recomputed with a fixed handful of ``torch._foreach_*`` ops
    into a ``CHUNK``-sized scratch buffer, so the cost does not grow with the number of tensors
    (a char-LM's 40) and the transient memory is the scratch, not a copy of the weights.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]):
        self.optimizer = optimizer
        self.params = params
        group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        self._groups = [group_of[id(p)] for p in params]
        self._captured: list[list | None] = []  # per param: lr, β₁, β₂, ε, wd, decoupled, amsgrad, t
        self.buckets = flat_buckets([p.numel() for p in params])
        device = params[0].device if params else torch.device("cpu")
        self.piece_lengths, self.piece_params = bucket_pieces(self.buckets, device)

    @staticmethod
    def for_optimizer(optimizer: torch.optim.Optimizer | None,
                      params: list[torch.Tensor]) -> "AdamUpdateRecovery | None":
        """The recovery for ``optimizer`` over ``params``, or None where the closed form does not
        hold exactly (the caller then measures the update with a before-copy)."""
        if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or not params:
            return None
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if not all(id(p) in owned and p.dtype == torch.float32 and p.is_contiguous() for p in params):
            return None
        if any(group.get("differentiable", False) for group in optimizer.param_groups):
            return None
        return AdamUpdateRecovery(optimizer, params)

    def capture(self) -> None:
        """Right before the step: each parameter's hyper-parameters and the step count its update
        will be made with (the count before the step plus one: every Adam implementation adds
        one per parameter with a gradient, from zero for a parameter without state yet), or None
        for a parameter without a gradient (the step leaves it alone: its update is zero). The
        counts on an accelerator (fused or capturable) are read in one transfer per device."""
        captured, on_device = [], {}
        for index, (p, group) in enumerate(zip(self.params, self._groups)):
            if p.grad is None:
                captured.append(None)
                continue
            state = self.optimizer.state.get(p)
            step = None if not state else state.get("step")
            if isinstance(step, torch.Tensor) and step.device.type != "cpu":
                on_device.setdefault(step.device, []).append((index, step))
                count = 0.0  # filled in below
            else:
                count = 0.0 if step is None else float(step)
            beta1, beta2 = group["betas"]
            captured.append([float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                             float(group["weight_decay"]), bool(group.get("decoupled_weight_decay", False))
                             or type(self.optimizer) is torch.optim.AdamW, bool(group["amsgrad"]), count + 1])
        for entries in on_device.values():
            counts = torch.stack([step.reshape(()).to(torch.float64) for _, step in entries]).tolist()
            for (index, _), count in zip(entries, counts):
                captured[index][-1] = count + 1
        self._captured = captured

    def _plan(self, index: int) -> tuple | None:
        """Per-parameter constants of the closed form, or None for a parameter the step left alone."""
        captured = self._captured[index]
        if captured is None:
            return None
        lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad, t = captured
        state = self.optimizer.state[self.params[index]]
        step_size = lr / (1 - beta1 ** t)
        second = state["max_exp_avg_sq"] if amsgrad else state["exp_avg_sq"]
        decay = lr * weight_decay if decoupled else 0.0
        return (state["exp_avg"].view(-1), second.view(-1), step_size, math.sqrt(1 - beta2 ** t), eps, decay)

    @torch.no_grad()
    def bucket_update(self, bucket: int, out: torch.Tensor) -> None:
        """Writes the update of bucket ``bucket`` into ``out`` (fp32, the bucket's length), zero
        for parameters the step left alone."""
        _, _, pieces = self.buckets[bucket]
        plans = {index: self._plan(index) for index in {index for index, _, _ in pieces}}
        views, skipped, offset = [], [], 0
        seconds, averages, weights, epsilons, step_scales, decays = [], [], [], [], [], []
        for index, start, stop in pieces:
            view = out[offset:offset + stop - start]
            offset += stop - start
            plan = plans[index]
            if plan is None:
                skipped.append(view)
                continue
            exp_avg, second, step_size, bias_correction2_sqrt, eps, decay = plan
            views.append(view)
            seconds.append(second[start:stop])
            averages.append(exp_avg[start:stop])
            weights.append(self.params[index].view(-1)[start:stop])
            epsilons.append(eps * bias_correction2_sqrt)
            step_scales.append(-step_size * bias_correction2_sqrt / (1 - decay))
            decays.append(-decay / (1 - decay))
        if skipped:
            torch._foreach_zero_(skipped)
        if not views:
            return
        # a = lr/(1 − β₁ᵗ) · m / (√v/b + ε) = lr·b/(1 − β₁ᵗ) · m / (√v + ε·b), b = √(1 − β₂ᵗ): one
        # division less per element than the step's own order (sqrt, the slowest op here, stays
        # the only transcendental), then u = −a/(1 − c) − c·θ_after/(1 − c).
        denominators = torch._foreach_sqrt(seconds)  # a bucket-sized transient (CHUNK at most)
        torch._foreach_add_(denominators, epsilons)
        torch._foreach_zero_(views)
        torch._foreach_addcdiv_(views, averages, denominators, step_scales)
        del denominators
        decaying = [i for i, c in enumerate(decays) if c]
        if decaying and len({decays[i] for i in decaying}) == 1:  # one decay (one group): one pass
            torch._foreach_add_([views[i] for i in decaying], [weights[i] for i in decaying], alpha=decays[decaying[0]])
        elif decaying:
            torch._foreach_add_([views[i] for i in decaying],
                                torch._foreach_mul([weights[i] for i in decaying], [decays[i] for i in decaying]))

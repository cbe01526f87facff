"""Predicted weight updates from the real update history.

Every real (optimizer) step records ``u = θ_after − θ_before`` for every parameter: measured
against a copy of the weights taken before the step, or, for Adam/AdamW, recomputed after it from
the optimizer's state (:mod:`~hybrid_trainer.update_recovery`), which spares that copy. From that
history the predictor keeps a *direction* per parameter and a *scale* per parameter tensor:

* direction ``"ema"``: exponential moving average of the updates (averaged in fp32, stored in
  ``direction_dtype``: fp32, bf16, or int8 blocks as the trainer keeps it,
  :mod:`~hybrid_trainer.int8_direction`), bias-corrected as Adam's moments are, so no single
  early update outweighs the recent ones.
* direction ``"linear"``: least-squares slope of the weight trajectory over the last K updates,
  which are stored in int8 (per-block absmax, :func:`hybrid_kernels.quantize_int8`).
* scale: per tensor, the least-squares fit of the real update onto the direction,
  ``s = <u, d> / <d, d>``, smoothed with an EMA and clamped to ``[0, scale_max]``. It is the
  part of a real step that moves along the direction: the predicted step is ``s · d``.

All fp32 buffers are single flat allocations with one view per parameter, so whole-history
updates are one tensor op and ``apply_delta_`` sees contiguous deltas.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

import hybrid_kernels as hk

from .int8_direction import Int8BlockVector
from .update_recovery import CHUNK, AdamUpdateRecovery

_HISTORY_BLOCK = 256  # int8 block size of the stored updates
# Largest parameter tensor (elements) for which batched reductions are the CUDA default: a 4 MB
# segment is read by one thread block in tens of µs, about what the per-tensor launches cost.
BATCHED_MAX_TENSOR = 1 << 20


@dataclass
class UpdateStats:
    """What one recorded real update looked like (all plain floats)."""

    update_norm: float  # ||u||_2 over all parameters
    cosine: float  # cos(u, d) of the whole update against the direction before it was added


class DeltaPredictor:
    """Records real updates of ``params`` and applies predicted ones in place.

    Args:
        params: the trained parameters, all on one device (fp32, fp16 or bf16).
        direction: ``"ema"`` or ``"linear"``.
        ema_beta: EMA factor of the direction (``"ema"``).
        history_size: K updates kept in int8 (``"linear"``).
        scale_beta: EMA factor of the per-tensor scale fits.
        scale_max: upper clamp of a scale.
        direction_dtype: storage of the EMA direction, ``torch.float32``, ``torch.bfloat16``
            (half the memory; each recorded step averages in fp32 and rounds once) or
            ``torch.int8`` (a quarter: int8 codes with an fp32 absmax scale per 256 values,
            :class:`~hybrid_trainer.int8_direction.Int8BlockVector`, read and written a bucket
            of ``update_recovery.CHUNK`` values at a time; ``"ema"`` only).
        batched_reductions: compute the per-tensor dot products as one elementwise pass into a
            scratch buffer plus one segmented sum (a fixed handful of ops whatever the number of
            tensors) instead of a dot per tensor. Default: on CUDA when no parameter tensor
            exceeds ``BATCHED_MAX_TENSOR`` elements. There every op is a launch and the recording
            machinery is launch-bound (docs/gpu.md); but the segmented sum (CUB's) reduces each
            tensor with one thread block, so one huge tensor would take one SM's bandwidth where
            a dot takes the whole GPU's. A CPU keeps the per-tensor dots: they only read their
            inputs and need no scratch buffer, and a CPU pays no launch latency.
    """

    def __init__(self, params: list[torch.Tensor], direction: str = "ema", ema_beta: float = 0.98,
                 history_size: int = 4, scale_beta: float = 0.9, scale_max: float = 4.0,
                 batched_reductions: bool | None = None, direction_dtype: torch.dtype = torch.float32):
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"params must all live on one device, got {sorted(map(str, devices))}")
        self.params = params
        self.direction_kind = direction
        self.ema_beta = ema_beta
        self.history_size = history_size
        self.scale_beta = scale_beta
        self.scale_max = scale_max
        if direction_dtype not in (torch.float32, torch.bfloat16, torch.int8):
            raise ValueError(f"direction_dtype must be torch.float32, torch.bfloat16 or torch.int8, got {direction_dtype}")
        if direction_dtype == torch.int8 and direction != "ema":
            raise ValueError(f"direction_dtype=torch.int8 stores the 'ema' direction; direction={direction!r} "
                             "reads a float one (use torch.bfloat16 or torch.float32)")
        self.direction_dtype = direction_dtype
        device = params[0].device
        self.device = device
        self.sizes = [p.numel() for p in params]
        self.numel = sum(self.sizes)
        # The buffers (the EMA direction, in direction_dtype; θ before a step, then the update u,
        # fp32, only where the update cannot be recomputed from the optimizer's state) are allocated at the first
        # recorded step and freed by release(): a trainer that never predicts, or no longer can,
        # holds none of them.
        self._before_flat: torch.Tensor | None = None
        self._ema_flat: torch.Tensor | None = None  # fp32 or bf16 direction
        self._ema_q: Int8BlockVector | None = None  # the int8 one
        self._before: list[torch.Tensor] = []
        self._ema: list[torch.Tensor] = []
        self._linear_flat: torch.Tensor | None = None
        self._linear: list[torch.Tensor] | None = None
        self._history: list[tuple[torch.Tensor, torch.Tensor]] = []  # int8 codes + block scales, oldest first
        self.scales = torch.zeros(len(params), dtype=torch.float32, device=device)
        if batched_reductions is None:
            batched_reductions = device.type == "cuda" and max(self.sizes, default=0) <= BATCHED_MAX_TENSOR
        self.batched_reductions = batched_reductions
        # Offsets, not lengths: segment_reduce would turn lengths into offsets (a cumsum) every call.
        self._segment_offsets = torch.tensor([0, *itertools.accumulate(self.sizes)], dtype=torch.long, device=device)
        self._scratch_flat: torch.Tensor | None = None  # allocated on first batched reduction
        self.n_updates = 0
        self.n_scale_fits = 0
        self._recording = False
        self._recovery: AdamUpdateRecovery | None = None
        self._recovering: AdamUpdateRecovery | None = None  # set between begin_step and end_step
        self._chunk_scratch: torch.Tensor | None = None  # one bucket's update (update_recovery.CHUNK at most)
        # Checked and planned once per direction buffer: a plain apply_delta_ call re-inspects
        # every parameter, which on a GPU costs more than the kernel (bench/test_bench_apply_delta.py).
        self._appliers: dict[int, hk.DeltaApplier] = {}

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [v.view(p.shape) for v, p in zip(flat.split(self.sizes), self.params)]

    @property
    def allocated(self) -> bool:
        """Whether the direction buffers exist (from the first recorded step until :meth:`release`)."""
        return self._ema_flat is not None or self._ema_q is not None

    def _allocate(self) -> None:
        if self.direction_dtype == torch.int8:
            if self._ema_q is None:
                self._ema_q = Int8BlockVector(self.params, self.device)
        elif self._ema_flat is None:
            self._ema_flat = torch.zeros(self.numel, dtype=self.direction_dtype, device=self.device)
            self._ema = self._views(self._ema_flat)

    def _allocate_before(self) -> None:
        if self._before_flat is None:
            self._before_flat = torch.empty(self.numel, dtype=torch.float32, device=self.device)
            self._before = self._views(self._before_flat)

    def _recovery_for(self, optimizer: torch.optim.Optimizer | None) -> AdamUpdateRecovery | None:
        """The closed-form recovery of ``optimizer``'s updates (None: measure with a before-copy).
        Not with the ``"linear"`` direction (its history quantises the whole update at once) nor
        with batched reductions (a GPU's launch-bound path wants the flat buffers)."""
        if optimizer is None or self.direction_kind != "ema" or (self.batched_reductions and self._ema_q is None):
            return None  # (the int8 direction is read a bucket at a time whatever the reductions)
        if self._recovery is None or self._recovery.optimizer is not optimizer:
            self._recovery = AdamUpdateRecovery.for_optimizer(optimizer, self.params)
        return self._recovery

    def release(self) -> None:
        """Forget the recorded history and free every buffer that grows with the model (the
        update history starts again at the next :meth:`begin_step`). For a trainer whose
        prediction is off for good: the buffers would otherwise stay allocated for nothing."""
        self._before_flat = self._ema_flat = self._linear_flat = self._scratch_flat = None
        self._ema_q = None
        self._chunk_scratch = None
        self._recovering = None
        self._before, self._ema, self._linear = [], [], None
        self._history = []
        self._appliers.clear()
        self._recording = False
        self.n_updates = 0
        self.n_scale_fits = 0  # the last scales stay readable (statistics report their mean)

    # -- recording real updates ------------------------------------------------------------
    @torch.no_grad()
    def begin_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Call right before ``optimizer.step()``. With ``optimizer`` given (and certain to step:
        no GradScaler that may skip it), an Adam/AdamW update is recomputed from its state after
        the step (:mod:`~hybrid_trainer.update_recovery`) instead of measured against a copy of
        the weights taken here: one fp32 copy of the model less at the step's memory peak."""
        self._allocate()
        recovery = self._recovery_for(optimizer)
        if recovery is not None:
            recovery.capture()
            if self._before_flat is not None:  # left by an earlier measured step
                self._before_flat, self._before = None, []
        else:
            self._allocate_before()
            torch._foreach_copy_(self._before, self.params)  # no_grad: no detach needed (one host op per tensor on a GPU)
        self._recovering = recovery
        self._recording = True

    @torch.no_grad()
    def end_step(self) -> UpdateStats:
        """Call right after ``optimizer.step()``: records the update, refits scales, updates the direction."""
        if not self._recording:
            raise RuntimeError("DeltaPredictor.end_step() without begin_step()")
        self._recording = False
        if self._recovering is not None:
            recovery, self._recovering = self._recovering, None
            return self._end_recovered_step(recovery)
        torch._foreach_sub_(self._before, [p.float() if p.dtype != torch.float32 else p for p in self.params])
        update = self._before_flat.neg_()  # now u = θ_after − θ_before
        update_views = self._before
        if self._ema_q is not None:
            q = self._ema_q
            return self._end_bucketed_step(q.buckets, q.piece_lengths, q.piece_params,
                                           lambda bucket, start, stop: update[start:stop])

        # One host read per recorded step for all the statistics below (each read of a GPU
        # value waits for the device).
        norm_u = update.norm()
        direction = self.current_direction(refresh=False)
        if self.n_updates > 0 and direction is not None:
            stats = self._fit_scales(update_views, direction, norm_u)
        else:
            stats = UpdateStats(update_norm=float(norm_u), cosine=float("nan"))

        if self.n_updates == 0:
            self._ema_flat.copy_(update)
        elif self._ema_flat.dtype != torch.float32:  # averaged in fp32 a chunk at a time, stored rounded
            weight = (1 - self.ema_beta) / (1 - self.ema_beta ** (self.n_updates + 1))
            for start in range(0, self.numel, CHUNK):
                stored = self._ema_flat[start:start + CHUNK]
                stored.copy_(stored.float().lerp_(update[start:start + CHUNK], weight))
        else:
            # Bias-corrected, as Adam's moments: update k of n weighs (1 − β) β^(n−k) / (1 − βⁿ).
            # Starting the plain EMA at the first update instead gave that one update the weight
            # β^(n−1) (0.36 after 51 updates at β 0.98), and experiments.scheduled measured the harm.
            self._ema_flat.lerp_(update, (1 - self.ema_beta) / (1 - self.ema_beta ** (self.n_updates + 1)))
        if self.direction_kind == "linear":
            codes, block_scales = hk.quantize_int8(update, "block", block_size=_HISTORY_BLOCK)
            self._history.append((codes, block_scales))
            if len(self._history) > self.history_size:
                self._history.pop(0)
        self.n_updates += 1
        return stats

    @torch.no_grad()
    def predicted_gain(self, grads: list[torch.Tensor | None]) -> float | None:
        """Linearised loss decrease ``−<g, s∘d>`` of the predicted step the predictor would apply
        now, on a gradient ``g`` of a batch the direction never saw (call after ``backward``,
        before ``begin_step``). None before any update."""
        if self.n_updates == 0 or self._recording:
            return None
        if self._ema_q is not None:
            return -float(torch.dot(self.scales, self._int8_dots(grads)))
        direction_flat, direction_views = self.current_direction(refresh=False)
        # Per-tensor dots gathered on the device and read once, not one host read per tensor.
        if self.batched_reductions:
            scratch, scratch_views = self._scratch()
            present = [(view, g) for view, g in zip(scratch_views, grads) if g is not None]
            if len(present) < len(grads):
                scratch.zero_()  # a parameter without a gradient contributes nothing
            if present:
                torch._foreach_copy_([view for view, _ in present], [g for _, g in present])
            dots = self._segment_dots(scratch, direction_flat)
        else:
            dots = torch.stack([torch.dot(g.reshape(-1).float(), d.reshape(-1).float()) if g is not None
                                else d.new_zeros((), dtype=torch.float32)
                                for g, d in zip(grads, direction_views)])
        return -float(torch.dot(self.scales, dots))

    def _int8_dots(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """Per-parameter ``<g_i, d_i>`` against the int8 direction, read a bucket at a time ([n_params] fp32)."""
        q = self._ema_q
        dots = self.scales.new_zeros(len(self.params))
        for bucket, (_, _, pieces) in enumerate(q.buckets):
            _, directions = q.read(bucket)
            parts = [torch.dot(grads[i].reshape(-1)[a:b].float(), d) if grads[i] is not None else d.new_zeros(())
                     for (i, a, b), d in zip(pieces, directions)]
            dots.index_add_(0, q.piece_params[bucket], torch.stack(parts))
        return dots

    def _scratch(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if self._scratch_flat is None:
            self._scratch_flat = torch.empty(self.numel, dtype=torch.float32, device=self.device)
            self._scratch_views = self._views(self._scratch_flat)
        return self._scratch_flat, self._scratch_views

    def _segment_dots(self, a_flat: torch.Tensor, b_flat: torch.Tensor) -> torch.Tensor:
        """Per-parameter ``<a_i, b_i>`` of two flat fp32 buffers laid out like the parameters
        ([n_params] fp32), in two ops; overwrites the scratch buffer (``a_flat`` may be it)."""
        scratch, _ = self._scratch()
        torch.mul(a_flat, b_flat, out=scratch)
        return torch.segment_reduce(scratch, "sum", offsets=self._segment_offsets)

    def _fit_scales(self, update_views, direction, norm_u: torch.Tensor) -> UpdateStats:
        direction_flat, direction_views = direction
        if self.batched_reductions:
            dots_ud = self._segment_dots(self._before_flat, direction_flat)  # _before_flat holds u now
            dots_dd = self._segment_dots(direction_flat, direction_flat)
        else:
            dots_ud, dots_dd = [], []
            for u, d in zip(update_views, direction_views):  # a bf16 direction in fp32 one tensor at a time
                d = d.reshape(-1).float()
                dots_ud.append(torch.dot(u.reshape(-1), d))
                dots_dd.append(torch.dot(d, d))
            dots_ud, dots_dd = torch.stack(dots_ud), torch.stack(dots_dd)
        return self._fit_scales_from_dots(dots_ud, dots_dd, norm_u)

    def _end_recovered_step(self, recovery: AdamUpdateRecovery) -> UpdateStats:
        """:meth:`end_step` with the update recomputed a bucket at a time into a scratch buffer
        of at most ``update_recovery.CHUNK`` elements: each bucket's dots against the direction are taken before
        it is folded into the EMA, as the measured path does for the whole buffer."""
        longest = max(stop - start for start, stop, _ in recovery.buckets)
        if self._chunk_scratch is None or self._chunk_scratch.numel() < longest:
            self._chunk_scratch = torch.empty(longest, dtype=torch.float32, device=self.device)

        def recomputed(bucket: int, start: int, stop: int) -> torch.Tensor:
            update = self._chunk_scratch[:stop - start]
            recovery.bucket_update(bucket, update)
            return update

        try:
            return self._end_bucketed_step(recovery.buckets, recovery.piece_lengths, recovery.piece_params, recomputed)
        finally:
            # Freed between recorded steps: kept, it would sit beside the optimizer step's own
            # transients at the next step's peak (a whole fp32 copy of a small model's weights).
            self._chunk_scratch = None

    def _end_bucketed_step(self, buckets, piece_lengths, piece_params, update_of) -> UpdateStats:
        """Fold the update into the EMA direction a bucket at a time (``update_of(bucket, start,
        stop)``: the bucket's fp32 update), taking each bucket's dots against the direction first.
        A bf16 or int8 direction is averaged in a bucket-sized fp32 transient and stored rounded."""
        first = self.n_updates == 0
        weight = (1 - self.ema_beta) / (1 - self.ema_beta ** (self.n_updates + 1))
        n_params = len(self.params)
        dots_ud, dots_dd, squares = (self.scales.new_zeros(n_params) for _ in range(3))
        quantized = self._ema_q
        for bucket, (start, stop, _) in enumerate(buckets):
            update = update_of(bucket, start, stop)
            lengths, owners = piece_lengths[bucket], piece_params[bucket]
            if quantized is not None:
                direction, directions = quantized.read(bucket)  # bucket-sized fp32 transient
            else:
                stored = self._ema_flat[start:stop]
                direction = stored if stored.dtype == torch.float32 else stored.float()  # bucket-sized transient
                directions = direction.split(lengths)
            # Per-piece dots (a CPU's segment_reduce is a slow scalar loop; a dot is BLAS).
            updates = update.split(lengths)
            squares.index_add_(0, owners, torch.stack([torch.dot(u, u) for u in updates]))
            if first:
                if quantized is None:
                    stored.copy_(update)
                    continue
                torch._foreach_copy_(directions, updates)
            else:
                dots_ud.index_add_(0, owners, torch.stack([torch.dot(u, d) for u, d in zip(updates, directions)]))
                dots_dd.index_add_(0, owners, torch.stack([torch.dot(d, d) for d in directions]))
                if quantized is None:
                    direction.lerp_(update, weight)
                else:  # piece by piece: the transient also holds the pads, which stay 0
                    torch._foreach_lerp_(directions, updates, weight)
            if quantized is not None:
                quantized.write(bucket, direction)
            elif direction is not stored:
                stored.copy_(direction)
        norm_u = squares.sum().sqrt()
        if first:
            stats = UpdateStats(update_norm=float(norm_u), cosine=float("nan"))
        else:
            stats = self._fit_scales_from_dots(dots_ud, dots_dd, norm_u)
        self.n_updates += 1
        return stats

    def _fit_scales_from_dots(self, dots_ud: torch.Tensor, dots_dd: torch.Tensor, norm_u: torch.Tensor) -> UpdateStats:
        fits = torch.where(dots_dd > 0, dots_ud / dots_dd.clamp_min(1e-30), torch.zeros_like(dots_dd))
        fits = fits.clamp_(0.0, self.scale_max)
        if self.n_scale_fits == 0:
            self.scales.copy_(fits)
        else:
            self.scales.mul_(self.scale_beta).add_(fits, alpha=1 - self.scale_beta)
        self.n_scale_fits += 1
        norm_u, ud, dd = torch.stack([norm_u, dots_ud.sum(), dots_dd.sum()]).tolist()
        cosine = ud / (math.sqrt(dd) * norm_u) if dd > 0 and norm_u > 0 else 0.0
        return UpdateStats(update_norm=norm_u, cosine=cosine)

    # -- the direction ---------------------------------------------------------------------
    def linear_weights(self, k: int) -> list[float]:
        """Weights w_j with slope = Σ_j w_j u_j for a least-squares line through θ_0..θ_k."""
        times = list(range(k + 1))
        mean_t = sum(times) / len(times)
        denom = sum((t - mean_t) ** 2 for t in times)
        # θ_i = θ_0 + Σ_{j<=i} u_j  ⇒  slope = Σ_j u_j Σ_{i>=j} (t_i − t̄) / Σ (t − t̄)²
        return [sum(t - mean_t for t in times[j:]) / denom for j in range(1, k + 1)]

    @torch.no_grad()
    def current_direction(self, refresh: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """(flat, per-parameter views) of the direction; None before any update. An int8
        direction is returned dequantized: a full fp32 copy, for inspection (training reads it a
        bucket at a time)."""
        if self.n_updates == 0:
            return None
        if self._ema_q is not None:
            flat = self._ema_q.dequantized()
            return flat, self._views(flat)
        if self.direction_kind == "ema" or len(self._history) < 2:
            return self._ema_flat, self._ema
        if self._linear_flat is None:
            self._linear_flat = torch.zeros_like(self._ema_flat, dtype=torch.float32)
            self._linear = self._views(self._linear_flat)
            refresh = True
        if refresh:
            self._linear_flat.zero_()
            for w, (codes, block_scales) in zip(self.linear_weights(len(self._history)), self._history):
                hk.apply_delta_([self._linear_flat], [codes], w, scales=[block_scales],
                                granularity="block", block_size=_HISTORY_BLOCK)
        return self._linear_flat, self._linear

    def history_tensors(self) -> list[torch.Tensor]:
        """The stored int8 updates and their scales (not needed while predicted steps are applied)."""
        return [t for pair in self._history for t in pair]

    # -- predicted steps -------------------------------------------------------------------
    @torch.no_grad()
    def apply_predicted_step(self, multiplier: float = 1.0) -> torch.Tensor:
        """Add ``multiplier · scale_i · d_i`` to every parameter in place; returns per-tensor step norms."""
        if self.n_updates == 0:
            raise RuntimeError("no update recorded yet: nothing to predict from")
        if self._ema_q is not None:  # codes and block scales read by the kernel, dequantized in its pass
            q = self._ema_q
            applier = self._appliers.get(q.codes.data_ptr())
            if applier is None:
                applier = self._appliers[q.codes.data_ptr()] = hk.DeltaApplier(
                    self.params, q.code_views, scales=q.scale_views, granularity="block", block_size=q.block)
        else:
            flat, views = self.current_direction(refresh=False)
            applier = self._appliers.get(flat.data_ptr())
            if applier is None:
                applier = self._appliers[flat.data_ptr()] = hk.DeltaApplier(self.params, views)
        norms = torch.empty(len(self.params), dtype=torch.float32, device=self.scales.device)
        applier(self.scales * multiplier, out_norms=norms)
        return norms

    # -- checkpoint ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The recorded history as CPU tensors (``ema`` None while nothing is recorded; an int8
        direction as its codes without pads, ``[numel]``, and its block scales ``ema_scales``); a
        checkpoint taken under memory pressure must not copy it on the device."""
        cpu = lambda t: t.to("cpu", copy=True)  # noqa: E731
        q = self._ema_q
        return {
            "numel": self.numel,
            "ema": (q.flat_codes().cpu() if q is not None else None if self._ema_flat is None else cpu(self._ema_flat)),
            "ema_scales": None if q is None else cpu(q.scales),
            "linear": None if self._linear_flat is None else cpu(self._linear_flat),
            "history": [(cpu(c), cpu(s)) for c, s in self._history],
            "scales": cpu(self.scales),
            "n_updates": self.n_updates,
            "n_scale_fits": self.n_scale_fits,
        }

    @staticmethod
    def saved_numel(state: dict) -> int:
        """Values a saved predictor covers (checkpoints from before ``numel`` was saved hold the EMA)."""
        return int(state["numel"]) if "numel" in state else state["ema"].numel()

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; a direction saved in another dtype is converted (rounded
        once, or quantized a bucket at a time)."""
        ema = state["ema"]
        if ema is None:
            self.release()
        else:
            self._allocate()
            if ema.dtype == torch.int8:  # saved int8: codes and block scales
                if self._ema_q is not None:
                    self._ema_q.load_codes(ema.to(self.device), state["ema_scales"].to(self.device))
                else:
                    saved = Int8BlockVector(self.params, torch.device("cpu"))
                    saved.load_codes(ema, state["ema_scales"])
                    self._ema_flat.copy_(saved.dequantized())
            elif self._ema_q is not None:
                self._ema_q.quantize_from(ema)
            else:
                self._ema_flat.copy_(ema)
        if state["linear"] is not None:
            if self._linear_flat is None:
                self._linear_flat = torch.zeros_like(self._ema_flat, dtype=torch.float32)
                self._linear = self._views(self._linear_flat)
            self._linear_flat.copy_(state["linear"])
        device = self.device
        self._history = [(c.to(device), s.to(device)) for c, s in state["history"]]
        self.scales.copy_(state["scales"])
        self.n_updates = int(state["n_updates"])
        self.n_scale_fits = int(state["n_scale_fits"])

"""The step guard: decides whether a real step's update may stand.

It owns the checks of a real step's loss and gradient norm (finite, not a spike; through the
:class:`~hybrid_trainer.divergence.DivergenceMonitor`), the last good state the weights go back
to after a spike, and the reads of the two values from the device (merged into one, or
overlapped with a fused optimizer's step on a GPU). The trainer asks it, in this order:
:meth:`StepGuard.grad_norm`, :meth:`StepGuard.read` (which may launch the optimizer step
itself, see :meth:`StepGuard.steps_on_device`), :meth:`StepGuard.check`, then either
:meth:`StepGuard.refuse_update` or, after the update, :meth:`StepGuard.accept`.

The good state is kept behind :class:`GoodStateStore`, made by :func:`make_good_state_store`
only: where the snapshot lives can change there without the guard's decisions changing. It
lives off the device by default (``HybridConfig.good_state_storage``): taken every
``good_state_every`` real steps and read back only after a spike, it need not cost the device
three copies of the weights (weights and AdamW's two moments). On the trainer's lean step a
snapshot kept in a file is taken at the start of the step after the one that made it due, its
file written behind that step's forward and backward (:meth:`StepGuard.accept`,
:meth:`StepGuard.take_due_snapshot`); whoever reads the good state between steps gets it taken
at once (:meth:`StepGuard.settled_good_state`).

What a refused step leaves: the weights and optimizer state as before the step (a non-finite
loss or gradient, or a lone spike: the monitor takes one for the batch's) or as in the last good
state (a spike right after another critical step, or one whose update ran before it was judged);
the module buffers as before the step's forward (:class:`~hybrid_trainer.buffer_guard.BufferGuard`;
the forward of a NaN batch would otherwise write NaN into batch-norm statistics for good) or the
good state's.

When the guard cannot make progress it escalates (:meth:`StepGuard.escalate`): after
``max_refused_in_a_row`` refusals in a row (``HybridConfig.divergence``; default 20), when a
refused step finds non-finite weights, buffers or optimizer state (a NaN written from outside,
a checkpoint's), or when the good-state snapshot would copy one, it restores the last good
state once and warns; if that happens again before a new good state is taken, or there is no
good state, it raises :class:`~hybrid_trainer.errors.TrainingStalledError` naming the
non-finite tensors. Before this, such a run went on refusing every step, silently, for ever.
Finiteness is looked at on refusals and at snapshots only (one host read over all tensors),
never on an accepted step.
"""
from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from .anchor import WeightAnchor
from .blas_dots import INT_LIMIT as BLAS_INT_LIMIT, self_dot_routine
from .buffer_guard import BufferGuard
from .config import HybridConfig
from .deferred_checks import DeferredChecks
from .divergence import DivergenceMonitor, Severity
from .errors import TrainingStalledError
from .gram_norm import GramNorms
from .optimizer_call import OptimizerStep
from .resume_check import non_finite_names
from .user_warning import warn_user


def grad_norm_tensor(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """Global L2 norm of ``grads`` as a 0-d tensor on the first grad's device (None for no
    grads); non-finite if any entry is. The same ops as ``torch.nn.utils.get_total_norm`` when
    all grads share a device and dtype, without its per-call grouping, which cost ~40 µs per step
    on a 4-tensor MLP (half of the norm)."""
    if not grads:
        return None
    first = grads[0]
    if all(g.device == first.device and g.dtype == first.dtype for g in grads):
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    return torch.nn.utils.get_total_norm(grads)


# Gradient dtypes whose squared norm a CPU takes as one BLAS dot product per gradient (squares_by_dots).
DOT_DTYPES = (torch.float32, torch.float64)
# ... where torch.dot would be called for them (no routine of blas_dots), only where the gradients
# hold at least this many entries each on average. Through torch a dot costs up to three calls per
# gradient (view, dot, read) against _foreach_norm's one read per gradient after one call: on the
# char-LM's 40 gradients (8.7k entries on average) the dots took 169 µs against 141, on a 32-tensor
# MLP of 64-wide layers they were no faster in the step; on the 1 ms MLP (22k) and Fashion-MNIST
# (90k) they were faster (squares_by_dots). Called past the dispatcher (blas_dots), a dot costs
# less than a read of a norm, at any size.
DOTS_FROM_MEAN_NUMEL = 16384


def read_by_dots(params: list[torch.Tensor]) -> bool:
    """Whether a CPU read takes the gradients of ``params`` (the guarded parameters) as
    :func:`squares_by_dots`: all on the CPU in one dtype of :data:`DOT_DTYPES`, either with a
    routine of :mod:`~hybrid_trainer.blas_dots` for it or with at least
    :data:`DOTS_FROM_MEAN_NUMEL` entries each on average."""
    if not params:
        return False
    first = params[0]
    return (first.device.type == "cpu" and first.dtype in DOT_DTYPES
            and all(p.device == first.device and p.dtype == first.dtype for p in params)
            and (self_dot_routine(first.dtype) is not None
                 or sum(p.numel() for p in params) >= DOTS_FROM_MEAN_NUMEL * len(params)))


def squares_by_dots(grads: list[torch.Tensor]) -> float:
    """Sum of the squares of every entry of ``grads`` (dense CPU tensors of one dtype in
    :data:`DOT_DTYPES`), as a Python float: one dot product of each gradient with itself (BLAS
    ``sdot``/``ddot``: MKL in torch's x86 CPU builds), summed with ``fsum``. The routine is
    called past torch's dispatcher where :mod:`~hybrid_trainer.blas_dots` has it and every
    gradient is contiguous (the same bits as ``torch.dot``, without its ~2.5 µs of calls a
    gradient), else through ``torch.dot`` on each gradient as a vector.

    Why not ``_foreach_norm``: torch has no multi-tensor CPU kernel for it, so it runs a generic
    reduction per tensor. Two trainers, one reading each way, stepped in turn on one core (200
    and 60 rounds of 50 steps): the dots' steps (through torch.dot) were 14 µs [-34, +1] shorter
    on the 1 ms MLP (six gradients, 134k entries) and 92 µs [-137, +8] on Fashion-MNIST (0.54M);
    through torch, on many small gradients they cost more (:data:`DOTS_FROM_MEAN_NUMEL`). MKL's
    dot of a 12.8M-entry gradient was closer to the float64 sum than ``_foreach_norm`` (relative
    error 3.7e-4 against 1.1e-3). Neither rescales, so both give 0 where every square underflows
    the dtype and Inf where one overflows; a NaN or an Inf entry makes the sum non-finite. Raises
    RuntimeError for a gradient that is not a contiguous dense tensor (torch's ``view(-1)``). A
    vector is taken as it is: its ``view(-1)`` costs ~1.3 µs, its ``ndim`` 0.1 µs, and a model's
    biases and norm scales are vectors (half the 1 ms MLP's six gradients)."""
    dtype = grads[0].dtype if grads else None
    routine = self_dot_routine(dtype)
    if routine is not None:
        # What the routine reads must be what it is told: one dtype, contiguous, on the host. A
        # loop, not all() over a generator: 1.4 µs less a read of six gradients, 4.1 of forty
        # (timeit, the two interleaved on one core).
        for g in grads:
            if not (g.is_cpu and g.dtype is dtype and g.is_contiguous() and g.numel() < BLAS_INT_LIMIT):
                break
        else:
            return math.fsum(list(map(routine, grads)))
    return math.fsum([torch.dot(flat, flat).item() for flat in [g if g.ndim == 1 else g.view(-1) for g in grads]])


def squares_read(grads: list[torch.Tensor], by_dots: bool) -> float:
    """The sum of the squares of ``grads``' entries, read from them on a CPU (0.0 for none):
    with ``by_dots`` (:func:`read_by_dots` of their parameters) one dot product per gradient
    (:func:`squares_by_dots`), else, or for a gradient not viewable as a vector, one norm per
    gradient read value by value and squared on the host."""
    if not grads:
        return 0.0
    if by_dots:
        try:
            return squares_by_dots(grads)
        except RuntimeError:  # a gradient that is not a contiguous dense tensor: read as below
            pass
    # Per-tensor reads: cheaper than stacking the norms for a read up to 40 tensors and beyond.
    return math.fsum([n * n for n in [norm.item() for norm in torch._foreach_norm(grads)]])


def reads_are_free(device: torch.device) -> bool:
    """Whether reading a value from ``device`` waits for nothing: a CPU op has finished when it
    returns, so there each read costs ~0.3 µs and merging two costs a stack (~7 µs)."""
    return device.type == "cpu"


class GoodStateStore(Protocol):
    """Where the last healthy point (weights, buffers, optimizer state) is kept."""

    params: list[torch.Tensor]
    step: int | None

    @property
    def is_set(self) -> bool: ...
    def save(self, step: int, optimizer: torch.optim.Optimizer | None = None, background: bool = False) -> None: ...
    def wait(self) -> None: ...
    def release(self) -> None: ...
    def restore(self, optimizer: torch.optim.Optimizer | None = None) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def good_state_storage(config: HybridConfig, device: torch.device) -> str:
    """``config.good_state_storage`` resolved: on ``"auto"``, page-locked host memory beside a
    GPU, an unlinked temporary file on a CPU (whose host memory is the training memory)."""
    if config.good_state_storage != "auto":
        return config.good_state_storage
    return "host" if device.type == "cuda" else "file"


def make_good_state_store(params: list[torch.Tensor], buffers: list[torch.Tensor], storage: str = "device",
                          directory: str | None = None) -> GoodStateStore:
    """The store of the last good state of ``params`` and ``buffers`` (``storage``: see
    :class:`~hybrid_trainer.anchor.WeightAnchor`; every storage restores the same bits)."""
    return WeightAnchor(params, buffers=buffers, storage=storage, directory=directory)


class StepGuard:
    """Finite and divergence checks of real steps, refusal and rollback to the last good state.

    Args:
        config: the run's :class:`HybridConfig` (``grad_clip``, ``good_state_every``, ``divergence``).
        optimizer: the trainer's optimizer (its step is launched here when overlapped).
        scaler: the fp16 ``GradScaler`` or None.
        stats: the trainer's run counters (``skipped_steps``, ``divergence_rollbacks``).
        device: the trained tensors' device.
    """

    def __init__(self, config: HybridConfig, optimizer: torch.optim.Optimizer, scaler: Any, stats: Any,
                 device: torch.device):
        self.config, self.optimizer, self.scaler, self.stats = config, optimizer, scaler, stats
        # The update of a real step: optimizer.step() without torch's profiler scope when no
        # profiler records (optimizer_call).
        self.step_optimizer = OptimizerStep(optimizer)
        self.storage = good_state_storage(config, device)
        self.monitor = DivergenceMonitor(**config.divergence)
        self.params: list[torch.Tensor] = []
        self.good_state: GoodStateStore | None = None
        self.buffers_before = BufferGuard([])  # the module buffers before the step's forward
        self._buffer_slots: list[tuple[torch.nn.Module, str]] = []
        self._names: dict[int, str] = {}  # id(param) -> name, for the messages
        self._buffer_names: list[str] = []
        # Set when the good state was restored because the guard could not make progress; cleared
        # when a new good state is taken. Needed again before then, the guard raises instead.
        self.stall_restored = False
        self._grads_uniform = False
        self._grads_by_dots = False  # the CPU read's squares from squares_by_dots (read_by_dots)
        self._host_values: torch.Tensor | None = None  # pinned landing place of the read (CUDA)
        # Large linear layers' squared gradient norms from Gram matrices (gram_norm; CPU steady steps).
        self.gram: GramNorms | None = None
        self.closed = False  # close(): no hooks on the model any more
        # Where a read waits for nothing there is nothing to overlap: the device-side skip's extra
        # ops would only add work to every step (a CPU's sub-millisecond MLP steps notice it).
        self.reads_free = reads_are_free(device)
        self.overlap = not self.reads_free
        # Checks read once every read_every steps while prediction is off (deferred_checks).
        every = config.read_every if config.read_every is not None else (1 if self.reads_free else 16)
        self.deferred = DeferredChecks(every) if every > 1 else None
        # The trainer step at whose end a good state became due, taken at the start of the next
        # steady step with its file written behind that step's forward and backward
        # (accept(defer_snapshot=True), take_due_snapshot); None when none is due.
        self.snapshot_due: int | None = None
        # Times the weights, optimizer state or trained set were put back or replaced (a rollback,
        # a stall's restore, a retarget): a captured step's graph points at the tensors they were.
        self.restores = 0

    def retarget(self, params: list[torch.Tensor], buffers: list[tuple[torch.nn.Module, str]],
                 module: torch.nn.Module | None = None) -> None:
        """Guard ``params`` and the buffers at ``buffers`` (``(owner, name)`` slots) from now on;
        the good state restarts empty. ``module`` (the unwrapped model) names them in messages."""
        if self.good_state is not None:
            self.good_state.release()  # a write still in flight ends first; the good state restarts empty
        self.snapshot_due = None
        self.restores += 1
        self.params = params
        # A dense gradient has its parameter's dtype and device (autograd's accumulation
        # enforces it), so whether the norm may take the one-dtype path is known here, not
        # re-checked per gradient per step (~10 µs a step on the char-LM's 40 tensors).
        first = params[0] if params else None
        self._grads_uniform = first is not None and all(p.device == first.device and p.dtype == first.dtype
                                                        for p in params)
        self._grads_by_dots = read_by_dots(params)
        self._drop_gram()
        grams = GramNorms(module, params) if module is not None and self.reads_free and not self.closed else None
        self.gram = grams if grams else None
        self.good_state = make_good_state_store(params, buffers, self.storage, self.config.snapshot_dir)
        self.buffers_before = BufferGuard(buffers)
        self._buffer_slots = list(buffers)
        self.stall_restored = False
        if module is not None:
            self._names = {id(p): name for name, p in module.named_parameters()}
            prefixes = {id(owner): name for name, owner in module.named_modules()}
            self._buffer_names = [f"{prefixes.get(id(owner), '?')}.{name}".lstrip(".") for owner, name in buffers]

    def before_forward(self, gram: bool = False) -> None:
        """Called before a real step's forward: keep the buffers it is about to change; with
        ``gram``, a step of one forward and one backward (the trainer's steady step), take the
        large linear layers' gradient norms from Gram matrices (:mod:`~hybrid_trainer.gram_norm`;
        :meth:`after_backward` then)."""
        self.buffers_before.before_forward()
        if self.gram is not None:
            self.gram.arm(gram)

    def after_backward(self, loss: torch.Tensor) -> None:
        """Called after the backward of a step begun with ``before_forward(gram=True)``, with its
        loss (still attached to the graph): keep the squared norms the Grams give for
        :meth:`read_step_values`."""
        if self.gram is not None:
            self.gram.finish(loss)

    def close(self) -> None:
        """Take the guard's hooks off the model (:mod:`~hybrid_trainer.gram_norm`) for good: from
        now on every gradient is read."""
        self.closed = True
        self._drop_gram()

    def _drop_gram(self) -> None:
        if self.gram is not None:
            self.gram.remove()
            self.gram = None

    def defers(self) -> bool:
        """Whether this step's checks may wait for the next read (``read_every`` > 1; not under a
        GradScaler, which decides its own skip; not before a good state exists, since a spike
        found later goes back to it; not from a rollback until the next good state is taken:
        a refused step found at a block's read also discards the block's later steps, and
        refusals come in runs, so after one each step is read as it comes, at one read a step,
        until a good state is taken again). The trainer adds its own conditions (prediction
        off)."""
        return (self.deferred is not None and self.scaler is None and self.good_state.is_set
                and not self.monitor.rewound)

    def snapshot_if_due(self, step: int) -> None:
        """After a block of deferred steps judged healthy: take the good state when
        ``good_state_every`` steps have passed since the last one (or escalate, as
        :meth:`accept` does, if something in it is non-finite)."""
        every = self.config.good_state_every
        if every and (self.good_state.step is None or step - self.good_state.step >= every):
            self._take_good_state(step)

    def grad_norm(self) -> torch.Tensor | None:
        """Global gradient norm as a 0-d device tensor (before clipping, which it applies when
        ``grad_clip`` is set); None without gradients."""
        if self.config.grad_clip is None:  # measure only: clip_grad_norm_(inf) would also rescale every grad by 1
            grads = [g for p in self.params if (g := p.grad) is not None]
            if self._grads_uniform and grads:  # grad_norm_tensor's ops, its per-step check done in retarget
                return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
            return grad_norm_tensor(grads)
        return torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip)

    def grad_norms(self) -> list[torch.Tensor] | None:
        """The gradients' norms as 0-d device tensors whose root sum of squares is the global
        norm (:func:`~hybrid_trainer.run_report.global_norm`): one per gradient where the
        gradients share a device and dtype and no clipping is asked for (one op,
        ``_foreach_norm``, instead of :meth:`grad_norm`'s three), else the one global norm; None
        without gradients. Norms of 16-bit gradients come in float32, the loss's dtype where
        :mod:`~hybrid_trainer.deferred_checks` queues them: one multi-tensor check takes them
        all only in one dtype."""
        if self.config.grad_clip is None and self._grads_uniform:
            # Each gradient read once: ``p.grad`` is a getter call, and for 40 tensors (the
            # char-LM's) the list took 6.3 µs reading each twice, 3.8 µs once (timeit, one core).
            grads = [g for p in self.params if (g := p.grad) is not None]
            if not grads:
                return None
            return torch._foreach_norm(grads, 2, dtype=torch.float32 if grads[0].element_size() < 4 else None)
        norm = self.grad_norm()
        return None if norm is None else [norm]

    def read_step_values(self, loss: torch.Tensor) -> tuple[float, float | None]:
        """The step's loss and global gradient norm as floats (:meth:`grad_norm`, then
        :meth:`read_loss_and_norm`; the norm None when the loss is not finite).

        Where reads are free (a CPU) and no clipping is asked for, each gradient's norm is read
        and the global norm combined on the host, ``sqrt(fsum(norm_i ** 2))`` in float64: one op
        on the gradients instead of three (``_foreach_norm``, a stack and a norm of it); for
        large float32 and float64 gradients (:func:`read_by_dots`) each one's square from a dot
        product instead (:func:`squares_by_dots`). A NaN or an Inf in any gradient still makes the
        norm non-finite. The large linear layers' weight gradients whose squares the Grams of a
        steady step gave (:meth:`after_backward`, :mod:`~hybrid_trainer.gram_norm`) are not read:
        those squares are finite only where every entry of the gradient is."""
        squares = self.gram.take() if self.gram is not None else None
        if self.config.grad_clip is not None or not self._grads_uniform or not self.reads_free:
            return self.read_loss_and_norm(loss, self.grad_norm())
        total = loss.item()
        if not math.isfinite(total):
            return total, None
        if squares:  # the gradients whose squares the Grams gave are not read
            grads = [g for p in self.params if (g := p.grad) is not None and id(p) not in squares]
            return total, math.sqrt(math.fsum(squares.values()) + squares_read(grads, self._grads_by_dots))
        grads = [g for p in self.params if (g := p.grad) is not None]
        return total, math.sqrt(squares_read(grads, self._grads_by_dots))

    def steps_on_device(self, record: bool) -> bool:
        """Whether this step launches its optimizer step before reading the guard's values.

        A fused optimizer (``fused=True``: torch's Adam, AdamW, SGD) skips its update on the
        device when told the gradients are not finite (the ``found_inf`` GradScaler uses), so a
        non-finite step is refused without the host having looked; a finite step the monitor
        refuses (a spike) restores the last good state, which overwrites the update either way.
        Not while recording (the predictor brackets the step and needs the read first), under
        a GradScaler (it has its own skip), before a good state exists (nothing to restore), or
        on a CPU (``overlap``: its reads wait for nothing).
        """
        return (self.overlap and not record and self.scaler is None and self.good_state.is_set
                and getattr(self.optimizer, "_step_supports_amp_scaling", False))

    def step_then_read(self, loss: torch.Tensor, norm: torch.Tensor | None) -> tuple[float, float | None]:
        """Queue the loss and norm's copy to the host, launch the optimizer step with a
        device-side skip for non-finite values, then wait for the copy only: on a GPU the host
        runs the monitor while the device runs the update, where the plain guard left the device
        idle until the host had read, checked and launched."""
        values = torch.stack([loss.float(), torch.zeros_like(loss, dtype=torch.float32) if norm is None
                              else norm.to(loss.device, torch.float32)])
        non_finite = (~torch.isfinite(values).all()).float()
        if values.device.type == "cuda":
            if self._host_values is None:  # pinned, so the copy is asynchronous; reused every step
                self._host_values = torch.empty(2, dtype=torch.float32, pin_memory=True)
            host = self._host_values
            host.copy_(values, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        else:
            host, copied = values, None
        self.optimizer.found_inf = non_finite
        try:
            self.step_optimizer()
        finally:
            del self.optimizer.found_inf
        if copied is not None:
            copied.synchronize()
        total, grad_norm = host.tolist()
        if norm is None:
            grad_norm = 0.0
        return total, (grad_norm if math.isfinite(total) else None)

    def read_loss_and_norm(self, loss: torch.Tensor, norm: torch.Tensor | None) -> tuple[float, float | None]:
        """The step's loss and global gradient norm as floats, read from the device together:
        on a GPU each host read waits for all queued work, which the plain loop never does. The
        norm is None when the loss is not finite (the update is refused on the loss alone)."""
        if norm is None:
            total, grad_norm = loss.item(), 0.0
        elif reads_are_free(loss.device) and reads_are_free(norm.device):
            total, grad_norm = loss.item(), norm.item()  # two reads cost less than a stack here
        else:
            total, grad_norm = torch.stack([loss.float(), norm.to(loss.device, torch.float32)]).tolist()
        return total, (grad_norm if math.isfinite(total) else None)

    def check(self, loss: float, grad_norm: float | None):
        """The monitor's :class:`~hybrid_trainer.divergence.DivergenceReport` of this step."""
        if self.scaler is not None and grad_norm is not None and not math.isfinite(grad_norm):
            grad_norm = None  # fp16 overflow: the GradScaler skips this step by itself
        return self.monitor.check(loss, grad_norm)

    def refuse_update(self, loss: float, grad_norm: float | None, report: Any = None, step: int | None = None,
                      judged_later: bool = False, update_ran: bool = False) -> bool:
        """A critical divergence: the update is not applied; weights go back to the last good
        state if they are already off, the buffers to where the step's forward found them
        otherwise. Escalates when the guard cannot make progress (module docstring). Returns
        whether the weights were rolled back; raises :class:`TrainingStalledError`.

        When the weights are off: a finite spike right after another critical step (the monitor's
        ``critical_in_a_row``), for weights gone wrong show on every batch. A lone one is taken
        for the batch's (a corrupt batch, a hard one): its update is refused and nothing else
        goes (``DivergenceMonitor(blame_lone_alarms_on_the_batch=False)``: every finite spike).

        ``judged_later``: the step's checks waited (:mod:`~hybrid_trainer.deferred_checks`); its
        non-finite update was skipped and its buffers put back where it ran, and its gradients
        are gone, so only the judgment is left to do. ``update_ran``: the step's update was
        launched before its values were read (:meth:`steps_on_device`, skipped on the device
        only if non-finite) or applied inside the backward (``step_in_backward``). In both, a
        finite spike's update ran, so it always goes back to the good state."""
        if not judged_later:
            self.optimizer.zero_grad(set_to_none=True)
            if self.scaler is not None:
                # unscale_ ran this step; without an update() the next step's unscale_ would raise.
                # The update also backs the scale off when the gradients overflowed.
                self.scaler.update()
        self.stats.skipped_steps += 1
        non_finite = not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm))
        rolled_back = False
        monitor = self.monitor
        # A lone alarm is taken for the batch's: weights gone wrong show on the next batch too. A
        # finite update that ran already (judged later, launched before the read) always goes back.
        weights_off = (judged_later or update_ran or monitor.critical_in_a_row > 1
                       or not monitor.blame_lone_alarms_on_the_batch)
        if not non_finite and self.good_state.is_set and weights_off:
            self.good_state.restore(self.optimizer)  # weights, optimizer state and buffers
            self.restores += 1
            self.stats.divergence_rollbacks += 1
            self.monitor.rewind_window()  # the next steps are judged by the good state's window
            rolled_back = True
        elif not judged_later:
            self.buffers_before.restore()  # the refused forward's trace in batch-norm statistics
        stalled = self.monitor.record_refusal()
        # A non-finite loss is most often the batch's; it is the state's when the weights (or
        # buffers, or optimizer state) are non-finite themselves, which no later step can mend.
        bad = self.non_finite_state() if non_finite else []
        if bad or stalled:
            why = "; ".join(report.reasons) if report is not None and report.reasons else "refused"
            reason = (f"{self.monitor.refused_in_a_row} steps in a row refused (last: {why})" if stalled
                      else f"step refused ({why})")
            self.escalate(reason, bad, step)
            rolled_back = True
        return rolled_back

    def accept(self, step: int, real_steps: int, loss: float, grad_norm: float | None, severity: Severity,
               defer_snapshot: bool = False) -> bool:
        """After an applied update: feed the monitor and, every ``good_state_every`` real steps
        of a healthy run, snapshot the good state (weights after the update, optimizer state),
        unless something in it is non-finite: a snapshot never holds a NaN (a NaN written into a
        batch-norm statistic from outside changes no train-mode loss; it is found here), and the
        guard escalates instead. Returns whether that rolled the weights back.

        ``defer_snapshot`` (the trainer's steady step): a snapshot kept in a file is only marked
        due (:attr:`snapshot_due`); the next steady step takes it first thing, from the same
        weights unless the caller changed them in between, and writes it behind its own forward
        and backward (:meth:`take_due_snapshot`). The write was ~470 µs of the 1 ms MLP's
        snapshot step on this project's CI host, ~200 ms of the 51M-parameter MLP's
        (``python -m bench.overhead``)."""
        monitor = self.monitor
        monitor.observe(loss, grad_norm)
        every = self.config.good_state_every
        # Also at the first healthy step after a run of critical steps taken for the batches'.
        if (severity is Severity.OK and every
                and (real_steps % every == 1 or not self.good_state.is_set or monitor.blamed_run_ended())):
            if defer_snapshot and self.storage == "file":
                self.snapshot_due = step
                return False
            return self._take_good_state(step)
        return False

    def take_due_snapshot(self, background: bool = False) -> bool:
        """Take the good state that :meth:`accept` marked due, if one is (with ``background``,
        its file written from a thread: the caller calls :meth:`wait_for_snapshot` before it
        changes the weights or the optimizer state). Returns whether finding a non-finite value
        in it escalated (:meth:`escalate`), rolling the weights back."""
        step = self.snapshot_due
        if step is None:
            return False
        return self._take_good_state(step, background)

    def wait_for_snapshot(self) -> None:
        """Return once the good state's file is wholly written (raises what its write raised)."""
        if self.good_state is not None:
            self.good_state.wait()

    def settled_good_state(self) -> GoodStateStore | None:
        """The good state as :meth:`accept` left it for a caller between steps (a checkpoint, the
        user): a snapshot marked due is taken now, and any write is done."""
        self.take_due_snapshot()
        self.wait_for_snapshot()
        return self.good_state

    def _take_good_state(self, step: int, background: bool = False) -> bool:
        """Snapshot the good state at ``step``, or escalate if something in it is non-finite
        (a snapshot never holds a NaN). Returns whether escalating rolled the weights back."""
        self.snapshot_due = None  # this one, or one that supersedes it
        bad = self.non_finite_state()
        if bad:
            self.escalate("non-finite values where the good state was to be taken", bad, step)
            return True
        self.good_state.save(step, self.optimizer, background=background)
        self.monitor.remember_window()
        self.stall_restored = False
        return False

    def non_finite_state(self) -> list[str]:
        """Names of the guarded weights, module buffers and optimizer-state tensors holding a
        NaN or an Inf (one host read for all of them). Each is keyed by where it sits and
        named only if it is non-finite: at a snapshot (every ``good_state_every`` steps) the
        names of every tensor cost more than a quarter of the check on the 1 ms MLP."""
        params, optimizer_state = self.params, self.optimizer.state
        keyed = [(("weight", i, None), p) for i, p in enumerate(params)]
        keyed += [(("buffer", i, None), owner._buffers[n]) for i, (owner, n) in enumerate(self._buffer_slots)]
        keyed += [(("optimizer state", i, key), value) for i, p in enumerate(params)
                  for key, value in optimizer_state.get(p, {}).items()]
        return [self._state_name(*key) for key in non_finite_names(keyed, self.reads_free)]

    def _state_name(self, kind: str, i: int, key: Any) -> str:
        if kind == "buffer":
            name = self._buffer_names[i] if i < len(self._buffer_names) else self._buffer_slots[i][1]
            return f"buffer {name!r}"
        param = repr(self._names.get(id(self.params[i]), f"trained tensor {i}"))
        return f"weight {param}" if kind == "weight" else f"optimizer state {key!r} of {param}"

    def escalate(self, reason: str, non_finite: list[str], step: int | None = None) -> None:
        """The guard cannot make progress: restore the last good state once (and warn), or, when
        that was done already since the good state was taken, or there is none, raise
        :class:`TrainingStalledError` naming ``non_finite``."""
        shown = ", ".join(non_finite[:8]) + (f" and {len(non_finite) - 8} more" if len(non_finite) > 8 else "")
        detail = reason + (f"; non-finite: {shown}" if non_finite else "")
        where = "" if step is None else f" at step {step}"
        if self.good_state.is_set and not self.stall_restored:
            self.good_state.restore(self.optimizer)
            self.restores += 1
            self.monitor.rewind_window()
            self.monitor.refused_in_a_row = 0
            self.stall_restored = True
            self.stats.stall_restores += 1
            warn_user(f"training{where}: {detail}; restored the last good state (step {self.good_state.step})")
            return
        why = (f"restoring the last good state (step {self.good_state.step}) did not help"
               if self.good_state.is_set else "there is no good state to restore")
        hint = ("check the data, the learning rate or the checkpoint resumed from" if non_finite else
                "check the data and the learning rate; if the refused steps are a loss that legitimately "
                "changed level (a new data regime), loosen HybridConfig.divergence (loss_jump_factor, "
                "loss_z_critical, grad_explosion_factor)")
        raise TrainingStalledError(f"training stalled{where}: {detail}; {why}: {hint}", non_finite)

"""The trainer's steady step captured in a CUDA graph and replayed (``HybridConfig(cuda_graph=True)``).

Why: on a step the GPU finishes before the host has launched it (a small model), whatever the
trainer adds on the host is added to the step. On the H200, Fashion-MNIST's MLP does 178 µs of
device work in a 1,504 µs eager step; the guard's device ops alone (the gradient norms, the
non-finite check, the device-side skip) cost +133 µs a step there without any of the trainer's
Python, over the 3% the trainer may cost; captured in one graph with those ops the step took
205 µs (``python -m experiments.gpu_step_capture``, ``experiments/results/gpu_step_capture_cuda.md``;
Nguyen et al., "Accelerating PyTorch with CUDA Graphs", PyTorch blog 2021, whole-network
capture). The graph holds the same ops as the deferred steady step
(:meth:`~hybrid_trainer.deferred_checks.DeferredChecks.launch`): the buffers kept, forward,
backward, one ``_foreach_norm``, GradScaler's non-finite check into a flag, the fused update
skipped on the device by that flag, the buffers put back where it is set, and the step's
``[loss, n_1, ..., n_k]`` stacked. What is left on the host per step: the batch copied into the
graph's input tensors, the replay, that row copied into a ring the guard reads once per
``read_every`` steps (the same judgment as the deferred path's), and the trainer's counters.

When it replays: prediction off for good on the steady path, the deferred checks on (a GPU's
default ``read_every``; a good state taken; not from a rollback until the next good state), a
fused optimizer that skips on the device, no ``grad_clip``, no optimizer step hooks, batches whose
tensors are on the device (other leaves plain values: numbers, strings). First
:data:`WARMUP_STEPS` steps run eagerly on a side stream (what torch.cuda.graphs asks of a
whole-network capture), then the next step shaped as the last of them is captured (nothing runs)
and replayed. Any step that does not fit runs eagerly (the same ops): a batch of another shape
(the graph is kept, unless :data:`MISSES_TO_DROP` in a row do not fit it), a step whose guard
reads it at once (after a rollback, until the next good state, and the step that then takes it).
The graph is dropped and captured again after warm-up when what it points at may have been
replaced (a rollback, a loaded checkpoint, a change of what is trained, the optimizer's state
loaded by the user, the buffers' copies remade), when what it was recorded with changed (the
loss function, the model's train/eval mode, optimizer step hooks registered: then it stays off)
or when a value it holds as a constant changes (any optimizer hyperparameter, the learning rate
included); after :data:`MAX_CAPTURES` captures the run goes on eagerly (a scheduler that changes
the learning rate every step).

What a graph cannot see: Python that the forward runs (a hook that counts calls, a ``print``)
runs once, at capture; a loss function that reads a value back (``.item()``) cannot be captured
(the capture fails, the run goes on eagerly with a warning); weights must be updated in place
(``p.data = ...`` is not seen). Gradients stay allocated in the graph's memory between steps,
where the eager steps free them, and the graph keeps its own memory for a step's activations: a
step run eagerly while a graph is held (a short batch, the per-step reads after a rollback) needs
its own beside it, about one step's activations and gradients more at the peak.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .deferred_checks import update_unless_non_finite
from .optimizer_call import step_hooks_registered
from .user_warning import warn_user

WARMUP_STEPS = 3
MAX_CAPTURES = 8
MISSES_TO_DROP = 3


_SIDE_STREAMS: dict[torch.device, Any] = {}  # one per device for the process: see side_stream


def side_stream(device: torch.device):
    """The process's side stream on ``device``, shared by every trainer that captures there.

    Why shared: torch keeps a cuBLAS workspace for each (handle, stream) pair it has run a matrix
    product on, until the process ends (ATen's CublasHandlePool), so a stream per trainer leaves
    one behind per trainer. On the H200 (2026-11-28, a stream per trainer), a memory run whose
    warm-up trainer was gone before the measured one was built started from 68 MB more allocated
    than the plain loop's run (``bench.overhead --child fashion 'predict=False, cuda_graph'``: 162
    against 94 MB), about two 32 MiB workspaces; the measured trainer's own peak was 77 MB above
    that, against the plain loop's 9. torch.cuda.graph's default capture stream is likewise one
    per process."""
    key = torch.device(device.type, device.index if device.index is not None else torch.cuda.current_device())
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(key)
    return _SIDE_STREAMS[key]


class CudaGraphs:
    """torch.cuda's graphs on ``device``: one side stream for the warm-up steps and the capture
    (torch's make_graphed_callables warms up and captures on one stream too: libraries that keep a
    handle per stream then make it before the capture, not inside it); the process's, for every
    trainer on that device (:func:`side_stream`)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.side = side_stream(device)

    @contextlib.contextmanager
    def warmup(self) -> Iterator[None]:
        """Run the enclosed eager steps on the side stream, ordered after and before the current
        stream's work (before, whether or not they raise)."""
        current = torch.cuda.current_stream(self.device)
        self.side.wait_stream(current)
        try:
            with torch.cuda.stream(self.side):
                yield
        finally:
            current.wait_stream(self.side)

    def capture(self, body: Callable[[], None]) -> Callable[[], None]:
        """Record ``body``'s device work (it runs once as Python; no kernel runs); returns the replay.

        On the trainer's device, whatever device is current (torch records only the capture
        stream's device: ops on another would run for real and leave an empty graph, which torch
        only warns about, so an empty graph is a failed capture here). ``thread_local``: another
        thread's CUDA calls (a DataLoader pinning memory) are not errors during the capture, as
        they are in torch's default mode, where both the capture and that thread's next batch would
        fail. A capture that fails at its end can leave the thread on the capture stream: the
        current stream is put back."""
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        try:
            with torch.cuda.device(self.device), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with torch.cuda.graph(graph, stream=self.side, capture_error_mode="thread_local"):
                    body()
        finally:
            torch.cuda.set_stream(current)
        for warning in caught:
            if "empty" in str(warning.message) and "graph" in str(warning.message).lower():
                raise RuntimeError(f"the captured graph is empty ({warning.message})")
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
        return graph.replay


def graphs_for(device: torch.device) -> CudaGraphs | None:
    """The capture backend on ``device``: torch.cuda's graphs on a CUDA device, else None."""
    return CudaGraphs(device) if device.type == "cuda" else None


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[tuple[Any, ...]]:
    """Every param group's values (a captured update holds them as constants), in a form compared
    with ``==``. The group's list of parameters is among them: it is the same object from step
    to step, which ``==`` on the tuples finds at once (AdamW's group compared in 0.9 µs, against
    2.4 with the other keys picked out one by one; timeit, one core)."""
    return [tuple(group.values()) for group in optimizer.param_groups]


class CapturedStep:
    """The trainer's steady steps as replays of one CUDA graph (module docstring).

    Args:
        trainer: the :class:`~hybrid_trainer.trainer.HybridTrainer` whose steady steps it takes.
        graphs: the capture backend (:func:`graphs_for`); None: the run steps eagerly.
    """

    def __init__(self, trainer: Any, graphs: CudaGraphs | None):
        self.trainer, self.graphs = trainer, graphs
        self.off_reason = self._why_not(trainer, graphs)  # None while the graph may still be used
        if self.off_reason is not None:
            warn_user(f"HybridConfig.cuda_graph: steps run eagerly ({self.off_reason})")
        self.captures = 0
        self.replays = 0
        self._replay: Callable[[], None] | None = None
        self._warm = 0  # eager steps on the side stream since the graph was last dropped
        self._static: list[torch.Tensor] = []  # the graph's input tensors, the batch's tensor leaves
        self._layout: tuple[Any, ...] | None = None  # of the batch it was captured with
        self._constants: list[tuple[Any, ...]] | None = None  # hyperparameters(optimizer) at capture
        self._restores = 0  # guard.restores at capture
        self._row: torch.Tensor | None = None  # the step's [loss, n_1, ..., n_k], written by the graph
        self._ring: torch.Tensor | None = None  # one row a queued step, read at the guard's read
        self._keep: tuple[Any, ...] = ()  # tensors the graph points at that nothing else holds
        self._built: tuple[Any, ...] = ()  # _built_from() at capture
        self._warm_layout: tuple[Any, ...] | None = None  # the last warm-up step's batch layout
        self._misses = 0  # steps in a row whose batch the graph does not fit

    @staticmethod
    def _why_not(trainer: Any, graphs: CudaGraphs | None) -> str | None:
        """Why the run cannot replay its steps (the first reason found), or None."""
        guard, optimizer = trainer.guard, trainer.optimizer
        if graphs is None:
            return f"the trained tensors are on {trainer.device}, not a CUDA device"
        if not trainer._steady_allowed:
            return ("the run uses what only the general step handles (gradient accumulation, DDP, a GradScaler, "
                    "the step inside the backward, a weight average, a nowcast, offloading, the memory profiler "
                    "or the VRAM guard)")
        if guard.deferred is None:
            return "read_every is 1: each step reads its values back, which a replay would wait on"
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            return "the optimizer cannot skip a non-finite update on the device (fused=True Adam, AdamW or SGD can)"
        if trainer.config.grad_clip is not None:
            return "grad_clip is set"
        if not guard._grads_uniform:
            return "the trained tensors are not all of one dtype and device"
        if step_hooks_registered(optimizer):
            return "optimizer step hooks are registered: a replay would not run them"
        return None

    def _built_from(self) -> tuple[Any, ...]:
        """What the graph points at or was recorded with that a load, an eager step or the user
        may replace without the weights' tensors changing: the optimizer's state dict (its
        ``load_state_dict`` makes a new one), the buffers' saved copies and the buffers, the loss
        function, the model's mode, whether optimizer step hooks are registered (a replay runs
        none). Compared by identity, a step at a time (~1 µs for a model without buffers)."""
        trainer = self.trainer
        guard, optimizer = trainer.guard, trainer.optimizer
        buffers = guard.buffers_before
        return (optimizer.state, buffers._saved, trainer.loss_fn, trainer.model.training,
                step_hooks_registered(optimizer),
                *[owner._buffers[name] for owner, name in buffers.slots])

    def _still_valid(self) -> bool:
        """Whether the graph may replay the next step: no rollback or retarget since it was
        captured, the optimizer's values the same, and nothing of :meth:`_built_from` replaced."""
        built_from = self._built_from()
        return (self.trainer.guard.restores == self._restores
                and hyperparameters(self.trainer.optimizer) == self._constants
                and len(built_from) == len(self._built) and all(a is b for a, b in zip(built_from, self._built)))

    @property
    def captured(self) -> bool:
        return self._replay is not None

    def drop(self) -> None:
        """Forget the graph (its memory goes with it); the next eligible steps warm up and capture again."""
        self._replay = self._row = self._ring = None
        self._static, self._layout, self._warm, self._keep, self._built = [], None, 0, (), ()
        self._warm_layout, self._misses = None, 0

    def statistics(self) -> dict[str, Any]:
        return dict(captures=self.captures, replays=self.replays, captured=self.captured, off_reason=self.off_reason)

    # ================================================================================ step ====
    def step(self, batch: Any) -> Any:
        """One steady step of the trainer: replayed, captured and replayed, or eager."""
        trainer = self.trainer
        guard = trainer.guard
        if guard.deferred is not None and guard.deferred.due:
            trainer._settle()  # a ring slot a queued step: none is taken twice before the read
        if self.off_reason is not None or not guard.defers() or guard.snapshot_due is not None:
            return trainer._steady_step(batch)  # eager: nothing to capture, or a good state to take first
        if self._replay is not None and not self._still_valid():
            self.drop()  # the state it points at may be new tensors, or its constants changed
        leaves, structure = _flatten(batch)
        layout = _layout(leaves, structure)
        if self._replay is None:
            # Captured on a batch shaped as the last warm-up step's: a loader's short last batch
            # falling on the capture would leave every later batch eager.
            if self._warm < WARMUP_STEPS or layout != self._warm_layout:
                self._warm += 1
                self._warm_layout = layout
                with self.graphs.warmup():
                    return trainer._steady_step(batch)
            # What the trainer was built with may have changed since (a hook registered later).
            why = self._why_not(trainer, self.graphs) or _not_capturable(leaves, trainer.device)
            if why is None and self.captures >= MAX_CAPTURES:
                why = (f"captured {self.captures} times: the learning rate or another value the graph holds changes "
                       f"too often (a scheduler), or the batches' shapes do")
            if why is not None:
                self.off_reason = why
                warn_user(f"HybridConfig.cuda_graph: steps run eagerly from step {trainer.step_count} ({why})")
                return trainer._steady_step(batch)
            self._capture(batch, leaves, layout)
            if self._replay is None:  # the capture failed: off for the run
                return trainer._steady_step(batch)
        elif layout != self._layout:
            # Another shape (a last short batch): the graph is kept, unless the batches no longer
            # fit it (MISSES_TO_DROP in a row), when it is captured again on theirs.
            self._misses += 1
            if self._misses >= MISSES_TO_DROP:
                self.drop()
            return trainer._steady_step(batch)
        self._misses = 0
        return trainer._captured_step(self, leaves)

    def replay(self, leaves: list[Any], result: Any) -> None:
        """The step on ``leaves`` (the batch's, as :func:`_flatten` gives them): its tensors
        copied into the graph's inputs, one replay, its values queued for the guard's read."""
        static = iter(self._static)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                buffer = next(static)
                if leaf is not buffer:
                    buffer.copy_(leaf)
        self._replay()
        self.replays += 1
        deferred = self.trainer.guard.deferred
        row = self._row
        if self._ring is None:
            self._ring = torch.empty((deferred.every, row.numel()), dtype=row.dtype, device=row.device)
        slot = self._ring[len(deferred.pending)]
        slot.copy_(row)  # the graph writes the next step's values where this one's are
        result.values_on_device(slot, has_norm=row.numel() > 1)
        deferred.pending.append((result, slot, row.numel() > 1))

    def _capture(self, batch: Any, leaves: list[Any], layout: tuple[Any, ...]) -> None:
        trainer = self.trainer
        guard, optimizer = trainer.guard, trainer.optimizer
        static_leaves = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        static_batch = tree_unflatten(static_leaves, tree_flatten(batch)[1])
        found = torch.zeros((), dtype=torch.float32, device=trainer.device)
        one = torch.ones((), dtype=torch.float32, device=trainer.device)

        def body() -> None:
            # What DeferredChecks.launch does after the steady step's backward, without its reads.
            trainer._drop_grads()  # the backward writes the gradients rather than adding to them
            guard.buffers_before.before_forward()
            loss = trainer._loss(static_batch)
            loss.backward()
            norms = guard.grad_norms()
            loss = loss.detach()
            values = [loss if loss.dtype is torch.float32 else loss.float(), *([] if norms is None else norms)]
            found.zero_()
            update_unless_non_finite(guard, values, found, one)
            self._row = torch.stack(values)

        # torch refuses to capture an update whose groups say capturable=False; the fused update
        # is the same kernel either way, and the flags are put back as the user set them.
        capturable = [group.get("capturable", False) for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["capturable"] = True
        try:
            replay = self.graphs.capture(body)
        except Exception as error:  # noqa: BLE001 - any capture failure: the run goes on eagerly
            self.off_reason = f"the step could not be captured ({type(error).__name__}: {error})"
            warn_user(f"HybridConfig.cuda_graph: steps run eagerly ({self.off_reason})")
            trainer._drop_grads()
            self.drop()
            return
        finally:
            for group, flag in zip(optimizer.param_groups, capturable):
                group["capturable"] = flag
        self._replay, self._layout = replay, layout
        self._static = [leaf for leaf in static_leaves if isinstance(leaf, torch.Tensor)]
        self._constants, self._restores, self._built = hyperparameters(optimizer), guard.restores, self._built_from()
        self.captures += 1
        self._keep = (static_batch, found, one)  # the graph holds their addresses, not the tensors


_PLAIN_VALUES = (int, float, bool, str, bytes, type(None))
_NOT_PLAIN = object()  # in a layout, a leaf that is neither a tensor nor a plain value (not compared)


def _flatten(batch: Any) -> tuple[Any, Any]:
    """The batch's leaves and its structure: a tuple or list of tensors as it is (what most
    loaders give: 1.2 µs for an ``(x, y)`` pair against tree_flatten's 7.1, timeit on one core),
    anything else through tree_flatten."""
    kind = type(batch)
    if (kind is tuple or kind is list) and all(type(leaf) is torch.Tensor for leaf in batch):
        return batch, (kind, len(batch))
    return tree_flatten(batch)


def _layout(leaves: list[Any], spec: Any) -> tuple[Any, ...]:
    """What a batch must share with the one the graph was captured with: its structure, its
    tensors' shapes, dtypes and devices, its other values."""
    return (spec, *[(leaf.shape, leaf.dtype, leaf.device) if isinstance(leaf, torch.Tensor)
                    else leaf if isinstance(leaf, _PLAIN_VALUES) else _NOT_PLAIN for leaf in leaves])




def _not_capturable(leaves: list[Any], device: torch.device) -> str | None:
    """Why a batch with these leaves cannot be the graph's input (a tensor off ``device``, a value
    that is neither a tensor nor a plain scalar, which the graph would hold as it was), or None."""
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if leaf.device != device:
                return (f"a batch tensor is on {leaf.device}, the model on {device}: the graph reads its inputs "
                        f"from tensors on the device; move the batch there before trainer.step")
        elif not isinstance(leaf, _PLAIN_VALUES):
            return (f"the batch holds a {type(leaf).__name__}: a graph takes tensors on the device and plain "
                    f"values (numbers, strings) that stay the same")
    return None

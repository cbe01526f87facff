"""Large linear layers' weight-gradient norms from two small Gram matrices, so that the guard's
per-step read on a CPU (:meth:`~hybrid_trainer.step_guard.StepGuard.read_step_values`) need not
read those gradients from memory.

For ``y = x W^T + b`` over N rows (``x``: N x in, and ``G``, the gradient reaching ``y``: N x out)
the weight's gradient is ``G^T x``, and

    ||G^T x||_F^2 = <G G^T, x x^T>_F

so its squared norm costs two N x N Gram matrices, N^2 (in + out) multiply-adds on tensors the
backward has just used, instead of a pass over in x out gradient entries in memory. The identity is
the "ghost norm" of per-example gradient clipping (Goodfellow 2015, "Efficient per-example gradient
computations"; Li et al. 2022, "Large language models can be strong differentially private
learners", whose rule compares N^2 with the layer's size); here it is taken once, for the whole
batch's gradient. It pays where the read is the largest share of a step: large layers and few
rows, where the step itself is bound by memory (``bench.overhead``'s 51M-parameter MLP, 8 rows a
step: reading its 205 MB of gradients took 17-35 ms of a 0.84-1.0 s step). Where N is large the
step's matrix products dwarf the read and the rule below leaves the layer to it.

Why a gradient taken this way may skip the guard's read (whose promise is that no NaN or Inf in a
gradient reaches the weights):

* Finite. Every entry of ``G^T x`` and every partial sum a matrix product forms of it is at most
  ||G||_F ||x||_F in magnitude (Cauchy-Schwarz). The traces of the two Grams are those squared
  norms; a NaN or an Inf in a row makes that row's diagonal entry (the row's dot product with
  itself) and so the trace non-finite. So when both traces are finite and the square root of
  their product is far below the dtype's largest value (:data:`BOUND_MARGIN`), every entry of the
  gradient is finite. Otherwise the gradient is read as every other one is.
* Exactly ``G^T x``. The layer is an ``nn.Linear`` running ``nn.Linear.forward``, its weight is
  its own parameter (not tied to another module's, not parametrized) with no hook that could change
  its gradient, and its gradient is None before the forward (nothing to accumulate onto). In the
  step the layer ran once, and its weight is used nowhere else in the graph: walking the graph from
  the loss finds one edge into the weight's gradient accumulator. ``x`` is the input the layer's
  forward received (this module's forward hook runs first among the layer's), ``G`` what the
  layer's output node receives (a pre-hook on that node: it runs after every tensor hook on the
  output).
* Only while armed, which the trainer does for a steady step (one forward, one backward, no
  DistributedDataParallel, GradScaler, micro-batches, or update inside the backward), and only on
  the CPU, where reading the three figures waits for nothing.

The norm differs from a direct read in its rounding only (float32 Gram products of length in and
out against a dot product over in x out entries; the tests hold them to 1e-5 relative).
"""
from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn

# Layers whose weight holds at least this many entries (4 MiB in float32, beyond a core's L2
# cache, where a read costs ~0.2 ms or more) get the hooks; smaller ones are read.
GRAM_MIN_ENTRIES = 1 << 20
# The Grams are taken while N^2 (in + out) <= in x out (GramNorms._forward): multiply-adds on
# data in cache against entries read from memory, which cost several times more each (so the
# rule leaves a margin). The 51M MLP's layers (N = 8, 3584 x 3584): 0.46M against 12.8M.
# How far below the dtype's largest value ||G||_F ||x||_F must stay: rounding grows a partial sum
# by a factor (1 + eps)^N at most, far below 16 for any N the rule admits.
BOUND_MARGIN = 16.0

_AccumulateGrad = torch._C._functions.AccumulateGrad  # the node that writes a leaf's .grad
GRAM_DTYPES = (torch.float32, torch.float64)


def candidate_layers(module: nn.Module, params: list[torch.Tensor],
                     min_entries: int = GRAM_MIN_ENTRIES) -> list[nn.Linear]:
    """The layers of ``module`` whose weight gradient :class:`GramNorms` may take: ``nn.Linear``
    (or a subclass keeping its forward) on the CPU, a float32/float64 weight among ``params`` (the
    guarded parameters) of at least ``min_entries`` entries, held by no other module, not
    parametrized. Each layer once."""
    guarded = {id(p) for p in params}
    holders: dict[int, int] = {}
    for sub in module.modules():
        for p in sub._parameters.values():
            if p is not None:
                holders[id(p)] = holders.get(id(p), 0) + 1
    layers, seen = [], set()
    for sub in module.modules():
        weight = sub._parameters.get("weight") if isinstance(sub, nn.Linear) else None
        if (weight is None or id(sub) in seen or type(sub).forward is not nn.Linear.forward
                or hasattr(sub, "parametrizations") or id(weight) not in guarded or holders[id(weight)] != 1
                or weight.device.type != "cpu" or weight.dtype not in GRAM_DTYPES or weight.numel() < min_entries):
            continue
        seen.add(id(sub))
        layers.append(sub)
    return layers


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def edges_into(root: Any, watched: set[int]) -> dict[int, int]:
    """How many edges of the autograd graph below ``root`` (a ``grad_fn``) lead into the gradient
    accumulator of each leaf whose ``id`` is in ``watched``: more than one means the leaf is used
    more than once and its gradient is a sum."""
    counts: dict[int, int] = {}
    # The nodes seen are kept, not only their ids: a Python wrapper of a C++ node can live only
    # while referenced, and one freed after its expansion gives its address, so its id, to the
    # next wrapper made; that node, taken for one already seen, would not be walked and its edges
    # would go uncounted (torch 2.11 on the lent GPU machine counted fewer edges than the graph
    # has, every Gram refused or, with a weight used twice, one use's square taken for the sum).
    seen, stack = {id(root): root}, [root]
    while stack:
        for node, _ in stack.pop().next_functions:
            if node is None:
                continue
            if type(node) is _AccumulateGrad:
                key = id(node.variable)
                if key in watched:
                    counts[key] = counts.get(key, 0) + 1
            elif id(node) not in seen:
                seen[id(node)] = node
                stack.append(node)
    return counts


class GramNorms:
    """Hooks on the large linear layers of a model that take each one's squared weight-gradient
    norm from two Gram matrices during the backward (see the module docstring).

    Args:
        module: the model (unwrapped).
        params: the guarded parameters.
        min_entries: the smallest weight that gets the hooks (:data:`GRAM_MIN_ENTRIES`).

    Per step: :meth:`arm` before the forward, :meth:`finish` with the loss after the backward,
    :meth:`take` for the squares that stood every check. ``taken`` counts the gradients whose
    squares were taken this way over the run (what a test can see). :meth:`remove` takes the
    hooks off the model (also done when the object is collected).
    """

    def __init__(self, module: nn.Module, params: list[torch.Tensor], min_entries: int = GRAM_MIN_ENTRIES):
        self.layers = candidate_layers(module, params, min_entries)
        self.weights = [layer.weight for layer in self.layers]
        self.limits = [torch.finfo(w.dtype).max / BOUND_MARGIN for w in self.weights]
        self.armed = False
        self.taken = 0
        self._calls = [0] * len(self.layers)
        self._inputs: dict[int, torch.Tensor] = {}
        self._sums: dict[int, torch.Tensor] = {}
        self._squares: dict[int, float] = {}
        self._handles: list[Any] = []
        # The hooks hold this object through a weak reference (_LayerHook): a model outliving its
        # trainer keeps no trainer state alive, and the finalizer takes the hooks off.
        for index, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_hook(_LayerHook(self, index, "_forward"), prepend=True))
        self._finalizer = weakref.finalize(self, _remove, self._handles)

    def __bool__(self) -> bool:
        return bool(self.layers)

    def arm(self, on: bool = True) -> None:
        """Start a step (``on``) or make sure none is captured (not ``on``: a step the Grams are
        not for, e.g. with several micro-batches)."""
        self.armed = on
        self._calls = [0] * len(self.layers)
        self._inputs.clear()
        self._sums.clear()
        self._squares = {}

    def finish(self, loss: torch.Tensor) -> None:
        """After the step's backward of ``loss``: keep the squares of the gradients that stood
        every check (:meth:`take` hands them over) and disarm."""
        sums, self._sums = self._sums, {}
        self._inputs.clear()
        self.armed = False
        self._squares = {}
        if not sums or loss.grad_fn is None:
            return
        edges = edges_into(loss.grad_fn, {id(self.weights[i]) for i in sums})
        squares = {}
        for index, values in sums.items():
            weight = self.weights[index]
            if (self._calls[index] != 1 or edges.get(id(weight)) != 1 or weight.grad is None
                    or weight._backward_hooks or weight._post_accumulate_grad_hooks):
                continue
            trace_g, trace_x, square = values.tolist()
            if not (math.isfinite(trace_g) and math.isfinite(trace_x) and math.isfinite(square)):
                continue  # a NaN or Inf in G or x, or an overflow: the gradient is read
            if math.sqrt(trace_g) * math.sqrt(trace_x) > self.limits[index]:
                continue  # an entry might overflow: read it
            squares[id(weight)] = max(square, 0.0)  # >= 0 in exact arithmetic (two PSD matrices)
        self._squares = squares

    def take(self) -> dict[int, float]:
        """The squared norms :meth:`finish` kept, by ``id`` of the weight; emptied by the call."""
        squares, self._squares = self._squares, {}
        self.taken += len(squares)
        return squares

    def remove(self) -> None:
        """Take the hooks off the model."""
        self.arm(False)
        self._finalizer()

    # ---- hooks -------------------------------------------------------------------------
    def _forward(self, index: int, layer: nn.Linear, args: tuple[Any, ...], output: Any) -> None:
        self._calls[index] += 1
        if self._calls[index] > 1:  # a second call: the weight's gradient is a sum
            self._inputs.pop(index, None)
            self._sums.pop(index, None)
            return
        weight = self.weights[index]
        x = args[0] if args else None
        if (not isinstance(x, torch.Tensor) or not isinstance(output, torch.Tensor) or output.grad_fn is None
                or x.dtype != weight.dtype or weight.grad is not None or nn.modules.module._global_forward_hooks):
            return
        rows = x.numel() // layer.in_features
        if rows * rows * (layer.in_features + layer.out_features) > weight.numel():
            return  # the Grams would cost more than reading the gradient
        self._inputs[index] = x.detach().reshape(rows, layer.in_features)
        output.grad_fn.register_prehook(_LayerHook(self, index, "_output_grad"))

    def _output_grad(self, index: int, grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        x = self._inputs.pop(index, None)
        if x is None:  # a second backward through this output: the weight's gradient is a sum
            self._sums.pop(index, None)
            return
        g = grad_outputs[0] if grad_outputs else None
        if g is None or g.dtype != x.dtype:
            return
        g = g.reshape(-1, g.shape[-1])
        if g.shape[0] != x.shape[0]:
            return
        with torch.no_grad():
            gram_g, gram_x = torch.mm(g, g.t()), torch.mm(x, x.t())
            self._sums[index] = torch.stack((gram_g.trace(), gram_x.trace(),
                                             torch.dot(gram_g.view(-1), gram_x.view(-1))))


class _LayerHook:
    """One layer's hook into its :class:`GramNorms` (``method``, called with the layer's
    ``index`` and the hook's arguments while armed), through a weak reference. Copied or pickled
    with the model (``copy.deepcopy``, ``torch.save(model)``) it becomes inert: a copy of the
    model is not the one the trainer guards."""

    __slots__ = ("ref", "index", "method")

    def __init__(self, grams: GramNorms | None, index: int, method: str):
        self.ref = None if grams is None else weakref.ref(grams)
        self.index, self.method = index, method

    def __call__(self, *args: Any) -> None:
        grams = None if self.ref is None else self.ref()
        if grams is not None and grams.armed:
            getattr(grams, self.method)(self.index, *args)

    def __reduce__(self) -> tuple[Any, ...]:
        return _LayerHook, (None, self.index, self.method)

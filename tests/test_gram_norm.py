"""The guard's Gram-matrix norms of large linear layers' weight gradients (hybrid_trainer/gram_norm.py).

What must hold: the squared norm taken from the two Grams equals the gradient's own (to rounding);
it is taken only where the gradient is exactly ``G^T x`` of one call and provably finite, and every
other case falls back to reading the gradient, so a NaN or an Inf still never reaches the weights;
the trainer's steady step makes the same decisions and leaves the same weights as a trainer that
reads every gradient; the hooks leave the model with the trainer.
"""
import copy
import gc
import io
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

from hybrid_trainer import HybridConfig, HybridTrainer
from hybrid_trainer.gram_norm import GRAM_MIN_ENTRIES, GramNorms, candidate_layers, edges_into

pytestmark = pytest.mark.usefixtures("eager_backend")

WIDE = 1024  # a 1024 x 1024 weight holds GRAM_MIN_ENTRIES entries: the smallest layer the trainer hooks


def square(t: torch.Tensor) -> float:
    return t.double().pow(2).sum().item()


def grams_of(layer: nn.Module, x: torch.Tensor, weights: torch.Tensor | None = None) -> tuple[dict, GramNorms]:
    """One armed step of ``layer`` on ``x`` (loss: the output against fixed weights), its gradients
    set to None first: the squares kept."""
    layer.zero_grad(set_to_none=True)
    grams = GramNorms(layer, list(layer.parameters()), min_entries=0)
    grams.arm()
    out = layer(x)
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out) if weights is None else weights
    loss = (out * w).sum()
    loss.backward()
    grams.finish(loss)
    return grams.take(), grams


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 4), width_in=st.integers(8, 48), width_out=st.integers(8, 48),
       three_d=st.booleans(), double=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_gram_square_equals_the_gradient_read(rows, width_in, width_out, three_d, double, seed):
    assume(rows * rows * (width_in + width_out) <= width_in * width_out)
    torch.manual_seed(seed)
    dtype = torch.float64 if double else torch.float32
    layer = nn.Linear(width_in, width_out).to(dtype)
    x = torch.randn(1, rows, width_in, dtype=dtype) if three_d else torch.randn(rows, width_in, dtype=dtype)
    squares, _ = grams_of(layer, x)
    assert list(squares) == [id(layer.weight)]
    assert squares[id(layer.weight)] == pytest.approx(square(layer.weight.grad), rel=1e-12 if double else 1e-5)


def test_too_many_rows_for_the_grams_leaves_the_gradient_to_the_read():
    layer = nn.Linear(16, 16)
    squares, _ = grams_of(layer, torch.randn(9, 16))  # 81 * 32 > 256
    assert squares == {}
    squares, _ = grams_of(layer, torch.randn(2, 16))
    assert list(squares) == [id(layer.weight)]


def test_a_gradient_to_accumulate_onto_makes_it_read():
    layer = nn.Linear(16, 16)
    layer(torch.randn(2, 16)).sum().backward()
    grams = GramNorms(layer, list(layer.parameters()), min_entries=0)
    grams.arm()
    loss = layer(torch.randn(2, 16)).sum()
    loss.backward()
    grams.finish(loss)
    assert grams.take() == {}


def test_non_finite_input_or_output_gradient_falls_back_to_the_read():
    layer = nn.Linear(16, 16)
    x = torch.randn(2, 16)
    x[1, 3] = float("nan")
    assert grams_of(layer, x)[0] == {}
    assert math.isnan(square(layer.weight.grad))  # what the read then finds
    layer = nn.Linear(16, 16)
    w = torch.ones(2, 16)
    w[0, 0] = float("inf")
    assert grams_of(layer, torch.randn(2, 16), weights=w)[0] == {}
    assert not math.isfinite(square(layer.weight.grad))


def test_the_overflow_bound_decides_before_any_entry_can_overflow():
    layer = nn.Linear(16, 16, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    # ||G|| ||x|| = 1.6e16, far below float32's 3.4e38: taken, and every entry is finite.
    squares, _ = grams_of(layer, torch.full((1, 16), 1e12), weights=torch.full((1, 16), 1e3))
    assert list(squares) == [id(layer.weight)] and torch.isfinite(layer.weight.grad).all()
    assert squares[id(layer.weight)] == pytest.approx(square(layer.weight.grad), rel=1e-5)
    # Entries finite (1e21) but their squares' sum overflows float32: read, as the read overflows too.
    assert grams_of(layer, torch.full((1, 16), 1e18), weights=torch.full((1, 16), 1e3))[0] == {}
    # Both traces finite (1e38 each) but ||G|| ||x|| = 1e38 > max / 16: read instead, though finite here.
    big = math.sqrt(1e38 / 16)
    squares, _ = grams_of(layer, torch.full((1, 16), big), weights=torch.full((1, 16), big))
    assert squares == {}
    # Entries that do overflow: a trace is Inf, read, and the read finds the Inf.
    squares, _ = grams_of(layer, torch.full((1, 16), 1e19), weights=torch.full((1, 16), 1e20))
    assert squares == {} and not torch.isfinite(layer.weight.grad).all()


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(16, 16)

    def forward(self, x):
        return self.layer(torch.tanh(self.layer(x)))


class ReusedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(16, 16)

    def forward(self, x):
        return self.layer(x) + F.linear(x, self.layer.weight)


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool = True):
        super().__init__()
        self.layer, self.reentrant = nn.Linear(16, 16), reentrant

    def forward(self, x):
        return checkpoint(self.layer, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("model", [Twice, ReusedWeight, Checkpointed])
def test_a_weight_used_more_than_once_or_out_of_the_graph_is_read(model):
    """Called twice, used again by another op, or (reentrant checkpointing) used in an inner
    backward the loss's graph does not reach: read."""
    torch.manual_seed(0)
    module = model()
    x = torch.randn(2, 16, requires_grad=True)  # reentrant checkpointing needs an input that requires grad
    squares, _ = grams_of(module, x)
    assert squares == {}
    once = nn.Linear(16, 16)  # the same layer used once is taken: the cases above differ in the use only
    assert list(grams_of(once, x)[0]) == [id(once.weight)]


def test_non_reentrant_checkpointing_keeps_the_one_use():
    """The recomputation stops once it has the saved tensors, before the layer's forward hooks:
    one call, one edge, and the Gram square of the gradient the original node produced."""
    torch.manual_seed(0)
    module = Checkpointed(reentrant=False)
    squares, _ = grams_of(module, torch.randn(2, 16))
    assert squares[id(module.layer.weight)] == pytest.approx(square(module.layer.weight.grad), rel=1e-5)


def test_a_second_backward_through_the_layer_makes_it_read():
    """A loss function that (against its contract) runs a backward of its own before returning:
    the weight's gradient is then the sum of two backwards, which one pair of Grams cannot give."""
    layer = nn.Linear(16, 16)
    grams = GramNorms(layer, list(layer.parameters()), min_entries=0)
    grams.arm()
    out = layer(torch.randn(2, 16))
    out.pow(2).sum().backward(retain_graph=True)
    loss = out.sum()
    loss.backward()
    grams.finish(loss)
    assert grams.take() == {}


def test_the_graph_walk_counts_every_edge_into_a_leaf():
    module = ReusedWeight()
    loss = module(torch.randn(2, 16)).sum()
    assert edges_into(loss.grad_fn, {id(module.layer.weight), id(module.layer.bias)}) == {
        id(module.layer.weight): 2, id(module.layer.bias): 1}


class ChurningNode:
    """An autograd node whose ``next_functions`` hands out a new wrapper object for each
    non-leaf child at every access, as torch may for a C++ node no one holds: a wrapper dropped
    after its expansion frees its address for the next one."""

    __slots__ = ("children",)  # small and of one size: a freed wrapper's memory is the next one's

    def __init__(self, children):
        self.children = children  # each a real AccumulateGrad node, or a tuple of grandchildren

    @property
    def next_functions(self):
        edges = []
        for child in self.children:
            edges.append((child if not isinstance(child, tuple) else ChurningNode(child), 0))
        return tuple(edges)


def test_the_graph_walk_counts_edges_when_node_wrappers_are_made_afresh():
    """Two paths into one weight, one a node deeper: with only the ids of the nodes it had seen,
    the walk took the deeper node's fresh wrapper, at the address of one it had dropped, for that
    one, and counted one edge, so a Gram square of one use passed for the summed gradient."""
    weight = nn.Parameter(torch.randn(4, 4))
    accumulate = (weight * 1.0).grad_fn.next_functions[0][0]
    root = ChurningNode((((accumulate,),), (accumulate,)))
    assert edges_into(root, {id(weight)}) == {id(weight): 2}


def test_a_hook_on_the_weight_makes_it_read():
    layer = nn.Linear(16, 16)
    layer.weight.register_hook(lambda g: g * 2)
    assert grams_of(layer, torch.randn(2, 16))[0] == {}


def test_a_global_forward_hook_makes_it_read():
    layer = nn.Linear(16, 16)
    handle = nn.modules.module.register_module_forward_hook(lambda module, args, out: out * 2)
    try:
        assert grams_of(layer, torch.randn(2, 16))[0] == {}
    finally:
        handle.remove()


def test_only_own_untied_large_weights_are_candidates():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.big = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(WIDE, WIDE)
            self.b.weight = self.a.weight
            self.small = nn.Linear(WIDE, 4)

    model = Tied()
    params = list(model.parameters())
    assert candidate_layers(model, params) == [model.big]
    assert candidate_layers(model, params, min_entries=0) == [model.big, model.small]
    assert candidate_layers(model, [p for p in params if p is not model.big.weight]) == []
    assert model.big.weight.numel() == GRAM_MIN_ENTRIES


def wide_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDE, WIDE), nn.ReLU(), nn.Linear(WIDE, WIDE), nn.ReLU(), nn.Linear(WIDE, 10))


def wide_batches(n: int, rows: int = 4, nan_at: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x = torch.randn(rows, WIDE, generator=gen)
        if i == nan_at:
            x[0, 0] = float("nan")
        out.append((x, torch.randint(0, 10, (rows,), generator=gen)))
    return out


def cross_entropy(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def wide_trainer(grams: bool, **config) -> HybridTrainer:
    model = wide_mlp(0)
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cross_entropy,
                            HybridConfig(predict=False, good_state_every=4, **config))
    if not grams:
        trainer.guard.close()
    return trainer


def test_trainer_steps_with_grams_as_with_every_gradient_read():
    """Same weights bit for bit, the same decisions (a NaN batch refused), norms to rounding; the
    two wide layers' gradients taken from Grams on every accepted step."""
    stream = wide_batches(9, nan_at=5)
    with_grams, read_all = wide_trainer(True), wide_trainer(False)
    assert read_all.guard.gram is None and len(with_grams.guard.gram.layers) == 2
    for batch in stream:
        a, b = with_grams.step(batch), read_all.step(batch)
        assert (a.skipped, a.divergence, a.rolled_back) == (b.skipped, b.divergence, b.rolled_back)
        if b.grad_norm is not None and math.isfinite(b.grad_norm):
            assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
    assert with_grams.stats.skipped_steps == read_all.stats.skipped_steps == 1
    assert with_grams.guard.gram.taken == 2 * 8  # the NaN batch's Grams were not finite: read
    for p, q in zip(with_grams.model.parameters(), read_all.model.parameters()):
        assert torch.equal(p, q)


def test_a_nan_gradient_behind_a_wide_layer_is_refused():
    class NanBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return torch.full_like(g, float("nan"))

    calls = {"n": 0}

    def loss_fn(model, batch):
        calls["n"] += 1
        hidden = model[0](batch[0])
        if calls["n"] == 3:
            hidden = NanBackward.apply(hidden)
        return F.cross_entropy(model[4](model[3](model[2](model[1](hidden)))), batch[1])

    model = wide_mlp(0)
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn,
                            HybridConfig(predict=False))
    results = [trainer.step(batch) for batch in wide_batches(2)]
    before = [p.detach().clone() for p in model.parameters()]
    refused = trainer.step(wide_batches(3)[2])
    assert refused.skipped and not math.isfinite(refused.grad_norm)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    # Two wide layers on each clean step; on the refused one the layer behind the NaN was taken
    # (its gradient is finite), the first layer's NaN gradient was read.
    assert not any(r.skipped for r in results) and trainer.guard.gram.taken == 2 + 2 + 1


def test_the_general_path_does_not_take_grams():
    model = wide_mlp(0)
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cross_entropy,
                            HybridConfig(grad_accumulation=2, predict=False))
    for x, y in wide_batches(3):
        trainer.step([(x[:2], y[:2]), (x[2:], y[2:])])
    assert trainer.guard.gram.taken == 0 and trainer.stats.optimizer_steps == 3


def test_hooks_leave_the_model_with_close_and_with_the_trainer():
    trainer = wide_trainer(True)
    model = trainer.model
    trainer.step(wide_batches(1)[0])
    assert len(model[0]._forward_hooks) == 1
    trainer.close()
    assert len(model[0]._forward_hooks) == 0 and trainer.guard.gram is None
    trainer.guard.retarget(trainer.params, [], model)  # a change of the trained set after close
    assert len(model[0]._forward_hooks) == 0 and trainer.guard.gram is None
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cross_entropy,
                            HybridConfig(predict=False))
    assert len(model[2]._forward_hooks) == 1
    del trainer
    gc.collect()
    assert len(model[2]._forward_hooks) == 0


def test_a_copied_or_pickled_model_carries_inert_hooks():
    """``copy.deepcopy(model)`` or ``torch.save(model)`` while a trainer guards it: the copy's
    hooks call nothing, even during the trainer's step (a teacher copy run inside the loss)."""
    trainer = wide_trainer(True)
    torch.save(trainer.model, io.BytesIO())
    twin = copy.deepcopy(trainer.model)

    def with_twin(model, batch):
        return cross_entropy(model, batch) + 0.0 * cross_entropy(twin, batch)

    trainer.loss_fn = with_twin
    trainer.step(wide_batches(1)[0])
    assert trainer.guard.gram.taken == 2  # the twin's calls of its layers were not counted as the model's

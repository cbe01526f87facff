"""GradientCheckpointing: same gradients as the plain model, less saved memory, clean removal."""
import copy

import pytest
import torch
from torch import nn

import hybrid_trainer.grad_checkpoint as grad_checkpoint
from bench.tasks import CharGPT, GPTBlock, next_char_loss
from hybrid_trainer.grad_checkpoint import GradientCheckpointing

VOCAB, CONTEXT = 23, 16


@pytest.fixture(autouse=True)
def eager(monkeypatch):
    # The CPU production path; the Triton interpreter would only make these tests slow.
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", "eager")


def small_gpt(n_layers: int = 3, seed: int = 0) -> CharGPT:
    torch.manual_seed(seed)
    return CharGPT(VOCAB, d_model=32, n_heads=2, n_layers=n_layers, context=CONTEXT)


def char_batch(batch: int = 4, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, CONTEXT + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def grads_of(model: nn.Module, loss_fn, batch) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()]


def saved_bytes(model: nn.Module, loss_fn, batch) -> int:
    """Bytes of the distinct storages autograd saves for backward during one forward."""
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(model, batch)
    return sum(storages.values())


@pytest.fixture
def count_checkpoint_calls(monkeypatch):
    calls = []
    real = grad_checkpoint.checkpoint

    def counting(*args, **kwargs):
        calls.append(kwargs.get("use_reentrant"))
        return real(*args, **kwargs)

    monkeypatch.setattr(grad_checkpoint, "checkpoint", counting)
    return calls


def test_chargpt_gradients_identical_to_unwrapped():
    reference = small_gpt()
    wrapped_model = copy.deepcopy(reference)
    batch = char_batch()
    checkpointing = GradientCheckpointing(wrapped_model, module_type=GPTBlock)
    assert checkpointing.wrapped == ["blocks.0", "blocks.1", "blocks.2"]
    loss_ref, grads_ref = grads_of(reference, next_char_loss, batch)
    loss_ckpt, grads_ckpt = grads_of(wrapped_model, next_char_loss, batch)
    assert loss_ckpt == loss_ref
    for (name, _), a, b in zip(reference.named_parameters(), grads_ref, grads_ckpt):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)


def test_dropout_gradients_identical_because_rng_is_replayed():
    torch.manual_seed(0)
    reference = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.3), nn.GELU()) for _ in range(3)],
                              nn.Linear(16, 4))
    wrapped_model = copy.deepcopy(reference)
    GradientCheckpointing(wrapped_model, modules=["0", "1", "2"])
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def loss_fn(model, batch):
        return nn.functional.cross_entropy(model(batch[0]), batch[1])

    torch.manual_seed(5)
    _, grads_ref = grads_of(reference, loss_fn, (x, y))
    torch.manual_seed(5)
    _, grads_ckpt = grads_of(wrapped_model, loss_fn, (x, y))
    for a, b in zip(grads_ref, grads_ckpt):
        assert torch.equal(a, b)


def test_saved_tensor_bytes_drop_when_active():
    model, batch = small_gpt(n_layers=4), char_batch(batch=8)
    plain = saved_bytes(model, next_char_loss, batch)
    checkpointing = GradientCheckpointing(model, module_type=GPTBlock)
    active = saved_bytes(model, next_char_loss, batch)
    checkpointing.active = False
    inactive = saved_bytes(model, next_char_loss, batch)
    assert inactive == plain
    assert active < 0.4 * plain, (active, plain)


def test_inactive_and_no_grad_run_plain_forwards(count_checkpoint_calls):
    model, batch = small_gpt(), char_batch()
    checkpointing = GradientCheckpointing(model, module_type=GPTBlock)
    with torch.no_grad():
        no_grad_loss = next_char_loss(model, batch)
    assert count_checkpoint_calls == []
    checkpointing.active = False
    next_char_loss(model, batch).backward()
    assert count_checkpoint_calls == []
    checkpointing.active = True
    loss = next_char_loss(model, batch)
    assert count_checkpoint_calls == [False, False, False]  # one per block, non-reentrant
    assert float(loss.detach()) == float(no_grad_loss)


def test_unknown_module_name_is_named_with_close_matches():
    model = small_gpt()
    with pytest.raises(ValueError, match=r"'blocks\.7'.*close matches: \[.*'blocks\.") as err:
        GradientCheckpointing(model, modules=["blocks.0", "blocks.7"])
    suggestions = str(err.value).split("close matches: ")[1]
    assert "'blocks.2'" in suggestions and suggestions.count("'") <= 2 * 5  # at most 5 names
    with pytest.raises(ValueError, match="'zzzz'.*no close matches"):
        GradientCheckpointing(model, modules=["zzzz"])
    assert "forward" not in vars(model.blocks[0])  # a failed construction wraps nothing


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "exactly one"),
    (dict(modules=["blocks.0"], module_type=GPTBlock), "exactly one"),
    (dict(module_type=GPTBlock, every_nth=0), "every_nth"),
    (dict(module_type=nn.Conv2d), "no submodule of type"),
    (dict(modules=["blocks.0", "blocks.0"]), "twice"),
])
def test_invalid_selection_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GradientCheckpointing(small_gpt(), **kwargs)


def test_type_selection_with_every_nth():
    model = small_gpt(n_layers=5)
    assert GradientCheckpointing(model, module_type=GPTBlock, every_nth=2).wrapped == ["blocks.1", "blocks.3"]
    model = small_gpt(n_layers=5)
    assert GradientCheckpointing(model, module_type=GPTBlock, every_nth=5).wrapped == ["blocks.4"]
    model = small_gpt(n_layers=2)
    selected = GradientCheckpointing(model, module_type=(nn.LayerNorm,), every_nth=2)
    assert selected.wrapped == ["blocks.0.ln2", "blocks.1.ln2"]  # 4 block norms + ln_f: the 2nd and 4th
    model = small_gpt(n_layers=4)
    by_name = GradientCheckpointing(model, modules=["blocks.3", "blocks.2", "blocks.0"], every_nth=2)
    assert by_name.wrapped == ["blocks.2"]
    assert "forward" in vars(model.blocks[2]) and "forward" not in vars(model.blocks[3])


def test_remove_restores_forwards_and_state_dict_is_untouched(count_checkpoint_calls):
    model, batch = small_gpt(), char_batch()
    before = model.state_dict()
    checkpointing = GradientCheckpointing(model, module_type=GPTBlock)
    during = model.state_dict()
    assert list(during) == list(before) and all(torch.equal(during[k], before[k]) for k in before)
    model.load_state_dict(before)  # loading works while wrapped
    checkpointing.remove()
    assert checkpointing.wrapped == []
    assert all("forward" not in vars(block) for block in model.blocks)
    next_char_loss(model, batch).backward()
    assert count_checkpoint_calls == []
    checkpointing.remove()  # idempotent
    GradientCheckpointing(model, module_type=GPTBlock)  # can wrap again after removal


def test_wrapping_twice_is_refused():
    model = small_gpt()
    GradientCheckpointing(model, modules=["blocks.1"])
    with pytest.raises(ValueError, match="'blocks.1' already has an instance-level forward"):
        GradientCheckpointing(model, module_type=GPTBlock)


def test_deepcopy_of_wrapped_model_trains_the_copy():
    model, batch = small_gpt(), char_batch()
    GradientCheckpointing(model, module_type=GPTBlock)
    clone = copy.deepcopy(model)
    assert clone.blocks[0].forward.module is clone.blocks[0]
    next_char_loss(clone, batch).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None for p in clone.blocks.parameters())

"""The trainer's call of the optimizer update (hybrid_trainer/optimizer_call.py): the same
update as ``optimizer.step()``, bit for bit; torch's profiler scope left out only while no
profiler records; hooks, a scheduler's counting wrapper and a user's own ``step`` honoured."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from hybrid_trainer import HybridConfig, HybridTrainer
from hybrid_trainer.optimizer_call import OptimizerStep


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def _batches(n: int = 6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(n)]


def _count_scopes(monkeypatch) -> list[str]:
    """Names of the profiler scopes torch's optimizer wrapper opens from now on."""
    opened: list[str] = []
    original = torch.autograd.profiler.record_function

    def counting(name, *args, **kwargs):
        opened.append(name)
        return original(name, *args, **kwargs)

    monkeypatch.setattr(torch.autograd.profiler, "record_function", counting)
    return opened


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
], ids=["adamw", "sgd-nesterov", "adam-foreach"])
def test_the_update_is_bit_for_bit_that_of_optimizer_step(make):
    runs = []
    for lean in (False, True):
        model = _model()
        optimizer = make(model.parameters())
        call = OptimizerStep(optimizer)
        for batch in _batches():
            optimizer.zero_grad(set_to_none=True)
            _loss(model, batch).backward()
            if lean:
                assert call.lean()
                call()
            else:
                optimizer.step()
        state = [t.clone() for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        runs.append(([p.detach().clone() for p in model.parameters()], state))
    for a, b in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1]):
        assert torch.equal(a, b)


def test_no_profiler_scope_unless_a_profiler_records(monkeypatch):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    call = OptimizerStep(optimizer)
    opened = _count_scopes(monkeypatch)
    _loss(model, _batches(1)[0]).backward()
    call()
    assert opened == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert not call.lean()
        call()
    assert opened == ["Optimizer.step#AdamW.step"]


def test_step_hooks_run_once_each(monkeypatch):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    call = OptimizerStep(optimizer)
    seen: list[str] = []
    pre = optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append("pre"))
    post = optimizer.register_step_post_hook(lambda opt, args, kwargs: seen.append("post"))
    glob = register_optimizer_step_post_hook(lambda opt, args, kwargs: seen.append("global"))
    try:
        _loss(model, _batches(1)[0]).backward()
        call()
        assert seen == ["pre", "post", "global"]
    finally:
        pre.remove(), post.remove(), glob.remove()
    seen.clear()
    assert call.lean()  # the hooks gone, the scope goes too
    call()
    assert seen == []


def test_a_step_replaced_on_the_instance_or_class_is_the_one_called(monkeypatch):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    call = OptimizerStep(optimizer)
    calls: list[str] = []
    optimizer.step = lambda: calls.append("instance")
    assert not call.lean()
    call()
    assert calls == ["instance"]
    del optimizer.step
    monkeypatch.setattr(torch.optim.SGD, "step", lambda self, closure=None: calls.append("class"))
    assert not call.lean()
    call()
    assert calls == ["instance", "class"]


def test_an_optimizer_outside_torchs_wrapper_is_stepped_as_usual():
    class Plain:  # duck-typed: no Optimizer.__init__, no hooked step
        def __init__(self):
            self.steps = 0

        def step(self):
            self.steps += 1

    optimizer = Plain()
    call = OptimizerStep(optimizer)  # type: ignore[arg-type]
    assert not call.lean()
    call()
    assert optimizer.steps == 1


def test_the_trainer_with_a_scheduler_steps_without_scope_or_warning(monkeypatch):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    trainer = HybridTrainer(model, optimizer, _loss, HybridConfig(predict=False, seed=0), scheduler=scheduler)
    opened = _count_scopes(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" among them
        for batch in _batches(5):
            trainer.step(batch)
    assert opened == []
    assert optimizer._opt_called
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** 2)


def test_the_trainer_matches_a_plain_loop_bit_for_bit_and_opens_no_scope(monkeypatch):
    batches = _batches(8)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        _loss(model, batch).backward()
        optimizer.step()
    trained = _model()
    trainer = HybridTrainer(trained, torch.optim.AdamW(trained.parameters(), lr=1e-2), _loss,
                            HybridConfig(predict=False, seed=0))
    opened = _count_scopes(monkeypatch)
    for batch in batches:
        trainer.step(batch)
    assert opened == []
    for a, b in zip(model.parameters(), trained.parameters()):
        assert torch.equal(a, b)

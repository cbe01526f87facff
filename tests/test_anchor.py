"""WeightAnchor: every storage restores the same bits into the same tensors."""
import copy

import pytest
import torch

from hybrid_trainer.anchor import STORAGES, WeightAnchor, buffer_slots


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, optimizer, steps=1):
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 5)).pow(2).mean().backward()
        optimizer.step()


def _optimizer_tensors(optimizer):
    return {(i, k): v for i, p in enumerate(optimizer.param_groups[0]["params"])
            for k, v in optimizer.state[p].items()}


@pytest.mark.parametrize("storage", STORAGES)
def test_restore_puts_back_weights_buffers_and_optimizer_state_bit_exactly_in_place(storage):
    model, optimizer = _model_and_optimizer()
    _train(model, optimizer)
    anchor = WeightAnchor(list(model.parameters()), buffers=buffer_slots(model), storage=storage)
    anchor.save(7, optimizer)
    weights = [p.detach().clone() for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    state = copy.deepcopy(optimizer.state_dict())
    storages = [p.data_ptr() for p in model.parameters()] + [t.data_ptr() for t in _optimizer_tensors(optimizer).values()]
    _train(model, optimizer, steps=3)
    anchor.restore(optimizer)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(torch.equal(b, s) for b, s in zip(model.buffers(), buffers))
    restored = optimizer.state_dict()["state"]
    for index, saved in state["state"].items():
        for key, value in saved.items():
            assert torch.equal(restored[index][key], value), (index, key)
    assert storages == [p.data_ptr() for p in model.parameters()] + \
        [t.data_ptr() for t in _optimizer_tensors(optimizer).values()]  # restored into the same memory
    assert anchor.step == 7


@pytest.mark.parametrize("source, target", [("file", "device"), ("device", "file"), ("host", "file")])
def test_state_dict_is_on_the_cpu_and_loads_into_any_storage(source, target):
    model, optimizer = _model_and_optimizer()
    _train(model, optimizer)
    anchor = WeightAnchor(list(model.parameters()), buffers=buffer_slots(model), storage=source)
    anchor.save(3, optimizer)
    weights = [p.detach().clone() for p in model.parameters()]
    state = anchor.state_dict()
    assert all(t.device.type == "cpu" for t in state["params"] + state["buffers"])
    other = WeightAnchor(list(model.parameters()), buffers=buffer_slots(model), storage=target)
    other.load_state_dict(state)
    _train(model, optimizer, steps=2)
    other.restore(optimizer)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert other.step == 3


def test_file_snapshot_holds_no_tensor_copy_and_release_forgets_it():
    model, optimizer = _model_and_optimizer()
    _train(model, optimizer)
    anchor = WeightAnchor(list(model.parameters()), buffers=buffer_slots(model), storage="file")
    anchor.save(1, optimizer)
    assert anchor._saved is None and anchor._buffers_saved == []  # the copies are in the file only
    assert anchor.is_set
    anchor.release()
    assert not anchor.is_set and anchor._file is None
    with pytest.raises(RuntimeError, match="before save"):
        anchor.restore(optimizer)


def test_file_restore_puts_back_a_buffer_reassigned_with_another_shape_and_a_dropped_optimizer_state():
    model, optimizer = _model_and_optimizer()
    anchor = WeightAnchor(list(model.parameters()), buffers=buffer_slots(model), storage="file")
    anchor.save(0, optimizer)  # before any step: no optimizer state yet
    batch_norm = model[1]
    saved_mean = batch_norm.running_mean.clone()
    _train(model, optimizer)
    batch_norm.running_mean = torch.zeros(3)  # reassigned with another shape
    anchor.restore(optimizer)
    assert torch.equal(batch_norm.running_mean, saved_mean)
    assert not optimizer.state  # the state the snapshot saw: none


def test_unknown_storage_is_refused():
    with pytest.raises(ValueError, match="storage"):
        WeightAnchor([torch.zeros(2)], storage="disk")


def _torchao_state(params):
    """An optimizer whose state is torchao's quantized moments (OptimState8bit for the first
    moment, OptimState4bit for the second), filled with random codes and scales as a step would
    leave them: built directly, so no torchao step (which compiles) is needed."""
    subclass_8bit = pytest.importorskip("torchao.optim.subclass_8bit")
    subclass_4bit = pytest.importorskip("torchao.optim.subclass_4bit")
    optimizer = torch.optim.SGD(params, lr=0.1)
    for p in params:
        m = subclass_8bit.OptimState8bit.zeros(p.shape, signed=True, block_size=128)
        v = subclass_4bit.OptimState4bit.zeros(p.shape, signed=False, block_size=128)
        optimizer.state[p] = {"exp_avg": m, "exp_avg_sq": v, "step": torch.tensor(3.0)}
    _scramble(optimizer)
    return optimizer


def _scramble(optimizer):
    """Changes every code and scale in place, as an optimizer step does."""
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            state[key].codes.copy_(torch.randint(0, 256, state[key].codes.shape, dtype=torch.uint8))
            state[key].scale.copy_(torch.rand(state[key].scale.shape))
        state["step"] += 1


def _inner(optimizer):
    return [(state[key].codes.clone(), state[key].scale.clone(), state["step"].clone())
            for state in optimizer.state.values() for key in ("exp_avg", "exp_avg_sq")]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


@pytest.mark.parametrize("storage", STORAGES)
def test_torchao_quantized_optimizer_state_is_restored_bit_exactly_in_place(storage):
    """torchao's 8/4-bit state (tensor subclasses with no empty_like, clone or byte view) is
    snapshotted through its inner tensors: restored bit for bit into the optimizer's own objects,
    and rebuilt when the optimizer replaced one with another layout since the snapshot."""
    params = [torch.nn.Parameter(torch.randn(16, 32)), torch.nn.Parameter(torch.randn(256))]
    optimizer = _torchao_state(params)
    anchor = WeightAnchor(params, storage=storage)
    anchor.save(5, optimizer)
    saved = _inner(optimizer)
    objects = [(id(s["exp_avg"]), s["exp_avg"].codes.data_ptr()) for s in optimizer.state.values()]
    _scramble(optimizer)
    assert not _same(_inner(optimizer), saved)
    anchor.restore(optimizer)
    assert _same(_inner(optimizer), saved)
    assert objects == [(id(s["exp_avg"]), s["exp_avg"].codes.data_ptr()) for s in optimizer.state.values()]
    # another block size (other scale shape): the snapshot rebuilds the saved object
    subclass_8bit = pytest.importorskip("torchao.optim.subclass_8bit")
    optimizer.state[params[1]]["exp_avg"] = subclass_8bit.OptimState8bit.zeros((256,), signed=True, block_size=256)
    anchor.restore(optimizer)
    assert _same(_inner(optimizer), saved)
    restored = optimizer.state[params[1]]["exp_avg"]
    assert type(restored) is subclass_8bit.OptimState8bit and restored.block_size == 128


@pytest.mark.parametrize("source, target", [("file", "device"), ("device", "file")])
def test_torchao_state_survives_the_anchor_state_dict(source, target):
    """The snapshot's state dict (what a checkpoint stores) holds torchao objects again, on the
    CPU; loaded into another anchor it restores the same bits."""
    params = [torch.nn.Parameter(torch.randn(16, 32))]
    optimizer = _torchao_state(params)
    anchor = WeightAnchor(params, storage=source)
    anchor.save(2, optimizer)
    saved = _inner(optimizer)
    state = anchor.state_dict()
    assert type(state["optimizer"][0]["exp_avg"]) is type(optimizer.state[params[0]]["exp_avg"])
    other = WeightAnchor(params, storage=target)
    other.load_state_dict(state)
    _scramble(optimizer)
    other.restore(optimizer)
    assert _same(_inner(optimizer), saved)


def test_a_background_file_write_keeps_the_buffers_as_they_were_and_every_read_waits_for_it(monkeypatch):
    import os
    import threading
    import time

    model, optimizer = _model_and_optimizer()
    _train(model, optimizer)
    anchor = WeightAnchor(list(model.parameters()), buffers=buffer_slots(model), storage="file")
    weights = [p.detach().clone() for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    write, threads = os.pwritev, []

    def slow_write(fd, views, offset):  # long enough that the caller runs on meanwhile
        threads.append(threading.current_thread().name)
        time.sleep(0.2)
        return write(fd, views, offset)
    monkeypatch.setattr(os, "pwritev", slow_write)
    anchor.save(3, optimizer, background=True)
    assert anchor.is_set and anchor.step == 3
    for b in model.buffers():  # what the caller's next forward does to the batch-norm statistics
        b.add_(1)
    anchor.wait()
    assert len(threads) == 1 and threads[0].startswith("hybrid-trainer-snapshot")
    _train(model, optimizer, steps=2)
    anchor.restore(optimizer)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(torch.equal(b, s) for b, s in zip(model.buffers(), buffers))


def test_a_failed_background_write_raises_at_the_wait_and_leaves_no_snapshot(monkeypatch):
    import os

    model, optimizer = _model_and_optimizer()
    _train(model, optimizer)
    anchor = WeightAnchor(list(model.parameters()), buffers=buffer_slots(model), storage="file")
    anchor.save(1, optimizer)

    def full_disk(fd, views, offset):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "pwritev", full_disk)
    anchor.save(2, optimizer, background=True)
    with pytest.raises(OSError, match="No space left"):
        anchor.wait()
    assert not anchor.is_set  # the file holds part of each snapshot: neither may be restored
    with pytest.raises(RuntimeError, match="before save"):
        anchor.restore(optimizer)

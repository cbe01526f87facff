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

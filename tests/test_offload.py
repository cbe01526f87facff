"""StateOffloader bookkeeping on CPU: ``enabled=True`` makes it move CPU-resident state into fresh host
buffers, so storage swaps, identity, exact values and idempotence are observable without a GPU."""
import copy

import pytest
import torch

from hybrid_trainer.offload import StateOffloader


def trained_adam(steps=2, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        train_step(model, optimizer)
    return model, optimizer


def train_step(model, optimizer, seed=1):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 6, generator=generator)
    optimizer.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    optimizer.step()


def state_tensors(optimizer):
    return {(i, key): value for i, state in enumerate(optimizer.state.values())
            for key, value in state.items() if isinstance(value, torch.Tensor)}


class CopySpy:
    """Records every copy the offloader asks for, then does it."""

    def __init__(self):
        self.calls = []

    def __call__(self, destination, source, non_blocking):
        self.calls.append((destination.data_ptr(), source.data_ptr(), source.numel() * source.element_size(),
                           non_blocking))
        destination.copy_(source)


def test_offload_swaps_storage_but_keeps_objects_and_values():
    _, optimizer = trained_adam()
    tensors = state_tensors(optimizer)
    before = {key: t.clone() for key, t in tensors.items()}
    pointers = {key: t.data_ptr() for key, t in tensors.items()}
    spy = CopySpy()
    offloader = StateOffloader(optimizer, enabled=True, copy_fn=spy)

    moved = offloader.offload()

    expected_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert moved == expected_bytes == offloader.bytes_offloaded
    assert offloader.offloaded
    assert len(spy.calls) == len(tensors)  # each state tensor copied exactly once, Adam's "step" included
    after = state_tensors(optimizer)
    for key, tensor in tensors.items():
        assert after[key] is tensor  # the optimizer still holds the very same object
        assert tensor.data_ptr() != pointers[key]  # ... now over a different (host) storage
        assert torch.equal(tensor, before[key])
    assert {id(t) for t in offloader.offloaded_tensors} == {id(t) for t in tensors.values()}


def test_offload_twice_is_idempotent():
    _, optimizer = trained_adam()
    spy = CopySpy()
    offloader = StateOffloader(optimizer, enabled=True, copy_fn=spy)
    first = offloader.offload()
    pointers = {key: t.data_ptr() for key, t in state_tensors(optimizer).items()}
    calls = len(spy.calls)
    assert offloader.offload() == 0
    assert len(spy.calls) == calls
    assert {key: t.data_ptr() for key, t in state_tensors(optimizer).items()} == pointers
    assert offloader.bytes_offloaded == first


def test_prefetch_restores_exact_values_to_new_storage_and_is_idempotent():
    _, optimizer = trained_adam()
    tensors = state_tensors(optimizer)
    before = {key: t.clone() for key, t in tensors.items()}
    offloader = StateOffloader(optimizer, enabled=True)
    moved = offloader.offload()
    host_pointers = {key: t.data_ptr() for key, t in tensors.items()}

    assert offloader.prefetch() == moved
    offloader.wait()

    assert not offloader.offloaded and offloader.bytes_offloaded == 0
    for key, tensor in tensors.items():
        assert state_tensors(optimizer)[key] is tensor
        assert tensor.data_ptr() != host_pointers[key]  # back on "device" storage, not the host buffer
        assert tensor.dtype == before[key].dtype and tensor.stride() == before[key].stride()
        assert torch.equal(tensor, before[key])  # bit-exact
    assert offloader.prefetch() == 0  # nothing left to bring back


def test_training_after_round_trips_matches_a_never_offloaded_twin():
    model, optimizer = trained_adam()
    twin_model = copy.deepcopy(model)
    twin_optimizer = torch.optim.Adam(twin_model.parameters(), lr=1e-2)
    twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # own tensors, not shared ones
    offloader = StateOffloader(optimizer, enabled=True)
    for seed in range(3):
        assert offloader.offload() > 0
        offloader.prefetch()
        offloader.wait()
        train_step(model, optimizer, seed)
        train_step(twin_model, twin_optimizer, seed)
    for ours, theirs in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(ours, theirs)
    for key, tensor in state_tensors(optimizer).items():
        assert torch.equal(tensor, state_tensors(twin_optimizer)[key])


def test_host_buffers_are_reused_across_cycles():
    _, optimizer = trained_adam()
    offloader = StateOffloader(optimizer, enabled=True)
    offloader.offload()
    first_host = {key: t.data_ptr() for key, t in state_tensors(optimizer).items()}
    offloader.prefetch()
    offloader.offload()
    assert {key: t.data_ptr() for key, t in state_tensors(optimizer).items()} == first_host
    offloader.prefetch()

    fresh = StateOffloader(optimizer, enabled=True, keep_host_buffers=False)
    fresh.offload()
    fresh.prefetch()
    assert fresh._host_buffers == {}


def test_auto_mode_on_cpu_and_disabled_are_no_ops():
    _, optimizer = trained_adam()
    pointers = {key: t.data_ptr() for key, t in state_tensors(optimizer).items()}
    spy = CopySpy()
    for offloader in (StateOffloader(optimizer, copy_fn=spy), StateOffloader(optimizer, enabled=False, copy_fn=spy)):
        assert offloader.offload() == 0 and not offloader.offloaded and offloader.bytes_offloaded == 0
        assert offloader.prefetch() == 0
    assert spy.calls == []
    assert {key: t.data_ptr() for key, t in state_tensors(optimizer).items()} == pointers


def test_auto_mode_moves_only_tensors_off_the_target_device():
    # Auto mode moves what is not on target_device. With a "cuda" target every CPU-resident state tensor is
    # eligible; the injected allocator stands in for CUDA memory, so the run needs no GPU.
    _, optimizer = trained_adam()
    tensors = state_tensors(optimizer)
    allocations = []

    def allocate(like, device, pin_memory):
        allocations.append((device, pin_memory))
        return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype)  # stands in for the target

    offloader = StateOffloader(optimizer, target_device="cuda", allocate_fn=allocate)  # state is not on cuda
    assert offloader.offload() == sum(t.numel() * t.element_size() for t in tensors.values())
    assert {device for device, _ in allocations} == {torch.device("cuda")}
    assert not any(pin for _, pin in allocations)  # only a CPU target is ever pinned


def test_extra_tensors_move_and_views_or_shared_storage_stay():
    _, optimizer = trained_adam()
    history = torch.arange(12.0)
    flat = torch.zeros(10)
    view = flat[2:6]
    shared_a = torch.ones(3)
    shared_b = shared_a.view(3)  # a second object over the same storage, not a slice
    offloader = StateOffloader(optimizer, extra=lambda: [history, view, shared_a, shared_b, history],
                               enabled=True)
    pointers = {name: t.data_ptr() for name, t in
                {"history": history, "view": view, "shared_a": shared_a, "shared_b": shared_b}.items()}

    offloader.offload()

    moved = {id(t) for t in offloader.offloaded_tensors}
    assert id(history) in moved and history.data_ptr() != pointers["history"]
    assert history.tolist() == [float(i) for i in range(12)]
    for name, tensor in {"view": view, "shared_a": shared_a, "shared_b": shared_b}.items():
        assert id(tensor) not in moved and tensor.data_ptr() == pointers[name], name
    assert offloader.skipped_aliased == 3
    view.fill_(7.0)
    assert flat[2:6].tolist() == [7.0] * 4  # the view still aliases its base
    offloader.prefetch()
    assert history.tolist() == [float(i) for i in range(12)]


def test_state_created_after_construction_is_picked_up():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    offloader = StateOffloader(optimizer, enabled=True)
    assert offloader.offload() == 0  # no state yet: SGD creates its momentum buffers lazily
    offloader.prefetch()
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    assert offloader.offload() == sum(p.numel() * 4 for p in model.parameters())


def test_non_contiguous_layout_survives_the_round_trip():
    weight = torch.nn.Parameter(torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last))
    optimizer = torch.optim.Adam([weight])
    weight.grad = torch.randn_like(weight)
    optimizer.step()
    exp_avg = optimizer.state[weight]["exp_avg"]
    stride, values = exp_avg.stride(), exp_avg.clone()
    assert not exp_avg.is_contiguous()  # guard: the case under test really is channels_last
    offloader = StateOffloader(optimizer, enabled=True)
    offloader.offload()
    assert exp_avg.stride() == stride
    offloader.prefetch()
    assert exp_avg.stride() == stride and torch.equal(exp_avg, values)


def test_rejects_non_optimizer():
    with pytest.raises(TypeError, match="optimizer"):
        StateOffloader(object())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real device-to-host transfers need a GPU")
def test_cuda_round_trip_frees_device_memory_and_restores_exactly():
    model = torch.nn.Linear(1024, 1024, device="cuda")
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 1024, device="cuda")).sum().backward()
    optimizer.step()
    tensors = state_tensors(optimizer)
    before = {key: t.clone() for key, t in tensors.items()}
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    offloader = StateOffloader(optimizer)  # auto: enabled because the state lives on CUDA
    moved = offloader.offload()
    assert moved >= 2 * 1024 * 1024 * 4  # exp_avg and exp_avg_sq of the weight at least
    assert all(t.device.type == "cpu" and t.is_pinned() for t in offloader.offloaded_tensors)
    assert torch.cuda.memory_allocated() <= allocated - moved + 4096 * len(tensors)
    assert offloader.prefetch(non_blocking=True) == moved
    offloader.wait()
    for key, tensor in tensors.items():
        assert state_tensors(optimizer)[key] is tensor and tensor.device == before[key].device
        assert torch.equal(tensor, before[key])
    optimizer.step()

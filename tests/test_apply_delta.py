"""apply_delta_: in place, one launch per dtype group, float and fused-int8 deltas, vs the eager path."""
import pytest
import torch

import hybrid_kernels as hk
from hybrid_kernels.apply_delta import kernel_launches

SIZES = [1, 7, 97, 1000, 8191, 8192, 8193, 100003]  # 1 element, primes, chunk edges, > 1e5


def _params(device, dtype=torch.float32, sizes=SIZES):
    return [torch.randn(n, device=device).to(dtype) for n in sizes]


def _run(backend, monkeypatch, *args, **kwargs):
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", backend)
    hk.apply_delta_(*args, **kwargs)
    assert hk.last_backend("apply_delta_") == backend
    monkeypatch.delenv("HYBRID_KERNELS_BACKEND")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("alpha", [1.0, -0.37])
def test_float_deltas_match_eager_in_place(dtype, alpha, device, monkeypatch):
    params = _params(device, dtype)
    expected = [p.clone() for p in params]
    deltas = [torch.randn_like(p, dtype=torch.float32) for p in params]
    _run("eager", monkeypatch, expected, deltas, alpha)
    ptrs = [p.data_ptr() for p in params]
    _run("triton", monkeypatch, params, deltas, alpha)
    assert [p.data_ptr() for p in params] == ptrs
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]  # bf16: 1 ulp (interpreter rounds toward zero)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p, e, rtol=tol, atol=tol)


def test_weights_change_by_exactly_the_delta(device):
    params = _params(device)
    before = [p.clone() for p in params]
    deltas = [torch.randn_like(p) for p in params]
    hk.apply_delta_(params, deltas, 1.0)
    for p, b, d in zip(params, before, deltas):
        assert torch.equal(p, b + d)


def test_one_launch_per_dtype_group(device):
    params = _params(device) + _params(device, torch.float16, [5, 33])
    deltas = [torch.randn_like(p) for p in params]
    before = kernel_launches()
    hk.apply_delta_(params, deltas, 0.5)
    assert kernel_launches() - before == 2  # fp32 group + fp16 group


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int8_deltas_dequantized_in_the_pass(granularity, dtype, device, monkeypatch):
    shapes = [(1,), (3, 5), (64, 129), (17, 1000)]
    params = [torch.randn(s, device=device).to(dtype) for s in shapes]
    deltas = [torch.randn(s, device=device) * 1e-2 for s in shapes]
    quantized = [hk.quantize_int8(d, granularity, block_size=64) for d in deltas]
    codes, scales = [q for q, _ in quantized], [s for _, s in quantized]
    expected = [p.float() + 0.5 * hk.dequantize_int8(q, s, granularity, 64) for p, q, s in zip(params, codes, scales)]
    eager = [p.clone() for p in params]
    _run("eager", monkeypatch, eager, codes, 0.5, scales=scales, granularity=granularity, block_size=64)
    _run("triton", monkeypatch, params, codes, 0.5, scales=scales, granularity=granularity, block_size=64)
    for p, e, ref in zip(params, eager, expected):
        if dtype == torch.float32:
            assert torch.equal(p, e)  # same fp32 arithmetic, same order: bit-exact
        torch.testing.assert_close(p.float(), ref, rtol=1e-3 if dtype == torch.float16 else 1e-6, atol=1e-6)


def test_per_tensor_alpha_and_norms(device, monkeypatch):
    params = _params(device, sizes=[10, 20000, 3])
    deltas = [torch.randn_like(p) for p in params]
    alphas = [0.5, -2.0, 0.0]
    expected_norms = torch.stack([(a * d).norm() for a, d in zip(alphas, deltas)])
    for backend in ("eager", "triton"):
        work = [p.clone() for p in params]
        norms = torch.full((3,), -1.0, device=device)
        _run(backend, monkeypatch, work, deltas, alphas, out_norms=norms)
        torch.testing.assert_close(norms, expected_norms, rtol=1e-5, atol=1e-6)
        for w, p, d, a in zip(work, params, deltas, alphas):
            torch.testing.assert_close(w, p + a * d, rtol=1e-6, atol=1e-6)
    tensor_alpha = torch.tensor(alphas, device=device)
    hk.apply_delta_(params, deltas, tensor_alpha)


def test_non_contiguous_param_is_updated_in_place(device):
    base = torch.randn(40, 30, device=device)
    transposed = base.t()  # a non-contiguous view of a parameter
    flat = torch.randn(50, device=device)
    d_t, d_f = torch.randn(30, 40, device=device), torch.randn(50, device=device)
    expected_t, expected_f = transposed + d_t, flat + d_f
    hk.apply_delta_([transposed, flat], [d_t, d_f])
    assert torch.equal(transposed, expected_t) and torch.equal(flat, expected_f)
    assert torch.equal(base, expected_t.t())  # the storage itself changed


def test_non_contiguous_delta(device):
    p = torch.randn(20, 30, device=device)
    d = torch.randn(30, 20, device=device).t()
    expected = p + d
    hk.apply_delta_([p], [d])
    assert torch.equal(p, expected)


def test_parameters_with_grad_and_empty_tensors(device):
    layer = torch.nn.Linear(7, 3).to(device)
    empty = torch.empty(0, device=device)
    params = [layer.weight, layer.bias, empty]
    before = [t.detach().clone() for t in params]
    deltas = [torch.ones_like(t) for t in params]
    hk.apply_delta_(params, deltas, 0.25)
    assert torch.equal(layer.weight, before[0] + 0.25) and torch.equal(layer.bias, before[1] + 0.25)
    assert layer.weight.requires_grad and layer.weight.grad is None


def test_alpha_accepts_real_numbers_of_any_kind(device):
    import numpy as np
    params = [torch.zeros(3, device=device), torch.zeros(5, device=device)]
    deltas = [torch.ones(3, device=device), torch.ones(5, device=device)]
    for alpha in (1, np.float32(1.0), [np.float64(1.0), 1], (torch.tensor(1.0), 1.0)):
        hk.apply_delta_(params, deltas, alpha)
    assert torch.equal(params[0], torch.full((3,), 4.0, device=device))


def test_empty_list_is_a_no_op():
    hk.apply_delta_([], [])


@pytest.mark.parametrize("call, match", [
    (lambda p, d: hk.apply_delta_(p, d[:1]), "deltas has 1 tensors but params has 2"),
    (lambda p, d: hk.apply_delta_(p, [d[0], d[1][:-1]]), r"deltas\[1\] has shape \(4,\) but params\[1\] has shape \(5,\)"),
    (lambda p, d: hk.apply_delta_(p, [d[0], d[1].to(torch.float64)]), r"deltas\[1\] must be float32"),
    (lambda p, d: hk.apply_delta_([p[0], p[1].long()], d), r"params\[1\] must be a float32"),
    (lambda p, d: hk.apply_delta_(p, [d[0], d[1].to("meta")]), r"deltas\[1\] is on meta"),
    (lambda p, d: hk.apply_delta_(p, d, [1.0]), "alpha has 1 values but params has 2"),
    (lambda p, d: hk.apply_delta_(p, d, float("nan")), r"alpha\[0\] is nan"),
    (lambda p, d: hk.apply_delta_(p, d, "1"), r"alpha must be a float, a sequence of floats or a tensor, got str"),
    (lambda p, d: hk.apply_delta_(p, d, "12"), r"alpha must be a float, a sequence of floats or a tensor, got str"),
    (lambda p, d: hk.apply_delta_(p, d, True), r"alpha must be a float, a sequence of floats or a tensor, got bool"),
    (lambda p, d: hk.apply_delta_(p, d, [1.0, "1"]), r"alpha\[1\] must be a real number, got str '1'"),
    (lambda p, d: hk.apply_delta_(p, d, [False, 1.0]), r"alpha\[0\] must be a real number, got bool"),
    (lambda p, d: hk.apply_delta_(p, d, torch.tensor([True, False])), r"alpha tensor must hold real numbers"),
    (lambda p, d: hk.DeltaApplier(p, d)("1"), r"alpha must be a float, a sequence of floats or a tensor, got str"),
    (lambda p, d: hk.apply_delta_([p[0], p[0]], d[:1] * 2), r"params\[1\] and params\[0\] share storage"),
    (lambda p, d: hk.apply_delta_(p, d, out_norms=torch.zeros(3)), r"out_norms must have shape \(2,\)"),
    (lambda p, d: hk.apply_delta_(p, d, scales=[torch.ones(()), torch.ones(())]), r"deltas\[0\] must be int8"),
    (lambda p, d: hk.apply_delta_(p, [torch.zeros(3, dtype=torch.int8), torch.zeros(5, dtype=torch.int8)],
                                  scales=[torch.ones(()), torch.ones(2)]), r"scales\[1\] has shape \(2,\)"),
    (lambda p, d: hk.apply_delta_(p[0], d[0]), "params must be a list or tuple"),
])
def test_bad_arguments_are_named(call, match):
    params = [torch.zeros(3), torch.zeros(5)]
    deltas = [torch.ones(3), torch.ones(5)]
    with pytest.raises((ValueError, TypeError), match=match):
        call(params, deltas)
    assert torch.equal(params[0], torch.zeros(3))  # nothing applied before the error


def test_chunks_with_several_inner_steps(device, monkeypatch):
    """The GPU configuration (several BLOCK steps per program, full and tail chunks)."""
    import hybrid_kernels.apply_delta as mod
    monkeypatch.setattr(mod, "_BLOCK", 256)
    monkeypatch.setattr(mod, "_ITERS", 4)
    params = _params(device, sizes=[1, 1023, 1024, 1025, 5000])
    deltas = [torch.randn_like(p) for p in params]
    expected = [p + 2.0 * d for p, d in zip(params, deltas)]
    norms = torch.zeros(len(params), device=device)
    hk.apply_delta_(params, deltas, 2.0, out_norms=norms)
    for p, e in zip(params, expected):
        assert torch.equal(p, e)
    torch.testing.assert_close(norms, torch.stack([(2.0 * d).norm() for d in deltas]), rtol=1e-5, atol=0)


# --------------------------------------------------------------------------------------------
# DeltaApplier: the same update, checked and planned once
# --------------------------------------------------------------------------------------------
def test_applier_matches_apply_delta_bit_for_bit_and_launches_once(device):
    params = _params(device)
    twin = [p.clone() for p in params]
    deltas = [torch.randn_like(p) for p in params]
    applier = hk.DeltaApplier(params, deltas)
    alphas = torch.linspace(-1.0, 1.0, len(params), device=device)
    norms, twin_norms = torch.zeros(len(params), device=device), torch.zeros(len(params), device=device)
    for step in range(3):  # the deltas change between calls; the applier reads their current values
        for d in deltas:
            d.mul_(0.5)
        before = kernel_launches()
        applier(alphas, out_norms=norms)
        assert kernel_launches() - before == 1
        hk.apply_delta_(twin, deltas, alphas, out_norms=twin_norms)
        for p, t in zip(params, twin):
            assert torch.equal(p, t), step
        assert torch.equal(norms, twin_norms)


def test_applier_int8_and_mixed_dtypes_fall_back_to_the_general_path(device):
    shapes = [(3, 5), (64, 129)]
    params = [torch.randn(s, device=device) for s in shapes]
    codes, scales = zip(*(hk.quantize_int8(torch.randn(s, device=device), "row") for s in shapes))
    expected = [p.clone() for p in params]
    hk.apply_delta_(expected, list(codes), 0.5, scales=list(scales), granularity="row")
    hk.DeltaApplier(params, codes, scales=scales, granularity="row")(0.5)
    for p, e in zip(params, expected):
        assert torch.equal(p, e)
    mixed = [torch.randn(10, device=device), torch.randn(7, device=device).half()]
    deltas = [torch.ones(10, device=device), torch.ones(7, device=device)]
    expected = [m.float() + 2.0 for m in mixed]
    hk.DeltaApplier(mixed, deltas)(2.0)  # two dtype groups: not one launch, still right
    for m, e in zip(mixed, expected):
        torch.testing.assert_close(m.float(), e, rtol=1e-3, atol=1e-3)


def test_applier_eager_backend_and_empty(device, monkeypatch):
    params, deltas = _params(device, sizes=[5, 9]), [torch.ones(5, device=device), torch.ones(9, device=device)]
    expected = [p + 1.0 for p in params]
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", "eager")
    hk.DeltaApplier(params, deltas)(1.0)
    assert hk.last_backend("apply_delta_") == "eager"
    assert all(torch.equal(p, e) for p, e in zip(params, expected))
    empty = hk.DeltaApplier([], [])
    empty(1.0)
    assert len(empty) == 0


def test_applier_checks_at_construction_and_per_call():
    params, deltas = [torch.zeros(3), torch.zeros(5)], [torch.ones(3), torch.ones(5)]
    with pytest.raises(ValueError, match=r"deltas\[1\] has shape \(4,\)"):
        hk.DeltaApplier(params, [deltas[0], deltas[1][:-1]])
    applier = hk.DeltaApplier(params, deltas)
    with pytest.raises(ValueError, match=r"alpha\[1\] is inf"):
        applier(torch.tensor([1.0, float("inf")]))
    with pytest.raises(ValueError, match=r"out_norms must have shape \(2,\)"):
        applier(1.0, out_norms=torch.zeros(3))
    assert torch.equal(params[0], torch.zeros(3))  # nothing applied before the errors


# --------------------------------------------------------------------------------------------
# Autograd sees the in-place write: a graph that saved the old values raises at backward
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("via", ["apply_delta_", "DeltaApplier"])
def test_saved_tensor_modified_by_apply_delta_raises_at_backward(backend, via, device, monkeypatch):
    """The kernel writes through raw pointers; without a version bump autograd would return the
    gradient of the new values (2 * w_new here) through a graph built on the old ones."""
    weight = torch.nn.Parameter(torch.randn(37, device=device))
    plain = torch.randn(5, device=device)  # a tensor not requiring grad, saved by the product below
    loss = (weight * weight).sum() + (plain.requires_grad_(False) * weight[:5]).sum()
    versions = (weight._version, plain._version)
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", backend)
    params, deltas = [weight, plain], [torch.ones(37, device=device), torch.ones(5, device=device)]
    if via == "apply_delta_":
        hk.apply_delta_(params, deltas, 0.5)
    else:
        hk.DeltaApplier(params, deltas)(0.5)
    assert hk.last_backend("apply_delta_") == backend
    assert weight._version > versions[0] and plain._version > versions[1]  # every written tensor
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


# --------------------------------------------------------------------------------------------
# DeltaApplier refuses tensors reallocated or resized after it was built
# --------------------------------------------------------------------------------------------
def _rebind_param(params, deltas, scales):
    params[1].data = torch.randn(300, device=params[1].device)  # what module.to(dtype) also does


def _grow_delta(params, deltas, scales):
    deltas[2].resize_(4096)  # larger: new storage, the old one is freed


def _shrink_param_same_address(params, deltas, scales):
    with torch.no_grad():
        params[0].set_(params[0].untyped_storage(), 0, (50,))  # same address, fewer elements


def _grow_scales(params, deltas, scales):
    scales[1].resize_(64)


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("change, name", [(_rebind_param, r"params\[1\]"), (_grow_delta, r"deltas\[2\]"),
                                          (_shrink_param_same_address, r"params\[0\]"),
                                          (_grow_scales, r"scales\[1\]")])
def test_applier_refuses_tensors_changed_after_construction(change, name, backend, device, monkeypatch):
    params = [torch.nn.Parameter(torch.randn(n, device=device)) for n in (100, 300, 2000)]
    if change is _grow_scales:
        codes, scales = zip(*(hk.quantize_int8(torch.randn(n, device=device), "block", 32) for n in (100, 300, 2000)))
        deltas, scales = list(codes), list(scales)
        applier = hk.DeltaApplier(params, deltas, scales=scales, granularity="block", block_size=32)
    else:
        deltas, scales = [torch.randn(n, device=device) for n in (100, 300, 2000)], None
        applier = hk.DeltaApplier(params, deltas)
    applier(0.5)  # fine while nothing changed
    change(params, deltas, scales)
    before = [p.detach().clone() for p in params]
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", backend)
    with pytest.raises(RuntimeError, match=name + r" changed since the applier was built .*new DeltaApplier"):
        applier(0.5)
    assert all(torch.equal(p, b) for p, b in zip(params, before))  # nothing written
    # A fresh applier over the current tensors works (when the shapes still match).
    if change is _grow_scales or change is _grow_delta:
        return
    fresh_deltas = [torch.ones_like(p) for p in params]
    hk.DeltaApplier(params, fresh_deltas)(1.0)
    assert all(torch.equal(p, b + 1.0) for p, b in zip(params, before))

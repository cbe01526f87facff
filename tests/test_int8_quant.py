"""quantize_int8 / dequantize_int8: Triton (interpreted on CPU) vs the eager reference."""
import math

import pytest
import torch

import hybrid_kernels as hk
from hybrid_kernels.int8_quant import GRANULARITIES, group_size_for

SHAPES = [(1,), (17,), (100, 33), (7, 1), (3, 5, 257), (100003,)]


def _eager(x, granularity, block_size, monkeypatch):
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", "eager")
    q, s = hk.quantize_int8(x, granularity, block_size)
    assert hk.last_backend("quantize_int8") == "eager"
    monkeypatch.delenv("HYBRID_KERNELS_BACKEND")
    return q, s


def sqnr_db(x, x_hat):
    return 20 * math.log10(x.float().norm() / (x.float() - x_hat.float()).norm())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_codes_equal_eager_reference(shape, granularity, dtype, device, monkeypatch):
    x = (torch.randn(shape) * 3).to(device=device, dtype=dtype)
    q_ref, s_ref = _eager(x, granularity, 64, monkeypatch)
    q, s = hk.quantize_int8(x, granularity, block_size=64)
    assert hk.last_backend("quantize_int8") == "triton"
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert torch.equal(s, s_ref)
    assert torch.equal(q, q_ref), f"{(q != q_ref).sum()} codes differ"
    x_hat = hk.dequantize_int8(q, s, granularity, block_size=64, dtype=dtype)
    assert hk.last_backend("dequantize_int8") == "triton"
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", "eager")
    assert torch.equal(x_hat, hk.dequantize_int8(q, s, granularity, block_size=64, dtype=dtype))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_round_trip_error_is_at_most_half_a_step(granularity, device):
    x = torch.randn(64, 300, device=device)
    q, s = hk.quantize_int8(x, granularity, block_size=128)
    x_hat = hk.dequantize_int8(q, s, granularity, block_size=128)
    gs = group_size_for(x.shape, granularity, 128)
    step = torch.nn.functional.pad(s.reshape(-1), (0, 0)).repeat_interleave(gs)[: x.numel()].view_as(x)
    assert bool(((x - x_hat).abs() <= step / 2 * (1 + 1e-6)).all())
    assert int(q.abs().max()) == 127  # the absmax element of each group maps to ±127
    assert int(q.min()) >= -127


def test_sqnr_on_normal_data(device):
    """Reported figures (pytest -s): finer groups give higher SQNR; all above 35 dB."""
    x = torch.randn(256, 1024, device=device)
    results = {}
    for granularity in GRANULARITIES:
        q, s = hk.quantize_int8(x, granularity, block_size=64)
        results[granularity] = sqnr_db(x, hk.dequantize_int8(q, s, granularity, block_size=64))
    print("SQNR dB (normal data, 256x1024):", {k: round(v, 2) for k, v in results.items()})
    assert results["tensor"] > 35
    assert results["tensor"] < results["row"] < results["block"]


def test_round_half_to_even(device):
    # absmax 127 → scale exactly 1, so x/scale hits the .5 ties exactly.
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49, -126.5], device=device)
    q, s = hk.quantize_int8(x)
    assert float(s) == 1.0
    assert q.tolist() == [127, 0, 2, 2, 0, -2, -2, 3, -126]


def test_all_zero_groups_give_zero_scale_and_no_nan(device):
    x = torch.zeros(4, 10, device=device)
    x[1, 3] = 2.0
    q, s = hk.quantize_int8(x, "row")
    assert torch.equal(s, torch.tensor([0.0, 2.0, 0.0, 0.0], device=device) / 127)
    x_hat = hk.dequantize_int8(q, s, "row")
    assert torch.isfinite(x_hat).all() and torch.allclose(x_hat, x, rtol=1e-6, atol=0)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("backend", ["triton", "eager"])
def test_non_finite_group_keeps_a_non_finite_scale(backend, device, monkeypatch):
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", backend)
    x = torch.randn(3, 8, device=device)
    x[1, 2] = float("nan")
    x[2, 0] = float("inf")
    q, s = hk.quantize_int8(x, "row")
    assert torch.isfinite(s[0]) and not torch.isfinite(s[1]) and not torch.isfinite(s[2])
    x_hat = hk.dequantize_int8(q, s, "row")
    assert torch.isfinite(x_hat[0]).all()
    assert not torch.isfinite(x_hat[1]).all() and not torch.isfinite(x_hat[2]).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("fused_max_group", [8192, 4])  # one-pass kernel, and the two-pass path
@pytest.mark.parametrize("granularity", ["row", "block"])
def test_both_kernel_paths_equal_eager_on_non_finite_groups(fused_max_group, granularity, device, monkeypatch):
    import hybrid_kernels.int8_quant as mod
    monkeypatch.setattr(mod, "_FUSED_MAX_GROUP", fused_max_group)
    x = torch.randn(5, 40, device=device) * 3
    x[1, 2], x[2, 0], x[3, 39] = float("nan"), float("inf"), float("-inf")
    q_ref, s_ref = _eager(x, granularity, 16, monkeypatch)
    q, s = hk.quantize_int8(x, granularity, block_size=16)
    assert hk.last_backend("quantize_int8") == "triton"
    assert torch.equal(q, q_ref)
    assert torch.equal(s.isnan(), s_ref.isnan()) and torch.equal(s.nan_to_num(), s_ref.nan_to_num())


def test_big_single_group_uses_partial_maxima(device):
    x = torch.randn(70001, device=device)
    x[69999] = 40.0  # the max sits in the last partial chunk
    q, s = hk.quantize_int8(x)
    assert float(s) == pytest.approx(40.0 / 127)
    assert int(q[69999]) == 127


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("max_fused_partials", [1024, 1])  # scale reduced in the kernel, or by torch ops
@pytest.mark.parametrize("poison", [None, "nan", "inf", "zero"])
def test_big_single_group_equals_eager_on_both_paths(max_fused_partials, poison, device, monkeypatch):
    import hybrid_kernels.int8_quant as mod
    monkeypatch.setattr(mod, "_MAX_FUSED_PARTIALS", max_fused_partials)
    x = torch.randn(3 * 65536 + 5, device=device) * 3  # four partial maxima
    if poison == "nan":
        x[100000] = float("nan")
    elif poison == "inf":
        x[-1] = float("-inf")
    elif poison == "zero":
        x.zero_()
    q_ref, s_ref = _eager(x, "tensor", 64, monkeypatch)
    q, s = hk.quantize_int8(x)
    assert hk.last_backend("quantize_int8") == "triton"
    assert s.shape == () and torch.equal(q, q_ref)
    assert torch.equal(s.isnan(), s_ref.isnan()) and torch.equal(s.nan_to_num(), s_ref.nan_to_num())


@pytest.mark.parametrize("granularity, shape", [("tensor", (200000,)), ("row", (300, 64)), ("block", (20000,))])
def test_host_work_per_call_is_allocations_only(granularity, shape, device):
    """Each torch op here is a launch or an allocator call on a GPU, where small calls are
    host-bound: one big group's maxima are reduced inside the codes kernel, not by torch ops."""
    from bench.host_ops import HostOps

    x = torch.randn(shape, device=device)
    hk.quantize_int8(x, granularity)
    with HostOps() as host:
        hk.quantize_int8(x, granularity)
    assert hk.last_backend("quantize_int8") == "triton"
    allocations = 3 if granularity == "tensor" else 2  # codes, scales (+ the chunk maxima)
    assert [op for op in host.ops if op not in ("detach", "view")] == ["empty"] * allocations, host.ops


def test_non_contiguous_input(device):
    x = torch.randn(33, 40, device=device).t()
    q, s = hk.quantize_int8(x, "row")
    q_ref, s_ref = hk.quantize_int8(x.contiguous(), "row")
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("shape", [(0,), (0, 5), (5, 0), (3, 0), (4, 0, 3), (2, 3, 0)])
def test_empty_input_gives_empty_codes_and_zero_scales_of_the_usual_shape(shape, granularity, backend, device,
                                                                          monkeypatch):
    """Empty in, empty out: rows of length 0 still get one scale each (0, as for an all-zero
    group), so the codes, scales and dequantized tensor keep the shapes every caller relies on."""
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", backend)
    x = torch.empty(shape, device=device)
    q, s = hk.quantize_int8(x, granularity, block_size=4)
    assert hk.last_backend("quantize_int8") == backend
    expected_scales = {"tensor": (), "row": shape[:-1], "block": (0,)}[granularity]
    assert q.shape == shape and q.dtype == torch.int8
    assert s.shape == expected_scales and s.dtype == torch.float32 and not s.any()
    out = hk.dequantize_int8(q, s, granularity, 4, dtype=torch.float16)
    assert out.shape == shape and out.dtype == torch.float16
    param = torch.empty(shape, device=device)
    hk.apply_delta_([param, torch.zeros(3, device=device)], [q, torch.ones(3, dtype=torch.int8, device=device)],
                    0.5, scales=[s, hk.quantize_int8(torch.ones(3, device=device), granularity, 4)[1]],
                    granularity=granularity, block_size=4)


@pytest.mark.parametrize("call, match", [
    (lambda: hk.quantize_int8(torch.arange(4)), "x must be float32"),
    (lambda: hk.quantize_int8(torch.randn(4), "column"), "granularity must be one of"),
    (lambda: hk.quantize_int8(torch.randn(4), "block", block_size=0), "block_size must be a positive int"),
    (lambda: hk.quantize_int8(torch.tensor(1.0), "row"), "granularity='row' needs"),
    (lambda: hk.dequantize_int8(torch.zeros(4), torch.ones(())), "q must be an int8 tensor"),
    (lambda: hk.dequantize_int8(torch.zeros(4, dtype=torch.int8), torch.ones((), dtype=torch.float64)),
     "scales must be a float32 tensor"),
    (lambda: hk.dequantize_int8(torch.zeros(4, 3, dtype=torch.int8), torch.ones(3), "row"),
     r"scales has shape \(3,\) but granularity='row'"),
])
def test_bad_arguments_are_named(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_eager_dequantize_holds_one_fp32_copy_of_its_input_at_a_time(monkeypatch):
    """The trainer's int8 direction is read a bucket at a time while the gradients are alive, so
    the read's transient adds to the step's peak: one fp32 tensor of the codes' size (widening,
    then scaling out of place, held two)."""
    from bench.overhead import TensorPeak

    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", "eager")
    codes = torch.randint(-127, 128, (64 * 256,), dtype=torch.int8)
    scales = torch.rand(64)
    with TensorPeak() as peak:
        values = hk.dequantize_int8(codes, scales, "block", 256, torch.float32)
    assert hk.last_backend("dequantize_int8") == "eager"
    assert peak.peak_bytes == values.numel() * 4
    torch.testing.assert_close(values, (codes.float().view(64, 256) * scales[:, None]).view(-1), rtol=0, atol=0)

"""flash_attention: Triton forward/backward (interpreted on CPU), SDPA fallback, custom op, module.

Correctness rule (FlashAttention's): against a float64 reference, the op's max abs error is at
most 2x the error of PyTorch's own attention (SDPA, math backend) run in the same dtype, for the
output and for dq, dk, dv, plus a small absolute floor for cases where PyTorch's error is ~0.
Every kernel test asserts the Triton path served it, so none can pass on the fallback.
"""
import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import hybrid_kernels
from hybrid_kernels import CausalSelfAttention, flash_attention

# The package exports the function under the module's name, so fetch the module itself.
fa = importlib.import_module("hybrid_kernels.flash_attention")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

ERROR_FLOOR = {torch.float32: 1e-6, torch.float16: 1e-5, torch.bfloat16: 1e-4}


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------
def _inputs(batch, n_q_heads, n_kv_heads, seq_q, seq_k, head_dim, dtype):
    def make(*shape):
        return torch.randn(*shape, device=DEVICE, dtype=torch.float32).to(dtype).requires_grad_()

    return (make(batch, n_q_heads, seq_q, head_dim), make(batch, n_kv_heads, seq_k, head_dim),
            make(batch, n_kv_heads, seq_k, head_dim))


def _attention_float64(q, k, v, causal, scale):
    """Independent oracle: softmax(q k^T * scale + top-left causal mask) v, materialized, float64."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        visible = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _attention_pytorch(q, k, v, causal, scale):
    """PyTorch's own attention in the inputs' dtype (SDPA math backend): the error baseline."""
    group = q.shape[1] // k.shape[1]
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1),
                                              is_causal=causal, scale=scale)


def _forward_backward(fn, q, k, v, dout, causal, scale, dtype=None):
    leaves = [t.detach().clone() if dtype is None else t.detach().to(dtype) for t in (q, k, v)]
    leaves = [t.requires_grad_() for t in leaves]
    out = fn(*leaves, causal, scale)
    out.backward(dout if dtype is None else dout.to(dtype))
    return [out.detach()] + [t.grad for t in leaves]


def _assert_within_2x_pytorch_error(q, k, v, causal, softmax_scale=None, dout=None):
    """Run flash_attention (must take the Triton path) and check the FA accuracy rule."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if dout is None:
        dout = torch.randn(q.shape, device=q.device).to(q.dtype)
    hybrid_kernels.reset_backend_counts()
    ours = _forward_backward(lambda *a: flash_attention(a[0], a[1], a[2], causal=a[3], softmax_scale=softmax_scale),
                             q, k, v, dout, causal, scale)
    assert hybrid_kernels.last_backend("flash_attention") == "triton"
    assert hybrid_kernels.last_backend("flash_attention_backward") == "triton"
    pytorch = _forward_backward(_attention_pytorch, q, k, v, dout, causal, scale)
    reference = _forward_backward(_attention_float64, q, k, v, dout, causal, scale, dtype=torch.float64)
    # The floor is a few ulps of the problem's largest value: it only matters where PyTorch's
    # error is ~0 by cancellation (one key: dK is exactly 0 for PyTorch, O(eps) for any kernel
    # that takes delta from O).
    floor = ERROR_FLOOR[q.dtype] * max(1.0, *(r.abs().max().item() for r in reference if r.numel()))
    for name, mine, theirs, ref, like in zip(("out", "dq", "dk", "dv"), ours, pytorch, reference, (q, q, k, v)):
        assert mine.shape == like.shape and mine.dtype == like.dtype, name
        assert torch.isfinite(mine).all(), f"{name}: non-finite values"
        err = (mine.double() - ref).abs().max().item()
        pytorch_err = (theirs.double() - ref).abs().max().item()
        assert err <= 2 * pytorch_err + floor, (
            f"{name}: max error {err:.3g} > 2 x PyTorch's {pytorch_err:.3g} + {floor:g}")
    return ours


# --------------------------------------------------------------------------------------------
# Accuracy grid: each case adds something the others do not (ragged sizes, Nq != Nk both ways,
# GQA and MQA, every head dim, causal and not, fp32 and fp16). Interpreter cost grows with
# programs x blocks, so batch * heads stay small.
# --------------------------------------------------------------------------------------------
F32, F16 = torch.float32, torch.float16
CASES = [
    # batch, Hq, Hkv, Nq, Nk, D, causal, dtype
    pytest.param(1, 2, 2, 128, 128, 64, False, F32, id="aligned-fp32"),
    pytest.param(1, 2, 2, 128, 128, 64, True, F32, id="aligned-causal-fp32"),
    pytest.param(1, 1, 1, 1, 1, 32, False, F32, id="one-token"),
    pytest.param(1, 2, 2, 17, 17, 16, True, F16, id="n17-causal-d16-fp16"),
    pytest.param(1, 2, 2, 100, 100, 32, True, F32, id="n100-causal-d32"),
    pytest.param(1, 2, 2, 129, 129, 128, False, F16, id="n129-d128-fp16"),
    pytest.param(1, 1, 1, 129, 129, 128, True, F32, id="n129-causal-d128"),
    pytest.param(1, 4, 2, 100, 129, 64, True, F16, id="gqa-q100-k129-causal-fp16"),
    pytest.param(1, 4, 1, 129, 17, 32, True, F32, id="mqa-q129-k17-causal"),
    pytest.param(2, 4, 1, 17, 100, 16, False, F32, id="mqa-batch2-q17-k100"),
    pytest.param(1, 2, 2, 100, 17, 64, False, F16, id="q100-k17-fp16"),
    pytest.param(1, 2, 1, 256, 100, 128, False, F32, id="gqa-q256-k100-d128"),
    pytest.param(1, 1, 1, 1, 129, 64, True, F16, id="one-query-causal-sees-key0-fp16"),
    pytest.param(1, 1, 1, 129, 1, 16, True, F32, id="one-key-causal"),
    pytest.param(1, 2, 2, 256, 256, 64, True, F16, id="n256-causal-fp16"),
]


@pytest.mark.parametrize("batch, n_q_heads, n_kv_heads, seq_q, seq_k, head_dim, causal, dtype", CASES)
def test_matches_float64_reference_within_2x_pytorch_error(batch, n_q_heads, n_kv_heads, seq_q, seq_k, head_dim,
                                                           causal, dtype):
    q, k, v = _inputs(batch, n_q_heads, n_kv_heads, seq_q, seq_k, head_dim, dtype)
    _assert_within_2x_pytorch_error(q, k, v, causal)


@pytest.mark.slow
def test_long_sequence_causal_gqa():
    q, k, v = _inputs(1, 2, 1, 1024, 1024, 64, F16)
    _assert_within_2x_pytorch_error(q, k, v, causal=True)


@pytest.mark.parametrize("block_m, block_n", [(32, 64), (64, 32), (64, 128), (128, 64)])  # last two: GPU-tuned
def test_unequal_query_and_key_blocks(monkeypatch, block_m, block_n):
    """The diagonal / ragged-block bookkeeping must not assume BLOCK_M == BLOCK_N."""
    base_config = fa._kernel_config
    monkeypatch.setattr(fa, "_kernel_config", lambda head_dim, dtype, backward=False: {
        **base_config(head_dim, dtype, backward), "BLOCK_M": block_m, "BLOCK_N": block_n})
    q, k, v = _inputs(1, 2, 1, 100, 129, 16, F32)
    _assert_within_2x_pytorch_error(q, k, v, causal=True)
    q, k, v = _inputs(1, 2, 1, 129, 70, 16, F32)
    _assert_within_2x_pytorch_error(q, k, v, causal=True)


def test_custom_softmax_scale():
    q, k, v = _inputs(1, 2, 2, 70, 70, 32, F32)
    _assert_within_2x_pytorch_error(q, k, v, causal=True, softmax_scale=0.5)


def test_strided_inputs_from_a_fused_projection():
    """q, k, v sliced out of one [B, N, 3, H, D] tensor (head dim contiguous, other strides not) and
    a dout whose head dim is strided too (copied by the launcher)."""
    batch, seq, heads, head_dim = 1, 70, 2, 32
    qkv = torch.randn(batch, seq, 3, heads, head_dim, device=DEVICE)
    q, k, v = (qkv[:, :, i].transpose(1, 2).requires_grad_() for i in range(3))
    assert not q.is_contiguous() and q.stride(-1) == 1
    dout = torch.randn(batch, heads, head_dim, seq, device=DEVICE).transpose(-1, -2)
    assert dout.stride(-1) != 1
    _assert_within_2x_pytorch_error(q, k, v, causal=True, dout=dout)


def test_head_dim_not_contiguous():
    q, k, v = (torch.randn(1, 2, 16, 40, device=DEVICE).transpose(-1, -2).requires_grad_() for _ in range(3))
    _assert_within_2x_pytorch_error(q, k, v, causal=False)


def test_saved_softmax_statistics():
    """What the backward reads: per query row, the max m of the raw scores q.k and 1 / l with
    l = sum exp(scale * (score - m)); together they give the log-sum-exp of the scaled scores."""
    q, k, v = _inputs(1, 4, 2, 100, 129, 32, F32)
    scale = 0.3
    with torch.no_grad():
        _out, stats, residual = fa._forward_triton(q, k, v, True, scale)
        expected = fa._softmax_stats_eager(q, k, True, scale)
        q64, k64 = q.double(), k.double().repeat_interleave(2, dim=1)
        scores = (q64 @ k64.transpose(-2, -1)) * scale
        scores = scores.masked_fill(~torch.ones(100, 129, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        log_sum_exp = torch.logsumexp(scores, dim=-1)
    assert stats.shape == (2, 1, 4, 100) and stats.dtype == torch.float32
    assert residual.numel() == 0  # fp32 output: nothing to correct
    torch.testing.assert_close(stats, expected, atol=1e-5, rtol=1e-6)
    rebuilt = stats[0].double() * scale - torch.log(stats[1].double())
    torch.testing.assert_close(rebuilt, log_sum_exp, atol=1e-5, rtol=1e-6)


def test_output_residual_is_the_rounding_error_of_the_output():
    """fp16 with a backward: residual = fp32 result - fp16 out, at most half an fp16 ulp of out,
    and out + residual is closer to the exact attention than out."""
    q, k, v = _inputs(1, 2, 2, 70, 70, 32, F16)
    with torch.no_grad():
        out, _stats, residual = fa._forward_triton(q, k, v, False, 0.25)
        inference_out, _stats, no_residual = fa._forward_triton(q, k, v, False, 0.25, for_backward=False)
        exact = _attention_float64(q.double(), k.double(), v.double(), False, 0.25)
    assert residual.shape == out.shape and residual.dtype == torch.float16 and no_residual.numel() == 0
    assert torch.equal(out, inference_out)
    half_ulp = (torch.nextafter(out.abs(), torch.tensor(float("inf"), dtype=F16, device=out.device)) - out.abs()).double() / 2
    assert (residual.double().abs() <= half_ulp * (1 + 1e-3)).all()
    assert (residual != 0).float().mean() > 0.5
    rounded_error = (out.double() - exact).abs().mean().item()
    restored_error = (out.double() + residual.double() - exact).abs().mean().item()
    assert restored_error < rounded_error


def test_inference_call_builds_no_graph():
    q, k, v = _inputs(1, 2, 1, 17, 17, 16, F16)
    with torch.no_grad():
        out = flash_attention(q, k, v, causal=True)
    assert hybrid_kernels.last_backend("flash_attention") == "triton"
    assert out.grad_fn is None and not out.requires_grad
    expected = _attention_float64(q.double(), k.double(), v.double(), True, 0.25)
    torch.testing.assert_close(out.double(), expected, atol=2e-3, rtol=2e-3)


def test_host_work_per_call_is_allocations_only():
    """At small shapes a GPU call's time is its host work (docs/gpu.md): forward and backward
    issue nothing but their output allocations (no slicing of the statistics, no copies)."""
    from bench.host_ops import HostOps

    q, k, v = _inputs(1, 2, 1, 32, 32, 16, F16)
    out = flash_attention(q, k, v, causal=True)
    dout = torch.randn_like(out)
    with HostOps() as forward:
        out = flash_attention(q, k, v, causal=True)
    with HostOps() as backward:
        torch.autograd.grad(out, (q, k, v), dout)
    assert hybrid_kernels.last_backend("flash_attention_backward") == "triton"
    # detach: autograd saving tensors for the backward, no device work
    assert [op for op in forward.ops if op != "detach"] == ["empty"] * 3, forward.ops  # out, its rounding residual, stats
    assert [op for op in backward.ops if op != "detach"] == ["empty"] * 4, backward.ops  # dq, dk, dv, delta


def test_gradient_for_some_inputs_only():
    q, k, v = _inputs(1, 2, 1, 17, 33, 16, F32)
    k = k.detach()
    out = flash_attention(q, k, v, causal=True)
    dq, dv = torch.autograd.grad(out.sum(), (q, v))
    assert hybrid_kernels.last_backend("flash_attention_backward") == "triton"
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_dq, ref_dv = torch.autograd.grad(_attention_float64(q64, k64, v64, True, 0.25).sum(), (q64, v64))
    torch.testing.assert_close(dq.double(), ref_dq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dv.double(), ref_dv, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("n_q_heads, n_kv_heads", [(0, 0), (0, 1)])
@pytest.mark.parametrize("causal, dtype", [(False, F32), (True, F16)])
def test_no_query_heads_gives_empty_output_like_sdpa(n_q_heads, n_kv_heads, causal, dtype, backend, monkeypatch):
    """Empty in, empty out (as SDPA): zero query heads, with zero or some kv heads."""
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", backend)
    q, k, v = _inputs(2, n_q_heads, n_kv_heads, 5, 7, 16, dtype)
    out = flash_attention(q, k, v, causal=causal)
    assert hybrid_kernels.last_backend("flash_attention") == backend
    assert out.shape == (2, n_q_heads, 5, 16) and out.dtype == dtype
    out.sum().backward()
    assert q.grad.shape == q.shape
    assert torch.equal(k.grad, torch.zeros_like(k)) and torch.equal(v.grad, torch.zeros_like(v))
    with torch.no_grad():
        assert flash_attention(q, k, v, causal=causal).shape == q.shape  # the inference path too


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("batch, seq_q", [(2, 0), (0, 5)])
def test_no_queries_gives_empty_output_and_zero_key_gradients(batch, seq_q, backend, monkeypatch):
    """Zero queries or an empty batch: empty output, zero k/v gradients, on both backends (the
    eager one must not reach SDPA, whose CUDA backward asserts on empty inputs)."""
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", backend)
    q, k, v = _inputs(batch, 2, 1, seq_q, 17, 16, F32)
    out = flash_attention(q, k, v)
    assert hybrid_kernels.last_backend("flash_attention") == backend
    assert out.shape == (batch, 2, seq_q, 16)
    out.sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k)) and torch.equal(v.grad, torch.zeros_like(v))
    assert q.grad.shape == q.shape


# --------------------------------------------------------------------------------------------
# Fallback (SDPA) path: same conventions, so the two backends agree, including the top-left
# causal alignment when Nq != Nk.
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seq_q, seq_k", [(40, 100), (100, 40)])
def test_backends_agree_on_top_left_causal_mask(monkeypatch, seq_q, seq_k):
    q, k, v = _inputs(1, 4, 2, seq_q, seq_k, 32, F32)
    dout = torch.randn(q.shape, device=DEVICE)
    results = {}
    for backend in ("triton", "eager"):
        monkeypatch.setenv("HYBRID_KERNELS_BACKEND", backend)
        results[backend] = _forward_backward(lambda a, b, c, causal, _s: flash_attention(a, b, c, causal=causal),
                                             q, k, v, dout, True, None)
        assert hybrid_kernels.last_backend("flash_attention") == backend
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    expected_out = _attention_float64(q64, k64, v64, True, 1 / math.sqrt(32))
    for name, a, b in zip(("out", "dq", "dk", "dv"), results["triton"], results["eager"]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, msg=name)
    torch.testing.assert_close(results["eager"][0].double(), expected_out, atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("eager_backend")
def test_eager_fallback_gqa_matches_reference():
    q, k, v = _inputs(2, 4, 1, 33, 20, 16, F32)
    out = flash_attention(q, k, v, causal=True, softmax_scale=0.7)
    assert hybrid_kernels.last_backend("flash_attention") == "eager"
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = _attention_float64(q64, k64, v64, True, 0.7)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.sum(), (q64, k64, v64))
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g.double(), e, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------------
def _bad(q=(1, 2, 8, 16), k=(1, 2, 8, 16), v=(1, 2, 8, 16), dtype=F32, k_dtype=None, v_dtype=None):
    return (torch.randn(q, dtype=dtype), torch.randn(k, dtype=k_dtype or dtype),
            torch.randn(v, dtype=v_dtype or dtype))


@pytest.mark.parametrize("args, kwargs, error, match", [
    pytest.param(_bad(q=(2, 8, 16)), {}, ValueError, r"q must be 4-D", id="q-rank"),
    pytest.param(_bad(k=(1, 2, 1, 8, 16)), {}, ValueError, r"k must be 4-D", id="k-rank"),
    pytest.param(_bad(dtype=torch.float64), {}, TypeError, r"q must be float32, float16 or bfloat16", id="q-dtype"),
    pytest.param(_bad(k_dtype=F16), {}, TypeError, r"k has dtype torch.float16 but q has dtype torch.float32",
                 id="k-dtype-mismatch"),
    pytest.param(_bad(v_dtype=F16), {}, TypeError, r"v has dtype", id="v-dtype-mismatch"),
    pytest.param(_bad(q=(1, 2, 8, 48), k=(1, 2, 8, 48), v=(1, 2, 8, 48)), {}, ValueError,
                 r"head_dim 48; supported head dims are \(16, 32, 64, 128\)", id="head-dim"),
    pytest.param(_bad(k=(1, 2, 8, 32), v=(1, 2, 8, 32)), {}, ValueError, r"k has head_dim 32 but q has head_dim 16",
                 id="head-dim-mismatch"),
    pytest.param(_bad(q=(1, 3, 8, 16)), {}, ValueError, r"head count \(3\) must be a multiple of .* \(2\)",
                 id="heads-not-divisible"),
    pytest.param(_bad(k=(1, 0, 8, 16), v=(1, 0, 8, 16)), {}, ValueError,
                 r"k and v have no heads \(dim 1 is 0\) but q has 2", id="no-kv-heads"),
    pytest.param(_bad(v=(1, 2, 9, 16)), {}, ValueError, r"k and v must have the same shape", id="k-v-shape"),
    pytest.param(_bad(k=(2, 2, 8, 16), v=(2, 2, 8, 16)), {}, ValueError, r"k has batch size 2 but q has batch size 1",
                 id="batch"),
    pytest.param(_bad(k=(1, 2, 0, 16), v=(1, 2, 0, 16)), {}, ValueError, r"at least one key", id="no-keys"),
    pytest.param(_bad(), {"softmax_scale": -1.0}, ValueError, r"softmax_scale", id="scale"),
    pytest.param(_bad(), {"causal": 1}, TypeError, r"causal must be a bool", id="causal-type"),
])
def test_bad_inputs_raise_naming_the_argument(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        flash_attention(*args, **kwargs)


def test_not_a_tensor():
    with pytest.raises(TypeError, match="v must be a torch.Tensor"):
        flash_attention(torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 16), [[0.0]])


def test_devices_must_match():
    meta = torch.empty(1, 2, 8, 16, device="meta")
    with pytest.raises(ValueError, match=r"k is on meta but q is on cpu"):
        flash_attention(torch.randn(1, 2, 8, 16), meta, torch.randn(1, 2, 8, 16))


# --------------------------------------------------------------------------------------------
# GPU-only numerics (bf16 arithmetic is wrong on the interpreter; races need real parallelism)
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 arithmetic is only meaningful on a GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_bf16_on_gpu(causal):
    q, k, v = _inputs(2, 4, 2, 300, 300, 64, torch.bfloat16)
    _assert_within_2x_pytorch_error(q, k, v, causal=causal)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="determinism across parallel programs needs a GPU")
def test_backward_is_deterministic_on_gpu():
    """dK/dV of a GQA group are summed inside one program (no atomics), so reruns are bitwise equal."""
    q, k, v = _inputs(2, 8, 2, 1000, 1000, 64, F16)
    dout = torch.randn_like(q)
    first = _forward_backward(lambda a, b, c, causal, _s: flash_attention(a, b, c, causal=causal), q, k, v, dout,
                              True, None)
    for _ in range(5):
        again = _forward_backward(lambda a, b, c, causal, _s: flash_attention(a, b, c, causal=causal), q, k, v, dout,
                                  True, None)
        assert all(torch.equal(x, y) for x, y in zip(first, again))


# --------------------------------------------------------------------------------------------
# torch.compile: the custom op is one opaque node with a registered backward
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_torch_compile_uses_the_custom_op():
    torch._dynamo.reset()
    q, k, v = _inputs(1, 4, 2, 70, 70, 16, F32)

    def attention_sum(q, k, v):
        return flash_attention(q, k, v, causal=True).square().sum()

    hybrid_kernels.reset_backend_counts()
    compiled = torch.compile(attention_sum, fullgraph=True)
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    expected_backend = hybrid_kernels.last_backend("flash_attention")
    assert expected_backend == "triton"
    assert hybrid_kernels.last_backend("flash_attention_backward") == "triton"
    eager_loss = attention_sum(q, k, v)
    eager_grads = torch.autograd.grad(eager_loss, (q, k, v))
    torch.testing.assert_close(loss, eager_loss, atol=1e-5, rtol=1e-5)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.usefixtures("eager_backend")
@pytest.mark.parametrize("batch, n_q_heads, n_kv_heads, seq_q, seq_k, causal, dtype", [
    pytest.param(1, 2, 2, 33, 20, False, F32, id="mha"),
    pytest.param(2, 4, 2, 20, 33, True, F32, id="gqa-causal"),
    pytest.param(1, 4, 1, 17, 17, True, F16, id="mqa-causal-fp16"),
    pytest.param(2, 2, 1, 0, 17, True, F32, id="no-queries"),
])
def test_torch_compile_backward_on_the_eager_backend(batch, n_q_heads, n_kv_heads, seq_q, seq_k, causal, dtype):
    """The custom op's backward served by the eager reference (HYBRID_KERNELS_BACKEND=eager, or a
    CPU without the interpreter). Its implementation runs below the Autograd dispatch key, where
    no autograd graph is recorded: recomputing the forward and calling torch.autograd.grad there
    failed with "element 0 of tensors does not require grad"."""
    torch._dynamo.reset()
    q, k, v = _inputs(batch, n_q_heads, n_kv_heads, seq_q, seq_k, 16, dtype)
    dout = torch.randn(q.shape, device=DEVICE).to(dtype)

    def attention(q, k, v):
        return flash_attention(q, k, v, causal=causal, softmax_scale=0.3)

    hybrid_kernels.reset_backend_counts()
    out = torch.compile(attention, fullgraph=True)(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert hybrid_kernels.last_backend("flash_attention") == "eager"
    assert hybrid_kernels.last_backend("flash_attention_backward") == "eager"
    eager_out = attention(q, k, v)  # uncompiled: SDPA with torch's own autograd
    eager_grads = torch.autograd.grad(eager_out, (q, k, v), dout)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == F32 else {"atol": 2e-3, "rtol": 2e-3}
    torch.testing.assert_close(out, eager_out, **tolerance)
    for name, g, e, like in zip(("dq", "dk", "dv"), grads, eager_grads, (q, k, v)):
        assert g.shape == like.shape and g.dtype == like.dtype, name
        torch.testing.assert_close(g, e, **tolerance, msg=name)
    if seq_q == 0:
        assert torch.equal(grads[1], torch.zeros_like(k)) and torch.equal(grads[2], torch.zeros_like(v))


@pytest.mark.usefixtures("eager_backend")
@pytest.mark.parametrize("n_q_heads, n_kv_heads, seq_q, seq_k, causal", [
    (2, 2, 33, 20, False), (4, 2, 20, 33, True), (4, 1, 40, 17, True)])
def test_backward_op_on_the_eager_backend_matches_float64_reference(n_q_heads, n_kv_heads, seq_q, seq_k, causal):
    """The same op the compiled graph calls, called directly (fast, no compile): its eager
    implementation runs below the Autograd key too."""
    q, k, v = (t.detach() for t in _inputs(2, n_q_heads, n_kv_heads, seq_q, seq_k, 16, F32))
    dout = torch.randn(q.shape, device=DEVICE)
    out, stats, residual = fa._flash_attention_fwd_op(q, k, v, causal, 0.3)
    grads = fa._flash_attention_bwd_op(dout, q, k, v, out, residual, stats, causal, 0.3)
    assert hybrid_kernels.last_backend("flash_attention_backward") == "eager"
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    expected = torch.autograd.grad(_attention_float64(q64, k64, v64, causal, 0.3), (q64, k64, v64), dout.double())
    for name, g, e, like in zip(("dq", "dk", "dv"), grads, expected, (q, k, v)):
        assert g.shape == like.shape and g.dtype == like.dtype and g.is_contiguous(), name
        torch.testing.assert_close(g.double(), e, atol=1e-5, rtol=1e-5, msg=name)


def test_custom_op_fake_kernels_give_the_real_shapes():
    """What torch.compile traces with: fake tensors must match the real outputs' shapes/dtypes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = (t.detach() for t in _inputs(1, 4, 2, 9, 5, 16, F16))
    real_fwd = fa._flash_attention_fwd_op(q, k, v, True, 0.25)
    real_out, real_lse, real_residual = real_fwd
    real_grads = fa._flash_attention_bwd_op(real_out, q, k, v, real_out, real_residual, real_lse, True, 0.25)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fake_fwd = fa._flash_attention_fwd_op(fq, fk, fv, True, 0.25)
        fake_out, fake_lse, fake_residual = fake_fwd
        fake_grads = fa._flash_attention_bwd_op(fake_out, fq, fk, fv, fake_out, fake_residual, fake_lse, True, 0.25)
    assert real_residual.shape == q.shape  # fp16: the backward's exact-output residual is saved
    for real, fake in zip((*real_fwd, *real_grads), (*fake_fwd, *fake_grads)):
        assert real.shape == fake.shape and real.dtype == fake.dtype and real.stride() == fake.stride()


# --------------------------------------------------------------------------------------------
# CausalSelfAttention module
# --------------------------------------------------------------------------------------------
def _module_reference(module: CausalSelfAttention, x: torch.Tensor) -> torch.Tensor:
    """The same computation written with SDPA and the module's own weights."""
    batch, seq, _ = x.shape
    head_dim, n_heads, n_kv_heads = module.head_dim, module.n_heads, module.n_kv_heads
    qkv = F.linear(x, module.qkv.weight, module.qkv.bias)
    q, k, v = qkv.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], dim=-1)
    q = q.view(batch, seq, n_heads, head_dim).transpose(1, 2)
    k = k.view(batch, seq, n_kv_heads, head_dim).transpose(1, 2).repeat_interleave(n_heads // n_kv_heads, dim=1)
    v = v.view(batch, seq, n_kv_heads, head_dim).transpose(1, 2).repeat_interleave(n_heads // n_kv_heads, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = y.transpose(1, 2).reshape(batch, seq, n_heads * head_dim)
    return F.linear(y, module.out_proj.weight, module.out_proj.bias)


@pytest.mark.parametrize("n_kv_heads, bias", [(None, True), (2, False), (1, True)])
def test_module_matches_sdpa_reference_forward_and_backward(n_kv_heads, bias):
    module = CausalSelfAttention(d_model=64, n_heads=4, n_kv_heads=n_kv_heads, bias=bias).to(DEVICE)
    x = torch.randn(2, 33, 64, device=DEVICE, requires_grad=True)
    hybrid_kernels.reset_backend_counts()
    y = module(x)
    assert y.shape == x.shape
    assert hybrid_kernels.last_backend("flash_attention") == "triton"
    dy = torch.randn_like(y)
    params = [p for p in module.parameters()]
    grads = torch.autograd.grad(y, [x, *params], dy)
    assert hybrid_kernels.last_backend("flash_attention_backward") == "triton"
    y_ref = _module_reference(module, x)
    grads_ref = torch.autograd.grad(y_ref, [x, *params], dy)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    names = ["x"] + [n for n, _ in module.named_parameters()]
    for name, g, e in zip(names, grads, grads_ref):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4, msg=name)


def test_module_is_causal():
    """Changing a later token must not change earlier outputs."""
    module = CausalSelfAttention(d_model=32, n_heads=2).to(DEVICE)
    x = torch.randn(1, 20, 32, device=DEVICE)
    with torch.no_grad():
        y = module(x)
        x[:, 12:] += 1.0
        y_changed = module(x)
    torch.testing.assert_close(y[:, :12], y_changed[:, :12])
    assert not torch.allclose(y[:, 12:], y_changed[:, 12:])


@pytest.mark.parametrize("kwargs, match", [
    ({"d_model": 60, "n_heads": 4}, r"head_dim 15"),
    ({"d_model": 64, "n_heads": 3}, r"d_model \(64\) must be divisible by n_heads \(3\)"),
    ({"d_model": 64, "n_heads": 4, "n_kv_heads": 3}, r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"),
    ({"d_model": 64 * 3, "n_heads": 1}, r"head_dim 192"),
])
def test_module_rejects_bad_configuration(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CausalSelfAttention(**kwargs)


def test_module_rejects_bad_input_shape():
    module = CausalSelfAttention(d_model=32, n_heads=2)
    with pytest.raises(ValueError, match=r"x must be \[batch, seq_len, 32\]"):
        module(torch.randn(2, 5, 16))

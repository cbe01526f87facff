"""encode_state benchmarks (pytest-benchmark; run WITHOUT TRITON_INTERPRET).

* Optimizer-moment reduction over a 12-layer transformer's parameter shapes (~10M and ~100M
  parameters, fp32 exp_avg + exp_avg_sq): the hybrid_kernels path (Triton on CUDA, eager row-norm
  sums on CPU) vs a per-tensor Python loop of plain torch ops.
* The full encode_state call (window statistics + moments) and the window statistics alone.

extra_info: impl, elements (moment elements read), bytes (bytes read) → GB/s = bytes / mean time.
Skip the 800 MB case with ``-k "not 100M"``.
"""
import pytest
import torch

from hybrid_kernels.encode_state import StateHistory, encode_state, moment_statistics

from .conftest import timed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def transformer_shapes(d_model: int, vocab: int, layers: int = 12, context: int = 1024) -> list[tuple[int, ...]]:
    """Parameter shapes of a GPT-style model: embeddings, per layer (ln, qkv, proj, ln, mlp), final ln."""
    shapes = [(vocab, d_model), (context, d_model)]
    for _ in range(layers):
        shapes += [(d_model,), (d_model,), (3 * d_model, d_model), (3 * d_model,), (d_model, d_model), (d_model,),
                   (d_model,), (d_model,), (4 * d_model, d_model), (4 * d_model,), (d_model, 4 * d_model), (d_model,)]
    return shapes + [(d_model,), (d_model,)]


MODELS = {"10M": dict(d_model=256, vocab=8192), "100M": dict(d_model=768, vocab=32000)}
_cache: dict[str, list] = {}


def moments_for(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if name not in _cache:
        _cache.clear()  # keep at most one model's moments alive (100M fp32 pairs = 800 MB)
        g = torch.Generator(device=DEVICE).manual_seed(0)
        _cache[name] = [(torch.randn(s, device=DEVICE, generator=g) * 1e-3,
                         torch.rand(s, device=DEVICE, generator=g) * 1e-6) for s in transformer_shapes(**MODELS[name])]
    return _cache[name]


def _info(benchmark, group: str, impl: str, pairs, baseline: bool = False) -> None:
    elements = sum(m.numel() for m, _ in pairs)
    benchmark.group = group
    benchmark.extra_info.update(impl=impl, elements=elements, baseline=baseline,
                                bytes=sum(m.numel() * m.element_size() + v.numel() * v.element_size() for m, v in pairs),
                                device=DEVICE)


def _sync(x):
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return x


def per_tensor_loop(pairs) -> torch.Tensor:
    """The baseline a user would write: per-tensor torch reductions, summed in Python."""
    count = s_m = s_mm = s_v = s_vv = 0.0
    for m, v in pairs:
        a = m.abs()
        count += m.numel()
        s_m += a.sum().item()
        s_mm += a.square().sum().item()
        s_v += v.sum().item()
        s_vv += v.square().sum().item()
    m_mean, v_mean = s_m / count, s_v / count
    return torch.tensor([2.0, m_mean, max(s_mm / count - m_mean ** 2, 0) ** 0.5, v_mean,
                         max(s_vv / count - v_mean ** 2, 0) ** 0.5, 0.0])


SIZES = ["10M", pytest.param("100M", marks=pytest.mark.slow, id="100M")]


@pytest.mark.parametrize("model", SIZES)
def test_moments_hybrid_kernels(benchmark, model):
    pairs = moments_for(model)
    _info(benchmark, f"encode_state moments {model}", "hybrid_kernels", pairs)
    stats = benchmark.pedantic(lambda: _sync(moment_statistics(pairs)), rounds=3, warmup_rounds=1)
    reference = per_tensor_loop(pairs)
    assert torch.allclose(stats.cpu().double(), reference.double(), rtol=1e-4)


@pytest.mark.parametrize("model", SIZES)
def test_moments_per_tensor_loop(benchmark, model):
    pairs = moments_for(model)
    _info(benchmark, f"encode_state moments {model}", "per_tensor_loop", pairs, baseline=True)
    benchmark.pedantic(lambda: per_tensor_loop(pairs), rounds=3, warmup_rounds=1)


def _full_history() -> StateHistory:
    h = StateHistory(device=DEVICE)
    for i in range(300):
        h.push_loss(3.0 / (1 + 0.01 * i))
        h.push_grad_norm(1.0 + 0.001 * i)
        h.push_update_norm(1e-3)
    h.lr, h.step, h.phase, h.phase_step = 3e-4, 300, 1, 20
    return h


def test_encode_state_window_only(benchmark):
    h = _full_history()
    _info(benchmark, "encode_state full call", "window_only", [])
    benchmark.extra_info.update(elements=h.buffer.numel(), bytes=h.buffer.numel() * 4)
    out = timed(benchmark, lambda: _sync(encode_state(h)))
    assert out.shape == (64,)


def test_encode_state_with_10M_moments(benchmark):
    h = _full_history()
    pairs = moments_for("10M")
    # The group's reference: the whole call, of which the window statistics are a part.
    _info(benchmark, "encode_state full call", "with_10M_moments", pairs, baseline=True)
    out = benchmark.pedantic(lambda: _sync(encode_state(h, pairs)), rounds=5, warmup_rounds=1)
    assert torch.isfinite(out).all()

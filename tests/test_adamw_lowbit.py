"""Low-bit AdamW: the fused Triton update (on the GPU when there is one, else interpreted on CPU)
against its eager reference, the optimizer's update against torch's fp32 AdamW within stated
tolerances, stochastic rounding, and exact resume."""
import pytest
import torch

import hybrid_kernels as hk
from hybrid_kernels import adamw_lowbit as K
from hybrid_trainer.lowbit_adamw import LowBitAdamW


def _state(n, bits, block, device="cpu"):
    return {k: torch.zeros(s, dtype=d, device=device) for k, (s, d) in K.state_shapes(n, bits, block).items()}


def _run(w, grads, bits, block, backend_env, monkeypatch, seed=3):
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", backend_env)
    st = _state(w.numel(), bits, block, w.device)
    for step, g in enumerate(grads, start=1):
        key = K.sr_key(seed, step, 0) if w.dtype == torch.bfloat16 else None
        K.adamw_lowbit_update_(w, g, st["m_codes"], st["m_scales"], st["v_codes"], st["v_scales"], bits=bits,
                               block_size=block, step=step, lr=1e-2, weight_decay=0.1, sr_key=key)
    return w, st


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,block", [(1000, 64), (300, 128), (17, 16)])
def test_triton_kernel_matches_eager(bits, dtype, n, block, device, monkeypatch):
    if not hk.INTERPRET and not torch.cuda.is_available():
        pytest.skip("kernels not interpreted in this process")
    g = torch.Generator().manual_seed(n)
    w0 = (torch.randn(n, generator=g) * 0.1).to(device=device, dtype=dtype)
    grads = [(torch.randn(n, generator=g) * torch.linspace(0.01, 3, n)).to(device) for _ in range(3)]
    w_e, st_e = _run(w0.clone(), grads, bits, block, "eager", monkeypatch)
    w_t, st_t = _run(w0.clone(), grads, bits, block, "triton", monkeypatch)
    assert hk.last_backend("adamw_lowbit") == "triton"
    # fp32 arithmetic may differ by an ulp (fma), which can move a code by one at a rounding
    # boundary: codes agree except for a few, scales to 1e-6, weights to one bf16 ulp.
    for name in ("m_codes", "v_codes"):
        differ = (st_e[name] != st_t[name]).float().mean().item()
        assert differ <= 0.01, (name, differ)
    for name in ("m_scales", "v_scales"):
        torch.testing.assert_close(st_e[name], st_t[name], rtol=1e-5, atol=1e-9)
    tol = dict(rtol=1e-2, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w_e.float(), w_t.float(), **tol)


def _noisy_gradients(n, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    signal = torch.randn(n, generator=g) * 1e-2
    spread = torch.rand(n, generator=g) * 2
    return [signal + torch.randn(n, generator=g) * spread * 1e-2 for _ in range(steps)]


# Relative error of the summed update after 40 steps on a noisy gradient stream, and its cosine
# with the fp32 AdamW update (measured: 8-bit 0.02 / 0.9998, 4-bit 0.25 / 0.97).
TOLERANCE = {None: (1e-5, 0.999999), 8: (0.05, 0.998), 4: (0.40, 0.93)}


@pytest.mark.parametrize("bits, block_size", [(None, None), (8, None), (4, None), (4, 256), (4, 512)])
def test_update_close_to_fp32_adamw(bits, block_size, eager_backend):
    """Larger 4-bit blocks (fewer fp32 scales: 1 + 8/256 or 8/512 bytes/param instead of 8/128)
    keep the 4-bit tolerance."""
    n = 10_000
    w0 = torch.randn(n) * 0.02
    ref = torch.nn.Parameter(w0.clone())
    mine = torch.nn.Parameter(w0.clone())
    opt_ref = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.1)
    opt = LowBitAdamW([mine], lr=1e-3, weight_decay=0.1, state_bits=bits, block_size=block_size)
    for g in _noisy_gradients(n, 40):
        ref.grad, mine.grad = g.clone(), g.clone()
        opt_ref.step()
        opt.step()
    du_ref, du = ref.detach() - w0, mine.detach() - w0
    rel = ((du - du_ref).norm() / du_ref.norm()).item()
    cos = torch.nn.functional.cosine_similarity(du, du_ref, dim=0).item()
    max_rel, min_cos = TOLERANCE[bits]
    assert rel <= max_rel and cos >= min_cos, (bits, rel, cos)


def test_stochastic_rounding_is_unbiased_and_keyed():
    lo = torch.tensor(1.0, dtype=torch.bfloat16)
    ulp = 2.0 ** -7  # bf16 spacing in [1, 2)
    x = torch.full((200_000,), 1.0 + 0.3 * ulp)
    index = torch.arange(x.numel())
    r = K.stochastic_round_bf16(x, index, key=123)
    assert set(r.float().unique().tolist()) == {1.0, 1.0 + ulp}
    assert abs(r.float().mean().item() - x[0].item()) < 0.01 * ulp
    assert torch.equal(r, K.stochastic_round_bf16(x, index, key=123))
    assert not torch.equal(r, K.stochastic_round_bf16(x, index, key=124))
    # Round-to-nearest would lose an update of 0.3 ulp entirely.
    assert x.to(torch.bfloat16).eq(lo).all()


def test_bf16_weights_follow_small_updates(eager_backend):
    """Updates far below one bf16 ulp still move bf16 weights on average (stochastic rounding)."""
    n = 20_000
    w = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    opt = LowBitAdamW([w], lr=1e-4, weight_decay=0.0, state_bits=8)  # 1e-4 per step << ulp 7.8e-3
    for _ in range(50):
        w.grad = torch.ones(n, dtype=torch.bfloat16)
        opt.step()
    moved = 1.0 - w.detach().float().mean().item()
    assert abs(moved - 50 * 1e-4) < 1e-4, moved


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_resume_is_bit_exact(bits, eager_backend, tmp_path):
    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(33, 40), torch.nn.GELU(), torch.nn.Linear(40, 5)).bfloat16()
        return model, LowBitAdamW(model.parameters(), lr=1e-2, state_bits=bits, seed=7)

    def train(model, opt, steps, offset):
        for s in range(steps):
            g = torch.Generator().manual_seed(offset + s)
            x = torch.randn(16, 33, generator=g).bfloat16()
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    model, opt = make()
    train(model, opt, 6, 0)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ck.pt")
    train(model, opt, 6, 6)
    model2, opt2 = make()
    ck = torch.load(tmp_path / "ck.pt")
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    for t in opt2.state.values():  # loading keeps the state's own dtypes
        for k, v in t.items():
            if k.endswith("scales") or k.startswith("exp_avg"):
                assert v.dtype == torch.float32
    train(model2, opt2, 6, 6)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_state_bytes_per_parameter(eager_backend):
    p8 = torch.nn.Parameter(torch.zeros(256 * 100))
    p4 = torch.nn.Parameter(torch.zeros(128 * 100))
    for p, bits, expected in ((p8, 8, 2 + 8 / 256), (p4, 4, 1 + 8 / 128)):
        opt = LowBitAdamW([p], state_bits=bits)
        p.grad = torch.ones_like(p)
        opt.step()
        assert opt.state_bytes() / p.numel() == pytest.approx(expected)


def test_argument_errors():
    with pytest.raises(ValueError, match="state_bits"):
        LowBitAdamW([torch.nn.Parameter(torch.zeros(3))], state_bits=2)
    with pytest.raises(ValueError, match="block_size"):
        LowBitAdamW([torch.nn.Parameter(torch.zeros(3))], block_size=100)
    with pytest.raises(TypeError, match="float16"):
        LowBitAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))])
    w = torch.zeros(10, dtype=torch.bfloat16)
    st = _state(10, 8, 16)
    with pytest.raises(ValueError, match="sr_key"):
        K.adamw_lowbit_update_(w, w, st["m_codes"], st["m_scales"], st["v_codes"], st["v_scales"], bits=8,
                               block_size=16, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="m_codes"):
        K.adamw_lowbit_update_(w.float(), w, st["m_codes"][:3], st["m_scales"], st["v_codes"], st["v_scales"],
                               bits=8, block_size=16, step=1, lr=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_compiled_cpu_path_matches_eager(bits, eager_backend):
    n = K.CHUNK_ELEMENTS + 1000  # one full chunk and a padded one
    block = K.DEFAULT_BLOCK[bits]
    out = {}
    for compiled in (False, True):
        w = (torch.arange(n, dtype=torch.float32).sin() * 0.1).bfloat16()
        st = _state(n, bits, block)
        for step in (1, 2):
            g = torch.arange(n, dtype=torch.float32).cos() * step
            K.adamw_lowbit_update_(w, g, st["m_codes"], st["m_scales"], st["v_codes"], st["v_scales"], bits=bits,
                                   block_size=block, step=step, lr=1e-2, sr_key=K.sr_key(0, step, 0),
                                   compiled=compiled)
        out[compiled] = (w, st)
    torch.testing.assert_close(out[False][0].float(), out[True][0].float(), rtol=1e-2, atol=1e-3)
    for name in ("m_codes", "v_codes"):
        assert (out[False][1][name] != out[True][1][name]).float().mean() < 0.01


def test_adam_l2_penalty_matches_torch_adam(eager_backend):
    """decoupled_weight_decay=False is Adam's L2 penalty (the trainer converts torch's Adam so)."""
    w0 = torch.randn(500)
    ref, mine = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt_ref = torch.optim.Adam([ref], lr=1e-2, weight_decay=0.1)
    opt = LowBitAdamW([mine], lr=1e-2, weight_decay=0.1, state_bits=None, decoupled_weight_decay=False)
    for g in _noisy_gradients(500, 10):
        ref.grad, mine.grad = g.clone(), g.clone()
        opt_ref.step()
        opt.step()
    torch.testing.assert_close(mine.detach(), ref.detach(), rtol=1e-5, atol=1e-6)

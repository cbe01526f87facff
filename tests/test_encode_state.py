"""encode_state: the slot table, the ring buffers, the eager reference against independent numpy
formulas, the Triton kernels against the eager reference (slot by slot, under the interpreter),
the optimizer-moment multi-tensor reduction, the NaN/Inf policy, checkpointing and argument checks.

Kernel calls cost ~0.1 s each under the interpreter, so each Triton test makes only a few."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hybrid_kernels
from hybrid_kernels.encode_state import (
    FEATURE_INDEX,
    FEATURE_NAMES,
    FEATURE_TABLE,
    LOSS_EMA_ALPHAS,
    NUM_FEATURES,
    StateHistory,
    _encode_window_eager,
    _moment_sums_eager,
    encode_state,
    kernel_launches,
    moment_statistics,
)

F = FEATURE_INDEX
# The Triton tests need tensors where the kernels run: CPU under the interpreter, else the GPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# The interpreter evaluates `x - x` on the stored inf/nan entries with numpy (that is how the
# kernels detect them); numpy's warning about it is expected.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _rich_history(loss_capacity=100, grad_capacity=20, update_capacity=64, n_steps=137, seed=1,
                  device=DEVICE) -> StateHistory:
    """A history with wrapped rings, a trend, noise, and every scalar set to a non-default value."""
    g = torch.Generator().manual_seed(seed)
    h = StateHistory(loss_capacity, grad_capacity, update_capacity, device=device)
    noise = torch.randn(n_steps, generator=g).tolist()
    for i in range(n_steps):
        h.push_loss(3.0 * math.exp(-i / 50) + 0.05 * noise[i])
        if i % 3:
            h.push_grad_norm(1.0 + 0.1 * i + 0.3 * abs(noise[i]))
        h.push_update_norm(0.01 * (1 + i % 7) * (1 + 0.1 * seed))
    h.lr, h.step, h.phase, h.phase_step = 3e-4, n_steps, 2, 5
    h.prediction_error, h.acceptance_rate = 0.1, 0.5
    return h


def _moment_pairs(sizes=(1, 17, 1000, 70000), dtype=torch.float32, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g).to(device, dtype), (torch.rand(n, generator=g) * 1e-3).to(device, dtype))
            for n in sizes]


def _eager(history, optimizer_state=None, monkeypatch=None):
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", "eager")
    out = encode_state(history, optimizer_state)
    monkeypatch.delenv("HYBRID_KERNELS_BACKEND")
    assert hybrid_kernels.last_backend("encode_state") == "eager"
    return out


def _assert_slots_close(actual, expected, rtol=2e-5, atol=1e-6):
    bad = [(FEATURE_NAMES[i], a, e) for i, (a, e) in enumerate(zip(actual.tolist(), expected.tolist()))
           if not abs(a - e) <= atol + rtol * abs(e)]
    assert not bad, f"slots differ (name, actual, expected): {bad}"


# --------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------
def test_feature_table_documents_every_slot_once():
    assert len(FEATURE_TABLE) == NUM_FEATURES == 64
    assert [row[0] for row in FEATURE_TABLE] == list(range(64))
    assert len(set(FEATURE_NAMES)) == 64
    for index, name, formula, units in FEATURE_TABLE:
        assert name and formula and units, f"slot {index} is missing a name, formula or units"
        assert "pad" not in name and "reserved" not in name


def test_package_exports():
    assert hybrid_kernels.encode_state is encode_state
    assert hybrid_kernels.StateHistory is StateHistory
    assert {"encode_state", "StateHistory"} <= set(hybrid_kernels.__all__)


def test_a_compiled_caller_breaks_its_graph_at_encode_state(monkeypatch):
    """Under torch.compile the features are computed eagerly, outside every graph: the caller's
    graph stops before the call and goes on after it, and none of encode_state's ops is traced."""
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", "eager")  # the interpreter's launches are not the point
    history = _rich_history(device="cpu")
    graphs = []

    def count_graphs(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    def caller(x):
        features = encode_state(history)
        return (x * 2).sum() + features.sum()

    torch._dynamo.reset()
    x = torch.arange(4.0)
    compiled = torch.compile(caller, backend=count_graphs)
    assert torch.equal(compiled(x), caller(x))
    traced = [node for graph in graphs for node in graph.graph.nodes if node.op == "call_function"]
    assert traced, "the caller's own ops were traced"
    where = [node.meta.get("stack_trace") or "" for node in traced]
    assert not any("hybrid_kernels" in trace for trace in where), where
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------------
# Ring buffers
# --------------------------------------------------------------------------------------------
def test_ring_wraps_and_keeps_the_newest_values_in_order():
    h = StateHistory(loss_capacity=5, grad_norm_capacity=3, update_norm_capacity=1)
    assert h.count("loss") == 0 and h.values("loss").numel() == 0
    for i in range(3):
        h.push_loss(float(i))
    assert h.values("loss").tolist() == [0.0, 1.0, 2.0] and h.head("loss") == 3
    for i in range(3, 12):
        h.push_loss(float(i))
        h.push_update_norm(float(i))
    assert h.values("loss").tolist() == [7.0, 8.0, 9.0, 10.0, 11.0]
    assert h.count("loss") == 5 and h.pushes("loss") == 12 and h.head("loss") == 2
    assert h.values("update_norm").tolist() == [11.0]
    assert h.values("grad_norm").numel() == 0  # rings are independent


def test_push_accepts_one_element_tensors_without_host_round_trip():
    h = StateHistory(loss_capacity=4)
    h.push_loss(torch.tensor(1.5))
    h.push_loss(torch.tensor([2.5], dtype=torch.float64))
    h.push_grad_norm(torch.tensor(3, dtype=torch.int64))
    assert h.values("loss").tolist() == [1.5, 2.5]
    assert h.values("grad_norm").tolist() == [3.0]


# --------------------------------------------------------------------------------------------
# The eager reference against independent numpy formulas
# --------------------------------------------------------------------------------------------
def _np_ema(x, alpha):
    age = np.arange(len(x) - 1, -1, -1)
    w = (1 - alpha) ** age
    return float((w * x).sum() / w.sum())


def test_eager_window_features_match_numpy(monkeypatch):
    h = _rich_history(device="cpu")
    f = _eager(h, monkeypatch=monkeypatch).double()
    loss = h.values("loss").double().numpy()
    t = np.arange(len(loss), dtype=np.float64)
    line = np.polyfit(t, loss, 1)
    parabola = np.polyfit(t, loss, 2)
    checks = {
        "loss_last": loss[-1], "loss_mean": loss.mean(), "loss_std": loss.std(), "loss_min": loss.min(),
        "loss_max": loss.max(), "loss_slope": line[0], "loss_curvature": 2 * parabola[0],
        "loss_ema_fast": _np_ema(loss, LOSS_EMA_ALPHAS[0]), "loss_ema_mid": _np_ema(loss, LOSS_EMA_ALPHAS[1]),
        "loss_ema_slow": _np_ema(loss, LOSS_EMA_ALPHAS[2]), "loss_recent_mean": loss[-16:].mean(),
        "loss_recent_std": loss[-16:].std(), "loss_recent_slope": np.polyfit(t[-16:], loss[-16:], 1)[0],
        "loss_detrended_std": np.std(loss - np.polyval(line, t)),
        "loss_symlog_last": math.log1p(loss[-1]), "loss_last_zscore": (loss[-1] - loss.mean()) / loss.std(),
        "loss_steps_since_min": len(loss) - 1 - int(np.flatnonzero(loss == loss.min())[-1]),
        "loss_fill": len(loss) / 100, "loss_nonfinite": 0.0,
    }
    grad = h.values("grad_norm").double().numpy()
    upd = h.values("update_norm").double().numpy()
    checks.update({
        "grad_norm_mean": grad.mean(), "grad_norm_std": grad.std(), "grad_norm_recent_std": grad[-8:].std(),
        "grad_norm_slope": np.polyfit(np.arange(len(grad)), grad, 1)[0], "grad_norm_ema": _np_ema(grad, 1 / 8),
        "grad_norm_log10_last": math.log10(grad[-1]), "grad_norm_cv": grad.std() / grad.mean(),
        "grad_norm_spike": grad[-1] / grad.mean(), "update_norm_recent_mean": upd[-8:].mean(),
        "update_to_grad_last": upd[-1] / grad[-1], "update_to_grad_mean": upd.mean() / grad.mean(),
        "lr": 3e-4, "log10_lr": math.log10(3e-4), "log10_step": math.log10(138), "phase_predict": 1.0,
        "phase_full": 0.0, "phase_step": 5.0, "prediction_error": 0.1, "acceptance_rate": 0.5,
    })
    for name, expected in checks.items():
        got = float(f[F[name]])
        assert got == pytest.approx(float(expected), rel=2e-5, abs=1e-9), name


def test_curvature_and_slope_of_an_exact_parabola(monkeypatch):
    h = StateHistory(loss_capacity=64)
    for i in range(40):  # x = 5 - 0.1 t + 0.002 t²: slope of the LS line and exact 2nd derivative
        h.push_loss(5.0 - 0.1 * i + 0.002 * i * i)
    f = _eager(h, monkeypatch=monkeypatch)
    assert float(f[F["loss_curvature"]]) == pytest.approx(0.004, rel=1e-3)
    assert float(f[F["loss_slope"]]) == pytest.approx(-0.1 + 0.002 * 39, rel=1e-3)


def test_empty_history_gives_documented_defaults(monkeypatch):
    h = StateHistory()
    f = _eager(h, monkeypatch=monkeypatch)
    assert torch.isfinite(f).all()
    nonzero = {FEATURE_NAMES[i]: v for i, v in enumerate(f.tolist()) if v != 0.0}
    # lr 0 floors at 1e-12; phase 0 is WARMUP. Everything else is 0 for an empty history.
    assert nonzero == {"log10_lr": pytest.approx(-12.0), "phase_warmup": 1.0}


def test_short_windows_use_the_filled_part_only(monkeypatch):
    h = StateHistory()
    h.push_loss(2.0)
    f = _eager(h, monkeypatch=monkeypatch)
    assert f[F["loss_mean"]] == 2.0 and f[F["loss_std"]] == 0.0 and f[F["loss_slope"]] == 0.0
    assert f[F["loss_ema_slow"]] == 2.0 and f[F["loss_fill"]] == pytest.approx(1 / 256)
    h.push_loss(4.0)
    f = _eager(h, monkeypatch=monkeypatch)
    assert f[F["loss_slope"]] == 2.0 and f[F["loss_curvature"]] == 0.0  # 2 points: a line, no parabola


# --------------------------------------------------------------------------------------------
# NaN / Inf policy
# --------------------------------------------------------------------------------------------
def test_nonfinite_pushes_are_ignored_and_counted(monkeypatch):
    clean, dirty = StateHistory(loss_capacity=32), StateHistory(loss_capacity=32)
    values = [3.0, 2.5, 2.7, 2.2, 2.0]
    for v in values:
        clean.push_loss(v)
    for v in [3.0, float("nan"), 2.5, 2.7, float("inf"), 2.2, 2.0, float("-inf")]:
        dirty.push_loss(v)
    dirty.push_grad_norm(float("nan"))
    fc, fd = _eager(clean, monkeypatch=monkeypatch), _eager(dirty, monkeypatch=monkeypatch)
    assert torch.isfinite(fd).all()
    for name in ("loss_last", "loss_mean", "loss_std", "loss_min", "loss_max"):
        assert fd[F[name]] == pytest.approx(float(fc[F[name]]), rel=1e-6), name
    assert fd[F["loss_nonfinite"]] == 3 and fd[F["grad_norm_nonfinite"]] == 1
    assert fd[F["grad_norm_mean"]] == 0 and fd[F["grad_norm_log10_last"]] == 0  # all non-finite → empty
    assert fd[F["loss_fill"]] == pytest.approx(5 / 32)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                          st.sampled_from([0.0, -0.0, 1e-30, 3e38])), max_size=70))
def test_output_is_always_finite_for_any_pushed_values(values):
    h = StateHistory(loss_capacity=32, grad_norm_capacity=8, update_norm_capacity=8)
    for i, v in enumerate(values):
        (h.push_loss, h.push_grad_norm, h.push_update_norm)[i % 3](v)
    with pytest.MonkeyPatch.context() as mp:
        f = _eager(h, monkeypatch=mp)
    assert f.shape == (64,) and f.dtype == torch.float32 and torch.isfinite(f).all()


# --------------------------------------------------------------------------------------------
# Triton kernels against the eager reference (interpreter on CPU)
# --------------------------------------------------------------------------------------------
def _histories():
    yield "empty", StateHistory(device=DEVICE)
    one = StateHistory(loss_capacity=7, grad_norm_capacity=3, update_norm_capacity=5, device=DEVICE)
    one.push_loss(1.25)
    one.push_update_norm(0.5)
    yield "one_value", one
    three = StateHistory(device=DEVICE)
    for v in (2.0, 1.5, 1.75):
        three.push_loss(v)
        three.push_grad_norm(v * 2)
        three.push_update_norm(v / 3)
    three.phase = 3
    yield "three_values", three
    yield "wrapped_odd_capacities", _rich_history()
    dirty = _rich_history(loss_capacity=256, grad_capacity=64, update_capacity=33, n_steps=300, seed=2)
    for v in (float("nan"), 1.0, float("inf")):
        dirty.push_loss(v)
        dirty.push_grad_norm(v)
    dirty.phase = 0
    yield "nonfinite_full", dirty


@pytest.mark.parametrize("case", [name for name, _ in _histories()])
def test_triton_window_kernel_matches_eager_slot_by_slot(case, monkeypatch):
    h = dict(_histories())[case]
    expected = _eager(h, monkeypatch=monkeypatch)
    before = kernel_launches()["window"]
    actual = encode_state(h)
    assert hybrid_kernels.last_backend("encode_state") == "triton"
    assert kernel_launches()["window"] == before + 1  # one launch for all 64 slots
    assert actual.dtype == torch.float32 and actual.shape == (64,) and torch.isfinite(actual).all()
    _assert_slots_close(actual, expected)


def test_triton_with_moments_matches_eager_and_fills_every_slot(monkeypatch):
    h = _rich_history()
    pairs = _moment_pairs()
    expected = _eager(h, pairs, monkeypatch)
    actual = encode_state(h, pairs)
    assert hybrid_kernels.last_backend("encode_state") == "triton"
    _assert_slots_close(actual, expected, rtol=2e-5)
    # Each slot comes from real data: in this rich history only the other phases' one-hot slots
    # and the non-finite counters are 0.
    zero = {FEATURE_NAMES[i] for i, v in enumerate(actual.tolist()) if v == 0.0}
    assert zero == {"phase_warmup", "phase_full", "phase_correct", "loss_nonfinite", "grad_norm_nonfinite",
                    "update_norm_nonfinite", "moment_nonfinite_fraction"}


def test_no_slot_is_constant_across_histories(monkeypatch):
    rows = []
    for seed in range(8):
        h = _rich_history(n_steps=40 + 30 * seed, seed=seed)
        h.phase, h.phase_step, h.step = seed % 4, seed, 100 * seed
        h.lr, h.prediction_error, h.acceptance_rate = 1e-3 / (1 + seed), 0.1 * seed, seed / 8
        h.push_loss(float("nan") if seed % 2 else 1.0)
        h.push_grad_norm(float("inf") if seed % 3 == 0 else 2.0)
        h.push_update_norm(float("nan") if seed % 4 == 1 else 0.5)
        if seed % 3 == 0:
            state = None
        elif seed % 3 == 1:
            state = [(torch.randn(100) * (1 + seed), torch.rand(100) * seed)]
            state[0][0][seed] = float("nan")
        else:
            state = [(torch.randn(50) * seed, torch.rand(50))]
        rows.append(_eager(h, state, monkeypatch))
    constant = [FEATURE_NAMES[i] for i in range(64) if torch.stack(rows)[:, i].unique().numel() == 1]
    assert not constant, f"slots that never change: {constant}"


# --------------------------------------------------------------------------------------------
# Optimizer moments: multi-tensor reduction
# --------------------------------------------------------------------------------------------
def _np_moment_stats(pairs, second=True):
    m = np.concatenate([p[0].double().flatten().cpu().numpy() for p in pairs])
    v = np.concatenate([p[1].double().flatten().cpu().numpy() for p in pairs]) if second else np.zeros_like(m)
    ok = np.isfinite(m) & np.isfinite(v)
    m, v = np.abs(m[ok]), np.abs(v[ok])
    return [2.0 if second else 1.0, m.mean(), m.std(), v.mean() if second else 0.0, v.std() if second else 0.0,
            1 - ok.sum() / ok.size]


def test_moment_reduction_triton_one_launch_per_dtype_group_matches_numpy():
    pairs = _moment_pairs()  # fp32 group
    pairs += [(m.half(), v.half()) for m, v in _moment_pairs((33, 9000), seed=1)]  # fp16 group
    pairs += [(m.bfloat16(), v.bfloat16()) for m, v in _moment_pairs((5,), seed=2)]  # bf16 group
    pairs[2][0][7] = float("nan")
    pairs[3][1][123] = float("inf")
    before = kernel_launches()["moments"]
    stats = moment_statistics(pairs)
    assert hybrid_kernels.last_backend("encode_state") == "triton"
    assert kernel_launches()["moments"] == before + 3
    np.testing.assert_allclose(stats.double().cpu().numpy(), _np_moment_stats(pairs), rtol=1e-5, atol=1e-12)


def test_moment_reduction_eager_matches_numpy(monkeypatch):
    pairs = _moment_pairs()
    pairs[1][0][3] = float("-inf")
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", "eager")
    stats = moment_statistics(pairs)
    assert hybrid_kernels.last_backend("encode_state") == "eager"
    np.testing.assert_allclose(stats.double().cpu().numpy(), _np_moment_stats(pairs), rtol=1e-5, atol=1e-12)


def test_moment_sums_triton_equal_eager_sums():
    from hybrid_kernels.encode_state import _moment_sums_triton_group
    pairs = _moment_pairs((17, 8192, 8193, 70000))  # straddles the interpreter's 8192-element chunk
    ms, vs = [p[0] for p in pairs], [p[1] for p in pairs]
    tri, ref = _moment_sums_triton_group(ms, vs), _moment_sums_eager(ms, vs)
    m = torch.cat(ms).double().abs()
    v = torch.cat(vs).double()
    truth = torch.stack([torch.tensor(float(m.numel()), dtype=torch.float64, device=m.device), m.sum(), (m * m).sum(), v.sum(),
                         (v * v).sum()])
    torch.testing.assert_close(tri, truth, rtol=2e-6, atol=0)
    torch.testing.assert_close(ref, truth, rtol=2e-6, atol=0)


def test_moments_from_views_and_shared_storage():
    storage = torch.randn(4000, device=DEVICE)
    sq = torch.rand(4000, device=DEVICE)
    pairs = [(storage[:1000], sq[:1000]), (storage[1000:3000].view(40, 50), sq[1000:3000].view(40, 50)),
             (storage[3001:].view(-1)[::3], sq[3001:][::3]),  # strided: reduced by the eager fallback
             (storage[3001:3003], sq[3001:3003])]  # odd offset: still whole elements from the base
    stats = moment_statistics(pairs)
    assert hybrid_kernels.last_backend("encode_state") == "triton"
    np.testing.assert_allclose(stats.double().cpu().numpy(), _np_moment_stats(pairs), rtol=1e-5, atol=1e-12)


def test_moments_from_real_optimizers():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x = torch.randn(32, 8)

    def step(opt):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    adam = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert moment_statistics(adam).tolist() == [0.0] * 6  # no state before the first step
    step(adam)
    step(adam)
    pairs = [(adam.state[p]["exp_avg"], adam.state[p]["exp_avg_sq"]) for p in model.parameters()]
    np.testing.assert_allclose(moment_statistics(adam).double().numpy(), _np_moment_stats(pairs), rtol=1e-5)

    sgd = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    step(sgd)
    buffers = [(sgd.state[p]["momentum_buffer"], sgd.state[p]["momentum_buffer"]) for p in model.parameters()]
    stats = moment_statistics(sgd)
    np.testing.assert_allclose(stats.double().numpy(), _np_moment_stats(buffers, second=False), rtol=1e-5)
    assert stats[0] == 1 and stats[3] == 0 and stats[4] == 0  # second-moment slots documented as 0

    plain = torch.optim.SGD(model.parameters(), lr=1e-2)
    step(plain)
    assert moment_statistics(plain).tolist() == [0.0] * 6


def test_encode_state_with_sgd_momentum_fills_first_moment_slots_only():
    h = _rich_history()
    p = torch.nn.Parameter(torch.randn(10))
    sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.randn(10)
    sgd.step()
    f = encode_state(h, sgd)
    assert f[F["moment_source"]] == 1 and f[F["m_abs_mean"]] > 0
    assert f[F["v_mean"]] == 0 and f[F["v_log10_mean"]] == 0 and f[F["moment_snr"]] == 0


# --------------------------------------------------------------------------------------------
# Checkpointing
# --------------------------------------------------------------------------------------------
def test_state_dict_round_trip_resumes_bit_exactly(monkeypatch, tmp_path):
    original = _rich_history()
    path = tmp_path / "history.pt"
    torch.save(original.state_dict(), path)
    resumed = StateHistory(100, 20, 64, device=DEVICE)
    resumed.load_state_dict(torch.load(path))
    for h in (original, resumed):  # continue both the same way
        for v in (0.3, float("nan"), 0.25):
            h.push_loss(v)
            h.push_grad_norm(v * 10)
        h.step += 3
    assert torch.equal(_eager(original, monkeypatch=monkeypatch), _eager(resumed, monkeypatch=monkeypatch))
    assert torch.equal(encode_state(original), encode_state(resumed))
    assert original.buffer.data_ptr() != resumed.buffer.data_ptr()
    assert repr(original) == repr(resumed)


def test_state_dict_is_a_copy_and_mismatches_are_rejected():
    h = _rich_history()
    state = h.state_dict()
    h.push_loss(123.0)
    assert 123.0 not in state["buffer"].tolist()
    with pytest.raises(ValueError, match="capacities"):
        StateHistory(loss_capacity=50).load_state_dict(state)
    bad = dict(state, scalars=dict(state["scalars"], phase=9))
    fresh = StateHistory(100, 20, 64)
    with pytest.raises(ValueError, match="phase"):
        fresh.load_state_dict(bad)
    assert fresh.count("loss") == 0  # nothing was half-loaded
    with pytest.raises(ValueError, match="missing"):
        fresh.load_state_dict({"version": 1})


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, word", [
    (dict(loss_capacity=0), ValueError, "loss_capacity"),
    (dict(grad_norm_capacity=5000), ValueError, "grad_norm_capacity"),
    (dict(update_norm_capacity=2.5), TypeError, "update_norm_capacity"),
])
def test_bad_capacities(kwargs, error, word):
    with pytest.raises(error, match=word):
        StateHistory(**kwargs)


@pytest.mark.parametrize("field, value, error", [
    ("lr", -1.0, ValueError), ("lr", float("nan"), ValueError), ("lr", "0.1", TypeError),
    ("step", -1, ValueError), ("step", 1.5, TypeError), ("phase", 4, ValueError), ("phase", True, TypeError),
    ("phase_step", -2, ValueError), ("prediction_error", float("inf"), ValueError),
    ("acceptance_rate", 1.5, ValueError),
])
def test_bad_scalars_name_the_field(field, value, error):
    h = StateHistory()
    with pytest.raises(error, match=field):
        setattr(h, field, value)


def test_bad_pushes_and_arguments_name_the_argument():
    h = StateHistory()
    with pytest.raises(TypeError, match="loss"):
        h.push_loss("1.0")
    with pytest.raises(ValueError, match="grad_norm"):
        h.push_grad_norm(torch.ones(2))
    with pytest.raises(TypeError, match="update_norm"):
        h.push_update_norm(torch.tensor(True))
    with pytest.raises(TypeError, match="history"):
        encode_state([1.0, 2.0])
    with pytest.raises(TypeError, match="optimizer_state"):
        encode_state(h, torch.ones(3))
    with pytest.raises(TypeError, match=r"optimizer_state\[1\]"):
        encode_state(h, [(torch.ones(2), torch.ones(2)), torch.ones(2)])
    with pytest.raises(ValueError, match=r"optimizer_state\[0\].*shape"):
        encode_state(h, [(torch.ones(2), torch.ones(3))])
    with pytest.raises(TypeError, match=r"optimizer_state\[0\] exp_avg_sq"):
        encode_state(h, [(torch.ones(2), torch.ones(2, dtype=torch.int32))])
    with pytest.raises(ValueError, match="ring"):
        h.values("lossy")

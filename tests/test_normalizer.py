"""RunningNormalizer: exact running statistics, forgetting, constant slots, clipping, checkpoints."""
import numpy as np
import pytest
import torch

from hybrid_trainer.normalizer import RunningNormalizer


def _stream(rows=300, features=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(rows, features, generator=g, dtype=torch.float64) * torch.tensor(
        [1.0, 1e-4, 1e3, 5.0, 0.0, 2.0], dtype=torch.float64) + torch.tensor([0, 3e-4, -7, 1e3, 4.0, 0],
                                                                            dtype=torch.float64)
    return data


def test_matches_mean_and_variance_of_all_rows_seen_in_any_batching():
    data = _stream()
    one_by_one, batched = RunningNormalizer(6), RunningNormalizer(6)
    for row in data:
        one_by_one.update(row.float())
    for chunk in torch.split(data, [1, 50, 7, 142, 100]):
        batched.update(chunk.float())
    expected = data.float().double().numpy()
    for norm in (one_by_one, batched):
        assert norm.count == 300
        np.testing.assert_allclose(norm.mean.numpy(), expected.mean(axis=0), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(norm.var.numpy(), expected.var(axis=0), rtol=1e-8, atol=1e-20)


def test_normalize_standardises_and_clips():
    data = _stream()
    norm = RunningNormalizer(6, clip=3.0)
    norm.update(data)
    z = norm.normalize(data.float())
    assert z.dtype == torch.float32 and z.shape == data.shape and torch.isfinite(z).all()
    assert z.abs().max() <= 3.0
    varying = [0, 1, 2, 3, 5]
    assert torch.allclose(z[:, varying].mean(dim=0).double(), torch.zeros(5, dtype=torch.float64), atol=0.05)
    assert ((z[:, varying].std(dim=0) - 1).abs() < 0.1).all()  # unit scale (clipping trims the tails)


def test_constant_slot_gives_zero_then_bounded_signal_and_never_nan():
    norm = RunningNormalizer(3, clip=5.0)
    for _ in range(10):
        norm.update(torch.tensor([2.0, 0.0, 1.0]) + torch.tensor([0.0, 0.0, torch.rand(()).item()]))
    assert norm.var[0] == 0 and norm.var[1] == 0
    z = norm.normalize(torch.tensor([2.0, 0.0, 1.5]))
    assert z[0] == 0 and z[1] == 0
    z = norm.normalize(torch.tensor([2.5, -1e-3, float("nan")]))
    assert z.tolist()[:2] == [5.0, -5.0] and z[2] == 0
    z = norm.normalize(torch.tensor([float("inf"), float("-inf"), 1.0]))
    assert z.tolist()[:2] == [5.0, -5.0] and torch.isfinite(z).all()


def test_before_any_update_output_is_zero():
    z = RunningNormalizer(4).normalize(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    assert z.shape == (1, 4) and (z == 0).all()


def test_max_count_forgets_old_data():
    exact, forgetting = RunningNormalizer(1), RunningNormalizer(1, max_count=50)
    for value in [0.0] * 1000 + [10.0] * 300:
        row = torch.tensor([value + 0.01 * torch.randn(()).item()])
        exact.update(row)
        forgetting.update(row)
    assert exact.mean[0] == pytest.approx(10 * 300 / 1300, rel=0.01)
    assert forgetting.mean[0] == pytest.approx(10.0, abs=0.05)  # (1 - 1/51)^300 of the old mean remains
    assert forgetting.var[0] < 1.0 < 15.0 < exact.var[0] and forgetting.weight == 50


def test_update_rejects_bad_input_and_keeps_statistics():
    norm = RunningNormalizer(3)
    norm.update(torch.ones(3))
    with pytest.raises(ValueError, match="non-finite"):
        norm.update(torch.tensor([1.0, float("nan"), 0.0]))
    with pytest.raises(ValueError, match="x must have shape"):
        norm.update(torch.ones(4))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        norm.update([1.0, 2.0, 3.0])
    with pytest.raises(TypeError, match="x must be a real tensor"):
        norm.normalize(torch.ones(3, dtype=torch.bool))
    assert norm.count == 1 and norm.mean.tolist() == [1.0, 1.0, 1.0]
    for kwargs, word in ((dict(num_features=0), "num_features"), (dict(clip=0.0), "clip"),
                         (dict(max_count=0), "max_count"), (dict(abs_floor=-1.0), "abs_floor")):
        with pytest.raises(ValueError, match=word):
            RunningNormalizer(**kwargs)


def test_state_dict_round_trip_is_exact(tmp_path):
    data = _stream()
    a = RunningNormalizer(6, max_count=100)
    a.update(data[:150])
    torch.save(a.state_dict(), tmp_path / "norm.pt")
    b = RunningNormalizer(6)
    b.load_state_dict(torch.load(tmp_path / "norm.pt"))
    a.update(data[150:])
    b.update(data[150:])
    assert torch.equal(a.mean, b.mean) and torch.equal(a.var, b.var) and a.count == b.count
    assert torch.equal(a.normalize(data.float()), b.normalize(data.float()))
    with pytest.raises(ValueError, match="num_features"):
        RunningNormalizer(5).load_state_dict(a.state_dict())


def test_normalizes_encode_state_output():
    from hybrid_kernels.encode_state import StateHistory, encode_state

    h = StateHistory(loss_capacity=16, grad_norm_capacity=8, update_norm_capacity=8)
    norm = RunningNormalizer(64)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HYBRID_KERNELS_BACKEND", "eager")
        for step in range(30):
            h.push_loss(2.0 / (1 + step))
            h.push_grad_norm(1.0 + step % 3)
            h.step = step
            features = encode_state(h)
            norm.update(features)
            z = norm.normalize(features)
            assert torch.isfinite(z).all() and z.abs().max() <= norm.clip

"""HybridTrainer with ``predictor="nowcast"``: jumps, verdicts, exact rollback and resume."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hybrid_trainer import HybridConfig, HybridTrainer
from hybrid_trainer import nowcaster as nc


def _loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _stream(n: int = 60):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 10, generator=gen)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 0.5).long()
    return [(x[(i * 16) % 256:(i * 16) % 256 + 16], y[(i * 16) % 256:(i * 16) % 256 + 16]) for i in range(n)]


@pytest.fixture(scope="module")
def caster_path(tmp_path_factory):
    """A nowcaster that moves the weights noticeably (random weights, saved like the shipped one)."""
    torch.manual_seed(3)
    caster = nc.build_nowcaster("weight")
    with torch.no_grad():
        for p in caster.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    path = tmp_path_factory.mktemp("caster") / "caster.pt"
    nc.save_nowcaster(caster, path)
    return str(path)


def _trainer(caster_path, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(10, 24), nn.ReLU(), nn.Linear(24, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = dict(predictor="nowcast", nowcast_spacing=2, nowcast_call_every=12, nowcast_recovery_steps=4,
               nowcast_trend_steps=6, nowcast_weights=caster_path, warmup_steps=2)
    cfg.update(overrides)
    return HybridTrainer(model, opt, _loss, HybridConfig(**cfg))


def _flat(trainer):
    return torch.cat([p.detach().reshape(-1) for p in trainer.params]).clone()


def test_nowcast_config_is_validated():
    with pytest.raises(ValueError, match="predictor"):
        HybridConfig(predictor="oracle")
    with pytest.raises(ValueError, match="nowcast_recovery_steps"):
        HybridConfig(predictor="nowcast", nowcast_call_every=10, nowcast_recovery_steps=10)
    with pytest.raises(ValueError, match="nowcast_moments"):
        HybridConfig(predictor="nowcast", nowcast_moments="rescale")


def test_jump_adds_exactly_the_predicted_displacement(caster_path):
    trainer = _trainer(caster_path)
    applied = []
    predict = trainer.nowcast.caster.predict

    def recording_predict(*args, **kw):
        applied.append(predict(*args, **kw).clone())
        return applied[-1]

    trainer.nowcast.caster.predict = recording_predict
    stream = _stream()
    for i, batch in enumerate(stream[:12]):
        result = trainer.step(batch)
        assert result.phase != "PREDICT"  # every step is a real step
    assert len(applied) == 1 and trainer.nowcast.pending is not None
    before = torch.cat([w.reshape(-1) for w in trainer.nowcast.pending["weights"]])
    torch.testing.assert_close(_flat(trainer) - before, applied[0], rtol=1e-6, atol=1e-7)
    assert applied[0].abs().max() > 1e-4


def test_rejected_jump_restores_weights_and_optimizer_bit_exactly(caster_path):
    trainer = _trainer(caster_path, nowcast_margin=1e9)  # no jump can beat the trend by that much
    stream = _stream()
    for batch in stream[:12]:
        trainer.step(batch)
    pending = trainer.nowcast.pending
    assert pending is not None
    pre_weights = torch.cat([w.reshape(-1) for w in pending["weights"]]).clone()
    pre_opt = copy.deepcopy(pending["optimizer"])
    for batch in stream[12:16]:
        trainer.step(batch)
    assert trainer.nowcast.pending is None and trainer.nowcast.records[-1].kept is False
    assert torch.equal(_flat(trainer), pre_weights)
    state = trainer.optimizer.state_dict()["state"]
    for k, st in pre_opt["state"].items():
        for name, v in st.items():
            assert torch.equal(state[k][name], v), name
    stats = trainer.statistics()
    assert stats["nowcast_jumps"] == 1 and stats["nowcast_rolled_back"] == 1


def test_kept_jump_stays(caster_path):
    trainer = _trainer(caster_path, nowcast_margin=-1e9)
    for batch in _stream()[:16]:
        trainer.step(batch)
    assert trainer.nowcast.records[-1].kept is True and trainer.statistics()["nowcast_kept"] == 1


def test_resume_across_a_jump_is_exact(caster_path, tmp_path):
    stream = _stream(40)
    reference = _trainer(caster_path)
    ref_losses = [reference.step(b).loss for b in stream]
    assert len(reference.nowcast.records) >= 2
    first = _trainer(caster_path)
    for b in stream[:14]:  # mid recovery window of the first jump
        first.step(b)
    assert first.nowcast.pending is not None
    first.save(tmp_path / "ckpt.pt")
    resumed = _trainer(caster_path, seed=7)
    resumed.load(tmp_path / "ckpt.pt")
    losses = [resumed.step(b).loss for b in stream[14:]]
    assert losses == ref_losses[14:]
    assert torch.equal(_flat(resumed), _flat(reference))
    assert [r.kept for r in resumed.nowcast.records] == [r.kept for r in reference.nowcast.records]


def test_default_trainer_has_no_nowcast():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    trainer = HybridTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss)
    assert trainer.nowcast is None and trainer.state_dict()["nowcast"] is None


def test_a_jump_transient_is_not_taken_for_a_divergence(caster_path, tmp_path):
    """A far jump makes the loss worse by design; the divergence guard must leave it to the
    jump's own verdict instead of rolling the weights back itself."""
    caster = nc.load_nowcaster(caster_path)
    with torch.no_grad():
        caster.net[-1].weight.mul_(400.0)  # a violent jump
        caster.net[-1].bias.mul_(400.0)
    path = tmp_path / "violent.pt"
    nc.save_nowcaster(caster, path)
    trainer = _trainer(str(path), warmup_steps=0, nowcast_trend_steps=10, nowcast_call_every=20,
                       nowcast_recovery_steps=6)
    stream = _stream(40)
    results = [trainer.step(b) for b in stream[:20]]
    assert trainer.nowcast.pending is not None and trainer.nowcast.records[-1].rel_norm > 0.5
    after = [trainer.step(b) for b in stream[20:26]]
    assert after[0].loss > 2 * results[-2].loss  # the jump did hurt at first
    assert not any(r.skipped or r.rolled_back for r in after)
    assert trainer.nowcast.records[-1].kept is not None  # judged by its verdict


def test_horizon_schedule_is_capped(caster_path):
    trainer = _trainer(caster_path, nowcast_max_horizon=8)
    assert trainer.nowcast.schedule == (8, 8, 8, 8, 8, 8, 8, 5, 3, 1)
    with pytest.raises(ValueError, match="nowcast_max_horizon"):
        HybridConfig(predictor="nowcast", nowcast_max_horizon=0)

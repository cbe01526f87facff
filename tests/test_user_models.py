"""The trainer's promises on models and setups users bring: exact rollback, no NaN in the
weights, exact resume and clear errors, each on a small real model that once broke one."""
import pytest
import torch

from hybrid_trainer import HybridConfig, HybridTrainer, Phase

from _digits import batches, cross_entropy, digits_tensors, mlp

FAST = dict(warmup_steps=8, full_steps=8, correct_steps=3, predict_lengths=(4,), verify_every=4,
            dynamics_hidden=32, dynamics_window=4, dynamics_batch=8, dynamics_train_every=2)
ALWAYS = dict(confidence_threshold=0.0, min_predicted_worth=-1.0, cost_aware=False)


@pytest.fixture(autouse=True)
def eager_kernels(monkeypatch):
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", "eager")


@pytest.fixture(scope="module")
def stream():
    x, y = digits_tensors()
    return batches(x, y, 64, 120)


def run_until_phase(trainer, stream, phase):
    for i, batch in enumerate(stream):
        if trainer.controller.phase is phase:
            return i
        trainer.step(batch)
    raise AssertionError(f"never reached {phase}")


class ReassignedRunningMean(torch.nn.Module):
    """An input normaliser whose forward reassigns its buffer, as hand-written ones often do
    (the tensor under the name ``mean`` is a new one after every train-mode forward)."""

    def __init__(self, seed=0):
        super().__init__()
        self.register_buffer("mean", torch.zeros(64))
        self.net = mlp(seed)

    def forward(self, x):
        if self.training:
            self.mean = 0.9 * self.mean + 0.1 * x.mean(0)
        return self.net(x - self.mean)


def test_rollback_restores_a_buffer_the_forward_reassigns(stream):
    model = ReassignedRunningMean()
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=0.05), cross_entropy,
                            HybridConfig(**FAST, **ALWAYS, loss_tolerance=0.0, noise_z=0.0))
    i = run_until_phase(trainer, stream, Phase.PREDICT)
    at_phase_start = model.mean.clone()
    trainer.predictor.scales.fill_(50.0)  # a huge predicted step: the verification must reject it
    results = [trainer.step(stream[i + k]) for k in range(4)]
    assert results[-1].verified and results[-1].rolled_back
    assert torch.equal(model.mean, at_phase_start)  # the verification forward moved it; it went back

"""HybridTrainer over a schedule-free optimizer (``schedulefree.AdamWScheduleFree``).

Such an optimizer keeps the weights at the point its gradients are taken while in train mode and
moves them to its running average on ``optimizer.eval()``; its warm-up and averaging weights are
param-group counters. The trainer must step it exactly as a plain loop does, roll back and resume
it exactly, and refuse to step it in eval mode.
"""
import pytest
import torch

from hybrid_trainer import HybridConfig, HybridTrainer, Phase

from _configs import ALWAYS, FAST
from _digits import batches, cross_entropy, digits_tensors, mlp
from _resume import assert_resume_reproduces

schedulefree = pytest.importorskip("schedulefree")  # the bench extra, which `make test` installs


pytestmark = pytest.mark.usefixtures("eager_backend")  # the CPU path, not the Triton interpreter


@pytest.fixture(scope="module")
def stream():
    x, y = digits_tensors()
    return batches(x, y, 64, 120)


def schedule_free(model, warmup=5):
    optimizer = schedulefree.AdamWScheduleFree(model.parameters(), lr=0.02, warmup_steps=warmup,
                                               betas=(0.95, 0.95), weight_decay=0.01)
    optimizer.train()
    return optimizer


def make_trainer(seed=0, **overrides):
    model = mlp(seed)
    return HybridTrainer(model, schedule_free(model), cross_entropy, HybridConfig(**{**FAST, **overrides}))


def test_real_steps_are_the_plain_schedule_free_loop(stream):
    trainer = make_trainer(predict=False)
    plain = mlp(0)
    optimizer = schedule_free(plain)
    for batch in stream[:15]:
        trainer.step(batch)
        optimizer.zero_grad(set_to_none=True)
        cross_entropy(plain, batch).backward()
        optimizer.step()
    for p, q in zip(trainer.params, plain.parameters()):
        assert torch.equal(p.detach(), q.detach())
    trainer.optimizer.eval()
    optimizer.eval()  # the averaged weights, what a user evaluates, agree too
    for p, q in zip(trainer.params, plain.parameters()):
        assert torch.equal(p.detach(), q.detach())
    assert trainer.optimizer.param_groups[0]["k"] == optimizer.param_groups[0]["k"] == 15


def test_a_rejected_verification_restores_the_weights_and_the_optimizer_is_untouched(stream):
    trainer = make_trainer(**ALWAYS, loss_tolerance=0.0, noise_z=0.0)
    i = 0
    while trainer.controller.phase is not Phase.PREDICT:
        trainer.step(stream[i])
        i += 1
    weights = [p.detach().clone() for p in trainer.params]
    state = {id(p): {k: v.clone() for k, v in trainer.optimizer.state[p].items()} for p in trainer.params}
    group = {k: v for k, v in trainer.optimizer.param_groups[0].items() if k != "params"}
    trainer.predictor.scales.fill_(50.0)  # a huge predicted step: the loss must go up
    results = [trainer.step(stream[i + k]) for k in range(4)]
    assert [r.phase for r in results] == ["PREDICT"] * 4
    assert results[-1].verified and results[-1].accepted is False and results[-1].rolled_back
    for p, saved in zip(trainer.params, weights):
        assert torch.equal(p.detach(), saved)
    # Predicted steps never step the optimizer: its z, second moment and counters are as they were.
    for p in trainer.params:
        for key, value in state[id(p)].items():
            assert torch.equal(trainer.optimizer.state[p][key], value), key
    assert {k: v for k, v in trainer.optimizer.param_groups[0].items() if k != "params"} == group


def test_resume_reproduces_the_uninterrupted_run(stream, tmp_path):
    # The weights, z and the group counters all come from the file.
    reference, resumed = assert_resume_reproduces(make_trainer, stream, 60, 31, tmp_path / "ckpt.pt", **ALWAYS)
    assert resumed.optimizer.param_groups[0]["weight_sum"] == reference.optimizer.param_groups[0]["weight_sum"]


def test_a_step_in_eval_mode_is_refused_before_anything_runs(stream):
    trainer = make_trainer()
    for batch in stream[:3]:
        trainer.step(batch)
    trainer.optimizer.eval()
    averaged = [p.detach().clone() for p in trainer.params]
    with pytest.raises(RuntimeError, match=r"optimizer: AdamWScheduleFree is in eval mode.*optimizer\.train\(\)"):
        trainer.step(stream[3])
    for p, saved in zip(trainer.params, averaged):
        assert torch.equal(p.detach(), saved)
    assert trainer.stats.forward_passes == 3
    trainer.optimizer.train()
    assert trainer.step(stream[3]).backward_done

"""HybridTrainer over a schedule-free optimizer (``schedulefree.AdamWScheduleFree``).

Such an optimizer keeps the weights at the point its gradients are taken while in train mode and
moves them to its running average on ``optimizer.eval()``; its warm-up and averaging weights are
param-group counters. The trainer must step it exactly as a plain loop does, roll back and resume
it exactly, and refuse to step it in eval mode.
"""
import pytest
import torch

from hybrid_trainer import HybridConfig, HybridTrainer

from _configs import ALWAYS, FAST
from _digits import batches, cross_entropy, digits_tensors, mlp
from _resume import assert_resume_reproduces
from _rollback import reject_a_prediction_and_check_the_optimizer_untouched

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
    # Predicted steps never step the optimizer: z, the second moment and the group counters stay.
    results = reject_a_prediction_and_check_the_optimizer_untouched(
        trainer, stream, extra=lambda: {k: v for k, v in trainer.optimizer.param_groups[0].items() if k != "params"})
    assert [r.phase for r in results] == ["PREDICT"] * 4


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

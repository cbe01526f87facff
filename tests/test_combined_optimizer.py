"""CombinedOptimizer: Muon over the hidden matrices and AdamW over the rest, stepped as one.

The combination must step exactly as its parts stepped one after the other, share their param
groups (a scheduler's lr reaches the parts), route state to the owning part (what the trainer's
rollback anchors read and write), checkpoint and resume exactly, and under HybridTrainer roll a
rejected prediction back without touching either part's state.
"""
import pytest
import torch

from hybrid_trainer import CombinedOptimizer, HybridConfig, HybridTrainer

from _configs import ALWAYS, FAST
from _digits import batches, cross_entropy, digits_tensors, mlp
from _resume import assert_resume_reproduces
from _rollback import reject_a_prediction_and_check_the_optimizer_untouched

pytestmark = [pytest.mark.usefixtures("eager_backend"),  # the CPU path, not the Triton interpreter
              pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")]


@pytest.fixture(scope="module")
def stream():
    x, y = digits_tensors()
    return batches(x, y, 64, 80)


def muon_parts(model):
    """Muon on the first layer's matrix, AdamW on the output layer and every bias."""
    hidden = [model[0].weight]
    rest = [model[0].bias, model[2].weight, model[2].bias]
    return torch.optim.Muon(hidden, lr=0.02, weight_decay=0.01), torch.optim.AdamW(rest, lr=3e-3)


def combined(model):
    return CombinedOptimizer(*muon_parts(model))


def plain_steps(model, parts, stream):
    """The plain loop over ``stream`` stepping each of ``parts`` (the Muon and AdamW parts, or a
    list holding one CombinedOptimizer)."""
    for batch in stream:
        for part in parts:
            part.zero_grad(set_to_none=True)
        cross_entropy(model, batch).backward()
        for part in parts:
            part.step()


def test_steps_exactly_as_its_parts_do(stream):
    model, reference = mlp(0), mlp(0)
    optimizer = combined(model)
    plain_steps(model, [optimizer], stream[:10])
    plain_steps(reference, muon_parts(reference), stream[:10])
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    assert all(p.grad is not None for p in model.parameters())
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_param_groups_are_the_parts_own_so_a_scheduler_reaches_them(stream):
    model = mlp(0)
    optimizer = combined(model)
    muon, adamw = optimizer.parts
    assert optimizer.param_groups[0] is muon.param_groups[0] and optimizer.param_groups[1] is adamw.param_groups[0]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    for batch in stream[:2]:
        optimizer.zero_grad()
        cross_entropy(model, batch).backward()
        optimizer.step()
        scheduler.step()
    assert muon.param_groups[0]["lr"] == pytest.approx(0.02 * 0.25)
    assert adamw.param_groups[0]["lr"] == pytest.approx(3e-3 * 0.25)


def test_state_lives_in_the_part_that_owns_the_parameter(stream):
    model = mlp(0)
    optimizer = combined(model)
    muon, adamw = optimizer.parts
    weight, out_weight = model[0].weight, model[2].weight
    assert weight not in optimizer.state and optimizer.state.get(weight) is None
    assert len(muon.state) == 0  # the lookups above created no entry
    optimizer.zero_grad()
    cross_entropy(model, stream[0]).backward()
    optimizer.step()
    assert set(optimizer.state[weight]) == {"momentum_buffer"}
    assert optimizer.state[weight] is muon.state[weight]
    assert "exp_avg_sq" in optimizer.state[out_weight] and optimizer.state[out_weight] is adamw.state[out_weight]
    assert len(optimizer.state) == 4 and {id(p) for p in optimizer.state} == {id(p) for p in model.parameters()}
    saved = optimizer.state.pop(weight)
    assert weight not in muon.state
    optimizer.state.setdefault(weight, {})["momentum_buffer"] = saved["momentum_buffer"]
    assert muon.state[weight]["momentum_buffer"] is saved["momentum_buffer"]
    with pytest.raises(KeyError, match="not a parameter of any of the combined optimizers"):
        optimizer.state[torch.zeros(2)]


def test_state_dict_resumes_exactly(stream):
    model, reference = mlp(0), mlp(0)
    plain_steps(reference, [combined(reference)], stream[:12])
    first = combined(model)
    plain_steps(model, first.parts, stream[:5])
    saved_weights, saved_state = {k: v.clone() for k, v in model.state_dict().items()}, first.state_dict()
    resumed_model = mlp(3)
    resumed_model.load_state_dict(saved_weights)
    resumed = combined(resumed_model)
    resumed.load_state_dict(saved_state)
    plain_steps(resumed_model, [resumed], stream[5:12])
    for p, q in zip(resumed_model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    assert resumed.param_groups[0] is resumed.parts[0].param_groups[0]  # followed the reloaded groups


def test_bad_input_is_named():
    model = mlp(0)
    with pytest.raises(ValueError, match="optimizers: give at least one"):
        CombinedOptimizer()
    with pytest.raises(TypeError, match=r"optimizers\[1\]: expected a torch.optim.Optimizer, got list"):
        CombinedOptimizer(torch.optim.SGD([model[0].weight], lr=0.1), [model[0].bias])
    with pytest.raises(ValueError, match=r"optimizers\[1\]: a parameter of shape \(64, 64\) is also trained by "
                                         r"optimizers\[0\]"):
        CombinedOptimizer(torch.optim.SGD([model[0].weight], lr=0.1), torch.optim.AdamW(model.parameters()))
    optimizer = combined(model)
    with pytest.raises(ValueError, match="state_dict: expected the state of a CombinedOptimizer with 2 parts, got 1"):
        optimizer.load_state_dict({"parts": [optimizer.parts[0].state_dict()]})
    with pytest.raises(ValueError, match="got no 'parts' list"):
        optimizer.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())


def make_trainer(seed=0, **overrides):
    model = mlp(seed)
    return HybridTrainer(model, combined(model), cross_entropy, HybridConfig(**{**FAST, **overrides}))


def test_trainer_real_steps_are_the_plain_loop(stream):
    trainer = make_trainer(predict=False)
    reference = mlp(0)
    plain_steps(reference, muon_parts(reference), stream[:15])
    for batch in stream[:15]:
        trainer.step(batch)
    for p, q in zip(trainer.model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_trainer_rolls_a_rejected_prediction_back_and_leaves_both_parts_alone(stream):
    trainer = make_trainer(**ALWAYS, loss_tolerance=0.0, noise_z=0.0)
    reject_a_prediction_and_check_the_optimizer_untouched(trainer, stream)
    kinds = [set(trainer.optimizer.state[p]) for p in trainer.params]
    assert {"momentum_buffer"} in kinds and any("exp_avg" in k for k in kinds)  # both parts had state to keep


def test_trainer_resume_reproduces_the_uninterrupted_run(stream, tmp_path):
    assert_resume_reproduces(make_trainer, stream, 50, 27, tmp_path / "ckpt.pt", **ALWAYS)


def test_trainer_refuses_a_step_when_any_part_is_in_eval_mode(stream):
    schedulefree = pytest.importorskip("schedulefree")
    model = mlp(0)
    free = schedulefree.AdamWScheduleFree([model[2].weight, model[2].bias], lr=0.01)
    free.train()
    trainer = HybridTrainer(model, CombinedOptimizer(torch.optim.AdamW([model[0].weight, model[0].bias]), free),
                            cross_entropy, HybridConfig(**FAST))
    trainer.step(stream[0])
    free.eval()
    with pytest.raises(RuntimeError, match="optimizer: CombinedOptimizer is in eval mode"):
        trainer.step(stream[1])
    free.train()
    assert trainer.step(stream[1]).backward_done


def test_a_group_added_to_a_part_is_followed_and_the_combination_refuses_one(stream):
    model = mlp(0)
    muon = torch.optim.Muon([model[0].weight], lr=0.02)
    adamw = torch.optim.AdamW([model[2].weight, model[2].bias], lr=3e-3)
    trainer = HybridTrainer(model, CombinedOptimizer(muon, adamw), cross_entropy, HybridConfig(**FAST))
    trainer.step(stream[0])
    bias = model[0].bias.detach().clone()
    with pytest.raises(TypeError, match="add_param_group: a CombinedOptimizer does not know which part"):
        trainer.optimizer.add_param_group({"params": [model[0].bias]})
    with pytest.raises(AttributeError, match="param_groups of a CombinedOptimizer are its parts'"):
        trainer.optimizer.param_groups = []
    adamw.add_param_group({"params": [model[0].bias], "lr": 1e-2})
    assert trainer.optimizer.param_groups[-1] is adamw.param_groups[-1]
    trainer.step(stream[1])
    assert not torch.equal(model[0].bias, bias)  # the new group trains, under the trainer too
    assert trainer.optimizer.state[model[0].bias] is adamw.state[model[0].bias]

"""The trainer under its memory techniques: the plan against the measured peak, training,
rollback of a rejected prediction and exact resume with low-bit state and bf16 weights, the
NaN guard with the step inside the backward, and third-party low-memory optimizers."""
import math

import pytest
import torch

from hybrid_trainer import HybridConfig, HybridTrainer
from hybrid_trainer.lowbit_adamw import LowBitAdamW

from _configs import ALWAYS, FAST
from _digits import batches, cross_entropy, digits_tensors, mlp
from _resume import assert_resume_reproduces, assert_same_state, copy_state_value
from _rollback import reject_a_prediction_and_check_the_optimizer_untouched

pytestmark = pytest.mark.usefixtures("eager_backend")  # the CPU path, not the Triton interpreter

KNOBS = {
    "in-backward": dict(step_in_backward=True, optimizer_state_bits=None, weight_dtype="float32"),
    "8-bit": dict(step_in_backward=False, optimizer_state_bits=8, weight_dtype="float32"),
    "4-bit": dict(step_in_backward=False, optimizer_state_bits=4, weight_dtype="float32"),
    "bf16": dict(step_in_backward=False, optimizer_state_bits=None, weight_dtype="bfloat16"),
    "all": dict(step_in_backward=True, optimizer_state_bits=4, weight_dtype="bfloat16"),
}


@pytest.fixture(scope="module")
def stream():
    x, y = digits_tensors()
    return batches(x, y, 64, 80)


def make_trainer(seed=0, knobs="8-bit", **overrides):
    model = mlp(seed)
    cfg = {**FAST, "predict": False, "good_state_every": 5, **KNOBS[knobs], **overrides}
    return HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3), cross_entropy, HybridConfig(**cfg))


@pytest.mark.parametrize("knobs", list(KNOBS))
def test_each_technique_trains_and_is_what_the_plan_says(knobs, stream):
    trainer = make_trainer(knobs=knobs)
    plan = trainer.memory_plan
    assert isinstance(trainer.optimizer, LowBitAdamW)
    assert plan.step_in_backward == KNOBS[knobs]["step_in_backward"]
    assert all(p.dtype == getattr(torch, KNOBS[knobs]["weight_dtype"]) for p in trainer.params)
    losses = [trainer.step(b).loss for b in stream[:60]]
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])
    assert all(p.grad is None for p in trainer.params)


def test_the_plain_plan_keeps_the_users_optimizer(stream):
    model = mlp(0)
    optimizer = torch.optim.AdamW(model.parameters())
    trainer = HybridTrainer(model, optimizer, cross_entropy, HybridConfig(predict=False))
    assert trainer.optimizer is optimizer and trainer.memory_plan.techniques == []


def test_a_scheduler_over_the_users_optimizer_drives_the_rebuilt_one(stream):
    model = mlp(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    trainer = HybridTrainer(model, optimizer, cross_entropy, HybridConfig(predict=False, optimizer_state_bits=8),
                            scheduler=scheduler)
    for b in stream[:3]:
        trainer.step(b)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 / 8)


@pytest.mark.parametrize("knobs", ["8-bit", "4-bit", "bf16"])
def test_rejected_prediction_rolls_back_low_bit_state_exactly(knobs, stream):
    trainer = make_trainer(knobs=knobs, predict=True, **ALWAYS, loss_tolerance=0.0, noise_z=0.0)
    reject_a_prediction_and_check_the_optimizer_untouched(trainer, stream)


@pytest.mark.parametrize("knobs", ["8-bit", "all"])
def test_resume_reproduces_the_uninterrupted_run(knobs, stream, tmp_path):
    # the shared helper wants predicted steps in the resumed part: not with the step in the backward
    if knobs == "8-bit":
        assert_resume_reproduces(lambda seed=0, **o: make_trainer(seed, knobs, **o), stream, 50, 27,
                                 tmp_path / "ckpt.pt", predict=True, **ALWAYS)
        return
    reference = make_trainer(knobs=knobs)
    ref = [reference.step(b).loss for b in stream[:30]]
    first = make_trainer(knobs=knobs)
    for b in stream[:12]:
        first.step(b)
    first.save(tmp_path / "ckpt.pt")
    resumed = make_trainer(seed=7, knobs=knobs)
    resumed.load(tmp_path / "ckpt.pt")
    assert [resumed.step(b).loss for b in stream[12:30]] == ref[12:]
    for p, q in zip(reference.params, resumed.params):
        assert torch.equal(p, q)


def test_resume_refuses_a_different_plan(stream, tmp_path):
    first = make_trainer(knobs="8-bit")
    first.step(stream[0])
    first.save(tmp_path / "ckpt.pt")
    with pytest.raises(ValueError, match="memory techniques"):
        make_trainer(knobs="4-bit").load(tmp_path / "ckpt.pt")


@pytest.mark.parametrize("knobs", ["in-backward", "all"])
def test_nan_loss_in_backward_mode_updates_nothing(knobs, stream):
    trainer = make_trainer(knobs=knobs)
    for b in stream[:6]:
        trainer.step(b)
    before = [p.detach().clone() for p in trainer.params]
    x, y = stream[6]
    result = trainer.step((x * float("nan"), y))
    assert result.skipped and result.loss is None
    for p, saved in zip(trainer.params, before):
        assert torch.equal(p, saved)


@pytest.mark.parametrize("knobs", ["in-backward", "all"])
def test_nan_gradient_after_partial_updates_is_undone(knobs, stream):
    """The output layer's gradients arrive first in backward and are applied; the first layer's
    are poisoned: the step must leave the model exactly at its last good state."""
    trainer = make_trainer(knobs=knobs, good_state_every=2)
    for b in stream[:5]:
        trainer.step(b)
    assert trainer.good_state.step == 4  # saved after real steps 1, 3, 5 (trainer step 4 is the 5th)
    good = [p.detach().clone() for p in trainer.params]
    state = {id(p): {k: v.clone() for k, v in trainer.optimizer.state[p].items() if torch.is_tensor(v)}
             for p in trainer.params}
    handle = trainer.model[0].weight.register_hook(lambda g: g * float("inf"))
    result = trainer.step(stream[5])
    handle.remove()
    assert result.skipped and trainer.stats.divergence_rollbacks == 1  # undone from the good state
    for p, saved in zip(trainer.params, good):
        assert torch.equal(p, saved)
    for p in trainer.params:
        for k, v in state[id(p)].items():
            assert torch.equal(trainer.optimizer.state[p][k], v), k
    assert trainer.stats.skipped_steps == 1
    assert trainer.step(stream[7]).loss is not None  # training goes on


@pytest.mark.parametrize("knobs", ["in-backward", "all"])
def test_a_lone_spike_whose_update_ran_in_the_backward_goes_back_to_the_good_state(knobs, stream):
    """With the step inside the backward a finite spike's update has run before the guard reads the
    loss: refused, even a lone one goes back to the good state (a lone spike whose update has not
    run is refused without a rollback), and the weights are the good state's."""
    trainer = make_trainer(knobs=knobs, divergence={"min_history": 3})
    for b in stream[:12]:
        trainer.step(b)
    x, y = stream[12]
    calls = {"n": 0}
    plain_loss = trainer.loss_fn

    def spiking(model, batch):  # 50 times the loss (a loss jump) on this one call
        calls["n"] += 1
        return plain_loss(model, batch) * 50.0
    trainer.loss_fn = spiking
    result = trainer.step((x, y))
    trainer.loss_fn = plain_loss
    assert calls["n"] == 1 and result.skipped and result.rolled_back
    assert trainer.stats.divergence_rollbacks == 1
    for p, saved in zip(trainer.params, trainer.good_state.state_dict()["params"]):
        assert torch.equal(p.detach(), saved.to(p.dtype))


def test_nan_gradient_without_good_state_never_reaches_the_weights(stream):
    trainer = make_trainer(knobs="all", good_state_every=0)
    assert any("partly applied" in g for g in trainer.memory_plan.guarantees_given_up)
    for b in stream[:3]:
        trainer.step(b)
    first_layer = trainer.model[0].weight.detach().clone()
    handle = trainer.model[0].weight.register_hook(lambda g: g * float("nan"))
    trainer.step(stream[3])
    handle.remove()
    assert torch.equal(trainer.model[0].weight, first_layer)
    assert all(torch.isfinite(p).all() for p in trainer.params)


def test_memory_budget_too_small_raises_naming_the_shortfall():
    model = mlp(0)
    with pytest.raises(ValueError, match=r"memory_budget='1MiB': nothing fits.*GiB over the budget"):
        HybridTrainer(model, torch.optim.AdamW(model.parameters()), cross_entropy,
                      HybridConfig(predict=False, memory_budget="1MiB"))


def test_step_in_backward_refused_with_an_unconvertible_optimizer():
    model = mlp(0)
    with pytest.raises(ValueError, match="cannot be converted"):
        HybridTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy,
                      HybridConfig(predict=False, step_in_backward=True))


def test_plan_within_ten_percent_of_measured_peak():
    """Each arm in a fresh process (peak RSS), a 2.4M-parameter Llama-shaped model."""
    from bench.capacity import SWEEP_SHAPES, run_probe

    for arm in ("fp32 AdamW", "in-backward + 4-bit + bf16"):
        row = run_probe({"arm": arm, "shape": list(SWEEP_SHAPES["S"]), "steps": 2})
        assert "error" not in row, row
        assert abs(row["predicted_peak"] / row["peak_rss"] - 1) <= 0.10, (arm, row["predicted_peak"], row["peak_rss"])


THIRD_PARTY = {
    "torchao8": ("torchao.optim", "AdamW8bit"),
    "torchao4": ("torchao.optim", "AdamW4bit"),
    "bnb8": ("bitsandbytes.optim", "AdamW8bit"),
    "galore": ("galore_torch", "GaLoreAdamW"),
    "apollo": ("apollo_torch", "APOLLOAdamW"),
}


def _third_party_trainer(kind, seed=0, **overrides):
    from bench.capacity import make_optimizer

    model = mlp(seed)
    opt = make_optimizer(kind, model, lr=3e-3)
    return HybridTrainer(model, opt, cross_entropy, HybridConfig(**{**FAST, **overrides}))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bnb8", "galore", "apollo", "torchao8", "torchao4"])
def test_third_party_optimizers_roll_back_and_resume(kind, stream, tmp_path):
    """torchao keeps its moments in tensor subclasses (OptimState8bit/4bit) with no empty_like,
    clone or copy into a plain tensor; the snapshots copy their inner tensors instead."""
    pytest.importorskip(THIRD_PARTY[kind][0].split(".")[0])
    trainer = _third_party_trainer(kind, **ALWAYS, loss_tolerance=0.0, noise_z=0.0)
    reject_a_prediction_and_check_the_optimizer_untouched(trainer, stream)
    assert_resume_reproduces(lambda seed=0, **o: _third_party_trainer(kind, seed, **o), stream, 50, 27,
                             tmp_path / "ckpt.pt", **ALWAYS)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["torchao8", "torchao4"])
def test_torchao_good_state_restores_the_quantized_moments(kind, stream):
    """Divergence rollback restores the good state's optimizer state: torchao's codes and scales
    bit for bit, into the optimizer's own objects, which then go on stepping."""
    pytest.importorskip("torchao")
    trainer = _third_party_trainer(kind, predict=False, good_state_every=3)
    for b in stream[:4]:  # the good state is saved after real steps 1 and 4
        trainer.step(b)
    assert trainer.good_state.step == 3
    weights = [p.detach().clone() for p in trainer.params]
    state = {id(p): {k: copy_state_value(v) for k, v in trainer.optimizer.state[p].items()} for p in trainer.params}
    objects = [id(trainer.optimizer.state[p]["exp_avg"]) for p in trainer.params]
    for b in stream[4:6]:
        trainer.step(b)
    trainer.good_state.restore(trainer.optimizer)
    for p, saved in zip(trainer.params, weights):
        assert torch.equal(p, saved)
    for p in trainer.params:
        for key, value in state[id(p)].items():
            assert_same_state(trainer.optimizer.state[p][key], value, key)
    assert objects == [id(trainer.optimizer.state[p]["exp_avg"]) for p in trainer.params]
    assert trainer.step(stream[6]).loss is not None


def test_a_recorded_step_frees_the_gradients_before_recording_its_update():
    """The update is recovered from the optimizer's state after the step, a bucket at a time; with
    the gradients already gone those transients reuse their memory instead of adding to the step's
    peak (with a fused optimizer they set it: bench.overhead's default arm)."""
    model = mlp()
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cross_entropy,
                            HybridConfig(seed=0, warmup_steps=2, **ALWAYS))
    seen = []
    predictor = trainer.predict_phase.predictor
    end_step = predictor.end_step

    def recording(*args, **kwargs):
        seen.append([p.grad is None for p in model.parameters()])
        return end_step(*args, **kwargs)
    predictor.end_step = recording
    for batch in batches(*digits_tensors(), batch_size=32, steps=8):
        trainer.step(batch)
    assert seen and all(all(step) for step in seen)

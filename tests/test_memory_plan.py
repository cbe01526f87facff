"""The memory planner (budget parsing, the choice, the shortfall error) and the step inside the
backward pass (same update as a step after it; non-finite gradients never applied)."""
import math

import pytest
import torch

from hybrid_trainer import HybridConfig
from hybrid_trainer.in_backward import StepInBackward
from hybrid_trainer.lowbit_adamw import LowBitAdamW
from hybrid_trainer.memory_plan import TRAINER_FIXED_BYTES, parse_bytes, plan_memory


@pytest.mark.parametrize("text,expected", [("20GiB", 20 * 1024 ** 3), ("1.5GB", 1_500_000_000), ("512 MiB", 512 << 20),
                                           (1000, 1000), ("64k", 64_000), ("7", 7)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["20 parsecs", "", "-1GiB", 0, -5, True, 1.5, "GiB"])
def test_memory_budget_validation_names_the_field(bad):
    with pytest.raises(ValueError, match="memory_budget"):
        HybridConfig(memory_budget=bad)


def test_knob_validation():
    with pytest.raises(ValueError, match="optimizer_state_bits"):
        HybridConfig(optimizer_state_bits=2)
    with pytest.raises(ValueError, match="weight_dtype"):
        HybridConfig(weight_dtype="float16")
    with pytest.raises(ValueError, match="grad_clip"):
        HybridConfig(step_in_backward=True, predict=False, grad_clip=1.0)
    with pytest.raises(ValueError, match="grad_accumulation"):
        HybridConfig(step_in_backward=True, predict=False, grad_accumulation=2)
    with pytest.raises(ValueError, match="predict"):
        HybridConfig(step_in_backward=True)


def _params(n=1_000_000, pieces=100):
    return [torch.nn.Parameter(torch.zeros(n // pieces)) for _ in range(pieces)]


def test_planner_picks_cheapest_that_fits():
    params = _params()
    opt = torch.optim.AdamW(params)
    base = 100 << 20
    cfg = HybridConfig(predict=False, good_state_every=0)
    plain = plan_memory(params, opt, cfg, in_use_bytes=base, activation_bytes=0)
    assert plain.techniques == [] and plain.bytes_per_param == pytest.approx(16.0)
    # fp32 AdamW on a CPU: weights 4 + grads 4 + state 8 = 16 bytes/param, and two fp32
    # temporaries of the largest tensor (10K values) while it steps
    assert plain.predicted_peak_bytes == base - 4_000_000 + 16_000_000 + 80_000 + TRAINER_FIXED_BYTES
    # bytes/param at the peak: in-backward 12.08, 8-bit 10.03, both 6.11, + bf16 4.07, 4-bit + bf16 3.10
    sib, b8, b4, bf16 = "step_in_backward", "optimizer_state_bits=8", "optimizer_state_bits=4", \
        "weight_dtype=bfloat16 (stochastic rounding)"
    budgets = {12_500_000: [sib], 11_000_000: [b8], 7_000_000: [sib, b8], 4_500_000: [sib, b8, bf16],
               3_500_000: [sib, b4, bf16]}
    for extra, expected in budgets.items():
        cfg = HybridConfig(predict=False, good_state_every=0, memory_budget=base - 4_000_000 + extra + TRAINER_FIXED_BYTES)
        plan = plan_memory(params, opt, cfg, in_use_bytes=base, activation_bytes=0)
        assert plan.techniques == expected and plan.predicted_peak_bytes <= plan.budget_bytes
    with pytest.raises(ValueError, match="memory_budget.*nothing fits.*over the budget"):
        plan_memory(params, opt, HybridConfig(predict=False, good_state_every=0, memory_budget=base - 2_000_000 + TRAINER_FIXED_BYTES),
                    in_use_bytes=base, activation_bytes=0)


def test_planner_reports_unconvertible_optimizer():
    params = _params()
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    plan = plan_memory(params, opt, HybridConfig(predict=False), in_use_bytes=0, activation_bytes=None)
    assert any("cannot be converted" in n for n in plan.notes)
    assert any("activations not measured" in n for n in plan.notes)
    with pytest.raises(ValueError, match="nothing fits.*cannot be converted"):
        plan_memory(params, opt, HybridConfig(predict=False, memory_budget=1000), in_use_bytes=0, activation_bytes=0)


def test_planner_respects_explicit_knobs_and_blocks():
    params = _params()
    opt = torch.optim.AdamW(params)
    plan = plan_memory(params, opt, HybridConfig(optimizer_state_bits=4), in_use_bytes=0, activation_bytes=0)
    assert plan.optimizer_state_bits == 4 and not plan.step_in_backward
    # predict=True rules the step inside the backward out: the plan says why
    plan = plan_memory(params, opt, HybridConfig(memory_budget="1GiB"), in_use_bytes=0, activation_bytes=0)
    assert not plan.step_in_backward and any("predict=True" in n for n in plan.notes)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Tanh(), torch.nn.Linear(30, 3))


@pytest.mark.parametrize("bits", [None, 8])
def test_step_in_backward_equals_step_after(bits, eager_backend):
    x, y = torch.randn(16, 20), torch.randn(16, 3)
    a, b = _model(), _model()
    oa = LowBitAdamW(a.parameters(), lr=1e-2, state_bits=bits)
    ob = LowBitAdamW(b.parameters(), lr=1e-2, state_bits=bits)
    stepper = StepInBackward(list(b.parameters()), ob)
    for _ in range(3):
        torch.nn.functional.mse_loss(a(x), y).backward()
        oa.step()
        oa.zero_grad(set_to_none=True)
        stepper.arm()
        torch.nn.functional.mse_loss(b(x), y).backward()
        norm, partial = stepper.finish()
        assert math.isfinite(norm) and not partial
        assert all(p.grad is None for p in b.parameters())  # no gradient kept
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_step_in_backward_never_applies_non_finite(eager_backend):
    model = _model()
    opt = LowBitAdamW(model.parameters(), lr=1e-2, state_bits=8)
    stepper = StepInBackward(list(model.parameters()), opt)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 20)

    def poison_first_layer(grad):  # the first layer's gradients arrive last in backward
        return grad * float("nan")

    handle = model[0].weight.register_hook(poison_first_layer)
    stepper.arm()
    model(x).sum().backward()
    norm, partial = stepper.finish()
    handle.remove()
    assert math.isnan(norm) and partial  # the last layer was updated before the NaN showed
    for p in model.parameters():
        assert torch.isfinite(p).all()
    for state in opt.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                assert torch.isfinite(t).all()
    assert not torch.equal(model[2].weight, before[2])  # applied: the trainer must undo it (tests/test_trainer_memory.py)
    assert torch.equal(model[0].weight, before[0])  # never applied

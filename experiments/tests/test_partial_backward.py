"""experiments.partial_backward: the cut skips the lower layers' backward, the arms apply what they say,
and the command writes its result (digits, seconds)."""
import json

import torch

from experiments import partial_backward
from bench.tasks import get_task
from _images import assert_plot


def test_lower_parameters_are_the_ones_below_the_cut():
    digits = get_task("digits", quick=True)
    model = digits.make_model(0)
    assert partial_backward.lower_parameters(digits, model, 0) == list(model[0].parameters())
    assert all(p.grad is None for p in model.parameters())  # the probe leaves no gradient behind

    charlm = get_task("charlm", quick=True)
    model = charlm.make_model(0)
    model.blocks.append(type(model.blocks[0])(32, 2))  # quick size has one block; the cut is block 1
    lower = partial_backward.lower_parameters(charlm, model, 0)
    # Positions and block 0 get gradients only through block 1's input; the tied embedding also
    # feeds the output head, so it keeps a gradient.
    assert {id(p) for p in lower} == {id(model.pos)} | {id(p) for p in model.blocks[0].parameters()}


def _lower_trajectory(mode: str, steps: int) -> list[torch.Tensor]:
    task = get_task("digits", quick=True)
    task.steps = steps
    snapshots = []
    original = task.loss_fn

    def loss_fn(model, batch):  # records the first layer's weight before each step
        snapshots.append(model[0].weight.detach().clone())
        return original(model, batch)

    task.loss_fn = loss_fn
    partial_backward.run(task, mode, every=2, lr=3e-3, seed=0)
    return snapshots[1:]  # the first call is lower_parameters' probe


def test_freeze_leaves_the_lower_layer_alone_on_skipped_steps_and_repeat_reapplies_the_last_update():
    steps = partial_backward.ALWAYS_REAL_STEPS + 6
    frozen = _lower_trajectory("freeze", steps)
    repeated = _lower_trajectory("repeat last", steps)
    plain = _lower_trajectory("plain", steps)
    first = partial_backward.ALWAYS_REAL_STEPS  # index of the weight before step first + 1
    assert torch.equal(frozen[first], plain[first])  # identical until the first skipped step
    # Step first+1 is skipped (odd), step first+2 real: frozen keeps its weight over a skipped step.
    assert torch.equal(frozen[first + 1], frozen[first])
    assert not torch.equal(frozen[first + 2], frozen[first + 1])
    # Repeating the last update moves the weight by exactly the real update before it.
    last_real = repeated[first] - repeated[first - 1]
    torch.testing.assert_close(repeated[first + 1] - repeated[first], last_real, rtol=0, atol=1e-6)


def test_command_writes_the_summary(tmp_path):
    assert partial_backward.main(["--task", "digits", "--quick", "--seeds", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "partial_backward_digits.json").read_text())
    assert set(result["arms"]) == set(partial_backward.MODES)
    plain, frozen = result["arms"]["plain"], result["arms"]["freeze"]
    assert plain["lower_backward_skipped"] == 0
    steps = result["steps"]
    assert frozen["lower_backward_skipped"] == (steps - partial_backward.ALWAYS_REAL_STEPS + 1) // 2
    assert plain["reached_target"] == 1 and plain["speedup_vs_plain"]["mean"] == 1.0
    assert 0 < frozen["lower_parameter_share"] < 1
    assert_plot(tmp_path / "partial_backward_digits.png", (8, 4.5), dpi=110)

"""The lean real step (``HybridTrainer._steady_step``) against the general one (``_real_step``).

Once prediction is off for good, real steps take the lean path. It must make the same decisions
and leave the same state as the general path, bit for bit: weights, optimizer state, module
buffers, the good state, the monitor's window, counters and every field of every result.
Each test runs the same stream through a trainer with the lean path and one with it turned off,
through the events the guard exists for (a NaN loss, a loss spike and its rollback, gradients
left by the caller, a scheduler, batch-norm buffers), and counts that the lean path ran.
"""
import dataclasses
import json

import pytest
import torch

from hybrid_trainer import Callback, HybridConfig, HybridTrainer
from hybrid_trainer.run_report import PendingStepResult, StepResult

from _configs import FAST
from _digits import batches, cross_entropy, digits_tensors
from _faults import batch_norm_mlp
from _resume import assert_same_state


pytestmark = pytest.mark.usefixtures("eager_backend")  # the trainer's logic, not the kernels, is under test


@pytest.fixture(scope="module")
def stream():
    return batches(*digits_tensors(), 64, 60)


def faulty_loss(nan_at: int, spike_at: tuple[int, ...]):
    """cross_entropy, NaN on call ``nan_at`` and 50 times too large on the calls ``spike_at``."""
    calls = {"n": 0}

    def loss_fn(model, batch):
        calls["n"] += 1
        loss = cross_entropy(model, batch)
        return loss * float("nan") if calls["n"] == nan_at else loss * 50.0 if calls["n"] in spike_at else loss
    return loss_fn


def run(stream, steady: bool, steps: int, stale_grads_at: int, fused: bool = False, callbacks=None, **overrides):
    """(trainer, results, lean steps taken) over ``steps`` batches of ``stream``."""
    model = batch_norm_mlp(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=fused)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.5)
    config = HybridConfig(**{**FAST, "good_state_every": 5, "divergence": {"min_history": 5}, **overrides})
    trainer = HybridTrainer(model, optimizer, faulty_loss(nan_at=12, spike_at=(20, 21)), config=config,
                            scheduler=scheduler, callbacks=callbacks)
    trainer._steady_allowed = trainer._steady_allowed and steady
    taken = {"n": 0}
    lean = trainer._steady_step

    def counted(batch):
        taken["n"] += 1
        return lean(batch)

    trainer._steady_step = counted
    results = []
    for i, batch in enumerate(stream[:steps]):
        if i == stale_grads_at:  # the caller's own backward leaves gradients behind
            cross_entropy(model, batch).backward()
        results.append(trainer.step(batch))
    return trainer, results, taken["n"]


# What a run measures with the clock (step times; the prediction machinery's cost, and so the
# margins of the worth decisions made from it) differs between two runs of the same steps.
TIMED = ("time_by_phase_s", "wall_time_s", "decline_margins", "cost", "predicted_step_worth", "required_worth",
         "prediction_overhead")


def without_times(value):
    """A state dict with its wall-clock entries left out."""
    if isinstance(value, dict):
        return {k: without_times(v) for k, v in value.items() if k not in TIMED}
    if isinstance(value, (list, tuple)):
        return type(value)(without_times(v) for v in value)
    return value


def fields(result: StepResult) -> dict:
    """Every field of a result; a deferred step's (PendingStepResult) as read and settled."""
    out = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    if isinstance(result, PendingStepResult):
        out["settled"] = result.settled
    return out


def assert_same_run(lean, general):
    (fast, fast_results), (slow, slow_results) = lean, general
    for got, want in zip(fast_results, slow_results):
        assert type(got) is type(want)
        assert without_times(fields(got)) == without_times(fields(want))
    assert len(fast_results) == len(slow_results)
    for p, q in zip(fast.params, slow.params):
        assert torch.equal(p, q)
    assert_same_state(without_times(fast.state_dict()), without_times(slow.state_dict()))
    assert_same_state(without_times(fast.statistics()), without_times(slow.statistics()))


def test_the_lean_step_equals_the_general_one_through_a_nan_a_spike_and_stale_gradients(stream):
    fast, fast_results, lean_steps = run(stream, True, 30, stale_grads_at=25, predict=False)
    slow, slow_results, general_lean_steps = run(stream, False, 30, stale_grads_at=25, predict=False)
    assert lean_steps == 30 and general_lean_steps == 0
    assert fast_results[11].skipped and not fast_results[11].rolled_back  # the NaN: refused
    assert fast_results[19].skipped and not fast_results[19].rolled_back  # a lone spike: refused
    assert fast_results[20].skipped and fast_results[20].rolled_back  # a second in a row: back to the good state
    assert fast.stats.divergence_rollbacks == 1
    assert_same_run((fast, fast_results), (slow, slow_results))


class Recorder(Callback):
    """Every hook call of a run, in order, with what identifies it (not the trainer)."""

    def __init__(self):
        self.calls = []

    def on_step_end(self, trainer, result):
        self.calls.append(("step_end", result.step, result.skipped, result.rolled_back))

    def on_update_refused(self, trainer, event):
        self.calls.append(("update_refused", event.step))

    def on_rollback(self, trainer, event):
        self.calls.append(("rollback", event.step))

    def on_phase_change(self, trainer, old, new):
        self.calls.append(("phase_change", old, new))

    def on_prediction_disabled(self, trainer, reason):
        self.calls.append(("prediction_disabled", reason))


def test_the_lean_step_writes_the_same_metrics_and_calls_the_same_hooks(stream, tmp_path):
    # The lean step ends with its own bookkeeping (_end_steady_step): the metrics file and the
    # callbacks must see exactly what the general path's end of step shows them.
    records, hooks = {}, {}
    for steady in (True, False):
        recorder = Recorder()
        path = tmp_path / f"metrics_{steady}.jsonl"
        trainer, _, lean_steps = run(stream, steady, 30, stale_grads_at=25, callbacks=[recorder],
                                     metrics_path=str(path), predict=False)
        trainer.close()
        assert lean_steps == (30 if steady else 0)
        records[steady] = [without_times(json.loads(line)) for line in path.read_text().splitlines()]
        hooks[steady] = recorder.calls
    assert len(records[True]) == 30 and records[True] == records[False]
    assert ("rollback", 20) in hooks[True] and ("update_refused", 19) in hooks[True]
    assert ("update_refused", 11) in hooks[True]
    assert hooks[True] == hooks[False]


def test_the_lean_step_takes_over_when_prediction_switches_off(stream):
    # Prediction on by default, switched off at the first decision (no predicted step can be
    # worth 10 real ones): the general path runs until then, the lean one after.
    off_at_once = dict(min_predicted_worth=10.0, max_consecutive_declines=1)
    fast, fast_results, lean_steps = run(stream, True, 40, stale_grads_at=33, **off_at_once)
    slow, slow_results, _ = run(stream, False, 40, stale_grads_at=33, **off_at_once)
    assert not fast.controller.prediction_enabled
    assert 0 < lean_steps < 40
    assert fast.predictor.allocated is False and fast.forecaster.dynamics is None  # released at the switch
    assert_same_run((fast, fast_results), (slow, slow_results))


@pytest.mark.parametrize("fused", [False, True], ids=["read-on-launch", "device-side-skip"])
def test_the_lean_step_with_deferred_checks_equals_the_general_one(stream, fused):
    # read_every=4: the NaN is skipped where it runs, the spike found at its block's read rolls
    # back to the good state and discards the steps queued after it.
    fast, fast_results, lean_steps = run(stream, True, 30, stale_grads_at=25, fused=fused, predict=False,
                                         read_every=4)
    slow, slow_results, _ = run(stream, False, 30, stale_grads_at=25, fused=fused, predict=False, read_every=4)
    assert lean_steps == 30
    fast.close()
    slow.close()  # settles the last block on both
    assert isinstance(fast_results[5], PendingStepResult) and fast_results[5].settled
    assert fast_results[11].skipped and fast_results[19].skipped and fast_results[19].rolled_back
    assert fast.stats.divergence_rollbacks == 1
    assert_same_run((fast, fast_results), (slow, slow_results))


@pytest.mark.parametrize("overrides", [dict(grad_accumulation=2), dict(weight_average=True),
                                       dict(memory_profile=True)], ids=lambda o: next(iter(o)))
def test_runs_using_what_the_lean_step_leaves_out_take_the_general_path(stream, overrides):
    model = batch_norm_mlp(0)
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3), cross_entropy,
                            config=HybridConfig(**{**FAST, "predict": False, **overrides}))
    assert trainer._steady_allowed is False
    calls = {"lean": 0}
    trainer._steady_step = lambda batch: calls.__setitem__("lean", calls["lean"] + 1)
    for batch in stream[:4]:
        trainer.step([batch, batch] if "grad_accumulation" in overrides else batch)
    assert calls["lean"] == 0
    model = batch_norm_mlp(0)
    plain = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3), cross_entropy,
                          config=HybridConfig(predict=False))
    assert plain._steady_allowed is True  # the defaults take the lean step once prediction is off

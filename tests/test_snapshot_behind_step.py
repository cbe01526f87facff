"""The good state of a steady step (prediction off, a snapshot in a file): marked due at the end
of its step, taken at the start of the next one and written behind that step's forward and
backward, from the weights as the caller left them; the update waits for the write."""
import os
import threading
import time
import warnings

import pytest
import torch

from hybrid_trainer import HybridConfig, HybridTrainer

from _configs import FAST
from _digits import batches, cross_entropy, digits_tensors
from _faults import batch_norm_mlp


pytestmark = pytest.mark.usefixtures("eager_backend")


@pytest.fixture(scope="module")
def stream():
    return batches(*digits_tensors(), 64, 30)


def steady_trainer(**overrides):
    model = batch_norm_mlp(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    config = HybridConfig(**{**FAST, "predict": False, "good_state_every": 5, **overrides})
    trainer = HybridTrainer(model, optimizer, cross_entropy, config=config)
    assert trainer.guard.storage == "file" and trainer._steady_allowed
    return trainer


def test_the_snapshot_is_written_behind_the_next_step_and_holds_the_weights_its_step_left(stream, monkeypatch):
    trainer = steady_trainer()
    for batch in stream[:5]:
        trainer.step(batch)  # the 5th real step is not a snapshot step (1, 6, 11, ...)
    trainer.step(stream[5])  # real step 6: its snapshot is due
    assert trainer.guard.snapshot_due == 5
    weights = [p.detach().clone() for p in trainer.params]
    state = {k: v.clone() for k, v in trainer.optimizer.state[trainer.params[0]].items()}
    write, events = os.pwritev, []

    def slow_write(fd, views, offset):
        events.append(("write starts", threading.current_thread().name))
        time.sleep(0.2)
        events.append(("write ends", None))
        return write(fd, views, offset)
    step_optimizer = trainer.guard.step_optimizer

    def update():
        events.append(("update", None))
        return step_optimizer()
    monkeypatch.setattr(os, "pwritev", slow_write)
    monkeypatch.setattr(trainer.guard, "step_optimizer", update)
    trainer.step(stream[6])
    assert [kind for kind, _ in events] == ["write starts", "write ends", "update"]
    assert events[0][1].startswith("hybrid-trainer-snapshot")
    assert trainer.guard.snapshot_due is None and trainer.good_state.step == 5
    saved = trainer.good_state.state_dict()
    assert all(torch.equal(s, w) for s, w in zip(saved["params"], weights))
    assert all(torch.equal(saved["optimizer"][0][k], v) for k, v in state.items())


def test_weights_changed_between_steps_are_what_the_snapshot_holds_whole(stream):
    trainer = steady_trainer()
    for batch in stream[:6]:
        trainer.step(batch)
    assert trainer.guard.snapshot_due == 5
    with torch.no_grad():  # a caller's own edit between steps (weight clipping, as a WGAN's critic)
        for p in trainer.params:
            p.clamp_(-0.01, 0.01)
    clipped = [p.detach().clone() for p in trainer.params]
    trainer.step(stream[6])
    assert all(torch.equal(s, c) for s, c in zip(trainer.good_state.state_dict()["params"], clipped))


def test_reading_the_good_state_between_steps_takes_a_due_snapshot_at_once(stream):
    trainer = steady_trainer()
    for batch in stream[:6]:
        trainer.step(batch)
    weights = [p.detach().clone() for p in trainer.params]
    assert trainer.guard.snapshot_due == 5
    checkpoint = trainer.state_dict()  # a checkpoint holds the good state its last step made due
    assert trainer.guard.snapshot_due is None and checkpoint["good_state"]["step"] == 5
    assert all(torch.equal(s, w) for s, w in zip(checkpoint["good_state"]["params"], weights))


@pytest.mark.parametrize("lone_is_the_batchs", [False, True])
def test_a_spike_rolls_back_to_the_snapshot_written_behind_its_own_step(stream, lone_is_the_batchs):
    calls = {"n": 0}

    def spiking_loss(model, batch):
        calls["n"] += 1
        loss = cross_entropy(model, batch)
        return loss * 50.0 if calls["n"] == 7 else loss
    # With every spike rolling back (the rule before), back to the snapshot written behind the
    # step; a lone spike (the default) is refused and leaves the state as before the step, which
    # is that snapshot's too.
    trainer = steady_trainer(divergence={"min_history": 3, "blame_lone_alarms_on_the_batch": lone_is_the_batchs})
    trainer.loss_fn = spiking_loss
    for batch in stream[:6]:
        trainer.step(batch)
    weights = [p.detach().clone() for p in trainer.params]
    buffers = [b.clone() for b in trainer.model.buffers()]
    result = trainer.step(stream[6])  # takes the due snapshot, then spikes
    assert result.skipped and result.rolled_back is not lone_is_the_batchs
    assert trainer.good_state.step == 5 and trainer.guard.snapshot_due is None
    assert all(torch.equal(p, w) for p, w in zip(trainer.params, weights))
    assert all(torch.equal(b, s) for b, s in zip(trainer.model.buffers(), buffers))


def test_a_nan_written_between_steps_is_found_where_the_due_snapshot_is_taken(stream, caplog):
    trainer = steady_trainer()
    for batch in stream[:2]:
        trainer.step(batch)  # the first good state (trainer step 0), taken at the start of the second
    for batch in stream[2:6]:
        trainer.step(batch)
    assert trainer.guard.snapshot_due == 5
    bn = trainer.model[1]
    bn.running_var[0] = float("nan")  # changes no train-mode loss
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = trainer.step(stream[6])
    assert result.rolled_back
    (warned,) = [str(w.message) for w in caught]
    assert "non-finite: buffer '1.running_var'" in warned and "restored the last good state (step 0)" in warned
    assert torch.isfinite(bn.running_var).all() and trainer.good_state.step == 0
    assert "rolled back to the good state after step 0 (non-finite values where the good state" in caplog.text
    assert "predicted steps undone" not in caplog.text

"""HybridConfig(read_every=N): the guard reads a block of steps at once (hybrid_trainer.deferred_checks).

What must hold: the weights, buffers and optimizer state are those of the per-step guard whenever
nothing is refused or only non-finite steps are (they are skipped where they run, so no NaN ever
reaches a weight); a spike found at the read goes back to the last good state and discards the
steps after it; a deferred step with a fused optimizer reads nothing back; saving settles the
block, so resume stays bit-exact; metrics records and events come at the read, in step order.
"""
import collections
import json
import math

import pytest
import torch

from bench.host_ops import HostOps
from hybrid_trainer import HybridConfig, HybridTrainer
from hybrid_trainer.run_report import PendingStepResult
from _resume import assert_same_state

pytestmark = pytest.mark.usefixtures("eager_backend")


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def _make(read_every, fused=False, batch_norm=False, seed=0, **config):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(12, 24)]
    if batch_norm:
        layers.append(torch.nn.BatchNorm1d(24))
    layers += [torch.nn.ReLU(), torch.nn.Linear(24, 3)]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    config = dict(dict(predict=False, good_state_every=6), **config)
    return model, HybridTrainer(model, optimizer, _loss, HybridConfig(read_every=read_every, **config))


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 12, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)]


def _with_nan_input(batch):
    x = batch[0].clone()
    x[0, 0] = float("nan")
    return x, batch[1]


def _state(model, trainer):
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": trainer.optimizer.state_dict()}


@pytest.mark.parametrize("fused", [False, True])
def test_clean_run_matches_the_per_step_guard(fused, monkeypatch):
    from hybrid_trainer import blas_dots

    # The per-step read through per-gradient norms (_foreach_norm), as the queued ones: with BLAS's
    # dots past the dispatcher it reads gradients of any size by dots, whose norms agree to ~1e-6.
    monkeypatch.setattr(blas_dots, "_ROUTINES", {})
    batches = _batches(40)
    results = {}
    states = {}
    for read_every in (1, 8):
        model, trainer = _make(read_every, fused=fused)
        results[read_every] = [trainer.step(b) for b in batches]
        trainer.close()
        states[read_every] = _state(model, trainer)
    assert_same_state(states[8], states[1])
    assert any(isinstance(r, PendingStepResult) for r in results[8])
    assert [r.loss for r in results[8]] == [r.loss for r in results[1]]
    # Exactly: the queued per-gradient norms are combined on the host in float64, as the per-step
    # guard combines the ones it reads on a CPU (a device-side global norm agreed to ~1e-7 only).
    # This model's gradients are small, so without BLAS's routines the per-step read takes
    # _foreach_norm too; where a CPU reads them by dot products (read_by_dots), the device-side
    # skip's norms agree to 1e-6.
    assert not trainer.guard._grads_by_dots
    assert [r.grad_norm for r in results[8]] == [r.grad_norm for r in results[1]]
    assert all(r.divergence == "OK" and r.settled for r in results[8] if isinstance(r, PendingStepResult))


def test_a_deferred_step_queues_its_loss_and_one_norm_per_gradient():
    """The device-side path queues ``[loss, |g_1|, ..., |g_k|]`` as 0-d float32 tensors (no
    reduction to the global norm on the device, no stack before the read); a result read before
    the block's read combines them."""
    trainer, batches, done = _right_after_a_read(fused=True)
    result = trainer.step(batches[done])
    _, values, has_norm = trainer.guard.deferred.pending[-1]
    assert has_norm and len(values) == 1 + len(trainer.params)
    assert all(v.shape == () and v.dtype == torch.float32 for v in values)
    grads_norms = [v.item() for v in values[1:]]
    assert result.grad_norm == math.sqrt(math.fsum(n * n for n in grads_norms))  # read on access
    assert result.loss == values[0].item() and not result.settled


def test_between_reads_a_fused_step_adds_the_norms_and_one_check_and_no_stack_or_zeroing():
    """On a GPU each op is a launch. Between reads a step with a fused optimizer adds to the
    forward, backward and update the gradients' norms and one multi-tensor check of them (and
    torch's own step-count correction for ``found_inf``): its values are stacked once at the
    read, and its skip flag is one of ``read_every`` zeros, zeroed again once they are used up."""
    trainer, batches, done = _right_after_a_read(fused=True)
    counter = HostOps()
    with counter:
        for b in batches[done:done + 15]:  # no read due among them
            trainer.step(b)
    ops = collections.Counter(counter.ops)
    assert ops["_foreach_norm"] == 15 and ops["_amp_foreach_non_finite_check_and_unscale_"] == 15
    assert ops["stack"] == 0 and ops["cat"] == 0 and ops["zero_"] <= 1 and ops["select"] == 0, ops
    with counter:
        trainer.step(batches[done + 15])  # the read: one stack for the whole block
    assert collections.Counter(counter.ops)["stack"] == 1


def test_between_reads_the_buffers_are_chosen_on_the_device_with_one_op_each():
    """With batch norm (3 buffers) each fused step keeps them with one multi-tensor copy before
    its forward and puts them back where its skip flag says, one in-place ``where`` a buffer:
    on a GPU every op is a launch on every step."""
    batches = _batches(48)
    _, trainer = _make(16, fused=True, batch_norm=True)
    done = _steps_until_a_read(trainer, batches)
    assert len(trainer.guard.buffers_before.slots) == 3
    counter = HostOps()
    with counter:
        for b in batches[done:done + 15]:  # no read due among them
            trainer.step(b)
    ops = collections.Counter(counter.ops)
    assert ops["where"] == 3 * 15 and ops["_foreach_copy_"] == 15, ops
    assert ops["copy_"] == 0, ops


@pytest.mark.parametrize("fused", [False, True])
def test_non_finite_steps_are_skipped_exactly_as_per_step(fused):
    """A NaN batch (through batch-norm statistics too) and a NaN gradient with a finite loss: skipped
    where they run, the run continues bit for bit as under the per-step guard."""
    batches = _batches(40)
    batches[13] = _with_nan_input(batches[13])
    states, stats = {}, {}
    for read_every in (1, 8):
        model, trainer = _make(read_every, fused=fused, batch_norm=True)
        hook = model[0].weight.register_hook(lambda g: g * float("nan") if hook_step[0] == 21 else g)
        hook_step = [0]
        for i, b in enumerate(batches):
            hook_step[0] = i
            trainer.step(b)
            assert all(torch.isfinite(p).all() for p in model.parameters()), f"NaN reached a weight at step {i}"
        hook.remove()
        stats[read_every] = trainer.statistics()
        states[read_every] = _state(model, trainer)
    assert_same_state(states[8], states[1])
    assert stats[8]["skipped_steps"] == stats[1]["skipped_steps"] == 2


def _steps_until_a_read(trainer, batches):
    """Steps over ``batches`` until a step ends with nothing waiting (the read came); returns how many."""
    for n, b in enumerate(batches, 1):
        trainer.step(b)
        if trainer.guard.defers() and not trainer.guard.deferred.pending:
            return n
    raise AssertionError("no read came")


def _two_reads_in(batches):
    """A read_every=8 trainer (and its model) two reads into ``batches``, so that its good state
    is a read's; how many steps that took; and a twin (model, trainer) stepped as far and closed,
    whose state is that good state."""
    model, trainer = _make(8, good_state_every=6)
    done = _steps_until_a_read(trainer, batches)
    done += _steps_until_a_read(trainer, batches[done:])
    reference, again = _make(8, good_state_every=6)
    for b in batches[:done]:
        again.step(b)
    again.close()
    return model, trainer, done, reference, again


def _assert_back_at_the_good_state(model, trainer, reference, again):
    """The weights and optimizer state are the twin's of :func:`_two_reads_in`: the good state's."""
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert_same_state(trainer.optimizer.state_dict(), again.optimizer.state_dict())


def test_a_spike_goes_back_to_the_good_state_and_discards_the_steps_after_it():
    batches = _batches(60)
    model, trainer, done, reference, again = _two_reads_in(batches)
    assert trainer.good_state.step == done - 1
    spike_at = done + 2
    batches[spike_at] = (batches[spike_at][0] * 1e4, batches[spike_at][1])  # far above the window
    results = [trainer.step(b) for b in batches[done:done + 8]]  # the 8th brings the read
    assert all(isinstance(r, PendingStepResult) and r.settled for r in results)
    assert not any(r.skipped for r in results[:2])
    assert results[2].skipped and results[2].rolled_back and "loss" in results[2].divergence
    assert all(r.skipped and r.rolled_back and r.divergence.startswith("discarded") for r in results[3:])
    assert trainer.stats.divergence_rollbacks == 1 and trainer.stats.skipped_steps == 6
    _assert_back_at_the_good_state(model, trainer, reference, again)


def test_a_lone_outlier_found_at_the_read_stands_and_nothing_is_discarded():
    # A batch far above the window with an ordinary gradient (a hard batch): found at the block's
    # read, it is tolerated like the per-step guard's, so its update and the block's later ones
    # stand (they ran already): the weights are those of a run without it, bit for bit.
    batches = _batches(80)
    _, clean = _make(8, good_state_every=6)
    model, trainer = _make(8, good_state_every=6)
    calls = {"n": 0}

    def louder(model, batch):  # ten times the loss on one call, the same gradient
        calls["n"] += 1
        loss = _loss(model, batch)
        return loss + 9 * loss.detach() if calls["n"] == outlier_call else loss

    outlier_call = 70 + 3
    trainer.loss_fn = louder
    results = [trainer.step(b) for b in batches]
    for b in batches:
        clean.step(b)
    trainer.close()
    clean.close()
    assert isinstance(results[72], PendingStepResult) and results[72].divergence == "WARNING"
    assert trainer.monitor.tolerated == 1 and trainer.stats.skipped_steps == 0
    assert_same_state(_state(model, trainer)["model"], _state(clean.model, clean)["model"])
    assert_same_state(trainer.optimizer.state_dict(), clean.optimizer.state_dict())


def test_a_second_outlier_in_a_row_found_at_the_read_goes_back_and_undoes_the_tolerated_first():
    # Weights gone wrong make every batch lose more: the second critical step in a row (higher
    # still: one as high is no outlier against the window the first widened) is the weights', and
    # the good state (taken before the block) undoes the tolerated first one too; the block's
    # later steps are discarded.
    batches = _batches(80)
    model, trainer, done, reference, again = _two_reads_in(batches)
    calls = {"n": 0}

    def louder(model, batch):  # 10 and 50 times the loss on the block's 2nd and 3rd steps, the same gradient
        calls["n"] += 1
        loss = _loss(model, batch)
        return loss + {2: 9, 3: 49}.get(calls["n"], 0) * loss.detach()

    trainer.loss_fn = louder
    results = [trainer.step(b) for b in batches[done:done + 8]]  # the 8th brings the read
    assert results[1].divergence == "WARNING" and trainer.monitor.tolerated == 1
    assert results[2].skipped and results[2].rolled_back and "loss z-score" in results[2].divergence
    assert all(r.skipped and r.divergence.startswith("discarded") for r in results[3:])
    assert trainer.stats.divergence_rollbacks == 1 and trainer.stats.skipped_steps == 6
    _assert_back_at_the_good_state(model, trainer, reference, again)


def test_after_a_rollback_each_step_is_read_until_the_next_good_state_then_blocks_again():
    # A refused step found at a block's read discards the block's later steps too, and
    # refusals come in runs: from a rollback until a good state is taken, steps are read one
    # by one, so a second alarm in that stretch costs its own step, not a block.
    batches = _batches(80)
    model, trainer = _make(8, good_state_every=6)
    done = _steps_until_a_read(trainer, batches)
    done += _steps_until_a_read(trainer, batches[done:])
    spike_at = done + 2
    batches[spike_at] = (batches[spike_at][0] * 1e4, batches[spike_at][1])
    for b in batches[done:done + 8]:  # the 8th brings the read, and the rollback
        trainer.step(b)
    assert trainer.stats.divergence_rollbacks == 1 and trainer.monitor.rewound and not trainer.guard.defers()
    good_step = trainer.good_state.step
    second = done + 9
    batches[second] = (batches[second][0] * 1e4, batches[second][1])  # another alarm in the stretch
    results = []
    for b in batches[done + 8:]:
        results.append(trainer.step(b))
        if trainer.good_state.step != good_step:
            break
    assert not any(isinstance(r, PendingStepResult) for r in results)  # judged as they came
    refused = [r for r in results if r.skipped]
    # Read as it came, a lone alarm is taken for the batch's: its step is refused, nothing else goes.
    assert len(refused) == 1 and refused[0].step == second and not refused[0].rolled_back
    assert trainer.stats.divergence_rollbacks == 1
    assert trainer.stats.skipped_steps == 6 + 1  # the first block's 6, then only the one step
    assert not trainer.monitor.rewound and trainer.guard.defers()  # a good state again: blocks again
    assert isinstance(trainer.step(batches[-1]), PendingStepResult)


def _right_after_a_read(fused):
    """A read_every=16 trainer that has just read, its batches, and how many it used."""
    batches = _batches(48)
    _, trainer = _make(16, fused=fused)
    return trainer, batches, _steps_until_a_read(trainer, batches)


def test_a_deferred_step_with_a_fused_optimizer_reads_nothing_back():
    trainer, batches, done = _right_after_a_read(fused=True)
    counter = HostOps()
    with counter:
        for b in batches[done:done + 15]:  # no read due among them
            trainer.step(b)
    assert dict(counter.read_backs) == {}, counter.read_backs
    with counter:
        trainer.step(batches[done + 15])  # the 16th: the block's one read
    # The block's one read, and the good state's finiteness check when a snapshot is due.
    assert counter.read_backs["deferred_checks.py:settle"] == 1
    assert set(counter.read_backs) <= {"deferred_checks.py:settle", "resume_check.py:_all_finite_on_cpu",
                                       "resume_check.py:non_finite_names"}


def test_without_a_device_side_skip_a_step_reads_its_two_values_once(monkeypatch):
    # Emulating a device whose reads wait for it: the loss and norm come back in one read.
    import hybrid_trainer.step_guard as step_guard

    monkeypatch.setattr(step_guard, "reads_are_free", lambda device: False)
    trainer, batches, done = _right_after_a_read(fused=False)
    counter = HostOps()
    with counter:
        trainer.step(batches[done])
    reads = {who: n for who, n in counter.read_backs.items() if who != "optimizer"}  # its step counters, as a plain loop's
    assert reads == {"deferred_checks.py:launch": 1}


def test_on_a_cpu_a_deferred_step_reads_as_the_per_step_guard_does():
    # Reads cost nothing on a CPU: the values come from the per-step guard's read (the loss and
    # one norm per gradient), not from a stack of them built for one read.
    trainer, batches, done = _right_after_a_read(fused=False)
    counter = HostOps()
    with counter:
        result = trainer.step(batches[done])
    reads = {who: n for who, n in counter.read_backs.items() if who != "optimizer"}
    # The loss, then one norm per gradient (a square per gradient where the read takes dot
    # products, squares_by_dots) read in a list comprehension of squares_read: its own frame up
    # to Python 3.11, inlined into the function from 3.12 (PEP 709). Dots from BLAS past torch's
    # dispatcher (blas_dots) read the gradients' memory with no tensor read-back at all.
    from hybrid_trainer import blas_dots

    assert set(reads) <= {"step_guard.py:read_step_values", "step_guard.py:squares_read",
                          "step_guard.py:squares_by_dots", "step_guard.py:<listcomp>"}, reads
    by_blas = trainer.guard._grads_by_dots and blas_dots.self_dot_routine(trainer.params[0].dtype) is not None
    assert sum(reads.values()) == 1 + (0 if by_blas else len(trainer.params)), reads
    assert result.loss is not None and result.grad_norm > 0 and not result.settled


def test_resume_with_steps_waiting_is_bit_exact(tmp_path):
    batches = _batches(40)
    _, reference = _make(8, fused=True)
    for b in batches[:21]:
        reference.step(b)
    path = tmp_path / "run.pt"
    assert reference.guard.deferred.pending
    reference.save(path)  # saving judges the waiting steps first
    assert not reference.guard.deferred.pending
    model, resumed = _make(8, fused=True, seed=7)
    resumed.load(path)
    assert_same_state(_without_timings(resumed.state_dict()), _without_timings(reference.state_dict()))
    for b in batches[21:]:
        reference.step(b)
        resumed.step(b)
    assert_same_state(_without_timings(resumed.state_dict()), _without_timings(reference.state_dict()))


def _without_timings(state):
    state["stats"] = {k: v for k, v in state["stats"].items() if k != "time_by_phase_s"}
    return state


def test_metrics_and_events_come_at_the_read_in_step_order(tmp_path):
    batches = _batches(20)
    batches[10] = _with_nan_input(batches[10])
    path = tmp_path / "metrics.jsonl"
    refused = []

    class Recorder:
        def on_update_refused(self, trainer, event):
            refused.append(event.step)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU(), torch.nn.Linear(24, 3))
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), _loss,
                            HybridConfig(predict=False, read_every=4, metrics_path=str(path)), callbacks=[Recorder()])
    results = [trainer.step(b) for b in batches[:14]]
    assert refused == [10]
    trainer.close()  # settles and writes the last two
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(14))
    assert records[10]["skipped"] and records[10]["loss"] is None
    assert all(math.isfinite(r["loss"]) for i, r in enumerate(records) if i != 10)
    assert results[10].skipped and results[10].loss is None


def test_the_loss_of_a_waiting_step_is_read_when_asked():
    batches = _batches(12)
    model, trainer = _make(16, fused=True)
    results = [trainer.step(b) for b in batches]
    waiting = results[-1]
    assert isinstance(waiting, PendingStepResult) and not waiting.settled and waiting.divergence == "PENDING"
    torch.manual_seed(0)
    assert waiting.loss == pytest.approx(_loss(model, batches[-1]).item(), rel=0.2)  # weights moved one step since
    assert waiting.grad_norm > 0


def test_prediction_on_keeps_the_per_step_guard():
    _, trainer = _make(8, predict=True)
    results = [trainer.step(b) for b in _batches(6)]
    assert trainer.controller.prediction_enabled
    assert not any(isinstance(r, PendingStepResult) for r in results)


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_read_every_is_checked(value):
    with pytest.raises(ValueError, match="read_every"):
        HybridConfig(read_every=value).validate()


def test_by_default_a_cpu_reads_every_step():
    _, trainer = _make(None)
    assert trainer.guard.deferred is None
    assert not any(isinstance(trainer.step(b), PendingStepResult) for b in _batches(5))


def test_a_refused_step_that_ends_its_block_is_reported_once_and_as_what_it_was():
    batches = _batches(20)
    refused = []

    class Recorder:
        def on_update_refused(self, trainer, event):
            refused.append(event.step)

        def on_rollback(self, trainer, event):
            rollbacks.append((event.kind, event.step))

    rollbacks = []
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU(), torch.nn.Linear(24, 3))
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), _loss,
                            HybridConfig(predict=False, read_every=4), callbacks=[Recorder()])
    done = _steps_until_a_read(trainer, batches)
    last_of_block = done + 3
    batches[last_of_block] = _with_nan_input(batches[last_of_block])
    batches[last_of_block + 4] = (batches[last_of_block + 4][0] * 1e4, batches[last_of_block + 4][1])  # a spike
    results = [trainer.step(b) for b in batches[done:last_of_block + 5]]
    assert results[-5].settled and results[-5].skipped
    assert results[-1].settled and results[-1].rolled_back
    assert refused == [last_of_block, last_of_block + 4]
    assert rollbacks == [("divergence", last_of_block + 4)]



def test_16_bit_gradients_queue_their_norms_in_float32():
    """GradScaler's check takes the queued values in one multi-tensor op only when they share a
    dtype: the loss is float32, so 16-bit gradients' norms are taken in float32 (not rounded to
    16 bits first)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(12, 3).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    trainer = HybridTrainer(model, optimizer, lambda m, b: m(b[0].to(torch.bfloat16)).float().pow(2).mean(),
                            HybridConfig(predict=False, read_every=16, good_state_every=6))
    batches = _batches(24)
    done = _steps_until_a_read(trainer, batches)
    trainer.step(batches[done])
    _, values, _ = trainer.guard.deferred.pending[-1]
    assert [v.dtype for v in values] == [torch.float32] * 3  # the loss and two norms
    trainer.loss_fn(model, batches[done + 1]).backward()  # gradients to compare the norms with
    norms = trainer.guard.grad_norms()
    assert [n.dtype for n in norms] == [torch.float32] * 2
    for norm, p in zip(norms, trainer.params):
        assert norm.item() == pytest.approx(p.grad.float().norm().item(), rel=1e-6)

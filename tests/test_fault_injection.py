"""Fault injection: NaN, Inf and spikes put into the inputs, the loss, the gradients, the weights and the
batch-norm buffers of a small run at chosen or random steps, in every phase (WARMUP, FULL, PREDICT, CORRECT;
prediction forced on so that PREDICT phases happen), with the guard's invariant checked after every step:

* weights, buffers and optimizer state are finite, or the run stopped with :class:`TrainingStalledError`;
* a step whose batch, loss or gradients were faulty leaves the weights and buffers in a state the run had
  already reached (the one before the step, the last good state, or a PREDICT phase's last verified point).

Faults put into the weights or buffers between steps come from outside the trainer (a user, a bad
checkpoint): a real step meets a non-finite weight through its loss or gradient at once; a non-finite
batch-norm statistic does not change a train-mode loss, so the guard finds it at its next good-state
snapshot, and until then only the invariant's first half is checked late: within one snapshot interval.

The short form runs in ``make test`` (a few seconds); the long form (``-m slow``) draws many more schedules.
"""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybrid_trainer import Phase

from _configs import ALWAYS
from _digits import batches, cross_entropy, digits_tensors
from _faults import fingerprint, make_trainer, non_finite

# The guard warns each time it restores the good state for a fault it cannot mend: expected here.
pytestmark = [pytest.mark.filterwarnings("ignore:.*restored the last good state:RuntimeWarning"),
              pytest.mark.usefixtures("eager_backend")]  # the CPU path, not the Triton interpreter

# Faults of the trainer's inputs: checked after the very step they enter.
INPUT_FAULTS = ("input_nan", "input_inf", "loss_nan", "loss_inf", "loss_spike", "grad_nan", "grad_inf",
                "grad_spike")
# Faults put into the trainer's state from outside, between steps.
STATE_FAULTS = ("weight_nan", "weight_inf", "buffer_nan")
GOOD_STATE_EVERY = 5
CONFIG = dict(**ALWAYS, good_state_every=GOOD_STATE_EVERY, divergence={"min_history": 5})


@pytest.fixture(scope="module")
def stream():
    x, y = digits_tensors()
    return batches(x, y, 64, 400)


class FaultyRun:
    """A trainer over a batch-norm MLP whose loss function and parameters can be made faulty for one step."""

    def __init__(self, stream, seed=0):
        self.stream = stream
        self.pending: str | None = None  # fault of the next loss_fn call
        self.fired = False  # the pending fault reached the trainer during the step
        self.trainer = make_trainer(loss_fn=self.loss_fn, seed=seed, **CONFIG)
        self.reached = {fingerprint(self.trainer)}  # states the run legitimately reached
        self.stale_since: int | None = None  # step at which a state fault went in, until it is gone
        self.phases_hit: set[str] = set()

    def loss_fn(self, model, batch):
        fault, self.pending = self.pending, None
        x, y = batch
        if fault in ("input_nan", "input_inf"):
            x = x.clone()
            x[0, 5] = math.nan if fault == "input_nan" else math.inf
        loss = cross_entropy(model, (x, y))
        if fault is not None:
            self.fired = True
        if fault == "loss_nan":
            return loss * math.nan
        if fault == "loss_inf":
            return loss * math.inf
        if fault == "loss_spike":
            return loss * 1e6
        if fault and fault.startswith("grad_"):
            if not loss.requires_grad:  # a PREDICT phase's verification: no gradients to spoil
                self.fired = False
                return loss
            scale = {"grad_nan": math.nan, "grad_inf": math.inf, "grad_spike": 1e6}[fault]
            loss.register_hook(lambda g: g * scale)
        return loss

    def inject_state_fault(self, fault: str) -> None:
        model = self.trainer.model
        with torch.no_grad():
            if fault == "weight_nan":
                model[0].weight[7, 11] = math.nan
            elif fault == "weight_inf":
                model[3].bias[2] = math.inf
            else:
                model[1].running_mean[4] = math.nan

    def step(self, index: int, fault: str | None) -> bool:
        """One step with ``fault``; checks the invariant. False once the run stopped with its error."""
        from hybrid_trainer import TrainingStalledError

        trainer = self.trainer
        phase = trainer.controller.phase
        if fault in STATE_FAULTS:
            self.inject_state_fault(fault)
            if self.stale_since is None:
                self.stale_since = index
        elif fault is not None:
            self.pending, self.fired = fault, False
        try:
            trainer.step(self.stream[index])
        except TrainingStalledError as error:
            assert "non-finite" in str(error) or "in a row" in str(error), str(error)
            return False
        fired, self.fired, self.pending = self.fired, False, None
        if fired:
            self.phases_hit.add(phase.value)
        bad = non_finite(trainer)
        if self.stale_since is not None:
            if not bad:
                self.stale_since = None
            else:  # from outside: the next good-state snapshot (a few real steps) must have found it
                assert index - self.stale_since <= 3 * GOOD_STATE_EVERY + 8, (index, bad)
                return True
        assert not bad, (index, fault, phase, bad)
        state = fingerprint(trainer)
        if fired:
            assert state in self.reached, f"step {index} ({fault} in {phase.value}) left a state never reached"
        self.reached.add(state)
        return True


def run_schedule(stream, schedule: dict[int, str], steps: int, seed: int = 0) -> FaultyRun:
    run = FaultyRun(stream, seed)
    for index in range(steps):
        if not run.step(index, schedule.get(index)):
            break
    return run


# State faults closer together than this many steps may find no new good state taken in between, and
# then rightly stop the run (the guard restores a good state once per fault it cannot mend).
STATE_FAULT_SPACING = 2 * GOOD_STATE_EVERY + 2


def phase_targeted(stream, fault: str, steps: int = 120) -> FaultyRun:
    """``fault`` once in each phase: at the first WARMUP, FULL and CORRECT step after the previous fault
    and at the verification step of a PREDICT phase (where the loss function runs), or for state faults
    its first step (state faults spaced by STATE_FAULT_SPACING steps)."""
    run = FaultyRun(stream)
    done: set[Phase] = set()
    last = -STATE_FAULT_SPACING
    for index in range(steps):
        ctl = run.trainer.controller
        phase = ctl.phase
        verifying = (ctl.phase_step + 1) % run.trainer.config.verify_every == 0
        due = phase not in done and index >= 2 and (
            phase is not Phase.PREDICT or fault in STATE_FAULTS or verifying)
        if fault in STATE_FAULTS and index - last < STATE_FAULT_SPACING:
            due = False
        if due:
            done.add(phase)
            last = index
        if not run.step(index, fault if due else None):
            raise AssertionError(f"{fault} once per phase stopped the run at step {index}")
    assert done == set(Phase), f"{fault} was injected in {sorted(p.value for p in done)} only"
    return run


@pytest.mark.parametrize("fault", INPUT_FAULTS + STATE_FAULTS)
def test_a_fault_in_every_phase_keeps_the_invariant(stream, fault):
    run = phase_targeted(stream, fault)
    assert run.trainer.stats.predict_phases > 0, "no PREDICT phase happened: the schedule tests nothing there"
    if fault in INPUT_FAULTS:  # a PREDICT phase runs no backward: gradient faults cannot reach it
        expected = {"WARMUP", "FULL", "CORRECT"} | (set() if fault.startswith("grad_") else {"PREDICT"})
        assert run.phases_hit == expected, run.phases_hit
    stats = run.trainer.stats
    if fault in STATE_FAULTS:  # each one mended by a restore of the good state or a rejected PREDICT phase
        assert stats.stall_restores + stats.predict_phases_rejected >= len(Phase), stats
    else:
        assert stats.skipped_steps + stats.predict_phases_rejected >= 1, stats


@st.composite
def schedules(draw, steps: int, max_faults: int):
    indices = draw(st.lists(st.integers(1, steps - 1), min_size=1, max_size=max_faults, unique=True))
    return {i: draw(st.sampled_from(INPUT_FAULTS + STATE_FAULTS)) for i in indices}


SHORT = settings(max_examples=6, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture])
LONG = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@SHORT
@given(schedule=schedules(steps=60, max_faults=6))
def test_random_faults_keep_the_invariant(stream, schedule):
    run_schedule(stream, schedule, steps=60)


@pytest.mark.slow
@LONG
@given(schedule=schedules(steps=200, max_faults=20), seed=st.integers(0, 3))
def test_random_faults_keep_the_invariant_long(stream, schedule, seed):
    run_schedule(stream, schedule, steps=200, seed=seed)


def test_a_burst_of_faults_ends_in_a_clear_error_or_a_finite_run(stream):
    """Every batch of a stretch longer than the refusal limit is faulty: the run stops with its error,
    never trains on, never stalls silently."""
    from hybrid_trainer import TrainingStalledError

    run = FaultyRun(stream)
    for index in range(20):
        run.step(index, None)
    with pytest.raises(TrainingStalledError):
        for index in range(20, 80):
            run.pending = "loss_nan"
            run.trainer.step(stream[index])
    assert not non_finite(run.trainer)

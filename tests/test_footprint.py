"""What the trainer keeps in tensors beside the plain loop's weights, gradients and optimizer state.

Measured as a slope: the bytes the trainer holds on the training device (walked through its
collaborators by ``hybrid_trainer.footprint``) at two model widths, per byte of parameters added.
Fixed-size parts (the dynamics model, counters) cancel; anything kept per parameter (a snapshot of
the weights or of the optimizer state, the predictor's direction buffers) shows up as 1 or more.
"""
import pytest
import torch

from hybrid_trainer import HybridConfig, HybridTrainer
from hybrid_trainer.footprint import trainer_tensor_bytes

from _digits import batches, cross_entropy, digits_tensors

WIDTHS = (128, 512)


pytestmark = pytest.mark.usefixtures("eager_backend")  # the CPU path, not the Triton interpreter


@pytest.fixture(scope="module")
def stream():
    x, y = digits_tensors()
    return batches(x, y, 64, 70)


def _trainer(width: int, **config) -> HybridTrainer:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, 10))
    return HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cross_entropy, HybridConfig(**config))


def _held_on_device(trainer: HybridTrainer) -> int:
    return trainer_tensor_bytes(trainer)["by_device"].get(str(trainer.device), 0)


def _param_bytes(trainer: HybridTrainer) -> int:
    return sum(p.numel() * p.element_size() for p in trainer.params)


def _slope(trainers) -> float:
    """Trainer-held device bytes per parameter byte, between the two widths."""
    small, large = trainers
    return (_held_on_device(large) - _held_on_device(small)) / (_param_bytes(large) - _param_bytes(small))


def _run(trainers, stream, steps, start=0):
    for trainer in trainers:
        for batch in stream[start:start + steps]:
            trainer.step(batch)


def test_predict_false_keeps_no_copy_of_the_weights_or_optimizer_state_on_the_device(stream):
    trainers = [_trainer(w, predict=False) for w in WIDTHS]
    _run(trainers, stream, 60)  # good states taken at real steps 1 and 51
    assert all(t.good_state.is_set for t in trainers)
    assert _slope(trainers) < 0.05


def test_a_good_state_kept_on_the_device_is_counted(stream):
    """The same measurement sees a snapshot beside the weights (weights + AdamW's two moments)."""
    trainers = [_trainer(w, predict=False, good_state_storage="device") for w in WIDTHS]
    _run(trainers, stream, 3)
    assert _slope(trainers) >= 2.9


def test_prediction_buffers_exist_only_while_prediction_can_run(stream):
    trainers = [_trainer(w) for w in WIDTHS]
    _run(trainers, stream, 10)  # WARMUP: nothing recorded yet
    assert all(t.controller.phase.value == "WARMUP" for t in trainers)
    assert _slope(trainers) < 0.05
    _run(trainers, stream, 20, start=10)  # FULL: real updates are recorded
    assert all(t.predictor.allocated for t in trainers)
    assert 0.25 <= _slope(trainers) < 0.3  # the int8 direction exists now: a byte per 4-byte value, a scale per 256
    for t in trainers:  # prediction off for good, as the controller does after repeated rejections
        t.controller.disabled_reason = "switched off by the test"
    _run(trainers, stream, 1, start=30)
    assert not any(t.predictor.allocated for t in trainers)
    assert all(t.dynamics is None for t in trainers)  # the forecaster's model goes too
    assert _slope(trainers) < 0.05


def test_a_default_run_whose_gate_never_opens_never_builds_the_dynamics_model(stream):
    """The dynamics model (an ensemble of GRUs, its Adam state once trained) only serves a forecast
    that only prediction reads: built the first time the worth gate passes, never before."""
    trainer = _trainer(128, min_predicted_worth=10.0)  # no predicted step is worth ten real ones here
    for batch in stream[:60]:
        trainer.step(batch)
        assert not trainer.worth.passes() and trainer.forecaster.dynamics is None
    assert trainer.predictor.n_updates > 0 or not trainer.controller.prediction_enabled  # it did run past WARMUP
    assert trainer_tensor_bytes(trainer)["by_holder"].get("forecaster", 0) < 10_000
    assert trainer.statistics()["dynamics_train_steps"] == 0


def test_the_dynamics_model_is_built_when_the_gate_first_passes(stream):
    trainer = _trainer(128, confidence_threshold=0.0, min_predicted_worth=-1.0, cost_aware=False)
    for i, batch in enumerate(stream[:40]):
        trainer.step(batch)
        if trainer.forecaster.dynamics is not None:
            break
    else:
        raise AssertionError("the gate never let the forecaster run")
    assert trainer.worth.passes() and trainer.controller.phase.value != "WARMUP"
    assert trainer.forecaster.dynamics.count == 1  # built for the step that first needed it


def test_every_prediction_buffer_goes_when_rejections_switch_prediction_off(stream):
    """The EMA direction, the PREDICT anchor and the dynamics model (its GRU networks, their Adam
    state, the replay of states) all exist during a PREDICT phase; when that phase's rejection
    switches prediction off for the run (as ``max_consecutive_rejections`` does), every one of
    them is freed by the end of that step, and the trainer's tensors on the device drop back to
    what ``predict=False`` holds."""
    from hybrid_trainer import Phase

    from _configs import ALWAYS, FAST

    trainer = _trainer(128, **{**FAST, **ALWAYS}, loss_tolerance=0.0, noise_z=0.0, max_consecutive_rejections=1)
    i = 0
    while trainer.controller.phase is not Phase.PREDICT:
        trainer.step(stream[i])
        i += 1
    trainer.predictor.scales.fill_(50.0)  # a predicted step far too large: its verification rejects it
    trainer.step(stream[i])  # the phase's first predicted step: the anchor is taken
    dynamics = trainer.forecaster.dynamics
    assert trainer.predictor.allocated and trainer.predict_phase.anchor.is_set
    assert dynamics is not None and dynamics.built and dynamics.train_steps > 0 and dynamics.states.shape[0] > 0
    during = trainer_tensor_bytes(trainer)["by_device"]["cpu"]
    assert during > 2 * _param_bytes(trainer)  # the anchor's copy of the weights plus the int8 direction plus the GRUs
    while trainer.controller.phase is Phase.PREDICT:
        i += 1
        trainer.step(stream[i])
    assert trainer.stats.predict_phases_rejected == 1 and not trainer.controller.prediction_enabled
    assert not trainer.predictor.allocated and not trainer.predict_phase.anchor.is_set
    assert trainer.forecaster.dynamics is None  # networks, Adam state and replay with it
    after = trainer_tensor_bytes(trainer)
    off = _trainer(128, predict=False)
    _run([off], stream, i + 1)
    assert after["by_holder"].get("forecaster", 0) < 10_000
    assert after["by_device"].get("cpu", 0) <= trainer_tensor_bytes(off)["by_device"].get("cpu", 0) + 10_000

"""The cost-aware worth gate: calibrated timings, break-even arithmetic, and its effect on a run."""
import pytest
import torch

from hybrid_trainer import HybridConfig, HybridTrainer
from hybrid_trainer.cost import CALIBRATION_STEPS, PredictionCost, real_steps_per_predicted

from _digits import batches, cross_entropy, digits_tensors, mlp


def calibrate(cost, part, values):
    for v in values:
        cost.observe(part, v)


def test_schedule_ratio_of_real_to_predicted_steps():
    # defaults: CORRECT 4 after each PREDICT of up to 16, FULL 20 every 4 cycles → (4 + 5) / 16
    assert real_steps_per_predicted(HybridConfig()) == pytest.approx(9 / 16)
    cfg = HybridConfig(correct_steps=3, full_steps=8, max_consecutive_predict=2, predict_lengths=(2, 6))
    assert real_steps_per_predicted(cfg) == pytest.approx((3 + 4) / 6)


def test_break_even_worth_from_calibrated_medians_then_frozen():
    cost = PredictionCost(real_per_predicted=0.5)
    assert cost.overhead == 0.0 and cost.required_worth(0.1) == pytest.approx(0.1)
    n = CALIBRATION_STEPS["core"]
    calibrate(cost, "core", [2.0] * (n - 1) + [50.0])  # one outlier (a GC pause) does not move the median
    assert cost.seconds["core"] == pytest.approx(2.0)
    calibrate(cost, "recording", [0.5] * CALIBRATION_STEPS["recording"])
    assert cost.overhead == pytest.approx(0.25)
    calibrate(cost, "forecasting", [3.0] * CALIBRATION_STEPS["forecasting"])
    calibrate(cost, "dynamics_training", [0.5] * CALIBRATION_STEPS["dynamics_training"])
    assert cost.overhead == pytest.approx((0.5 + 3.0 + 0.5) / 2.0)
    assert cost.required_worth(0.1) == pytest.approx(0.1 + 2.0 * 0.5)
    calibrate(cost, "core", [100.0] * 20)  # calibrated parts are fixed for the run
    assert cost.seconds["core"] == pytest.approx(2.0)
    restored = PredictionCost(0.5)
    restored.load_state_dict(cost.state_dict())
    assert restored.required_worth(0.1) == cost.required_worth(0.1)


def test_partial_calibration_counts_only_finished_parts():
    cost = PredictionCost(1.0)
    calibrate(cost, "core", [1.0] * CALIBRATION_STEPS["core"])
    calibrate(cost, "forecasting", [5.0] * (CALIBRATION_STEPS["forecasting"] - 1))
    assert cost.overhead == 0.0 and cost.calibrated == {"core": True, "recording": False, "forecasting": False,
                                                         "dynamics_training": False}


@pytest.mark.slow
def test_cost_gate_switches_off_machinery_that_costs_more_than_the_step(eager_backend):
    """A tiny MLP on digits, whose step costs about what the recording machinery costs (~1x on
    the eager path, the CPU product; the Triton interpreter made it ~12x here, and a GPU machine's
    eager run measured 1.4x): at a frequency of 1.25 real steps per predicted one, no predicted
    step can pay for it. Cost-aware, prediction switches off for that reason; with the gate at
    min_predicted_worth alone, the same run keeps predicting."""
    x, y = digits_tensors()
    stream = batches(x, y, 64, 100)
    settings = dict(warmup_steps=8, full_steps=8, correct_steps=3, predict_lengths=(4,), verify_every=4,
                    dynamics_hidden=128, dynamics_window=4, dynamics_batch=8, dynamics_train_every=2,
                    confidence_threshold=0.0, min_predicted_worth=-1.0, max_consecutive_rejections=100)
    stats = {}
    for aware in (True, False):
        model = mlp(0)
        trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=0.05), cross_entropy,
                                HybridConfig(cost_aware=aware, **settings))
        for b in stream:
            trainer.step(b)
        stats[aware] = trainer.statistics()
    aware, unaware = stats[True], stats[False]
    assert aware["prediction_overhead"] > 0.5, aware  # recording alone: half a step or more on any machine
    per_predicted = real_steps_per_predicted(HybridConfig(**settings))
    assert aware["required_worth"] == pytest.approx(-1.0 + per_predicted * aware["prediction_overhead"])
    assert not aware["prediction_enabled"] and "costs" in aware["prediction_disabled_reason"], aware
    assert unaware["required_worth"] == -1.0 and unaware["prediction_overhead"] is None
    assert unaware["predicted_steps"] > aware["predicted_steps"]


def test_calibrated_cost_travels_with_the_checkpoint(tmp_path):
    x, y = digits_tensors()
    stream = batches(x, y, 64, 40)
    trainers = []
    for seed in (0, 1):
        model = mlp(seed)
        trainers.append(HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), cross_entropy,
                                      HybridConfig(warmup_steps=2, full_steps=8)))
    first, second = trainers
    for b in stream:
        first.step(b)
    assert first.cost.calibrated["core"] and first.cost.calibrated["recording"]
    first.save(tmp_path / "ckpt.pt")
    second.load(tmp_path / "ckpt.pt")
    assert second.cost.seconds == first.cost.seconds
    assert second.required_worth() == first.required_worth()


def test_gpu_timings_synchronise_only_while_their_part_calibrates(monkeypatch):
    """On a GPU the clock is read after a synchronize while a part calibrates, so queued device
    work is charged to the part that queued it; afterwards no synchronize is added."""
    model = mlp(0)
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters()), cross_entropy)
    synchronised = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronised.append(device))
    trainer.worth.clock("recording")
    assert synchronised == []  # a CPU run never synchronises
    trainer.worth.device = torch.device("cuda", 0)  # the clock's view only: no tensor moves
    trainer.worth.clock("recording")
    assert synchronised == [torch.device("cuda", 0)]
    calibrate(trainer.cost, "recording", [1e-3] * CALIBRATION_STEPS["recording"])
    trainer.worth.clock("recording")
    trainer.worth.clock("core")  # still calibrating
    assert len(synchronised) == 2


def test_only_recording_steps_synchronise_and_only_while_calibrating(monkeypatch):
    """Warmup steps and runs without prediction never synchronise; recording steps do until
    every part they time is calibrated."""
    synchronised = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronised.append(device))
    x, y = digits_tensors()
    stream = batches(x, y, 64, 120)

    def run(config, steps):
        synchronised.clear()
        model = mlp(0)
        trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3), cross_entropy, config=config)
        trainer.worth.device = torch.device("cuda", 0)  # the clock's view only: the tensors stay on the CPU
        per_step = []
        for batch in stream[:steps]:
            before = len(synchronised)
            trainer.step(batch)
            per_step.append(len(synchronised) - before)
        return trainer, per_step

    _, per_step = run(HybridConfig(predict=False), 60)
    assert sum(per_step) == 0
    trainer, per_step = run(HybridConfig(warmup_steps=10), 60)
    assert sum(per_step[:10]) == 0  # WARMUP records nothing
    assert sum(per_step) > 0 and trainer.cost.calibrated["core"] and trainer.cost.calibrated["recording"]
    assert per_step[-1] == 0  # calibrated: no synchronize on later steps

"""Events of a run: log records, callback hooks, the TensorBoard writer and StepResult.lrs.

Every hook is checked against what the run itself reports (its StepResults, counters and
weights), not only that it was called."""
import json
import logging
import math
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hybrid_trainer import Callback, CombinedOptimizer, HybridConfig, HybridTrainer, Phase

from _configs import ALWAYS, FAST
from _digits import batches, cross_entropy, digits_tensors, mlp

pytestmark = pytest.mark.usefixtures("eager_backend")  # the CPU path, not the Triton interpreter

DOCS = Path(__file__).resolve().parent.parent / "docs" / "trainer.md"


@pytest.fixture(scope="module")
def stream():
    x, y = digits_tensors()
    return batches(x, y, 64, 120)


class Recorder(Callback):
    """Every hook's arguments, in call order."""

    def __init__(self):
        self.calls = []

    def on_step_end(self, trainer, result):
        self.calls.append(("step_end", result.step, trainer.step_count))

    def on_phase_change(self, trainer, old, new):
        self.calls.append(("phase", trainer.step_count - 1, old, new))

    def on_prediction_disabled(self, trainer, reason):
        self.calls.append(("disabled", trainer.step_count - 1, reason))

    def on_rollback(self, trainer, event):
        self.calls.append(("rollback", event))

    def on_update_refused(self, trainer, event):
        self.calls.append(("refused", event))

    def on_trained_set_change(self, trainer, event):
        self.calls.append(("trained_set", event))

    def on_save(self, trainer, path):
        self.calls.append(("save", str(path)))

    def on_load(self, trainer, path):
        self.calls.append(("load", str(path)))

    def of(self, kind):
        return [c[1:] for c in self.calls if c[0] == kind]


def make(callbacks=(), model=None, **overrides):
    model = model if model is not None else mlp(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    return HybridTrainer(model, optimizer, cross_entropy, HybridConfig(**{**FAST, **overrides}),
                         callbacks=callbacks)


def test_phase_changes_are_hooked_and_logged_exactly_when_the_next_step_runs_in_another_phase(stream, caplog):
    recorder = Recorder()
    trainer = make([recorder], **ALWAYS)
    with caplog.at_level(logging.INFO, logger="hybrid_trainer"):
        results = [trainer.step(b) for b in stream[:60]]
    phases = [r.phase for r in results] + [trainer.controller.phase.value]
    expected = [(i, Phase(phases[i]), Phase(phases[i + 1])) for i in range(60) if phases[i] != phases[i + 1]]
    assert {Phase.PREDICT.value, Phase.CORRECT.value} <= set(phases)  # the run went through every phase
    assert recorder.of("phase") == expected
    logged = [(r.levelno, r.getMessage()) for r in caplog.records if "phase" in r.getMessage()]
    assert [(logging.INFO, f"step {i}: phase {old.value} -> {new.value}") for i, old, new in expected] == \
        [(level, message.split(" (")[0]) for level, message in logged]
    assert all(r.name.startswith("hybrid_trainer.") for r in caplog.records)
    # on_step_end: once per step, after the step is counted, last of the step's hooks
    assert recorder.of("step_end") == [(i, i + 1) for i in range(60)]
    for i, call in enumerate(recorder.calls[:-1]):
        if call[0] == "phase":
            assert recorder.calls[i + 1] == ("step_end", call[1], call[1] + 1)


def test_a_refused_update_is_a_warning_and_a_hook_with_the_step_result(stream, caplog):
    recorder = Recorder()
    trainer = make([recorder])
    calls = {"n": 0}

    def sometimes_nan(model, batch):
        calls["n"] += 1
        loss = cross_entropy(model, batch)
        return loss * float("nan") if calls["n"] == 5 else loss

    trainer.loss_fn = sometimes_nan  # read at call time: patching after construction works
    with caplog.at_level(logging.WARNING, logger="hybrid_trainer"):
        results = [trainer.step(b) for b in stream[:8]]
    assert [r.step for r in results if r.skipped] == [4]
    (event,), = recorder.of("refused")
    assert (event.step, event.phase, event.loss, event.rolled_back) == (4, results[4].phase, None, False)
    assert event.reason == results[4].divergence and "nan" in event.reason
    assert recorder.of("rollback") == []  # a non-finite update is refused; nothing to roll back
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert record.getMessage().startswith("step 4: update refused (") and "weights unchanged" in record.getMessage()


def test_a_divergence_rollback_names_the_good_state_it_went_back_to(stream, caplog):
    recorder = Recorder()
    trainer = make([recorder], good_state_every=5, divergence={"min_history": 5})
    calls = {"n": 0}

    def spiking(model, batch):
        calls["n"] += 1
        loss = cross_entropy(model, batch)
        return loss * 50.0 if calls["n"] in (16, 17) else loss

    trainer.loss_fn = spiking
    for b in stream[:15]:
        trainer.step(b)
    good_step = trainer.good_state.step
    lone = trainer.step(stream[15])  # a lone spike is taken for the batch's: refused, no rollback
    assert lone.skipped and not lone.rolled_back and not recorder.of("rollback")
    with caplog.at_level(logging.WARNING, logger="hybrid_trainer"):
        result = trainer.step(stream[16])  # the second in a row is the weights'
    assert result.skipped and result.rolled_back
    (first,), (refused,) = recorder.of("refused")
    (rollback,), = recorder.of("rollback")
    assert not first.rolled_back
    assert refused.rolled_back and refused.loss == result.loss and refused.grad_norm == result.grad_norm
    assert (rollback.step, rollback.kind, rollback.to_step, rollback.reason) == (16, "divergence", good_step,
                                                                                 result.divergence)
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert messages[0].startswith("step 15: update refused") and messages[0].endswith("weights unchanged")
    assert len(messages) == 3 and f"rolled back to the good state after step {good_step}" in messages[2]
    # Order within the step: refused, rollback, then (FULL restarted: no phase change) step end.
    assert [c[0] for c in recorder.calls[-3:]] == ["refused", "rollback", "step_end"]


def test_a_rejected_prediction_is_a_rollback_and_switches_prediction_off_when_it_is_the_last_allowed(stream, caplog):
    recorder = Recorder()
    trainer = make([recorder], **ALWAYS, loss_tolerance=0.0, noise_z=0.0, max_consecutive_rejections=1)
    i = 0
    while trainer.controller.phase is not Phase.PREDICT:
        trainer.step(stream[i])
        i += 1
    trainer.predictor.scales.fill_(50.0)  # a huge predicted step: its verification must reject it
    with caplog.at_level(logging.INFO, logger="hybrid_trainer"):
        results = [trainer.step(stream[i + k]) for k in range(4)]
    assert results[-1].rolled_back and not trainer.controller.prediction_enabled
    (rollback,), = recorder.of("rollback")
    assert (rollback.step, rollback.kind, rollback.predicted_steps_undone, rollback.reason) == \
        (results[-1].step, "rejected_prediction", 4, results[-1].divergence)
    assert trainer.stats.predicted_steps_rolled_back == 4
    assert recorder.of("disabled") == [(results[-1].step, trainer.controller.disabled_reason)]
    assert recorder.of("phase")[-1] == (results[-1].step, Phase.PREDICT, Phase.CORRECT)
    assert [c[0] for c in recorder.calls[-4:]] == ["rollback", "disabled", "phase", "step_end"]
    levels = {r.getMessage().split(": ")[1].split(" ")[0]: r.levelno for r in caplog.records}
    assert levels == {"4": logging.WARNING, "prediction": logging.INFO, "phase": logging.INFO}


def test_freezing_during_predict_is_a_trained_set_change_and_a_rollback_of_the_unverified_steps(stream, caplog):
    recorder = Recorder()
    model = mlp(0)
    trainer = make([recorder], model=model, **ALWAYS, verify_every=4, predict_lengths=(4,))
    i = 0
    while trainer.controller.phase is not Phase.PREDICT:
        trainer.step(stream[i])
        i += 1
    trainer.step(stream[i])
    trainer.step(stream[i + 1])  # two predicted steps, not verified yet
    model[0].bias.requires_grad_(False)
    with caplog.at_level(logging.INFO, logger="hybrid_trainer"):
        result = trainer.step(stream[i + 2])
    (change,), = recorder.of("trained_set")
    assert (change.step, change.tensors_before, change.tensors_after) == (i + 2, 4, 3)
    assert change.values_before - change.values_after == model[0].bias.numel()
    (rollback,), = recorder.of("rollback")
    assert (rollback.kind, rollback.predicted_steps_undone) == ("trained_set_change", 2)
    assert (i + 2, Phase.PREDICT, Phase.FULL) in recorder.of("phase")
    assert result.phase == Phase.FULL.value and trainer.stats.trained_set_changes == 1
    assert any("trained set changed (4 -> 3 tensors" in r.getMessage() for r in caplog.records)


def test_an_error_during_predict_is_logged_with_the_predicted_steps_it_undid(stream, caplog):
    trainer = make([Recorder()], **ALWAYS, verify_every=4, predict_lengths=(4,))
    i = 0
    while trainer.controller.phase is not Phase.PREDICT:
        trainer.step(stream[i])
        i += 1
    for k in range(3):  # three predicted steps, the fourth verifies
        trainer.step(stream[i + k])

    def broken(model, batch):
        raise KeyError("bad batch")

    trainer.loss_fn = broken
    with caplog.at_level(logging.WARNING, logger="hybrid_trainer"), pytest.raises(KeyError):
        trainer.step(stream[i + 3])
    (record,) = caplog.records
    assert record.getMessage() == f"step {i + 3} raised KeyError during PREDICT: 4 unverified predicted steps undone"
    assert trainer.predict_phase.unverified_steps == 0


def test_checkpoints_written_and_loaded_are_logged_and_hooked(stream, tmp_path, caplog):
    recorder = Recorder()
    trainer = make([recorder])
    for b in stream[:5]:
        trainer.step(b)
    path = tmp_path / "run.pt"
    with caplog.at_level(logging.INFO, logger="hybrid_trainer"):
        trainer.save(path)
        other_recorder = Recorder()
        other = make([other_recorder])
        other.load(path)
    assert recorder.of("save") == [(str(path),)] and other_recorder.of("load") == [(str(path),)]
    assert other.step_count == 5
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [f"checkpoint written to {path} after 5 steps",
                        f"checkpoint loaded from {path}: resuming after 5 steps"]


def test_a_callback_that_raises_finds_the_step_done_and_counted(stream, tmp_path):
    class Fails(Callback):
        def on_step_end(self, trainer, result):
            if result.step == 3:
                raise RuntimeError("user bug")

    metrics = tmp_path / "m.jsonl"
    trainer = make([Fails()], metrics_path=str(metrics))
    for b in stream[:3]:
        trainer.step(b)
    weights = [p.detach().clone() for p in trainer.params]
    with pytest.raises(RuntimeError, match="user bug") as raised:
        trainer.step(stream[3])
    if sys.version_info >= (3, 11):  # exception notes
        assert raised.value.__notes__ == ["raised by callbacks[0] (Fails).on_step_end; step 3 had completed: it is done "
                                          "and counted"]
    assert trainer.step_count == 4 and sum(trainer.stats.steps_by_phase.values()) == 4
    assert trainer.stats.optimizer_steps == 4
    assert any(not torch.equal(p, w) for p, w in zip(trainer.params, weights))  # the update was applied
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [0, 1, 2, 3]
    assert trainer.step(stream[4]).step == 4  # the run goes on


def test_a_hook_given_as_an_attribute_that_raises_is_named_and_so_is_a_save_it_follows(stream, tmp_path):
    def refuse(trainer, path):
        raise OSError("disk full")

    trainer = make([Recorder(), SimpleNamespace(on_save=refuse)])
    trainer.step(stream[0])
    with pytest.raises(OSError) as raised:
        trainer.save(tmp_path / "c.pt")
    if sys.version_info >= (3, 11):  # exception notes
        assert raised.value.__notes__ == [f"raised by callbacks[1] (SimpleNamespace).on_save; "
                                          f"trainer.save({str(tmp_path / 'c.pt')!r}) had completed"]
    assert (tmp_path / "c.pt").exists()  # the checkpoint was written before the hook ran


def test_callbacks_are_checked_at_construction():
    class Misspelt(Callback):
        def on_step_ended(self, trainer, result):
            pass

    with pytest.raises(TypeError, match=r"callbacks\[0\] \(Misspelt\) defines \['on_step_ended'\]"):
        make([Misspelt()])
    with pytest.raises(TypeError, match=r"callbacks\[1\] \(object\) has none of the hooks"):
        make([Callback(), object()])
    with pytest.raises(TypeError, match="callbacks: must be a list"):
        make(Callback())


def test_duck_typed_callbacks_work_and_no_callback_queues_nothing(stream):
    class OnlyStepEnd:  # not a Callback subclass
        def __init__(self):
            self.steps = []

        def on_step_end(self, trainer, result):
            self.steps.append(result.step)

    duck, phases = OnlyStepEnd(), []
    namespace = SimpleNamespace(on_phase_change=lambda trainer, old, new: phases.append(new))  # hooks as attributes
    trainer = make([duck, namespace], **ALWAYS)
    bare = make([], **ALWAYS)
    results = [trainer.step(b) for b in stream[:40]]
    for b in stream[:40]:
        bare.step(b)
    assert duck.steps == list(range(40))
    assert phases and phases == [Phase(results[i + 1].phase) for i in range(39) if results[i].phase != results[i + 1].phase]
    assert bare.events.step_end == () and bare.events.pending == []

    class OnlyRollbacks(Callback):
        def on_rollback(self, trainer, event):
            pass

    only = make([OnlyRollbacks()])
    assert only.events.step_end == () and len(only.events.hooks["on_rollback"]) == 1  # inherited no-ops not called
    assert trainer.events.pending == []  # events without a hook are not kept


def test_the_package_logger_prints_nothing_by_default():
    package = logging.getLogger("hybrid_trainer")
    assert any(isinstance(h, logging.NullHandler) for h in package.handlers)
    assert logging.getLogger("hybrid_trainer.events").parent is package


def muon_parts(model):
    return (torch.optim.Muon([model[0].weight], lr=0.02, weight_decay=0.01),
            torch.optim.AdamW([model[0].bias, model[2].weight, model[2].bias], lr=3e-3))


def test_step_result_lrs_lists_every_group_under_a_combined_optimizer(stream, tmp_path):
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon needs torch >= 2.9")
    model = mlp(0)
    optimizer = CombinedOptimizer(*muon_parts(model))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0 / (1 + k))
    metrics = tmp_path / "m.jsonl"
    trainer = HybridTrainer(model, optimizer, cross_entropy, HybridConfig(**FAST, metrics_path=str(metrics)),
                            scheduler=scheduler)
    results = [trainer.step(b) for b in stream[:6]]
    for k, result in enumerate(results):  # the lr the step's update used: before the scheduler stepped
        assert result.lrs == (0.02 * (1.0 / (1 + k)), 3e-3 * (1.0 / (1 + k)))  # as LambdaLR computes it
        assert result.lr == result.lrs[0]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [tuple(r["lrs"]) for r in records] == [r.lrs for r in results]


def test_step_result_lrs_of_a_plain_optimizer_and_predicted_steps(stream):
    trainer = make([], **ALWAYS)
    results = [trainer.step(b) for b in stream[:40]]
    real = [r for r in results if r.backward_done]
    assert real and all(r.lrs == (0.05,) and r.lr == 0.05 for r in real)
    predicted = [r for r in results if r.phase == Phase.PREDICT.value]
    assert predicted and all(r.lrs is None and r.lr is None for r in predicted)


def test_tensorboard_writes_every_steps_scalars(stream, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = tmp_path / "tb"
    recorder = Recorder()
    with make([recorder], **ALWAYS, tensorboard_dir=str(log_dir)) as trainer:
        results = [trainer.step(b) for b in stream[:40]]
        stats = trainer.statistics()
    assert recorder.of("step_end") == [(i, i + 1) for i in range(40)]  # the user's hooks run beside it
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}

    def approx(pairs):
        return [(step, pytest.approx(value, rel=1e-6)) for step, value in pairs]

    train = [(r.step, r.loss) for r in results if r.backward_done and r.loss is not None]
    verification = [(r.step, r.loss) for r in results if r.verified]
    assert verification, "the run had no verified predicted step"
    assert scalars["loss/train"] == approx(train)
    assert scalars["loss/verification"] == approx(verification)
    assert scalars["loss/expected"] == approx([(r.step, r.predicted_loss) for r in results if r.verified])
    assert scalars["lr/group0"] == approx([(r.step, r.lr) for r in results if r.lrs is not None])
    assert scalars["grad_norm"] == approx([(r.step, r.grad_norm) for r in results if r.grad_norm is not None])
    assert scalars["phase"] == [(r.step, float(Phase(r.phase).code)) for r in results]
    assert [v for _, v in scalars["steps/predicted"]][-1] == stats["predicted_steps"] > 0
    assert [v for _, v in scalars["steps/verifications"]][-1] == stats["verifications"] > 0
    assert [s for s, _ in scalars["steps/predicted"]] == list(range(40))
    assert trainer.tensorboard.writer.file_writer is None or trainer.tensorboard.writer.all_writers is None


def test_tensorboard_writes_every_param_groups_lr_under_a_combined_optimizer(stream, tmp_path):
    pytest.importorskip("tensorboard")
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon needs torch >= 2.9")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = mlp(0)
    optimizer = CombinedOptimizer(*muon_parts(model))
    config = HybridConfig(**FAST, tensorboard_dir=str(tmp_path / "tb"))
    with HybridTrainer(model, optimizer, cross_entropy, config) as trainer:
        results = [trainer.step(b) for b in stream[:5]]
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    for group in (0, 1):
        assert [(e.step, e.value) for e in events.Scalars(f"lr/group{group}")] == \
            [(r.step, pytest.approx(r.lrs[group])) for r in results]
    assert {r.lrs for r in results} == {(0.02, 3e-3)}


def test_a_missing_tensorboard_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ImportError
    with pytest.raises(ImportError, match=re.escape("hybrid-trainer[tensorboard]")):
        make([], tensorboard_dir=str(tmp_path / "tb"))


def test_tensorboard_dir_is_validated():
    with pytest.raises(ValueError, match="tensorboard_dir"):
        HybridConfig(tensorboard_dir=3)


def docs_example() -> str:
    """The Python block of docs/trainer.md's events section."""
    text = DOCS.read_text()
    section = text[text.index("## Events, logging and callbacks"):]
    section = section[:section.index("\n## ", 1)]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return block


def test_the_docs_example_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    namespace = {"__name__": "docs_example"}
    try:
        exec(compile(docs_example(), str(DOCS), "exec"), namespace)
    finally:  # basicConfig may have added a handler to the root logger: the other tests must not see it
        for handler in root.handlers:
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)
    run_log, trainer = namespace["run_log"], namespace["trainer"]
    assert capsys.readouterr().out.strip() == "(10, 'WARMUP', 'FULL')"
    assert run_log.phases[0] == (10, "WARMUP", "FULL") and trainer.step_count == 60
    assert run_log.losses and all(step % 10 == 0 for step, _, _ in run_log.losses)
    assert all(lrs == (1e-2,) for _, _, lrs in run_log.losses)
    assert trainer.metrics.closed  # the with block closed the metrics file
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 60
    assert all(math.isfinite(loss) for _, loss, _ in run_log.losses)

"""HybridTrainer behaviour: every claim of the design has a test here that fails if it breaks."""
import copy
import json
import math
import random
import sys

import numpy as np
import pytest
import torch

import hybrid_kernels as hk
from hybrid_trainer import HybridConfig, HybridTrainer, Phase
from hybrid_trainer import checkpoint
from hybrid_trainer.anchor import buffer_slots

from _configs import ALWAYS, FAST
from _digits import batches, cross_entropy, digits_tensors, mlp
from _images import assert_plot
from _resume import assert_same_state



@pytest.fixture(autouse=True)
def eager_kernels(monkeypatch):
    """Trainer logic does not depend on the backend; the interpreter is exercised once below."""
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", "eager")


def batch_norm_mlp(seed: int = 0):
    """The test MLP with a batch norm: its train-mode forwards change its running statistics."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


def make_trainer(seed=0, lr=0.05, opt="adamw", device="cpu", model_fn=mlp, **overrides):
    model = model_fn(seed).to(device)
    if opt == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    elif opt == "adamw-fused":
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    config = HybridConfig(**{**FAST, **overrides})
    return HybridTrainer(model, optimizer, cross_entropy, config=config)


@pytest.fixture(scope="module")
def stream():
    x, y = digits_tensors()
    return batches(x, y, 64, 200)


def run_until_phase(trainer, stream, phase, start=0):
    for i in range(start, len(stream)):
        if trainer.controller.phase is phase:
            return i
        trainer.step(stream[i])
    raise AssertionError(f"never reached {phase}")


def test_predicted_step_changes_weights_by_exactly_the_delta_in_place(stream):
    trainer = make_trainer(**ALWAYS)
    i = run_until_phase(trainer, stream, Phase.PREDICT)
    ptrs = [p.data_ptr() for p in trainer.params]
    before = [p.detach().clone() for p in trainer.params]
    _, direction = trainer.predictor.current_direction(refresh=False)
    scales = trainer.predictor.scales.clone()
    assert float(scales.abs().sum()) > 0, "no scale fitted: the predicted delta would be zero"
    result = trainer.step(stream[i])
    assert result.phase == "PREDICT" and not result.backward_done and not result.verified
    for p, b, d, s in zip(trainer.params, before, direction, scales):
        assert torch.equal(p.detach(), b.clone().add_(d, alpha=float(s)))  # p += s·d, one rounding (fma)
        torch.testing.assert_close(p.detach(), b + s * d.float(), rtol=0, atol=1e-6)
    assert any(not torch.equal(p, b) for p, b in zip(trainer.params, before))
    assert [p.data_ptr() for p in trainer.params] == ptrs


def test_no_parameter_is_reallocated_over_a_run(stream):
    trainer = make_trainer(**ALWAYS)
    ptrs = [p.data_ptr() for p in trainer.model.parameters()]
    phases = set()
    for batch in stream[:80]:
        phases.add(trainer.step(batch).phase)
        assert [p.data_ptr() for p in trainer.model.parameters()] == ptrs
    assert {"WARMUP", "FULL", "PREDICT", "CORRECT"} <= phases


def test_rejected_verification_rolls_back_bit_exactly(stream):
    trainer = make_trainer(**ALWAYS, loss_tolerance=0.0, noise_z=0.0)
    i = run_until_phase(trainer, stream, Phase.PREDICT)
    at_phase_start = [p.detach().clone() for p in trainer.params]
    trainer.predictor.scales.fill_(50.0)  # a huge predicted step: the loss must go up
    results = [trainer.step(stream[i + k]) for k in range(4)]
    assert results[-1].verified and results[-1].accepted is False and results[-1].rolled_back
    for p, saved in zip(trainer.params, at_phase_start):
        assert torch.equal(p.detach(), saved)
    assert trainer.controller.phase is Phase.CORRECT
    assert trainer.stats.predicted_steps_rolled_back == 4


def test_a_rejected_predict_phase_restarts_the_clock_from_the_anchor(stream):
    """After a rejection: weights and optimizer state exactly those at the phase start, and a
    CORRECT phase counted from step 0 that runs its full correct_steps, then a backed-off FULL
    phase, then a new PREDICT phase whose anchor is taken at its own first step."""
    trainer = make_trainer(**ALWAYS, loss_tolerance=0.0, noise_z=0.0)
    i = run_until_phase(trainer, stream, Phase.PREDICT)
    ctl = trainer.controller
    assert (ctl.phase_step, ctl.length) == (0, 4)
    at_phase_start = [p.detach().clone() for p in trainer.params]
    optimizer_at_start = copy.deepcopy(trainer.optimizer.state_dict())
    trainer.predictor.scales.fill_(50.0)  # a huge predicted step: the loss must go up
    results = [trainer.step(stream[i + k]) for k in range(4)]
    assert [r.phase for r in results] == ["PREDICT"] * 4
    assert results[-1].rolled_back and results[-1].accepted is False
    assert trainer.anchor.step == i
    assert not trainer.anchor.is_set  # the phase ended: its anchor's memory is released
    for p, saved in zip(trainer.params, at_phase_start):
        assert torch.equal(p.detach(), saved)
    assert_same_state(trainer.optimizer.state_dict(), optimizer_at_start)
    assert (ctl.phase, ctl.phase_step, ctl.length, ctl.backoff) == (Phase.CORRECT, 0, 3, 2)

    i += 4
    clock = []
    for k in range(3):
        result = trainer.step(stream[i + k])
        clock.append((result.phase, ctl.phase.value, ctl.phase_step))
    assert clock == [("CORRECT", "CORRECT", 1), ("CORRECT", "CORRECT", 2), ("CORRECT", "FULL", 0)]
    assert ctl.length == 2 * 8  # the FULL phase after a rejection is backed off
    i = run_until_phase(trainer, stream, Phase.PREDICT, start=i + 3)
    assert ctl.phase_step == 0
    trainer.step(stream[i])
    assert trainer.anchor.step == i and trainer.stats.predict_phases == 2


def batch_norm_state(model):
    bn = model[1]
    return [bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()]


def test_rejected_verification_also_restores_batch_norm_statistics(stream):
    trainer = make_trainer(model_fn=batch_norm_mlp, **ALWAYS, loss_tolerance=0.0, noise_z=0.0)
    i = run_until_phase(trainer, stream, Phase.PREDICT)
    at_phase_start = batch_norm_state(trainer.model)
    trainer.predictor.scales.fill_(50.0)
    results = [trainer.step(stream[i + k]) for k in range(4)]
    assert results[-1].verified and results[-1].rolled_back  # the check's forward ran in train mode...
    for got, want in zip(batch_norm_state(trainer.model), at_phase_start):
        assert torch.equal(got, want)  # ...and left no trace


def test_module_buffers_are_the_saved_ones_each_once():
    model = batch_norm_mlp()
    model.register_buffer("mask", torch.ones(3), persistent=False)  # a cache: not snapshotted
    model.shared = model[1]  # the same batch norm under a second name
    buffers = [owner._buffers[name] for owner, name in buffer_slots(model)]
    bn = model[1]
    assert [id(b) for b in buffers] == [id(bn.running_mean), id(bn.running_var), id(bn.num_batches_tracked)]


def test_correct_phase_runs_backward_and_the_optimizer(stream):
    trainer = make_trainer(**ALWAYS)
    i = run_until_phase(trainer, stream, Phase.CORRECT)
    backward_before, opt_before = trainer.stats.backward_passes, trainer.stats.optimizer_steps
    before = [p.detach().clone() for p in trainer.params]
    result = trainer.step(stream[i])
    assert result.phase == "CORRECT" and result.backward_done and result.loss is not None
    assert trainer.stats.backward_passes == backward_before + 1
    assert trainer.stats.optimizer_steps == opt_before + 1
    assert any(not torch.equal(p, b) for p, b in zip(trainer.params, before))
    assert result.grad_norm is not None and result.grad_norm > 0


def test_nan_loss_never_reaches_the_weights_and_the_run_continues(stream):
    trainer = make_trainer()
    calls = {"n": 0}

    def sometimes_nan(model, batch):
        calls["n"] += 1
        loss = cross_entropy(model, batch)
        return loss * float("nan") if calls["n"] == 5 else loss

    trainer.loss_fn = sometimes_nan
    for batch in stream[:4]:
        trainer.step(batch)
    before = [p.detach().clone() for p in trainer.params]
    adam_before = {k: v.clone() for k, v in trainer.optimizer.state[trainer.params[0]].items()}
    result = trainer.step(stream[4])
    assert result.skipped and result.divergence != "OK"
    for p, b in zip(trainer.params, before):
        assert torch.equal(p.detach(), b)
    for k, v in trainer.optimizer.state[trainer.params[0]].items():
        assert torch.equal(v, adam_before[k])
    later = [trainer.step(b) for b in stream[5:15]]
    assert all(r.loss is not None and math.isfinite(r.loss) for r in later if r.backward_done)
    assert all(torch.isfinite(p).all() for p in trainer.params)


def test_nan_gradient_never_reaches_the_weights(stream):
    trainer = make_trainer()
    for batch in stream[:4]:
        trainer.step(batch)
    handle = trainer.params[0].register_hook(lambda g: g * float("nan"))
    before = [p.detach().clone() for p in trainer.params]
    result = trainer.step(stream[4])
    handle.remove()
    assert result.skipped
    for p, b in zip(trainer.params, before):
        assert torch.equal(p.detach(), b)
    result = trainer.step(stream[5])
    assert not result.skipped and all(torch.isfinite(p).all() for p in trainer.params)


def test_resume_reproduces_the_uninterrupted_run_bit_exactly(stream, tmp_path):
    steps, cut = 70, 37
    reference = make_trainer(**ALWAYS)
    ref_results = [reference.step(b) for b in stream[:steps]]
    assert any(r.phase == "PREDICT" for r in ref_results[cut:]), "the resumed part must include predicted steps"

    first = make_trainer(**ALWAYS)
    for b in stream[:cut]:
        first.step(b)
    first.save(tmp_path / "ckpt.pt")
    resumed = make_trainer(seed=123, **ALWAYS)  # different init: everything must come from the file
    resumed.load(tmp_path / "ckpt.pt")
    # Every part of the state, not only what these 33 steps happen to read (anchor, dynamics
    # model, state history, monitor, worth, forecast ...).
    assert_same_state(resumed.state_dict(), first.state_dict())
    resumed_results = [resumed.step(b) for b in stream[cut:steps]]

    for p, q in zip(reference.params, resumed.params):
        assert torch.equal(p, q)
    for a, b in zip(ref_results[cut:], resumed_results):
        assert (a.phase, a.loss, a.accepted, a.rolled_back) == (b.phase, b.loss, b.accepted, b.rolled_back)
    assert reference.statistics()["predicted_steps"] == resumed.statistics()["predicted_steps"]


def _as_version_1(state):
    """``state`` in the layout the trainer wrote as checkpoint version 1: the worth, forecast
    and predict-phase entries inside its ``trainer`` entry."""
    state = dict(state, version=1)
    loop = dict(state.pop("trainer"), forecast=state.pop("forecast"), **state.pop("worth"))
    phase = state.pop("predict_phase")
    state["trainer"] = {**loop, **phase}
    return state


def test_a_version_1_checkpoint_resumes_as_exactly_as_the_current_layout(stream, tmp_path):
    first = make_trainer(**ALWAYS)
    for b in stream[:37]:
        first.step(b)
    assert first.predicted_worth is not None and first.dynamics.train_steps > 0  # entries v1 held elsewhere
    checkpoint.atomic_save(_as_version_1(first.state_dict()), tmp_path / "v1.pt")
    resumed = make_trainer(seed=123, **ALWAYS)
    resumed.load(tmp_path / "v1.pt")
    assert_same_state(resumed.state_dict(), first.state_dict())
    bad = dict(first.state_dict(), version=99)
    with pytest.raises(ValueError, match="version 99"):
        make_trainer(**ALWAYS).load_state_dict(bad)
    incomplete = first.state_dict()
    del incomplete["worth"]
    with pytest.raises(ValueError, match="worth"):
        make_trainer(**ALWAYS).load_state_dict(incomplete)


def test_load_restores_every_random_stream_the_saved_run_would_have_drawn(stream, tmp_path):
    """A user's dropout, augmentation or sampler draws from torch, Python's ``random`` or NumPy:
    after ``load`` each must continue where the saved run was (through the file, as
    ``weights_only`` loading reads it), whatever was drawn in between."""
    def draw():
        return torch.rand(4).tolist(), [random.random() for _ in range(4)], np.random.rand(4).tolist()

    trainer = make_trainer()
    trainer.step(stream[0])
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    trainer.save(tmp_path / "ckpt.pt")
    continued = draw()
    draw()  # the streams move on
    make_trainer().load(tmp_path / "ckpt.pt")
    assert draw() == continued


def test_checkpoint_file_is_written_atomically(tmp_path, stream):
    trainer = make_trainer()
    trainer.step(stream[0])
    trainer.save(tmp_path / "ckpt.pt")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary file left behind


def test_sgd_optimizer_scheduler_and_clipping(stream):
    model = mlp(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    trainer = HybridTrainer(model, optimizer, cross_entropy, HybridConfig(**{**FAST, **ALWAYS,
                                                                             "grad_clip": 0.5}), scheduler)
    results = [trainer.step(b) for b in stream[:60]]
    real = sum(r.backward_done for r in results)
    assert scheduler.last_epoch == real  # stepped only with the optimizer
    assert any(r.phase == "PREDICT" for r in results)
    # clip_grad_norm_ reports the norm before clipping; the applied update must respect the clip.
    assert all(r.grad_norm is not None for r in results if r.backward_done)


def test_gradient_accumulation_takes_micro_batches(stream):
    trainer = make_trainer(grad_accumulation=2)
    result = trainer.step([stream[0], stream[1]])
    assert result.backward_done and trainer.stats.backward_passes == 2
    with pytest.raises(ValueError, match="grad_accumulation=2"):
        trainer.step(stream[2])


@pytest.mark.parametrize("accumulation", [1, 2])
def test_real_steps_are_the_plain_loop_for_any_loss_shape_and_accumulation(stream, accumulation):
    """The trainer divides each micro-batch loss by their number (and skips the division by 1) and
    accepts a one-element loss of any shape: the weights still equal the plain loop's bit for bit."""
    def one_element_loss(model, batch):
        return cross_entropy(model, batch).reshape(1, 1)

    model = mlp(0)
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=0.05), one_element_loss,
                            HybridConfig(**{**FAST, "predict": False, "grad_accumulation": accumulation}))
    plain = mlp(0)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=0.05)
    for start in range(0, 12 * accumulation, accumulation):
        micro = stream[start:start + accumulation]
        result = trainer.step(micro if accumulation > 1 else micro[0])
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for batch in micro:
            loss = cross_entropy(plain, batch) / accumulation if accumulation > 1 else cross_entropy(plain, batch)
            total += float(loss.detach())
            loss.backward()
        optimizer.step()
        # Micro-batch losses are summed on the device (one host read per step), in the loss's
        # float32, here in Python's double.
        assert result.loss == pytest.approx(total, rel=1e-6, abs=0)
    for p, q in zip(trainer.params, plain.parameters()):
        assert torch.equal(p.detach(), q.detach())


def test_gradients_left_by_the_caller_are_cleared_and_none_are_left_behind(stream):
    """Every step ends with the gradients set to None, so the next one clears only gradients that
    someone else left: a caller's own backward between steps must not leak into the update."""
    trainer = make_trainer(**{**ALWAYS, "predict": False})
    plain = mlp(0)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=0.05)
    for i, batch in enumerate(stream[:20]):
        if i % 3 == 0:  # e.g. the caller looking at the gradient of a held-out batch
            cross_entropy(trainer.model, stream[-1 - i]).backward()
        trainer.step(batch)
        assert all(p.grad is None for p in trainer.model.parameters())
        optimizer.zero_grad(set_to_none=True)
        cross_entropy(plain, batch).backward()
        optimizer.step()
    for p, q in zip(trainer.params, plain.parameters()):
        assert torch.equal(p.detach(), q.detach())
    predicting = make_trainer(**ALWAYS)  # predicted, verified and rolled-back steps leave none either
    phases = set()
    for batch in stream[:60]:
        phases.add(predicting.step(batch).phase)
        assert all(p.grad is None for p in predicting.model.parameters())
    assert "PREDICT" in phases


def test_bfloat16_autocast_on_cpu(stream):
    trainer = make_trainer(autocast_dtype="bfloat16")
    output_dtypes = []

    def loss_fn(model, batch):
        x, y = batch
        logits = model(x)
        output_dtypes.append(logits.dtype)
        return torch.nn.functional.cross_entropy(logits.float(), y)

    trainer.loss_fn = loss_fn
    results = [trainer.step(b) for b in stream[:12]]
    assert all(math.isfinite(r.loss) for r in results if r.loss is not None)
    assert output_dtypes and set(output_dtypes) == {torch.bfloat16}  # the forward ran under autocast
    assert all(p.dtype == torch.float32 for p in trainer.params)  # the weights stay in full precision


def test_clipped_real_steps_are_the_plain_clipped_loop(stream):
    trainer = make_trainer(**{**ALWAYS, "predict": False, "grad_clip": 0.5})
    plain = mlp(0)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=0.05)
    for batch in stream[:15]:
        trainer.step(batch)
        optimizer.zero_grad(set_to_none=True)
        cross_entropy(plain, batch).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        optimizer.step()
    for p, q in zip(trainer.params, plain.parameters()):
        assert torch.equal(p.detach(), q.detach())


def test_metrics_jsonl_and_summary(stream, tmp_path):
    path = tmp_path / "metrics.jsonl"
    trainer = make_trainer(**ALWAYS, metrics_path=str(path))
    for b in stream[:40]:
        trainer.step(b)
    trainer.metrics.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 40 and {"step", "phase", "loss", "backward_done"} <= set(lines[0])
    assert not trainer.metrics.records  # a long run must not grow in memory
    trainer.plot(tmp_path / "run.png")
    assert_plot(tmp_path / "run.png", (10, 5), dpi=100)
    text = trainer.summary()
    assert "backward passes" in text and "predicted steps" in text
    stats = trainer.statistics()
    assert stats["steps"] == 40
    assert stats["backward_passes"] + stats["backward_passes_saved"] >= 40 - stats["skipped_steps"]


def test_triton_kernels_serve_the_trainer(stream, monkeypatch):
    """Interpreted on CPU, compiled on a GPU: a whole run with predicted steps uses the kernels."""
    monkeypatch.delenv("HYBRID_KERNELS_BACKEND")
    hk.reset_backend_counts()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    trainer = make_trainer(device=device, **ALWAYS)
    for x, y in stream[:30]:
        trainer.step((x.to(device), y.to(device)))
    used = {op for (op, backend) in hk.backend_counts() if backend == "triton"}
    assert {"apply_delta_", "gru_cell", "encode_state"} <= used
    assert trainer.stats.predicted_steps > 0


@pytest.mark.parametrize("field, value, match", [
    ("verify_every", 0, "verify_every=0: must be an int >= 1"),
    ("ema_beta", 1.0, r"ema_beta=1.0: must be a float in \(0, 1\)"),
    ("direction", "momentum", "direction='momentum'"),
    ("predict_lengths", (), "predict_lengths"),
    ("autocast_dtype", "int8", "autocast_dtype"),
    ("confidence_threshold", float("nan"), "confidence_threshold"),
    ("vram_warning", -0.5, "vram_warning=-0.5"),
    ("vram_warning", 0.9, "vram_critical=None: must be set together with vram_warning"),
    ("checkpoint_modules", [], "checkpoint_modules=\\[\\]"),
    ("memory_spike_threshold", 0.0, "memory_spike_threshold=0.0"),
    ("predict", "no", "predict='no': must be a bool"),
    ("weight_average", 1, "weight_average=1: must be a bool"),
])
def test_config_validation_names_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        HybridConfig(**{field: value})


def test_vram_thresholds_must_be_ordered_and_of_one_kind():
    with pytest.raises(ValueError, match="vram_critical=0.5: must be above vram_warning=0.9"):
        HybridConfig(vram_warning=0.9, vram_critical=0.5)
    with pytest.raises(ValueError, match="same kind"):
        HybridConfig(vram_warning=0.9, vram_critical=8e9)


def test_config_json_round_trip_and_presets():
    for config in (HybridConfig(), HybridConfig.conservative(), HybridConfig.aggressive(seed=3)):
        assert HybridConfig.from_json(config.to_json()) == config
    assert HybridConfig.aggressive().use_bandit
    with pytest.raises(ValueError, match="no field"):
        HybridConfig.from_dict({"verify_evry": 3})


def test_bad_constructor_arguments():
    model = mlp(0)
    with pytest.raises(TypeError, match="optimizer"):
        HybridTrainer(model, "adam", cross_entropy)
    with pytest.raises(ValueError, match="none of the model's trainable parameters"):
        HybridTrainer(model, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), cross_entropy)


def test_bandit_over_predict_lengths_chooses_and_learns(stream):
    trainer = make_trainer(**ALWAYS, use_bandit=True, predict_lengths=(2, 4))
    chosen = []
    for b in stream[:80]:
        entering = trainer.controller.phase is not Phase.PREDICT
        trainer.step(b)
        if entering and trainer.controller.phase is Phase.PREDICT:
            chosen.append((trainer.controller.length, trainer.controller.bandit_arm))
    assert trainer.stats.predict_phases > 0
    assert chosen and all(length == arm for length, arm in chosen)  # every length was the bandit's pick
    finished = trainer.stats.predict_phases - (trainer.controller.phase is Phase.PREDICT)
    assert sum(trainer.controller.bandit.pulls) == finished  # each finished phase updated the bandit


@pytest.mark.slow
def test_random_labels_prediction_turns_off_and_loss_matches_plain_loop():
    """On data where nothing generalises, predictions must stop and the run must end within 2%
    of the plain loop's training loss (same init, same batches)."""
    x, y = digits_tensors(random_labels=True)
    stream = batches(x, y, 64, 400, seed=1)
    plain = mlp(1)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=3e-3)
    plain_losses = []
    for b in stream:
        optimizer.zero_grad()
        loss = cross_entropy(plain, b)
        loss.backward()
        optimizer.step()
        plain_losses.append(float(loss.detach()))

    model = mlp(1)
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3), cross_entropy,
                            HybridConfig(**{**FAST, "max_consecutive_rejections": 3}))
    results = [trainer.step(b) for b in stream]
    stats = trainer.statistics()
    last_predict = max((r.step for r in results if r.phase == "PREDICT"), default=-1)
    assert not stats["prediction_enabled"] or last_predict < len(stream) * 0.75, stats
    eval_x, eval_y = x[:1024], y[:1024]
    with torch.no_grad():
        plain_final = float(torch.nn.functional.cross_entropy(plain(eval_x), eval_y))
        hybrid_final = float(torch.nn.functional.cross_entropy(model(eval_x), eval_y))
    assert abs(hybrid_final - plain_final) / plain_final < 0.02, (hybrid_final, plain_final, stats)


def test_memory_profiler_and_vram_guard_emergency_checkpoint(stream, tmp_path):
    # CPU: the reader is process RSS; thresholds in bytes far below it force a critical crossing.
    path = tmp_path / "emergency.pt"
    trainer = make_trainer(memory_profile=True, vram_warning=1.0e3, vram_critical=2.0e3,
                           emergency_checkpoint_path=str(path))
    for b in stream[:12]:
        trainer.step(b)
    stats = trainer.profiler.per_phase_stats()
    assert set(stats) == {"WARMUP", "FULL"} and stats["WARMUP"]["count"] == 8
    assert trainer.profiler.peak().bytes_in_use > 0
    assert [e["level"] for e in trainer.vram_guard.events] == ["warning", "critical"]  # once per crossing
    restored = make_trainer(seed=5)
    restored.load(path)
    assert restored.step_count == 1  # written at the first step's crossing


def test_gradient_checkpointing_gives_the_same_run(stream):
    plain = make_trainer(**ALWAYS)
    checkpointed = make_trainer(**ALWAYS, checkpoint_modules=["0", "2"])
    assert checkpointed.grad_checkpointing.wrapped == ["0", "2"]
    for b in stream[:40]:
        plain.step(b)
        checkpointed.step(b)
    for p, q in zip(plain.params, checkpointed.params):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="'block0'"):
        make_trainer(checkpoint_modules=["block0"])
    with pytest.raises(ValueError, match="checkpoint_module_type='GPTBlock'"):
        make_trainer(checkpoint_module_type="GPTBlock")


def test_offload_while_predicting_leaves_the_run_unchanged(stream):
    plain = make_trainer(**ALWAYS)
    offloading = make_trainer(**ALWAYS, offload_while_predicting=True)
    for b in stream[:50]:
        plain.step(b)
        offloading.step(b)
    assert offloading.stats.predicted_steps > 0
    for p, q in zip(plain.params, offloading.params):
        assert torch.equal(p, q)


def spiking_trainer(stream, after_step=None, spikes=(16,), **overrides):
    """A trainer after 15 ordinary steps whose loss on the calls ``spikes`` (the 16th: the next
    step's) is 50 times too large. ``after_step(trainer)`` runs after each of the 15 steps."""
    trainer = make_trainer(good_state_every=5, divergence={"min_history": 5, **overrides.pop("divergence", {})},
                           **overrides)
    calls = {"n": 0}

    def spiking(model, batch):
        calls["n"] += 1
        loss = cross_entropy(model, batch)
        return loss * 50.0 if calls["n"] in spikes else loss

    trainer.loss_fn = spiking
    for b in stream[:15]:
        trainer.step(b)
        if after_step is not None:
            after_step(trainer)
    return trainer


# What a rollback restores, each spike rolling back (a lone one is refused without a rollback
# by default: test_loss_spike_restores_the_last_good_state).
ROLL_BACK_EACH_SPIKE = {"divergence": {"blame_lone_alarms_on_the_batch": False}}


def test_loss_spike_restores_the_batch_norm_statistics_of_the_last_good_state(stream):
    trainer = spiking_trainer(stream, model_fn=batch_norm_mlp, **ROLL_BACK_EACH_SPIKE)
    before_spike = batch_norm_state(trainer.model)
    saved = trainer.good_state.state_dict()["buffers"]
    assert not torch.equal(saved[0], before_spike[0])  # the statistics moved since the good state
    assert trainer.step(stream[15]).rolled_back
    for got, want in zip(batch_norm_state(trainer.model), saved):
        assert torch.equal(got, want)


def test_loss_spike_restores_the_last_good_state(stream):
    trainer = spiking_trainer(stream, spikes=(16, 17))
    assert trainer.good_state.is_set
    good_step = trainer.good_state.step
    before = [p.detach().clone() for p in trainer.params]
    lone = trainer.step(stream[15])  # taken for the batch's: refused, the weights as before it
    assert lone.skipped and not lone.rolled_back and trainer.stats.divergence_rollbacks == 0
    for p, b in zip(trainer.params, before):
        assert torch.equal(p.detach(), b)
    result = trainer.step(stream[16])  # the second in a row is the weights': back to the good state
    assert result.skipped and result.rolled_back and "z" in result.divergence
    saved = trainer.good_state.state_dict()["params"]
    for p, s in zip(trainer.params, saved):
        assert torch.equal(p.detach(), s)
    assert trainer.controller.phase is Phase.FULL and trainer.stats.divergence_rollbacks == 1
    assert good_step <= 15
    assert not trainer.step(stream[17]).skipped  # and training goes on


def test_a_hard_batch_stands_and_a_second_in_a_row_goes_back_to_the_good_state(stream):
    # A hard batch: the loss far above the window (a z-score outlier, below the loss-jump bound)
    # with an ordinary gradient. Alone it is taken for the batch's: its update stands, the weights
    # a clean run's bit for bit, and its loss joins the window. A second outlier in a row (higher
    # still, as a divergence's losses climb: one as high is no outlier against the widened
    # window) is the weights': back to the good state, taken before the first, which undoes it too.
    calls = {"n": 0}

    def hard(model, batch):
        calls["n"] += 1
        loss = cross_entropy(model, batch)
        return loss + {16: 10.0, 17: 40.0}.get(calls["n"], 0.0)

    divergence = {"min_history": 5}
    trainer = make_trainer(good_state_every=5, divergence=divergence)
    clean = make_trainer(good_state_every=5, divergence=divergence)
    trainer.loss_fn = hard
    results = [trainer.step(b) for b in stream[:16]]
    for b in stream[:16]:
        clean.step(b)
    assert results[15].divergence == "WARNING" and not results[15].skipped and trainer.monitor.tolerated == 1
    for p, c in zip(trainer.params, clean.params):
        assert torch.equal(p.detach(), c.detach())
    second = trainer.step(stream[16])
    assert second.skipped and second.rolled_back and "loss z-score" in second.divergence
    for p, s in zip(trainer.params, trainer.good_state.state_dict()["params"]):
        assert torch.equal(p.detach(), s)
    assert trainer.good_state.step <= 15


def test_loss_spike_restores_the_optimizer_state_of_the_last_good_state(stream):
    """AdamW's exp_avg, exp_avg_sq and step go back to their values when the good state was
    taken, not those of the steps since (restoring the weights alone would keep them)."""
    taken = {}

    def remember(trainer):
        if trainer.good_state.step not in taken:
            taken[trainer.good_state.step] = ([p.detach().clone() for p in trainer.params],
                                              copy.deepcopy(trainer.optimizer.state_dict()))

    trainer = spiking_trainer(stream, after_step=remember, **ROLL_BACK_EACH_SPIKE)
    good_step = trainer.good_state.step
    weights, optimizer_state = taken[good_step]
    before_spike = copy.deepcopy(trainer.optimizer.state_dict())
    assert before_spike["state"][0]["step"] > optimizer_state["state"][0]["step"]  # steps since the good state
    assert set(optimizer_state["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    result = trainer.step(stream[15])
    assert result.skipped and result.rolled_back
    assert_same_state(trainer.optimizer.state_dict(), optimizer_state)
    for p, w in zip(trainer.params, weights):
        assert torch.equal(p.detach(), w)
    trainer.step(stream[16])  # Adam's step count goes on from the good state
    assert trainer.optimizer.state_dict()["state"][0]["step"] == optimizer_state["state"][0]["step"] + 1


def test_refused_step_under_fp16_grad_scaling_leaves_the_scaler_usable(stream):
    # The GradScaler allows one unscale_ per update(); a refused step must still end with one,
    # or the next step raises.
    # Scaled to overflow, the spike's gradient norm is not read (the scaler skips that update
    # itself), so only its loss z-score is left: a lone outlier, which the guard would tolerate.
    trainer = spiking_trainer(stream, autocast_dtype="float16", divergence={"blame_lone_alarms_on_the_batch": False})
    assert trainer.step(stream[15]).skipped
    later = [trainer.step(b) for b in stream[16:20]]
    assert not any(r.skipped for r in later) and trainer.stats.optimizer_steps == 19


def test_a_queueing_device_gets_one_host_read_per_real_step(stream, monkeypatch):
    # On a GPU every read of a value waits for the queued work; the step reads its loss and its
    # gradient norm together. Emulated on the CPU: values and weights must equal the CPU path's.
    import hybrid_trainer.step_guard as step_guard

    plain = make_trainer(predict=False)
    reference = [plain.step(b) for b in stream[:12]]
    monkeypatch.setattr(step_guard, "reads_are_free", lambda device: False)
    merged = make_trainer(predict=False)
    reads = {"n": 0}
    for name in ("item", "tolist", "__float__"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original):
            # The trainer's reads only: AdamW's step counters are CPU tensors on every device.
            reads["n"] += sys._getframe(1).f_globals.get("__name__", "").startswith("hybrid_trainer")
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counting)
    results = [merged.step(b) for b in stream[:12]]
    monkeypatch.undo()
    # One per real step, and one per good-state snapshot (its finiteness check, every
    # good_state_every real steps: here only the first step's).
    assert reads["n"] == 12 + 1
    assert [r.loss for r in results] == [r.loss for r in reference]
    # The CPU path combines the per-tensor norms in float64 on the host, a queueing device in
    # float32 where they are: the same norm to rounding.
    assert [r.grad_norm for r in results] == pytest.approx([r.grad_norm for r in reference], rel=1e-6)
    for p, q in zip(merged.params, plain.params):
        assert torch.equal(p, q)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: the update launched before the read"))])
def test_a_lone_spike_whose_update_ran_goes_back_to_the_good_state(stream, device):
    # A lone spike is taken for the batch's and refused without a rollback only where its update
    # has not run: launched before the read (a fused optimizer on a GPU), it ran on the device,
    # and only the good state undoes it.
    runs = {}
    for overlap in (False, True):
        trainer = make_trainer(opt="adamw-fused", device=device, predict=False, good_state_every=5,
                               divergence={"min_history": 5}, read_every=1)
        trainer.guard.overlap = overlap  # the CPU runs the overlapped logic too
        trainer.loss_fn = spiking_loss_on_call(20)
        runs[overlap] = (trainer, [trainer.step((x.to(device), y.to(device))) for x, y in stream[:20]])
    (_, read_first), (launched, overlapped) = runs[False], runs[True]
    assert read_first[19].skipped and not read_first[19].rolled_back
    assert overlapped[19].skipped and overlapped[19].rolled_back
    for p, saved in zip(launched.params, launched.good_state.state_dict()["params"]):
        assert torch.equal(p.detach().cpu(), saved.cpu())  # a GPU keeps the good state in host memory


def spiking_loss_on_call(n: int):
    """cross_entropy, 50 times too large on call ``n``."""
    calls = {"n": 0}

    def loss_fn(model, batch):
        calls["n"] += 1
        loss = cross_entropy(model, batch)
        return loss * 50.0 if calls["n"] == n else loss
    return loss_fn


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: pinned copy and event path"))])
def test_fused_optimizer_steps_before_the_read_and_refuses_exactly_as_the_plain_guard(stream, device):
    """With a fused optimizer the guard launches the update with a device-side skip before it
    reads (on a GPU the host then checks while the device updates). Through a NaN step and a
    loss spike, weights, optimizer state and reports equal the read-first guard's bit for bit.
    A per-step read (``read_every=1``) is the path under test: a GPU's default reads a block of
    16 steps at once (tests/test_deferred_checks.py), which never calls ``step_then_read``."""
    def run(overlap: bool):
        # Each spike rolls back in both: launched before the read, a lone spike's update ran, and
        # only the good state undoes it (test_a_lone_spike_whose_update_ran_goes_back_to_the_good_state).
        trainer = make_trainer(opt="adamw-fused", device=device, predict=False, good_state_every=5,
                               divergence={"min_history": 5, "blame_lone_alarms_on_the_batch": False}, read_every=1)
        assert trainer.guard.overlap == (device == "cuda")  # a CPU read waits for nothing: no overlap there
        trainer.guard.overlap = overlap  # the CPU runs the overlapped logic too, to check it
        calls = {"n": 0, "overlapped": 0}
        step_then_read = trainer.guard.step_then_read

        def counted(*args):
            calls["overlapped"] += 1
            return step_then_read(*args)

        trainer.guard.step_then_read = counted

        def loss_fn(model, batch):
            calls["n"] += 1
            loss = cross_entropy(model, batch)
            return loss * float("nan") if calls["n"] == 12 else loss * 50.0 if calls["n"] == 20 else loss

        trainer.loss_fn = loss_fn
        results = [trainer.step((x.to(device), y.to(device))) for x, y in stream[:30]]
        return trainer, results, calls["overlapped"]

    overlapped, results, n_overlapped = run(True)
    plain, reference, n_plain = run(False)
    assert n_plain == 0 and n_overlapped == 29  # every step once the first good state exists
    assert results[11].skipped and not results[11].rolled_back  # NaN: refused, nothing to restore
    assert results[19].skipped and results[19].rolled_back  # spike: back to the last good state
    summary = [(r.loss, r.skipped, r.rolled_back, r.divergence) for r in results]
    assert summary == [(r.loss, r.skipped, r.rolled_back, r.divergence) for r in reference]
    # The read-first guard on a CPU combines the per-tensor norms in float64 on the host.
    assert [r.grad_norm is None for r in results] == [r.grad_norm is None for r in reference]
    assert ([r.grad_norm for r in results if r.grad_norm is not None]
            == pytest.approx([r.grad_norm for r in reference if r.grad_norm is not None], rel=1e-6))
    for p, q in zip(overlapped.params, plain.params):
        assert torch.equal(p, q)
    for p, q in zip(overlapped.params, plain.params):
        a, b = overlapped.optimizer.state[p], plain.optimizer.state[q]
        assert all(torch.equal(a[k], b[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    assert not hasattr(overlapped.optimizer, "found_inf")  # GradScaler's protocol left as found


def test_linear_direction_is_the_least_squares_slope_of_recorded_updates():
    from hybrid_trainer.predictor import DeltaPredictor

    param = torch.zeros(1000)
    predictor = DeltaPredictor([param], direction="linear", history_size=4)
    updates = [torch.randn(1000) * 0.01 + 0.02 * k for k in range(4)]  # an accelerating trajectory
    for u in updates:
        predictor.begin_step()
        param += u
        predictor.end_step()
    flat, _ = predictor.current_direction(refresh=True)
    thetas = torch.stack([torch.zeros(1000)] + [sum(updates[: k + 1]) for k in range(4)])
    t = torch.arange(5, dtype=torch.float32)
    expected = ((t - t.mean())[:, None] * (thetas - thetas.mean(0))).sum(0) / ((t - t.mean()) ** 2).sum()
    # int8 storage: each stored update is off by at most half a quantization step (absmax / 127 / 2).
    weights = predictor.linear_weights(4)
    bound = sum(abs(w) * float(u.abs().max()) / 127 / 2 for w, u in zip(weights, updates))
    assert float((flat - expected).abs().max()) <= bound * 1.001
    assert float((flat - expected).abs().max()) < 0.05 * float(expected.abs().max())
    assert predictor._history[0][0].dtype == torch.int8  # kept compact



@pytest.mark.parametrize("batched", [False, True])  # per-tensor dots (CPU default), segmented sums (CUDA default)
def test_recorded_update_statistics_and_predicted_gain_match_a_float64_reference(batched):
    """end_step's norm, cosine and scale fits and predicted_gain are read from the device once
    each; their values must still be the per-tensor definitions."""
    from hybrid_trainer.predictor import DeltaPredictor

    gen = torch.Generator().manual_seed(0)
    params = [torch.zeros(30, 7), torch.zeros(7), torch.zeros(0), torch.zeros(5, 3)]
    predictor = DeltaPredictor(params, direction="ema", ema_beta=0.5, scale_beta=0.9, scale_max=4.0,
                               batched_reductions=batched)
    ema = None
    scales = None
    for k in range(3):
        updates = [torch.randn(p.shape, generator=gen) * 0.01 + 0.003 * (i + 1) for i, p in enumerate(params)]
        predictor.begin_step()
        for p, u in zip(params, updates):
            p += u
        stats = predictor.end_step()
        flat_u = torch.cat([u.reshape(-1) for u in updates]).double()
        assert stats.update_norm == pytest.approx(float(flat_u.norm()), rel=1e-6)
        if ema is None:
            assert math.isnan(stats.cosine)
            ema = [u.double() for u in updates]
            continue
        flat_d = torch.cat([d.reshape(-1) for d in ema])
        assert stats.cosine == pytest.approx(float(flat_u @ flat_d / (flat_u.norm() * flat_d.norm())), rel=1e-5)
        fits = [float((u.double() * d).sum() / (d * d).sum()) if d.numel() else 0.0 for u, d in zip(updates, ema)]
        fits = [min(max(f, 0.0), 4.0) for f in fits]
        scales = fits if scales is None else [0.9 * s + 0.1 * f for s, f in zip(scales, fits)]
        assert predictor.scales.tolist() == pytest.approx(scales, rel=1e-5)
        weight = 0.5 / (1 - 0.5 ** (k + 1))  # bias-corrected EMA after k + 1 updates
        ema = [(1 - weight) * d + weight * u.double() for d, u in zip(ema, updates)]
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    grads[1] = None  # a parameter without a gradient contributes nothing
    expected = -sum(s * float((g.double() * d).sum()) for g, d, s in zip(grads, ema, scales) if g is not None)
    assert predictor.predicted_gain(grads) == pytest.approx(expected, rel=1e-5)


def test_batched_reductions_cost_the_same_few_host_ops_for_any_number_of_tensors():
    """On a GPU each op is a launch: with batched reductions a recorded step's statistics and
    the predicted gain must not grow with the parameter count (they did by ~10 ops per tensor)."""
    from bench.host_ops import HostOps
    from hybrid_trainer.predictor import DeltaPredictor

    counts = {}
    for n_tensors in (3, 30):
        params = [torch.zeros(8) for _ in range(n_tensors)]
        predictor = DeltaPredictor(params, batched_reductions=True)
        ops = []
        grads = [torch.ones(8) for _ in params]
        for k in range(3):
            predictor.begin_step()
            torch._foreach_add_(params, 0.01 * (k + 1))
            with HostOps() as host:
                predictor.end_step()
                predictor.predicted_gain(grads)
            ops.append(len(host.ops))
        counts[n_tensors] = ops[-1]
    assert counts[3] == counts[30] <= 40, counts

def test_an_error_mid_predict_leaves_only_verified_weights(stream):
    trainer = make_trainer(**ALWAYS, predict_lengths=(8,), verify_every=8)
    i = run_until_phase(trainer, stream, Phase.PREDICT)
    verified = [p.detach().clone() for p in trainer.params]
    trainer.step(stream[i])  # one unverified predicted step
    assert any(not torch.equal(p, v) for p, v in zip(trainer.params, verified))

    trainer.predictor.apply_predicted_step = lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        trainer.step(stream[i + 1])
    for p, v in zip(trainer.params, verified):
        assert torch.equal(p.detach(), v)


def test_warmup_steps_record_nothing_for_prediction(stream):
    """WARMUP is plain training: no update recorded, no worth measured, no dynamics observation."""
    trainer = make_trainer(**{**ALWAYS, "warmup_steps": 12})
    for i in range(12):
        assert trainer.controller.phase is Phase.WARMUP
        trainer.step(stream[i])
    assert trainer.predictor.n_updates == 0 and trainer.predicted_worth is None and trainer.dynamics is None  # not built
    assert trainer.stats.optimizer_steps == 12
    trainer.step(stream[12])  # first FULL step records
    assert trainer.predictor.n_updates == 1


def test_predict_false_is_the_plain_loop_bit_for_bit(stream):
    """With prediction off the trainer is the plain AdamW loop plus its safety checks: the same
    weights to the last bit, nothing recorded for prediction, and it says why in its statistics."""
    trainer = make_trainer(**{**ALWAYS, "predict": False})
    plain = mlp(0)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=0.05)
    for batch in stream[:60]:
        result = trainer.step(batch)
        assert result.backward_done and result.phase in ("WARMUP", "FULL")
        optimizer.zero_grad(set_to_none=True)
        cross_entropy(plain, batch).backward()
        optimizer.step()
    for p, q in zip(trainer.params, plain.parameters()):
        assert torch.equal(p.detach(), q.detach())
    stats = trainer.statistics()
    assert stats["predicted_steps"] == 0 and stats["backward_passes"] == 60
    assert not stats["prediction_enabled"] and "predict=False" in stats["prediction_disabled_reason"]
    assert trainer.predictor.n_updates == 0 and trainer.predicted_worth is None
    assert trainer.dynamics is None and trainer.history.count("loss") == 0  # no forecaster built
    assert not trainer.predictor.allocated  # nor prediction buffers


@pytest.mark.parametrize("saved_predict, resumed_predict", [(False, True), (True, False)])
def test_resume_follows_the_resuming_config_on_predict(stream, tmp_path, saved_predict, resumed_predict):
    first = make_trainer(**{**ALWAYS, "predict": saved_predict})
    for batch in stream[:12]:
        first.step(batch)
    first.save(tmp_path / "ckpt.pt")
    resumed = make_trainer(**{**ALWAYS, "predict": resumed_predict})
    resumed.load(tmp_path / "ckpt.pt")
    assert resumed.controller.prediction_enabled is resumed_predict
    phases = {resumed.step(batch).phase for batch in stream[12:60]}
    assert ("PREDICT" in phases) is resumed_predict


def test_grad_norm_matches_torch_and_reports_non_finite():
    from hybrid_trainer.step_guard import grad_norm_tensor

    torch.manual_seed(0)
    grads = [torch.randn(33, 7), torch.randn(5), torch.randn(2, 3, 4)]
    assert float(grad_norm_tensor(grads)) == float(torch.nn.utils.get_total_norm(grads))
    mixed = [torch.randn(8), torch.randn(8, dtype=torch.float64)]  # falls back to torch's grouping
    assert float(grad_norm_tensor(mixed)) == pytest.approx(float(torch.cat([g.double() for g in mixed]).norm()))
    assert grad_norm_tensor([]) is None
    grads[1][2] = float("inf")
    assert float(grad_norm_tensor(grads)) == float("inf")
    grads[0][0, 0] = float("nan")
    assert math.isnan(float(grad_norm_tensor(grads)))


def test_squares_by_dots_is_the_sum_of_squares_and_reports_non_finite():
    from hybrid_trainer.step_guard import squares_by_dots

    torch.manual_seed(0)
    for dtype, rel in ((torch.float32, 1e-6), (torch.float64, 1e-14)):
        grads = [torch.randn(300, 70, dtype=dtype), torch.randn(5, dtype=dtype), torch.randn(2, 3, 4, dtype=dtype)]
        exact = math.fsum(float(g.double().pow(2).sum()) for g in grads)
        assert squares_by_dots(grads) == pytest.approx(exact, rel=rel)
        grads[1][2] = float("inf")
        assert squares_by_dots(grads) == float("inf")
        grads[0][0, 0] = float("nan")
        assert math.isnan(squares_by_dots(grads))
    with pytest.raises(RuntimeError):  # not viewable as a vector: the guard's read takes _foreach_norm instead
        squares_by_dots([torch.randn(70, 30).t()])


def test_squares_by_dots_gives_torch_dots_bits_with_or_without_the_blas_routine(monkeypatch):
    """The routine past the dispatcher (blas_dots) is the one torch.dot calls: the same bits."""
    from hybrid_trainer import blas_dots
    from hybrid_trainer.step_guard import squares_by_dots

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        grads = [torch.randn(256, 256, dtype=dtype), torch.randn(256, dtype=dtype), torch.randn(10, 256, dtype=dtype)]
        through_torch = math.fsum(torch.dot(g.reshape(-1), g.reshape(-1)).item() for g in grads)
        assert squares_by_dots(grads) == through_torch
        with monkeypatch.context() as patch:
            patch.setattr(blas_dots, "_ROUTINES", {})
            assert squares_by_dots(grads) == through_torch


@pytest.mark.parametrize("blas", [True, False])
def test_dots_read_float_gradients_on_a_cpu_only(monkeypatch, blas):
    """With a BLAS routine called past torch's dispatcher, gradients of any size are read by dots;
    through torch.dot, only large ones (DOTS_FROM_MEAN_NUMEL on average)."""
    from hybrid_trainer import blas_dots
    from hybrid_trainer.step_guard import DOTS_FROM_MEAN_NUMEL, read_by_dots

    if not blas:
        monkeypatch.setattr(blas_dots, "_ROUTINES", {})
    elif not blas_dots._ROUTINES:
        pytest.skip("this torch build exports no verified BLAS dot routine")
    large = list(mlp(0, hidden=2048).parameters())
    assert read_by_dots(large)
    # 1.2k entries each on average: through torch, _foreach_norm's one call reads them for less
    assert read_by_dots(list(mlp(0).parameters())) is blas
    assert not read_by_dots([p.detach().half() for p in large])
    assert not read_by_dots(large + [torch.zeros(3, dtype=torch.float64)])
    assert not read_by_dots([])
    assert read_by_dots([torch.zeros(DOTS_FROM_MEAN_NUMEL)])
    assert read_by_dots([torch.zeros(DOTS_FROM_MEAN_NUMEL - 1)]) is blas


@pytest.mark.parametrize("contiguous", [True, False])
def test_cpu_guard_reads_the_norm_by_dots_or_falls_back_exactly(stream, contiguous):
    """On a CPU the per-step read takes each float32 gradient's square from a dot product; a
    gradient that is not viewable as a vector (a transposed weight's) sends the read to the
    per-tensor norms, whose value it then is exactly."""
    from hybrid_trainer.run_report import global_norm
    from hybrid_trainer.step_guard import squares_by_dots

    model = mlp(0, hidden=2048)  # 38k entries per gradient on average: read by dots
    if not contiguous:  # the same values in a transposed layout: dense, not viewable as a vector
        model[0].weight = torch.nn.Parameter(model[0].weight.detach().t().contiguous().t())
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=0.05), cross_entropy,
                            config=HybridConfig(**{**FAST, "predict": False}))
    assert trainer.guard._grads_by_dots
    loss = cross_entropy(model, stream[0])
    loss.backward()
    grads = [p.grad for p in trainer.params]
    assert grads[0].is_contiguous() is contiguous
    total, norm = trainer.guard.read_step_values(loss)
    per_tensor = global_norm([n.item() for n in torch._foreach_norm(grads)])
    assert total == loss.item()
    if contiguous:
        assert norm == math.sqrt(squares_by_dots(grads)) and norm == pytest.approx(per_tensor, rel=1e-6)
    else:
        assert norm == per_tensor


def test_weight_average_follows_real_steps_and_is_only_swapped_in_for_evaluation(stream):
    """The averaged trainer trains exactly like the plain loop (the average never feeds back);
    ``averaged_weights()`` shows the lag-corrected average of the real iterates, then the
    trained weights again; without the config field it says how to get one."""
    from hybrid_trainer.averaging import WeightAverage

    trainer = make_trainer(**{**ALWAYS, "predict": False, "weight_average": True})
    plain = mlp(0)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=0.05)
    average = WeightAverage(list(plain.parameters()))
    for batch in stream[:40]:
        trainer.step(batch)
        optimizer.zero_grad(set_to_none=True)
        cross_entropy(plain, batch).backward()
        optimizer.step()
        average.update()
    for p, q in zip(trainer.params, plain.parameters()):
        assert torch.equal(p.detach(), q.detach())
    with trainer.averaged_weights():
        for p, e in zip(trainer.params, average.estimate()):
            assert torch.equal(p.detach(), e)
        averaged_loss = cross_entropy(trainer.model, stream[0]).item()
    for p, q in zip(trainer.params, plain.parameters()):
        assert torch.equal(p.detach(), q.detach())
    assert averaged_loss != cross_entropy(trainer.model, stream[0]).item()
    with pytest.raises(ValueError, match="weight_average is False"):
        make_trainer().averaged_weights()


def _trained_and_saved(path, steps, stream, **overrides):
    trainer = make_trainer(**overrides)
    for batch in stream[:steps]:
        trainer.step(batch)
    trainer.save(path)
    return trainer


def test_weight_average_survives_a_resume_and_starts_fresh_from_a_checkpoint_without_one(stream, tmp_path):
    overrides = {**ALWAYS, "weight_average": True}
    reference = make_trainer(**overrides)
    for batch in stream[:30]:
        reference.step(batch)
    _trained_and_saved(tmp_path / "with.pt", 15, stream, **overrides)
    resumed = make_trainer(seed=5, **overrides)
    resumed.load(tmp_path / "with.pt")
    for batch in stream[15:30]:
        resumed.step(batch)
    for a, b in zip(reference.weight_average.estimate(), resumed.weight_average.estimate()):
        assert torch.equal(a, b)
    assert resumed.weight_average.updates == reference.weight_average.updates

    _trained_and_saved(tmp_path / "without.pt", 15, stream, **ALWAYS)
    started = make_trainer(seed=5, **overrides)
    started.load(tmp_path / "without.pt")
    assert started.weight_average.updates == 0
    for p, e in zip(started.params, started.weight_average.estimate()):
        assert torch.equal(p.detach(), e)  # an average of the loaded weights only


def test_worth_is_the_predicted_gain_in_units_of_a_real_steps_loss_decrease(monkeypatch):
    """The gate's worth: EMA (β 0.9) of the predicted step's first-order gain divided by the loss
    decrease per real step; 0 while the loss is not falling."""
    trainer = make_trainer()
    gains, slopes = iter([0.03, 0.01, 0.02]), iter([-0.1, -0.1, 0.05])
    monkeypatch.setattr(trainer.predictor, "predicted_gain", lambda grads: next(gains))
    monkeypatch.setattr(trainer.loss_trend, "slope", lambda: next(slopes))
    trainer.worth.measure(trainer.predictor, [p.grad for p in trainer.params], trainer.loss_trend)
    assert trainer.predicted_worth == pytest.approx(0.3)
    trainer.worth.measure(trainer.predictor, [p.grad for p in trainer.params], trainer.loss_trend)
    assert trainer.predicted_worth == pytest.approx((0.9 * 0.03 + 0.1 * 0.01) / 0.1)
    trainer.worth.measure(trainer.predictor, [p.grad for p in trainer.params], trainer.loss_trend)
    assert trainer.predicted_worth == 0.0

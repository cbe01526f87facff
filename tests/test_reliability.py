"""The guard's reliability promises, one test per fault that once got through (docs/trainer.md,
"Reliability"): refused batches leave batch-norm statistics alone, a spike right after a rollback or in
the first steps is refused, a run that cannot make progress stops with an error naming the culprit, a
parameter appended to a group is guarded, a failed load changes nothing, and a failed emergency
checkpoint does not break the step."""
import contextlib
import json
import math
import warnings

import pytest
import torch

from hybrid_trainer import HybridConfig, HybridTrainer

from _configs import ALWAYS, FAST
from _digits import batches, cross_entropy, digits_tensors, mlp
from _faults import cloned, make_trainer, non_finite
from _resume import assert_same_state


pytestmark = pytest.mark.usefixtures("eager_backend")  # the CPU path, not the Triton interpreter


@pytest.fixture(scope="module")
def stream():
    x, y = digits_tensors()
    return batches(x, y, 64, 200)


def regression_stream(steps: int, batch: int = 32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 1, generator=gen)
    out = []
    for _ in range(steps):
        x = torch.randn(batch, 16, generator=gen)
        out.append((x, x @ w + 0.1 * torch.randn(batch, 1, generator=gen)))
    return out


def mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def bn_regression(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 1))


# ------------------------------------------------------------------------- batch norm statistics ----
def test_a_refused_nan_batch_leaves_batch_norm_statistics_as_before_its_forward():
    model = bn_regression()
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), mse,
                            config=HybridConfig(predict=False))
    data = regression_stream(121)
    for batch in data[:20]:
        trainer.step(batch)
    before = [b.clone() for b in model.buffers()]
    x, y = data[20]
    x = x.clone()
    x[0, 0] = float("nan")
    assert trainer.step((x, y)).skipped
    for got, want in zip(model.buffers(), before):
        assert torch.equal(got, want)  # bit for bit: the step never happened, to the statistics either
    for batch in data[21:]:
        trainer.step(batch)
    assert torch.isfinite(model.eval()(data[0][0])).all()
    assert trainer.good_state.is_set and all(torch.isfinite(b).all() for b in trainer.state_dict()["good_state"]["buffers"])


# ------------------------------------------------------------------------------ blind spells ----
def spiking_loss(loss_fn, at_calls, factor=1e6):
    calls = {"n": 0}

    def spiking(model, batch):
        calls["n"] += 1
        loss = loss_fn(model, batch)
        return loss * factor if calls["n"] in at_calls else loss
    return spiking


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_a_spike_right_after_a_rollback_is_refused_too(stream, opt):
    """The rollback to the good state also rewinds the monitor's window to the good state's, so the
    steps after it are judged at once (an emptied window accepted a second spike)."""
    lr = 0.05 if opt == "sgd" else 3e-3
    trainer = make_trainer(model_fn=mlp, opt=opt, lr=lr, predict=False, good_state_every=10)
    trainer.loss_fn = spiking_loss(cross_entropy, {61, 62, 63, 66})
    results = [trainer.step(b) for b in stream[:100]]
    assert [r.step for r in results if r.skipped] == [60, 61, 62, 65]
    # A lone spike is taken for the batch's (refused, no rollback); the second in a row goes back,
    # and the step right after the rollback is judged by the good state's window at once.
    assert [r.rolled_back for r in results[60:63]] == [False, True, True] and not results[65].rolled_back
    clean = make_trainer(model_fn=mlp, opt=opt, lr=lr, predict=False, good_state_every=10)
    for b in stream[:100]:
        clean.step(b)
    largest = max(p.abs().max() for p in trainer.params)
    assert largest < 2 * max(p.abs().max() for p in clean.params)
    if opt == "adamw":
        second_moments = [s["exp_avg_sq"].max() for s in trainer.optimizer.state.values()]
        assert max(second_moments) < 1.0  # a 1e6 loss's gradients would leave ~1e9 here


def test_a_spike_in_the_first_steps_is_refused(stream):
    trainer = make_trainer(model_fn=mlp, opt="sgd", lr=0.05, predict=False)
    trainer.loss_fn = spiking_loss(cross_entropy, {3})
    results = [trainer.step(b) for b in stream[:10]]
    assert [r.step for r in results if r.skipped] == [2]
    assert all(p.abs().max() < 10 for p in trainer.params)


def louder_loss(loss_fn, at_calls, factor=10.0):
    """``loss_fn`` whose value on the calls numbered ``at_calls`` is ``factor`` times itself while its
    gradient stays the same: a batch that scores far above the window (a loss z-score outlier) and
    carries an ordinary update, as a hard batch does."""
    calls = {"n": 0}

    def louder(model, batch):
        calls["n"] += 1
        loss = loss_fn(model, batch)
        return loss + (factor - 1) * loss.detach() if calls["n"] in at_calls else loss
    return louder


@pytest.mark.parametrize("path", ["steady", "general"])
def test_a_lone_outlier_is_applied_and_a_second_in_a_row_goes_back_to_the_good_state(stream, path):
    """One batch far above the window is the data's: its update stands, bit for bit the plain step's.
    Weights gone wrong show on the next batch too: that one is refused and rolls back."""
    config = dict(model_fn=mlp, predict=False, good_state_every=10, memory_profile=path == "general")
    clean, lone, twice = (make_trainer(**config) for _ in range(3))
    assert lone._steady_allowed is (path == "steady")
    lone.loss_fn = louder_loss(cross_entropy, {101})
    twice.loss_fn = louder_loss(cross_entropy, {101, 102})
    runs = {name: [t.step(b) for b in stream[:102]] for name, t in (("clean", clean), ("lone", lone))}
    outlier = runs["lone"][100]
    assert not outlier.skipped and not outlier.rolled_back and outlier.divergence == "WARNING"
    assert outlier.loss == pytest.approx(10 * runs["clean"][100].loss, rel=1e-6)
    assert lone.monitor.tolerated == 1 and lone.monitor.counts["loss_z"] == 1
    assert lone.statistics()["outliers_tolerated"] == 1 and "alarms taken for the batch's and applied 1" in lone.summary()
    assert lone.stats.skipped_steps == 0 and lone.stats.divergence_rollbacks == 0
    for p, q in zip(lone.params, clean.params):
        assert torch.equal(p, q)
    results = [twice.step(b) for b in stream[:102]]
    assert not results[100].skipped and results[101].skipped and results[101].rolled_back
    assert "loss z-score" in results[101].divergence and twice.monitor.tolerated == 1
    for p, saved in zip(twice.params, twice.good_state.state_dict()["params"]):
        assert torch.equal(p.detach(), saved)
    assert twice.good_state.step < 100  # taken before the tolerated step, which goes with the rollback


def _learnt_late(path: str, seed: int = 0) -> tuple[float, float, HybridTrainer | None]:
    """A 100k-parameter MLP learns 12 of 16 batches by heart (500 steps), then steps over all 16
    (320 more): the mean loss of the 4 it met late, of the 12 it knew, and the trainer (None for
    the plain loop)."""
    from bench.overhead import synthetic_mlp
    from bench.protocol import guard_as_on_a_gpu

    workload = synthetic_mlp("learnt late", 128, [256, 256], 10, 16, 16, torch.device("cpu"))
    model = workload.make_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=path == "as on a GPU")
    trainer = None
    with guard_as_on_a_gpu() if path == "as on a GPU" else contextlib.nullcontext():
        if path == "plain":
            def step(batch):
                optimizer.zero_grad()
                workload.loss_fn(model, batch).backward()
                optimizer.step()
        else:
            trainer = HybridTrainer(model, optimizer, workload.loss_fn,
                                    HybridConfig(seed=seed, predict=False, memory_profile=path == "general",
                                                 read_every=16 if path == "as on a GPU" else None))
            step = trainer.step
        for i in range(500):
            step(workload.batches[i % 12])
        for i in range(320):
            step(workload.batches[i % 16])
        if trainer is not None:
            trainer.statistics()  # the last block's read
    with torch.no_grad():
        losses = [workload.loss_fn(model, batch).item() for batch in workload.batches]
    return sum(losses[12:]) / 4, sum(losses[:12]) / 12, trainer


@pytest.mark.parametrize("path", ["steady", "general", "as on a GPU"])
def test_batches_met_after_the_rest_was_learnt_by_heart_are_learnt_as_by_the_plain_loop(path):
    """They lose ten thousand times more than the window, step after step. Refused each time (and
    rolled back at each run of them), they were never learnt: their loss stayed at 2.26 where the
    plain loop's fell to 0.001. The run of them that meets the good state's weights after a
    rollback is taken for the batches' (DivergenceMonitor._blamed_on_batches)."""
    plain_late, plain_known, _ = _learnt_late("plain")
    late, known, trainer = _learnt_late(path)
    assert trainer._steady_allowed is (path != "general")
    assert plain_late < 0.01 and late < 0.01 and known < 0.01
    assert trainer.monitor.tolerated >= 4 and trainer.stats.divergence_rollbacks <= 10


# -------------------------------------------------------------------------------- escalation ----
def test_non_finite_weights_restore_the_good_state_once_then_stop_with_an_error_naming_them(stream):
    from hybrid_trainer import TrainingStalledError

    trainer = make_trainer(model_fn=mlp, predict=False, good_state_every=5)
    for b in stream[:12]:
        trainer.step(b)
    good = [t.clone() for t in trainer.state_dict()["good_state"]["params"]]
    with torch.no_grad():
        trainer.model[0].weight[3, 3] = float("nan")
    with pytest.warns(RuntimeWarning, match=r"non-finite: weight '0\.weight'; restored the last good state"):
        result = trainer.step(stream[12])
    assert result.skipped and result.rolled_back and trainer.stats.stall_restores == 1
    for p, g in zip(trainer.params, good):
        assert torch.equal(p.detach(), g)
    assert not non_finite(trainer)
    with torch.no_grad():
        trainer.model[2].bias[0] = float("inf")
    with pytest.raises(TrainingStalledError, match=r"2\.bias") as info:
        trainer.step(stream[13])
    assert isinstance(info.value, RuntimeError)


def test_the_snapshot_names_each_non_finite_tensor_by_where_it_sits(stream):
    """Optimizer state and module buffers are named as well as weights, and only the non-finite
    ones (their names are built only for those)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 10))
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cross_entropy,
                            HybridConfig(predict=False, good_state_every=5))
    for b in stream[:3]:
        trainer.step(b)
    assert trainer.guard.non_finite_state() == []
    with torch.no_grad():
        trainer.optimizer.state[model[3].weight]["exp_avg_sq"][0, 0] = float("inf")
        model[1].running_var[2] = float("nan")
    assert trainer.guard.non_finite_state() == ["buffer '1.running_var'", "optimizer state 'exp_avg_sq' of '3.weight'"]


def test_refused_steps_in_a_row_restore_the_good_state_once_then_stop_with_an_error(stream):
    from hybrid_trainer import TrainingStalledError

    trainer = make_trainer(model_fn=mlp, predict=False, good_state_every=5,
                           divergence={"max_refused_in_a_row": 4})
    for b in stream[:12]:
        trainer.step(b)
    trainer.loss_fn = lambda model, batch: cross_entropy(model, batch) * float("nan")
    with pytest.warns(RuntimeWarning, match="4 steps in a row refused"):
        results = [trainer.step(b) for b in stream[12:16]]
    assert all(r.skipped for r in results) and results[-1].rolled_back  # the 4th: back to the good state
    with pytest.raises(TrainingStalledError, match="4 steps in a row") as info:
        for b in stream[16:20]:
            trainer.step(b)
    assert "loss is nan" in str(info.value)
    assert trainer.step_count == 19  # the step that raised does not count: nothing of it stands


def test_load_refuses_a_checkpoint_holding_non_finite_weights_naming_the_tensor(stream, tmp_path):
    trainer = make_trainer(model_fn=mlp, predict=False)
    for b in stream[:5]:
        trainer.step(b)
    state = trainer.state_dict()
    state["model"]["2.weight"] = state["model"]["2.weight"].clone()
    state["model"]["2.weight"][1, 1] = float("nan")
    torch.save(state, tmp_path / "nan.pt")
    other = make_trainer(model_fn=mlp, predict=False, seed=3)
    before = cloned(other.state_dict())
    with pytest.raises(ValueError, match=r"2\.weight"):
        other.load(tmp_path / "nan.pt")
    assert_same_state(cloned(other.state_dict()), before)
    state = trainer.state_dict()
    state["optimizer"]["state"][1]["exp_avg_sq"] = state["optimizer"]["state"][1]["exp_avg_sq"].clone().fill_(math.inf)
    torch.save(state, tmp_path / "inf.pt")
    with pytest.raises(ValueError, match="exp_avg_sq"):
        other.load(tmp_path / "inf.pt")


# ----------------------------------------------------------------------- appended parameters ----
def test_a_parameter_appended_to_a_group_is_guarded_from_its_next_step(stream):
    model = mlp()
    last_bias = model[2].bias
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p is not last_bias], lr=3e-3)
    trainer = HybridTrainer(model, optimizer, cross_entropy, config=HybridConfig(**FAST, predict=False))
    for b in stream[:5]:
        trainer.step(b)
    optimizer.param_groups[0]["params"].append(last_bias)  # what users do to train one more tensor
    trainer.step(stream[5])
    assert any(p is last_bias for p in trainer.params)
    before = last_bias.detach().clone()
    handle = last_bias.register_hook(lambda g: g * float("nan"))
    assert trainer.step(stream[6]).skipped
    handle.remove()
    assert torch.equal(last_bias.detach(), before)
    assert not trainer.step(stream[7]).skipped and torch.isfinite(last_bias).all()


# --------------------------------------------------------------------------- transactional load ----
def trained(steps, stream, **overrides):
    trainer = make_trainer(model_fn=mlp, **{**ALWAYS, **overrides})
    for b in stream[:steps]:
        trainer.step(b)
    return trainer


def assert_failed_load_changes_nothing(trainer, path, match):
    before = cloned(trainer.state_dict())
    with pytest.raises(ValueError, match=match):
        trainer.load(path)
    assert_same_state(cloned(trainer.state_dict()), before)


def test_a_load_with_another_dynamics_size_fails_before_restoring_anything(stream, tmp_path):
    trained(30, stream, dynamics_hidden=32).save(tmp_path / "h32.pt")
    assert_failed_load_changes_nothing(trained(10, stream, dynamics_hidden=64), tmp_path / "h32.pt",
                                       "dynamics_hidden")


def test_a_load_with_another_optimizer_class_or_groups_fails_before_restoring_anything(stream, tmp_path):
    trained(20, stream).save(tmp_path / "adamw.pt")
    model = mlp()
    sgd = HybridTrainer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), cross_entropy,
                        config=HybridConfig(**{**FAST, **ALWAYS}))
    for b in stream[:5]:
        sgd.step(b)
    assert_failed_load_changes_nothing(sgd, tmp_path / "adamw.pt", "AdamW")
    model = mlp()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    two_groups = HybridTrainer(model, torch.optim.AdamW([{"params": weights}, {"params": biases}], lr=3e-3),
                               cross_entropy, config=HybridConfig(**{**FAST, **ALWAYS}))
    assert_failed_load_changes_nothing(two_groups, tmp_path / "adamw.pt", "param group")


def test_a_load_with_another_model_shape_fails_before_restoring_anything(stream, tmp_path):
    trained(20, stream).save(tmp_path / "h64.pt")
    model = mlp(hidden=32)
    narrow = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3), cross_entropy,
                           config=HybridConfig(**{**FAST, **ALWAYS}))
    assert_failed_load_changes_nothing(narrow, tmp_path / "h64.pt", "0.weight")


def test_a_load_with_a_damaged_component_fails_before_restoring_anything(stream, tmp_path):
    source = trained(30, stream)
    state = source.state_dict()
    state["history"] = {k: (v[:1] if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                        for k, v in state["history"].items()}
    torch.save(state, tmp_path / "damaged.pt")
    assert_failed_load_changes_nothing(trained(10, stream), tmp_path / "damaged.pt", "history")


# ------------------------------------------------------------------------ emergency checkpoint ----
def test_a_failed_emergency_checkpoint_warns_and_the_step_completes(stream, tmp_path):
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("")
    metrics = tmp_path / "metrics.jsonl"
    trainer = make_trainer(model_fn=mlp, predict=False, memory_profile=True, vram_warning=1.0e3,
                           vram_critical=2.0e3, emergency_checkpoint_path=str(blocker / "emergency.pt"),
                           metrics_path=str(metrics))
    with pytest.warns(RuntimeWarning, match="emergency checkpoint") as caught:
        result = trainer.step(stream[0])
    assert [w.filename for w in caught] == [__file__]  # attributed to the line that called step()
    assert result.emergency_checkpoint_error is not None and "not_a_directory" in result.emergency_checkpoint_error
    assert trainer.step_count == 1 and trainer.stats.optimizer_steps == 1
    assert trainer.statistics()["emergency_checkpoint_failures"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.step(stream[1])  # below the re-armed level no second attempt, no second warning
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]


# ------------------------------------------------------------------------------- the pieces ----
def test_non_finite_names_names_each_non_finite_floating_tensor_once():
    from hybrid_trainer.resume_check import non_finite_names

    named = [("a", torch.ones(3)), ("b", torch.tensor([1.0, math.nan])), ("c", torch.tensor([math.inf])),
             ("d", torch.tensor([-math.inf], dtype=torch.bfloat16)), ("e", torch.tensor([7])),
             ("f", torch.empty(0)), ("g", 3.0)]
    assert non_finite_names(named) == ["b", "c", "d"]
    assert non_finite_names([("a", torch.full((4,), 3e38))]) == []  # large is not infinite
    # 0-d tensors (an optimizer's step count) are read as they are, not summed
    scalars = [("s", torch.tensor(4.0)), ("t", torch.tensor(math.nan)), ("u", torch.tensor(-math.inf, dtype=torch.bfloat16))]
    assert non_finite_names(scalars) == ["t", "u"] and non_finite_names(scalars[:1]) == []


def test_non_finite_names_as_on_a_gpu_names_the_same_tensors_with_a_few_ops_for_all_of_them(monkeypatch):
    # A GPU's way (one multi-tensor max-abs norm, stacked, one read), forced on CPU tensors.
    from torch.utils._python_dispatch import TorchDispatchMode

    from hybrid_trainer import resume_check

    monkeypatch.setattr(resume_check, "_multi_tensor_norm_pays", lambda device: True)
    named = [("a", torch.ones(3)), ("b", torch.tensor([1.0, math.nan])), ("c", torch.tensor([math.inf])),
             ("d", torch.tensor([-math.inf], dtype=torch.bfloat16)), ("e", torch.tensor([7])),
             ("big", torch.full((4,), 3e38)), ("half", torch.full((2,), 6e4, dtype=torch.float16)),
             ("w", torch.nn.Parameter(torch.tensor([2.0, math.nan]))), ("s", torch.tensor(math.nan))]
    assert resume_check.non_finite_names(named, reads_free=False) == ["b", "c", "d", "w", "s"]

    class Ops(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Ops.count += 1
            return func(*args, **(kwargs or {}))

    def ops_for(n: int) -> int:
        tensors = [(i, torch.nn.Parameter(torch.randn(5))) for i in range(n)]
        tensors[-1][1].data[0] = math.inf
        Ops.count = 0
        with Ops():
            assert resume_check.non_finite_names(tensors, reads_free=False) == [n - 1]
        return Ops.count
    # The same ops for 160 tensors as for 2 (a snapshot of the char-LM's weights and AdamW state
    # was ~5 ops a tensor: a detach, two views and a cast each, where each is a GPU host's call).
    assert ops_for(160) == ops_for(2) <= 6


def test_buffer_guard_restores_a_buffer_the_forward_reassigned():
    from hybrid_trainer.anchor import buffer_slots
    from hybrid_trainer.buffer_guard import BufferGuard

    class Normaliser(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mean", torch.zeros(4))

        def forward(self, x):
            self.mean = 0.9 * self.mean + 0.1 * x.mean(0)  # a new tensor under the name
            return x - self.mean

    model = Normaliser()
    guard = BufferGuard(buffer_slots(model))
    guard.before_forward()
    model(torch.full((2, 4), math.nan))
    guard.restore()
    assert torch.equal(model.mean, torch.zeros(4))
    assert not BufferGuard(buffer_slots(torch.nn.Linear(2, 2))).active


def test_buffer_guard_copies_a_buffer_again_when_its_shape_or_dtype_changed_between_steps():
    from hybrid_trainer.anchor import buffer_slots
    from hybrid_trainer.buffer_guard import BufferGuard

    model = torch.nn.BatchNorm1d(3)
    guard = BufferGuard(buffer_slots(model))
    guard.before_forward()
    first = list(guard._saved)
    guard.before_forward()
    assert all(a is b for a, b in zip(first, guard._saved))  # same layout: the same copies, refreshed
    model.running_mean = torch.arange(5.0)  # reassigned with another shape
    model.running_var = torch.ones(3, dtype=torch.float64)  # and another dtype
    guard.before_forward()
    model.running_mean.fill_(math.nan)
    model.running_var.fill_(math.nan)
    guard.restore()
    assert torch.equal(model.running_mean, torch.arange(5.0))
    assert model.running_var.dtype == torch.float64 and torch.equal(model.running_var, torch.ones(3, dtype=torch.float64))


def test_save_refuses_to_write_non_finite_buffers(stream, tmp_path):
    trainer = make_trainer(predict=False)  # the batch-norm MLP
    for b in stream[:3]:
        trainer.step(b)
    with torch.no_grad():
        trainer.model[1].running_var[0] = math.inf
    with pytest.raises(ValueError, match=r"buffer '1\.running_var'"):
        trainer.save(tmp_path / "poisoned.pt")
    assert not (tmp_path / "poisoned.pt").exists()

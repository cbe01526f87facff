"""HybridConfig(cuda_graph=True): the steady step captured in a CUDA graph and replayed (hybrid_trainer.captured_step).

What must hold: a run whose steps are replayed decides, reports and trains as the same run with
every step eager on the deferred path (the graph holds the same ops); a non-finite batch is
skipped on the device, a spike rolls back and the graph is captured again after it; a changed
learning rate is captured again, and a scheduler that changes it every step turns capture off;
a batch of another shape steps eagerly; a loaded checkpoint drops the graph; where capture cannot
be used, the trainer says why once and steps eagerly.

This machine has no GPU: the CPU tests replace torch.cuda's graphs by a stand-in with their
contract. A capture records the step's aten ops (under a TorchDispatchMode) and leaves every
tensor as it found it, refusing a value read back; a replay runs only those ops, on the tensors
they were recorded with, each result written where the capture's was: no Python of the step runs
again and every constant it was given (a learning rate) stays. A first stand-in that re-ran the
step's Python at each replay let a graph keep a stale learning rate unnoticed; this one fails it.
What it cannot check: the kernels' recording, streams and the graph's memory pool. The CUDA tests
at the end run the real graphs.
"""
import contextlib
import numpy as np
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid_trainer import HybridConfig, HybridTrainer, captured_step
from hybrid_trainer.run_report import PendingStepResult
from _resume import assert_same_state

pytestmark = pytest.mark.usefixtures("eager_backend")


class _Recorder(TorchDispatchMode):
    """Records every aten op a step issues with its arguments and results, running it; keeps the
    value each tensor had when an op first took it, so the recording can be undone (every tensor,
    not only those a schema marks as written: native_batch_norm's does not mark the running
    statistics it updates); refuses a read back to the host, as a capture does."""

    def __init__(self):
        super().__init__()
        self.ops = []
        self.seen = {}  # id -> (tensor, its value when an op first took it)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("operation not permitted when stream is capturing (a value read back)")
        for value in [*args, *kwargs.values()]:
            for tensor in (value if isinstance(value, (list, tuple)) else [value]):
                if isinstance(tensor, torch.Tensor) and id(tensor) not in self.seen:
                    self.seen[id(tensor)] = (tensor, tensor.clone())
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class GraphStandIn:
    """torch.cuda's graphs as the trainer meets them, on the CPU. The warm-up steps run as they
    are. A capture records the aten ops of the step (running them, then putting back every tensor
    they wrote: a capture runs nothing) and refuses a value read back; a replay runs those ops
    again on the same tensors and writes each result into the tensor the op returned at the
    capture, as a CUDA graph's kernels write the addresses they were recorded with. No Python of
    the step runs at a replay, and every value the ops were given at the capture (a learning
    rate, a flag) is the one they get: what a graph holds as a constant stays one here."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.captured = 0
        self.warmups = 0

    @contextlib.contextmanager
    def warmup(self):
        self.warmups += 1
        yield

    def capture(self, body):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        recorder = _Recorder()
        with recorder:
            body()
        with torch.no_grad():
            for tensor, before in recorder.seen.values():
                tensor.copy_(before)
        self.captured += 1
        ops = recorder.ops

        def replay():
            with torch.no_grad():
                for func, args, kwargs, out in ops:
                    result = func(*args, **kwargs)
                    for target, value in zip(*(([out], [result]) if not isinstance(out, (list, tuple))
                                                else (out, result))):
                        if isinstance(target, torch.Tensor) and value is not target:
                            target.copy_(value)
        return replay


@pytest.fixture
def stand_in(monkeypatch):
    graphs = GraphStandIn()
    monkeypatch.setattr("hybrid_trainer.trainer.graphs_for", lambda device: graphs)
    return graphs


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def _make(cuda_graph, device="cpu", fused=True, batch_norm=True, scheduler=None, **config):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(12, 24)]
    if batch_norm:
        layers.append(torch.nn.BatchNorm1d(24))
    layers += [torch.nn.ReLU(), torch.nn.Linear(24, 3)]
    model = torch.nn.Sequential(*layers).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    config = dict(dict(predict=False, good_state_every=10, read_every=8), **config)
    trainer = HybridTrainer(model, optimizer, _loss, HybridConfig(cuda_graph=cuda_graph, **config),
                            scheduler=None if scheduler is None else scheduler(optimizer))
    return model, trainer


def _batches(n, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 12, generator=g).to(device), torch.randint(0, 3, (16,), generator=g).to(device))
            for _ in range(n)]


def _with_nan_input(batch):
    x = batch[0].clone()
    x[0, 0] = float("nan")
    return x, batch[1]


def _run(cuda_graph, batches, device="cpu", between=None, **make):
    """Both arms' (model, trainer, what each step reported); ``between(trainer, index)`` runs
    before each step."""
    model, trainer = _make(cuda_graph, device=device, **make)
    seen = []
    for index, batch in enumerate(batches):
        if between is not None:
            between(trainer, index)
        seen.append(trainer.step(batch))
    trainer.close()
    reports = [(r.loss, r.grad_norm, r.skipped, r.rolled_back, r.divergence) for r in seen]
    return model, trainer, reports


def _state(model, trainer):
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": trainer.optimizer.state_dict()}


def _faulty_batches(n=90, device="cpu"):
    batches = _batches(n, device)
    batches[30] = _with_nan_input(batches[30])
    batches[55] = (batches[55][0] * 1e4, batches[55][1])  # a loss far above the window: a rollback
    return batches


@pytest.mark.parametrize("batch_norm", [False, True])
def test_replayed_steps_decide_report_and_train_as_the_eager_deferred_steps(stand_in, batch_norm):
    # With batch norm the buffers are kept and put back on the device inside the graph; it
    # normalizes the spike away, so that run has the NaN batch only.
    batches = _faulty_batches()
    model_e, trainer_e, eager = _run(False, batches, batch_norm=batch_norm)
    model_g, trainer_g, replayed = _run(True, batches, batch_norm=batch_norm)
    assert replayed == eager
    assert eager[30][2] and not eager[30][3]  # the NaN batch skipped where it ran
    rollbacks = trainer_e.stats.divergence_rollbacks
    assert rollbacks == (0 if batch_norm else 1) == trainer_g.stats.divergence_rollbacks
    assert_same_state(_state(model_g, trainer_g), _state(model_e, trainer_e))
    graph = trainer_g.statistics()["cuda_graph"]
    # Captured once, and again after a rollback, which may have given the state new tensors.
    assert graph["captures"] == stand_in.captured == 1 + rollbacks and graph["off_reason"] is None
    assert graph["replays"] > 50  # every step but the warm-up ones and those read one by one after the rollback
    assert stand_in.warmups == graph["captures"] * captured_step.WARMUP_STEPS
    assert "CUDA graph: " in trainer_g.summary()


def test_a_replayed_step_queues_one_row_and_its_loss_is_read_when_asked(stand_in):
    batches = _batches(30)
    model, trainer = _make(True, batch_norm=False)
    results = [trainer.step(b) for b in batches]
    _, reference = _make(False, batch_norm=False)
    expected = [reference.step(b) for b in batches]
    assert trainer.captured.replays > 0
    _, value, _ = trainer.guard.deferred.pending[-1]
    assert isinstance(value, torch.Tensor) and value.shape == (1 + 4,)  # the loss and 4 gradient norms
    last = results[-1]
    assert isinstance(last, PendingStepResult) and not last.settled
    assert (last.loss, last.grad_norm) == (expected[-1].loss, expected[-1].grad_norm)  # read now, when asked
    assert not last.settled


def test_a_changed_learning_rate_is_captured_again(stand_in):
    def halve_at_40(trainer, index):
        if index == 40:
            for group in trainer.optimizer.param_groups:
                group["lr"] *= 0.5
    batches = _batches(70)
    model_e, trainer_e, eager = _run(False, batches, between=halve_at_40)
    model_g, trainer_g, replayed = _run(True, batches, between=halve_at_40)
    assert replayed == eager
    assert_same_state(_state(model_g, trainer_g), _state(model_e, trainer_e))
    assert trainer_g.captured.captures == 2 and trainer_g.captured.off_reason is None


def test_a_scheduler_that_changes_the_learning_rate_every_step_turns_capture_off(stand_in):
    def schedule(optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.99)
    batches = _batches(24 + captured_step.MAX_CAPTURES * (captured_step.WARMUP_STEPS + 1) + 40)
    model_e, trainer_e, eager = _run(False, batches, scheduler=schedule)
    with pytest.warns(RuntimeWarning, match="changes too often"):
        model_g, trainer_g, replayed = _run(True, batches, scheduler=schedule)
    assert replayed == eager
    assert_same_state(_state(model_g, trainer_g), _state(model_e, trainer_e))
    assert trainer_g.captured.captures == captured_step.MAX_CAPTURES
    assert "scheduler" in trainer_g.captured.off_reason and not trainer_g.captured.captured


def test_a_batch_of_another_shape_steps_eagerly_and_keeps_the_graph(stand_in):
    batches = _batches(40)
    batches[25] = (batches[25][0][:9], batches[25][1][:9])  # a short batch, as a loader's last
    model_e, trainer_e, eager = _run(False, batches)
    model_g, trainer_g, replayed = _run(True, batches)
    assert replayed == eager
    assert_same_state(_state(model_g, trainer_g), _state(model_e, trainer_e))
    assert trainer_g.captured.captures == 1


def test_a_loaded_checkpoint_drops_the_graph_and_resumes_bit_exactly(stand_in, tmp_path):
    batches = _batches(60)
    model, trainer = _make(True)
    for b in batches[:30]:
        trainer.step(b)
    trainer.save(tmp_path / "run.pt")
    for b in batches[30:]:
        trainer.step(b)
    resumed_model, resumed = _make(True)
    resumed.load(tmp_path / "run.pt")
    assert not resumed.captured.captured
    for b in batches[30:]:
        resumed.step(b)
    trainer.close()
    resumed.close()
    assert_same_state(_state(resumed_model, resumed), _state(model, trainer))
    # Loaded into the trainer that captured: its graph goes too.
    assert trainer.captured.captures >= 1
    trainer.load(tmp_path / "run.pt")
    assert not trainer.captured.captured


@pytest.mark.parametrize("make, why", [
    (dict(fused=False), "cannot skip a non-finite update on the device"),
    (dict(read_every=1), "read_every is 1"),
    (dict(grad_clip=1.0), "grad_clip"),
    (dict(grad_accumulation=2), "general step"),
])
def test_where_it_cannot_capture_it_says_why_once_and_steps_eagerly(stand_in, make, why):
    batches = _batches(30)
    if make.get("grad_accumulation"):
        batches = [[b, b] for b in batches]
    _, _, eager = _run(False, batches, **make)
    with pytest.warns(RuntimeWarning, match=why) as caught:
        _, trainer, replayed = _run(True, batches, **make)
    assert len([w for w in caught if "cuda_graph" in str(w.message)]) == 1
    assert replayed == eager
    assert trainer.captured.replays == 0 and why in trainer.statistics()["cuda_graph"]["off_reason"]


def test_without_a_cuda_device_it_says_so_and_steps_eagerly():
    with pytest.warns(RuntimeWarning, match="not a CUDA device"):
        _, trainer = _make(True)
    for b in _batches(20):
        trainer.step(b)
    assert trainer.captured.replays == 0


def test_optimizer_step_hooks_turn_it_off_registered_before_or_after_the_trainer_is_built(stand_in):
    model = torch.nn.Linear(12, 3)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    handle = optimizer.register_step_post_hook(lambda *args: None)
    with pytest.warns(RuntimeWarning, match="step hooks"):
        HybridTrainer(model, optimizer, _loss, HybridConfig(predict=False, read_every=8, cuda_graph=True))
    handle.remove()
    trainer = HybridTrainer(model, optimizer, _loss, HybridConfig(predict=False, read_every=8, cuda_graph=True))
    calls = []
    optimizer.register_step_post_hook(lambda *args: calls.append(1))  # after: found when it would capture
    with pytest.warns(RuntimeWarning, match="step hooks"):
        for b in _batches(20):
            trainer.step(b)
    assert trainer.captured.captures == 0 and len(calls) == 20  # every update ran its hook


def test_a_capture_that_fails_turns_it_off_and_the_run_goes_on_eagerly(monkeypatch):
    graphs = GraphStandIn(fail=True)
    monkeypatch.setattr("hybrid_trainer.trainer.graphs_for", lambda device: graphs)
    batches = _faulty_batches(70)
    model_e, trainer_e, eager = _run(False, batches)
    with pytest.warns(RuntimeWarning, match="could not be captured .*stream is capturing"):
        model_g, trainer_g, replayed = _run(True, batches)
    assert replayed == eager
    assert_same_state(_state(model_g, trainer_g), _state(model_e, trainer_e))
    assert trainer_g.captured.replays == 0 and not trainer_g.captured.captured


def test_cuda_graph_is_checked():
    with pytest.raises(ValueError, match="cuda_graph"):
        HybridConfig(cuda_graph="yes").validate()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda's graphs: needs a GPU")
@pytest.mark.parametrize("batch_norm", [False, True])
def test_on_cuda_the_replayed_run_decides_and_trains_as_the_eager_one(batch_norm):
    # The real capture: the same decisions and reports, step by step, and the same state (cuBLAS
    # may choose another kernel inside a capture, so to float32's rounding rather than bit for bit).
    batches = _faulty_batches(device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model_g, trainer_g, replayed = _run(True, batches, device="cuda", batch_norm=batch_norm)
    assert not [str(w.message) for w in caught if "cuda_graph" in str(w.message)]  # no capture failure, no fallback
    model_e, trainer_e, eager = _run(False, batches, device="cuda", batch_norm=batch_norm)
    assert [r[2:] for r in replayed] == [r[2:] for r in eager]
    for (loss_g, norm_g, *_), (loss_e, norm_e, *_) in zip(replayed, eager):
        assert (loss_g is None) == (loss_e is None)
        if loss_g is not None:
            assert loss_g == pytest.approx(loss_e, rel=1e-4) and norm_g == pytest.approx(norm_e, rel=1e-4)
    for name, tensor in model_e.state_dict().items():
        assert torch.allclose(model_g.state_dict()[name].float(), tensor.float(), rtol=1e-4, atol=1e-6), name
    rollbacks = trainer_e.stats.divergence_rollbacks
    assert rollbacks == (0 if batch_norm else 1) == trainer_g.stats.divergence_rollbacks  # batch norm takes the spike
    assert trainer_g.captured.captures == 1 + rollbacks and trainer_g.captured.replays > 50


def _after(step_index, action):
    """``between`` for :func:`_run`: ``action(trainer)`` before step ``step_index``."""
    def between(trainer, index):
        if index == step_index:
            action(trainer)
    return between


def _scaled_loss(model, batch):
    return 2.0 * _loss(model, batch)


@pytest.mark.parametrize("action", ["load the optimizer's state", "replace the loss", "evaluate a while"])
def test_what_the_graph_was_built_from_replaced_by_the_user_is_captured_again(stand_in, action):
    # Each leaves the weights' tensors where they were, which a graph would not notice: a loaded
    # optimizer state is new tensors, a new loss function other ops, eval mode other kernels.
    batches = _batches(70)
    if action == "load the optimizer's state":
        between = _after(35, lambda trainer: trainer.optimizer.load_state_dict(trainer.optimizer.state_dict()))
    elif action == "replace the loss":
        between = _after(35, lambda trainer: setattr(trainer, "loss_fn", _scaled_loss))
    else:
        def between(trainer, index):
            if index == 35:
                trainer.model.eval()
            elif index == 50:
                trainer.model.train()
    model_e, trainer_e, eager = _run(False, batches, between=between)
    model_g, trainer_g, replayed = _run(True, batches, between=between)
    assert replayed == eager
    assert_same_state(_state(model_g, trainer_g), _state(model_e, trainer_e))
    assert trainer_g.captured.captures == (3 if action == "evaluate a while" else 2)


def test_a_step_hook_registered_after_the_capture_turns_it_off_and_every_update_runs_it(stand_in):
    batches = _batches(40)
    model, trainer = _make(True)
    for b in batches[:20]:
        trainer.step(b)
    assert trainer.captured.captured
    calls = []
    trainer.optimizer.register_step_post_hook(lambda *args: calls.append(1))
    with pytest.warns(RuntimeWarning, match="step hooks"):
        for b in batches[20:]:
            trainer.step(b)
    assert len(calls) == 20 and not trainer.captured.captured and trainer.captured.captures == 1


def _capture_step(batches):
    """The index of the step at which a cuda_graph trainer captures, over ``batches``."""
    graphs = GraphStandIn()
    _, trainer = _make(True)
    trainer.captured.graphs = graphs
    for index, b in enumerate(batches):
        trainer.step(b)
        if graphs.captured:
            return index
    raise AssertionError("no capture")


def test_a_short_batch_where_it_would_capture_is_stepped_and_the_next_full_one_captured(stand_in):
    batches = _batches(40)
    at = _capture_step(batches)
    batches[at] = (batches[at][0][:9], batches[at][1][:9])
    model_e, trainer_e, eager = _run(False, batches)
    model_g, trainer_g, replayed = _run(True, batches)
    assert replayed == eager
    assert_same_state(_state(model_g, trainer_g), _state(model_e, trainer_e))
    # The short batch and the full one after it step eagerly (the capture waits for a warm-up step
    # shaped as the batch it captures), then every step replays: captured on the short one, the
    # full batches after it would not fit, and it would be captured again.
    assert trainer_g.captured.captures == 1
    assert trainer_g.captured.replays == len(batches) - at - 2


def test_batches_that_stop_fitting_the_graph_are_captured_again_on_their_shape(stand_in):
    batches = _batches(30) + [(x[:10], y[:10]) for x, y in _batches(30, seed=2)]
    model_e, trainer_e, eager = _run(False, batches)
    model_g, trainer_g, replayed = _run(True, batches)
    assert replayed == eager
    assert_same_state(_state(model_g, trainer_g), _state(model_e, trainer_e))
    # Dropped after MISSES_TO_DROP steps that did not fit, warmed up and captured again: the
    # second half replays but for those steps.
    graph = trainer_g.captured
    assert graph.captures == 2
    assert graph.replays == 2 * 30 - _capture_step(batches) - captured_step.MISSES_TO_DROP \
        - captured_step.WARMUP_STEPS


def test_a_batch_holding_other_values_than_tensors_and_plain_scalars_is_not_captured(stand_in):
    def dict_loss(model, batch):
        return _loss(model, (batch["x"], batch["y"]))
    torch.manual_seed(0)
    model = torch.nn.Linear(12, 3)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    trainer = HybridTrainer(model, optimizer, dict_loss, HybridConfig(predict=False, read_every=8, cuda_graph=True))
    with pytest.warns(RuntimeWarning, match="the batch holds a ndarray"):
        for x, y in _batches(20):
            trainer.step({"x": x, "y": y, "ids": np.arange(3)})
    assert trainer.captured.replays == 0


def test_a_loss_function_that_reads_a_value_back_is_not_captured_and_the_run_goes_on(stand_in):
    logged = []

    def logging_loss(model, batch):
        loss = _loss(model, batch)
        logged.append(float(loss.detach()))  # a read back, which a capture refuses
        return loss
    batches = _batches(30)
    model_e, trainer_e, eager = _run(False, batches, batch_norm=False)
    torch.manual_seed(0)
    model_g, trainer_g = _make(True, batch_norm=False)
    trainer_g.loss_fn = logging_loss
    with pytest.warns(RuntimeWarning, match="could not be captured .*value read back"):
        replayed = [trainer_g.step(b) for b in batches]
    trainer_g.close()
    assert [(r.loss, r.grad_norm, r.skipped) for r in replayed] == [r[:3] for r in eager]
    assert_same_state(_state(model_g, trainer_g), _state(model_e, trainer_e))
    assert len(logged) == len(batches)  # every step's (the capture's read raised)
    assert trainer_g.captured.replays == 0 and stand_in.captured == 0


def test_trainers_on_one_device_share_its_side_stream(monkeypatch):
    # torch keeps a cuBLAS workspace per (handle, stream) until the process ends: a stream per
    # trainer would leave one behind for each trainer made and dropped.
    made = []

    def stream(device):
        made.append(device)
        return object()

    monkeypatch.setattr(torch.cuda, "Stream", stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(captured_step, "_SIDE_STREAMS", {})
    first, again = captured_step.CudaGraphs(torch.device("cuda")), captured_step.CudaGraphs(torch.device("cuda", 0))
    other = captured_step.CudaGraphs(torch.device("cuda", 1))
    assert first.side is again.side and other.side is not first.side
    assert made == [torch.device("cuda", 0), torch.device("cuda", 1)]

"""The trainer's promises on models and setups users bring: exact rollback, no NaN in the
weights, exact resume and clear errors, each on a small real model that once broke one."""
import pytest
import torch

from hybrid_trainer import HybridConfig, HybridTrainer, Phase
from hybrid_trainer.averaging import WeightAverage

from _configs import ALWAYS, FAST
from _digits import batches, cross_entropy, digits_tensors, mlp


@pytest.fixture(autouse=True)
def eager_kernels(monkeypatch):
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", "eager")


@pytest.fixture(scope="module")
def stream():
    x, y = digits_tensors()
    return batches(x, y, 64, 120)


def run_until_phase(trainer, stream, phase):
    for i, batch in enumerate(stream):
        if trainer.controller.phase is phase:
            return i
        trainer.step(batch)
    raise AssertionError(f"never reached {phase}")


class ReassignedRunningMean(torch.nn.Module):
    """An input normaliser whose forward reassigns its buffer, as hand-written ones often do
    (the tensor under the name ``mean`` is a new one after every train-mode forward)."""

    def __init__(self, seed=0):
        super().__init__()
        self.register_buffer("mean", torch.zeros(64))
        self.net = mlp(seed)

    def forward(self, x):
        if self.training:
            self.mean = 0.9 * self.mean + 0.1 * x.mean(0)
        return self.net(x - self.mean)


def test_rollback_restores_a_buffer_the_forward_reassigns(stream):
    model = ReassignedRunningMean()
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=0.05), cross_entropy,
                            HybridConfig(**FAST, **ALWAYS, loss_tolerance=0.0, noise_z=0.0))
    i = run_until_phase(trainer, stream, Phase.PREDICT)
    at_phase_start = model.mean.clone()
    trainer.predictor.scales.fill_(50.0)  # a huge predicted step: the verification must reject it
    results = [trainer.step(stream[i + k]) for k in range(4)]
    assert results[-1].verified and results[-1].rolled_back
    assert torch.equal(model.mean, at_phase_start)  # the verification forward moved it; it went back


def temperature_setup(seed=0):
    """A classifier with a learned logit temperature outside the model (only the loss uses it)."""
    model = mlp(seed)
    temperature = torch.nn.Parameter(torch.ones(()))

    def loss_fn(model, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x) * temperature, y)

    return model, temperature, torch.optim.AdamW([*model.parameters(), temperature], lr=0.05), loss_fn


def test_a_trained_tensor_outside_the_model_is_guarded_and_rolled_back(stream):
    model, temperature, optimizer, loss_fn = temperature_setup()
    trainer = HybridTrainer(model, optimizer, loss_fn, HybridConfig(**FAST, predict=False))
    for batch in stream[:5]:
        trainer.step(batch)
    before = temperature.detach().clone()
    handle = temperature.register_hook(lambda g: g * float("nan"))
    assert trainer.step(stream[5]).skipped
    handle.remove()
    assert torch.equal(temperature.detach(), before)  # the NaN update was refused for it too
    assert any(p is temperature for p in trainer.good_state.params)  # and a spike restores it


@pytest.mark.parametrize("how", ["requires_grad", "add_param_group"])
def test_unfreezing_mid_run_is_guarded_from_the_next_step_on(stream, how):
    """Gradual unfreezing: the first layer trains from step 5 on. Its first gradient is NaN:
    the guard must refuse it (weights untouched), then the layer trains and is snapshotted."""
    model = mlp(0)
    first = list(model[0].parameters())
    for p in first:
        p.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters() if how == "requires_grad" else model[2].parameters(), lr=0.05)
    trainer = HybridTrainer(model, optimizer, cross_entropy, HybridConfig(**FAST, predict=False))
    for batch in stream[:5]:
        trainer.step(batch)
    for p in first:
        p.requires_grad_(True)
    if how == "add_param_group":
        optimizer.add_param_group({"params": first, "lr": 0.01})
    handle = first[0].register_hook(lambda g: g * float("nan"))
    before = [p.detach().clone() for p in model.parameters()]
    assert trainer.step(stream[5]).skipped
    handle.remove()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    trainer.step(stream[6])
    assert not torch.equal(first[0].detach(), before[0])  # it trains now
    assert all(any(q is p for q in trainer.good_state.params) for p in first)
    assert trainer.stats.trained_set_changes == 1


def test_freezing_mid_predict_rolls_back_the_unverified_steps_and_stops_moving_the_frozen_weights(stream):
    model = mlp(0)
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=0.05), cross_entropy,
                            HybridConfig(**FAST, **ALWAYS))
    i = run_until_phase(trainer, stream, Phase.PREDICT)
    anchored = [p.detach().clone() for p in model.parameters()]
    trainer.step(stream[i])  # an unverified predicted step
    for p in model[0].parameters():
        p.requires_grad_(False)
    assert trainer.step(stream[i + 1]).phase == "FULL"  # the update history restarts
    assert trainer.stats.predicted_steps_rolled_back == 1
    frozen = [p.detach().clone() for p in model[0].parameters()]
    assert all(torch.equal(p, a) for p, a in zip(frozen, anchored[:2]))  # the unverified delta went back
    phases = {trainer.step(batch).phase for batch in stream[i + 2:i + 40]}
    assert "PREDICT" in phases
    assert all(torch.equal(p.detach(), f) for p, f in zip(model[0].parameters(), frozen))
    assert not any(p is q for p in model[0].parameters() for q in trainer.params)


def test_the_weight_average_carries_over_a_change_of_trained_tensors():
    a, b, c = (torch.full((3,), v) for v in (1.0, 2.0, 3.0))
    average = WeightAverage([a, b])
    b += 1.0
    average.update()
    moved = average.retarget([b, c])
    assert moved.updates == 1
    assert torch.equal(moved._fast[0], average._fast[1]) and torch.equal(moved._slow[0], average._slow[1])
    assert torch.equal(moved._fast[1], c) and torch.equal(moved.estimate()[1], c)  # never moved: its average


def test_loading_a_checkpoint_of_other_trained_parameters_names_it(stream, tmp_path):
    model, _, optimizer, loss_fn = temperature_setup()
    trainer = HybridTrainer(model, optimizer, loss_fn, HybridConfig(**FAST))
    trainer.step(stream[0])
    trainer.save(tmp_path / "run.pt")
    model = mlp(0)
    other = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=0.05), cross_entropy, HybridConfig(**FAST))
    with pytest.raises(ValueError, match=r"checkpoint: .* 5 parameter tensors .* 4 "):
        other.load(tmp_path / "run.pt")


def test_sparse_embedding_gradients_are_refused_at_construction():
    """Before, the first step failed deep in torch ('linalg_vector_norm ... SparseCPU')."""
    model = torch.nn.Sequential(torch.nn.EmbeddingBag(50, 8, sparse=True), torch.nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"model: EmbeddingBag '0' has sparse=True"):
        HybridTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy)
    model[0].sparse = False
    with pytest.raises(ValueError, match="optimizer: SparseAdam"):
        HybridTrainer(model, torch.optim.SparseAdam(list(model[0].parameters())), cross_entropy)


def test_a_scheduler_the_trainer_cannot_step_is_refused_at_construction():
    """Before, ReduceLROnPlateau failed at the first real step ('missing ... metrics')."""
    model = mlp(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    with pytest.raises(TypeError, match="scheduler: ReduceLROnPlateau"):
        HybridTrainer(model, optimizer, cross_entropy, scheduler=plateau)
    other = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), step_size=5)
    with pytest.raises(ValueError, match="scheduler: built over another optimizer"):
        HybridTrainer(model, optimizer, cross_entropy, scheduler=other)


def test_resume_restores_a_trained_tensor_outside_the_model(stream, tmp_path):
    """The temperature is in no model's state_dict: the checkpoint must carry it itself."""
    def trained(steps, resume_from=None):
        model, temperature, optimizer, loss_fn = temperature_setup()
        trainer = HybridTrainer(model, optimizer, loss_fn, HybridConfig(**FAST))
        if resume_from is not None:
            trainer.load(resume_from)
        for batch in stream[trainer.step_count:steps]:
            trainer.step(batch)
        return trainer, [*model.parameters(), temperature]

    reference, want = trained(14)
    first, _ = trained(7)
    first.save(tmp_path / "run.pt")
    _, got = trained(14, resume_from=tmp_path / "run.pt")
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_an_optimizer_that_needs_a_closure_is_refused_at_construction():
    """Before, LBFGS failed at the first real step ('missing ... closure')."""
    model = mlp(0)
    with pytest.raises(TypeError, match="optimizer: LBFGS.step needs a closure"):
        HybridTrainer(model, torch.optim.LBFGS(model.parameters()), cross_entropy)


def test_double_precision_weights_are_refused_at_construction_unless_prediction_is_off(stream):
    """Before, a float64 model trained until its first predicted step, which failed in the kernel."""
    def as_double(model, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x.double()), y)

    model = mlp(0).double()
    with pytest.raises(TypeError, match=r"model: parameter '0\.weight' is torch\.float64"):
        HybridTrainer(model, torch.optim.AdamW(model.parameters()), as_double, HybridConfig(**FAST))
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters()), as_double,
                            HybridConfig(**FAST, predict=False))
    assert trainer.step(stream[0]).backward_done


@pytest.mark.parametrize("detach", [lambda loss: loss.detach(), lambda loss: torch.tensor(loss.item())])
def test_a_detached_loss_is_named_as_loss_fns_fault(stream, detach):
    model = mlp(0)
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters()), lambda m, b: detach(cross_entropy(m, b)),
                            HybridConfig(**FAST))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match="loss_fn returned a loss detached"):
        trainer.step(stream[0])
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_a_loss_of_one_element_is_stepped_on_and_one_of_several_is_named_as_loss_fns_fault(stream):
    model = mlp(0)
    one = HybridTrainer(model, torch.optim.AdamW(model.parameters()), lambda m, b: cross_entropy(m, b).reshape(1, 1),
                        HybridConfig(**FAST))
    assert one.step(stream[0]).backward_done
    model = mlp(0)
    several = HybridTrainer(model, torch.optim.AdamW(model.parameters()),
                            lambda m, b: cross_entropy(m, b) * torch.ones(2), HybridConfig(**FAST))
    with pytest.raises(TypeError, match=r"loss_fn must return a scalar tensor, got Tensor of shape \(2,\)"):
        several.step(stream[0])

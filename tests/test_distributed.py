"""HybridTrainer under DistributedDataParallel: two gloo ranks on CPU, each on its own shard.

Every rank must take the same path (phases, verdicts, refusals) and hold the same weights, bit
for bit, or a rank would hang in a collective the others skipped; and the run must be the one a
single process makes on the ranks' batches concatenated. One process start serves every test
(``ddp_runs``): starting two Python processes with torch costs more than the training.
"""
import os

import pytest
import torch

import _ddp
from hybrid_trainer import HybridConfig, HybridTrainer
from hybrid_trainer.distributed import RankSync

from _digits import mlp

WORLD = 2
STEPS = 80
NAN_STEP = 40
RESUME = dict(steps=60, save_at=30, config=_ddp.ALWAYS)


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("ddp"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HYBRID_KERNELS_BACKEND", "eager")  # the spawned ranks inherit it
        runs = _ddp.run(WORLD, out_dir, {
            "train": ("train", dict(steps=STEPS, config=_ddp.ALWAYS, nan_step=NAN_STEP, perturb_dynamics=True)),
            # Also: per-step metrics, gradient checkpointing (module names of the wrapped model)
            # and a VRAM guard whose thresholds (bytes of process RSS on a CPU) every rank
            # crosses at its first step.
            "accumulate": ("train", dict(steps=30, accumulation=2, config={
                **_ddp.ALWAYS, "metrics_path": os.path.join(out_dir, "metrics.jsonl"), "checkpoint_modules": ["0"],
                "vram_warning": 1.0e3, "vram_critical": 2.0e3,
                "emergency_checkpoint_path": os.path.join(out_dir, "emergency.pt")})),
            # Which parts get timed depends on the clock (the worth gate reads the costs), so this
            # job only checks that the timings agree, whatever path they lead to.
            "costs": ("train", dict(steps=30, config={**_ddp.ALWAYS, "cost_aware": True})),
            "unwrapped": ("unwrapped", {}),
            "mismatched": ("mismatched", {}),
            "outside_model": ("outside_model", {}),
            "unfreeze": ("unfreeze", {}),
            "uninterrupted": ("resume_full", RESUME),
            "resumed": ("resume_loaded", RESUME),
        })
    runs["out_dir"] = out_dir
    return runs


def assert_ranks_agree(results):
    first = results[0]
    for other in results[1:]:
        assert other["records"] == first["records"]
        for got, want in zip(other["weights"], first["weights"]):
            assert torch.equal(got, want)
        clock = "time_by_phase_s"  # each rank's own clock; everything else must agree
        assert {k: v for k, v in other["stats"].items() if k != clock} == \
            {k: v for k, v in first["stats"].items() if k != clock}


def single_process_run(steps, config, accumulation=1, poisoned_step=None):
    """The same training in this process on every rank's batches concatenated."""
    model = mlp(0)
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=0.05), _ddp.clean_loss,
                            config=HybridConfig(**{**_ddp.FAST, **config, "grad_accumulation": accumulation}))
    records = []
    for step, step_batches in enumerate(_ddp.global_batches(WORLD, steps, accumulation)):
        batch = _ddp.concatenated_batch(step_batches)
        if step == poisoned_step:  # rank 1's half of the batch is NaN
            x, y = batch
            half = len(x) // WORLD
            batch = (torch.cat([x[:half], torch.full_like(x[half:], float("nan"))]), y)
        records.append(_ddp.record(trainer.step(batch)))
    return records, [p.detach() for p in trainer.params]


@pytest.mark.slow
def test_ranks_take_the_same_path_through_every_phase_verdict_and_refusal(ddp_runs):
    results = ddp_runs["train"]
    assert_ranks_agree(results)
    stats = results[0]["stats"]
    # The run covers what could split the ranks: accepted and rejected predict phases...
    assert stats["verifications_accepted"] > 0 and stats["predict_phases_rejected"] > 0
    assert {"WARMUP", "FULL", "PREDICT", "CORRECT"} <= {r[0] for r in results[0]["records"]}
    # ...and a NaN on one rank only, which every rank refuses.
    poisoned = results[0]["poisoned_step"]
    assert poisoned is not None and results[0]["records"][poisoned][5], "the NaN step was not refused"
    assert stats["skipped_steps"] == 1


@pytest.mark.slow
def test_ddp_run_is_the_single_process_run_on_the_concatenated_batches(ddp_runs):
    """Also holds with rank 1's dynamics model perturbed: rank 0's forecast is every rank's."""
    result = ddp_runs["train"][0]
    assert ddp_runs["train"][1]["dynamics_perturbed"] == 1  # rank 1's networks, once, when built
    records, weights = single_process_run(STEPS, _ddp.ALWAYS, poisoned_step=result["poisoned_step"])
    assert [r[0] for r in records] == [r[0] for r in result["records"]]  # phases
    assert [r[2:] for r in records] == [r[2:] for r in result["records"]]  # verdicts, rollbacks, refusals
    for (_, want, *_), (_, got, *_) in zip(records, result["records"]):
        assert (want is None) == (got is None)
        if want is not None:
            assert got == pytest.approx(want, rel=1e-5)
    # The ranks average gradients in another order than one process sums them (fp32 rounding).
    # The predicted direction is stored rounded (int8 blocks), so such a difference can, rarely,
    # round one of its elements to the neighbouring grid value: that element's predicted steps
    # then differ by a grid step. Everything else agrees to fp32 rounding.
    for got, want in zip(result["weights"], weights):
        close = torch.isclose(got, want, rtol=1e-4, atol=1e-5)
        assert float(close.float().mean()) >= 0.999, f"{int((~close).sum())} of {close.numel()} differ"
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)


@pytest.mark.slow
def test_collectives_per_step_are_the_documented_ones(ddp_runs):
    """One mean per real step and per verification; predicted steps between verifications
    communicate nothing (a forecast broadcast or a calibrated timing rides on a real step)."""
    result = ddp_runs["train"][0]
    for (phase, _, verified, *_), count in zip(result["records"], result["collectives"]):
        if phase == "PREDICT":
            assert count == (1 if verified else 0)
        else:
            assert count >= 1
    assert any(r[0] == "PREDICT" and not r[2] for r in result["records"])


@pytest.mark.slow
def test_an_unwrapped_model_on_a_process_group_trains_alone(ddp_runs):
    solo, idle = ddp_runs["unwrapped"]
    assert solo["steps"] == 30 and solo["predicted"] > 0 and idle["steps"] == 0


@pytest.mark.slow
def test_gradient_accumulation_all_reduces_once_per_step(ddp_runs):
    """With gradient checkpointing on too: the wrapped model's module names are the user's."""
    results = ddp_runs["accumulate"]
    assert_ranks_agree(results)
    stats = results[0]["stats"]
    assert results[0]["no_sync_entries"] == stats["optimizer_steps"]  # the first of 2 micro-batches
    records, weights = single_process_run(30, _ddp.ALWAYS, accumulation=2)
    assert [r[0] for r in records] == [r[0] for r in results[0]["records"]]
    for got, want in zip(results[0]["weights"], weights):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_rank_0_writes_the_metrics_and_each_rank_its_own_emergency_checkpoint(ddp_runs):
    out_dir = ddp_runs["out_dir"]
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        assert len(f.readlines()) == 30  # one record per step, not one per rank
    weights = None
    for rank in range(WORLD):
        state = torch.load(os.path.join(out_dir, f"emergency.pt.rank{rank}"), weights_only=True)
        assert state["trainer"]["step_count"] == 1  # written at the first step's crossing
        weights = weights or state["model"]
        assert all(torch.equal(state["model"][k], weights[k]) for k in weights)
    assert not os.path.exists(os.path.join(out_dir, "emergency.pt"))


@pytest.mark.slow
def test_calibrated_costs_are_the_same_on_every_rank(ddp_runs):
    """Each rank times its own steps; the thresholds built on them must agree."""
    assert_ranks_agree(ddp_runs["costs"])
    costs = [r["cost"] for r in ddp_runs["costs"]]
    assert costs[0]["core"] is not None and costs[0]["recording"] is not None  # timed on every recording step
    assert costs[1] == costs[0]


@pytest.mark.slow
def test_resume_under_ddp_reproduces_the_uninterrupted_run_on_every_rank(ddp_runs):
    """One file, written by rank 0, holds every rank's random streams (the loss draws dropout)."""
    uninterrupted, resumed = ddp_runs["uninterrupted"], ddp_runs["resumed"]
    assert_ranks_agree(uninterrupted)
    assert "PREDICT" in {r[0] for r in uninterrupted[0]["records"]}
    for full, tail in zip(uninterrupted, resumed):
        assert tail["records"] == full["records"][RESUME["save_at"]:]
        for got, want in zip(tail["weights"], full["weights"]):
            assert torch.equal(got, want)
        assert torch.equal(tail["draw"], full["draw"])
    assert not torch.equal(uninterrupted[0]["draw"], uninterrupted[1]["draw"])  # the ranks' streams differ


@pytest.mark.slow
def test_ranks_configured_differently_are_refused_at_construction(ddp_runs):
    errors = [r["error"] for r in ddp_runs["mismatched"]]
    assert all(e is not None and "verify_every" in e for e in errors), errors


@pytest.mark.slow
def test_a_trained_tensor_outside_the_ddp_model_is_refused_at_construction(ddp_runs):
    errors = [r["error"] for r in ddp_runs["outside_model"]]
    assert all(e is not None and "outside the DistributedDataParallel model" in e for e in errors), errors


@pytest.mark.slow
def test_unfreezing_under_ddp_is_refused_on_every_rank(ddp_runs):
    errors = [r["error"] for r in ddp_runs["unfreeze"]]
    assert all(e is not None and "changed under DistributedDataParallel" in e for e in errors), errors


def test_rank_sync_is_the_identity_without_ddp():
    ranks = RankSync(mlp(0))
    assert not ranks.active and ranks.is_writer and ranks.world_size == 1
    value = torch.tensor([1.5, float("nan")])
    assert ranks.mean(value) is value and ranks.from_rank0(value) is value
    assert ranks.mean_float(2.5) == 2.5 and ranks.gather("x") == ["x"]


def test_a_checkpoint_of_another_number_of_ranks_resumes_with_rank_0s_streams():
    def trainer():
        model = mlp(0)
        return HybridTrainer(model, torch.optim.AdamW(model.parameters()), _ddp.clean_loss,
                             config=HybridConfig(**_ddp.FAST))

    state = trainer().state_dict()
    torch.manual_seed(7)
    rank0_streams = dict(state["rng"], torch=torch.get_rng_state())
    state["rng_by_rank"] = [rank0_streams, state["rng"]]
    with pytest.warns(UserWarning, match="written by 2 ranks, resumed on 1"):
        trainer().load_state_dict(state)
    expected = torch.rand(3, generator=torch.Generator().set_state(rank0_streams["torch"]))
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.slow
def test_a_ddp_checkpoint_resumes_in_a_single_process(ddp_runs):
    """World size 2 -> 1: the model is no longer DDP-wrapped, so the checkpoint's weights must
    not be keyed by the wrapper (``module.``); likewise a single process's checkpoint loads under
    DDP."""
    path = os.path.join(ddp_runs["out_dir"], "resume.pt")
    saved = torch.load(path, weights_only=True)["model"]
    model = mlp(0)
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters()), _ddp.clean_loss,
                            config=HybridConfig(**{**_ddp.FAST, **_ddp.ALWAYS}))
    with pytest.warns(UserWarning, match="written by 2 ranks, resumed on 1"):
        trainer.load(path)
    assert set(saved) == set(model.state_dict())
    assert all(torch.equal(model.state_dict()[k], saved[k]) for k in saved)
    legacy = trainer.state_dict()  # as written before: keyed by the DDP wrapper
    legacy["model"] = {f"module.{k}": v for k, v in legacy["model"].items()}
    trainer.load_state_dict(legacy)


def _digits_trainer():
    model = mlp(0)
    return HybridTrainer(model, torch.optim.AdamW(model.parameters()), _ddp.clean_loss,
                         config=HybridConfig(**_ddp.FAST))


def test_load_keeps_random_streams_on_the_cpu_whatever_the_trainers_device(tmp_path):
    """Each rank loads the one checkpoint onto its own device. Mapping the whole file there moved
    the RNG and sampler states too, which torch only takes as CPU byte tensors: on a GPU ``load``
    raised. A trainer whose device is ``meta`` stands in for a GPU here (every loader moves what
    it restores to its own tensors' device)."""
    first = _digits_trainer()
    first.save(tmp_path / "ckpt.pt")
    draw = torch.rand(3)
    resumed = _digits_trainer()
    resumed.device = torch.device("meta")
    resumed.load(tmp_path / "ckpt.pt")
    assert torch.equal(torch.rand(3), draw)
    assert all(torch.equal(a, b) for a, b in zip(resumed.params, first.params))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_load_onto_a_cuda_trainer(tmp_path):
    def cuda_trainer():
        model = mlp(0).cuda()
        return HybridTrainer(model, torch.optim.AdamW(model.parameters()), _ddp.clean_loss,
                             config=HybridConfig(**_ddp.FAST))

    first = cuda_trainer()
    first.save(tmp_path / "ckpt.pt")
    draw = torch.rand(3)
    cuda_trainer().load(tmp_path / "ckpt.pt")
    assert torch.equal(torch.rand(3), draw)


def test_nccl_object_collectives_and_barrier_run_on_the_ranks_own_gpu(monkeypatch):
    """NCCL's ``all_gather_object`` and ``barrier`` place their tensors on the *current* CUDA
    device, which a rank that moved its model with ``.to(f"cuda:{rank}")`` but never called
    ``torch.cuda.set_device`` leaves at cuda:0, the same GPU on every rank (NCCL then fails or
    hangs). RankSync must make the model's device current around them (no GPU here: the CUDA
    device context and the collectives are stand-ins)."""
    import hybrid_trainer.distributed as distributed

    current = ["cuda:0"]

    class DeviceContext:
        def __init__(self, device):
            self.device, self.previous = str(torch.device(device)), None

        def __enter__(self):
            self.previous, current[0] = current[0], self.device

        def __exit__(self, *exc):
            current[0] = self.previous

    seen = []

    def all_gather_object(out, obj, group=None):
        seen.append(("gather", current[0]))
        out[:] = [obj] * len(out)

    monkeypatch.setattr(torch.cuda, "device", DeviceContext)
    monkeypatch.setattr(distributed.dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(distributed.dist, "barrier", lambda group=None: seen.append(("barrier", current[0])))
    ranks = RankSync(mlp(0))
    ranks.active, ranks.world_size, ranks.device = True, 2, torch.device("cuda", 1)
    assert ranks.gather("x") == ["x", "x"]
    ranks.barrier()
    assert seen == [("gather", "cuda:1"), ("barrier", "cuda:1")]
    assert current[0] == "cuda:0"


def test_a_single_process_checkpoint_resumed_on_several_ranks_warns(monkeypatch):
    def trainer():
        model = mlp(0)
        return HybridTrainer(model, torch.optim.AdamW(model.parameters()), _ddp.clean_loss,
                             config=HybridConfig(**_ddp.FAST))

    state = trainer().state_dict()
    resumed = trainer()
    monkeypatch.setattr(resumed.ranks, "active", True)  # what a DDP model's trainer on 2 ranks sees
    monkeypatch.setattr(resumed.ranks, "world_size", 2)
    with pytest.warns(UserWarning, match="written by one process, resumed on 2 ranks"):
        resumed.load_state_dict(state)

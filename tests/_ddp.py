"""Worker processes for the DDP tests: each rank trains the digits MLP wrapped in
DistributedDataParallel (gloo, CPU) on its own shard of the batch stream and saves what it saw."""
from __future__ import annotations

import datetime
import gc
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import _configs
from _digits import batches, digits_tensors, mlp

FAST = {**_configs.FAST, "verify_every": 2}
# Predicted steps whatever they are worth, and verifications strict enough to reject some.
ALWAYS = {**_configs.ALWAYS, "loss_tolerance": 0.0, "noise_z": 0.25}
BATCH = 32


def global_batches(world: int, steps: int, accumulation: int = 1) -> list:
    """``[step][micro-batch][rank]`` batches dealt from one stream as a DistributedSampler would:
    rank r takes every ``world``-th batch. A single process that concatenates the ranks' batches
    trains on the same data."""
    x, y = digits_tensors()
    stream = batches(x, y, BATCH, world * accumulation * steps)
    return [[[stream[(step * accumulation + micro) * world + rank] for rank in range(world)]
             for micro in range(accumulation)] for step in range(steps)]


def rank_batch(step_batches: list, rank: int):
    """What ``trainer.step`` takes on ``rank``: its batch, or its list of micro-batches."""
    micro = [per_rank[rank] for per_rank in step_batches]
    return micro[0] if len(micro) == 1 else micro


def concatenated_batch(step_batches: list):
    """The single-process equivalent of one step of every rank."""
    micro = [(torch.cat([x for x, _ in per_rank]), torch.cat([y for _, y in per_rank])) for per_rank in step_batches]
    return micro[0] if len(micro) == 1 else micro


def noisy_loss(model, batch):
    """Cross-entropy through dropout on the logits: each step draws from the global torch RNG,
    which differs between ranks, so a resume must give every rank its own streams back."""
    x, y = batch
    return torch.nn.functional.cross_entropy(torch.nn.functional.dropout(model(x), 0.05, training=True), y)


def clean_loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def run(world: int, out_dir: str, jobs: dict[str, tuple[str, dict]]) -> dict[str, list[dict]]:
    """Run each job ``name: (scenario, kwargs)`` in turn on the same ``world`` gloo ranks (one
    process start for all); returns ``name: [rank 0's result, rank 1's, ...]``."""
    init_file = os.path.join(out_dir, "init")
    mp.start_processes(_rank_main, args=(world, init_file, out_dir, jobs), nprocs=world, join=True,
                       start_method="spawn")
    return {name: [torch.load(os.path.join(out_dir, f"{name}_rank{r}.pt"), weights_only=False) for r in range(world)]
            for name in jobs}


def _rank_main(rank: int, world: int, init_file: str, out_dir: str, jobs: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for name, (scenario, kwargs) in jobs.items():
            result = SCENARIOS[scenario](rank, world, out_dir, **kwargs)
            torch.save(result, os.path.join(out_dir, f"{name}_rank{rank}.pt"))
    finally:
        # Trainers in reference cycles (a bound method held by their own memory guard) keep their
        # DDP models alive until the cyclic collector runs; one freed after the group is
        # destroyed can abort the process, so they go first.
        gc.collect()
        dist.destroy_process_group()


def _trainer(rank: int, config_overrides: dict, loss_fn=clean_loss, accumulation: int = 1):
    from hybrid_trainer import HybridConfig, HybridTrainer

    model = DistributedDataParallel(mlp(0))
    torch.manual_seed(1000 + rank)  # mlp() seeded the global stream alike on every rank
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    config = HybridConfig(**{**FAST, **config_overrides, "grad_accumulation": accumulation})
    return HybridTrainer(model, optimizer, loss_fn, config=config)


def record(result) -> tuple:
    return (result.phase, result.loss, result.verified, result.accepted, result.rolled_back, result.skipped)


def _outcome(trainer, records: list) -> dict:
    return {"records": records, "weights": [p.detach().clone() for p in trainer.params],
            "stats": trainer.statistics(), "cost": None if trainer.cost is None else dict(trainer.cost.seconds),
            "dynamics_perturbed": getattr(trainer, "dynamics_perturbed", None)}


def _perturb_dynamics_when_built(trainer) -> None:
    """Move the dynamics model's networks off their seeded weights the moment they are built (the
    forecaster builds the model when the worth gate first passes, the model its networks at its
    first training step), and count it in ``trainer.dynamics_perturbed``."""
    forecaster = trainer.forecaster
    trainer.dynamics_perturbed = 0
    make = forecaster.new_dynamics

    def new_dynamics():
        dynamics = make()
        build = dynamics._build

        def perturbed_build():
            fresh = not dynamics.built
            build()
            if fresh:
                with torch.no_grad():
                    for p in dynamics.parameters():
                        p.add_(torch.randn_like(p), alpha=0.05)
                trainer.dynamics_perturbed += 1

        dynamics._build = perturbed_build
        return dynamics

    forecaster.new_dynamics = new_dynamics


def train(rank: int, world: int, out_dir: str, steps: int, config: dict, nan_step: int | None = None,
          perturb_dynamics: bool = False, accumulation: int = 1) -> dict:
    """``steps`` trainer steps on this rank's shard. ``nan_step``: rank 1's input at that step is
    NaN (the others' finite). ``perturb_dynamics``: rank 1's dynamics model starts from other
    weights, standing in for nondeterministic GPU kernels that let the ranks' models drift."""
    trainer = _trainer(rank, config, accumulation=accumulation)
    if perturb_dynamics and rank == 1:
        _perturb_dynamics_when_built(trainer)
    no_sync_entries = [0]
    original_no_sync = trainer.model.no_sync

    def counting_no_sync():
        no_sync_entries[0] += 1
        return original_no_sync()

    trainer.model.no_sync = counting_no_sync
    collectives = count_collectives()
    records, poisoned_step, per_step = [], None, []
    for step, step_batches in enumerate(global_batches(world, steps, accumulation)):
        batch = rank_batch(step_batches, rank)
        if poisoned(trainer, step, nan_step) and poisoned_step is None:
            poisoned_step = step
            if rank == 1:
                x, y = batch
                batch = (torch.full_like(x, float("nan")), y)
        before = collectives[0]
        records.append(record(trainer.step(batch)))
        per_step.append(collectives[0] - before)
    collectives.restore()
    outcome = _outcome(trainer, records)
    outcome["no_sync_entries"] = no_sync_entries[0]
    outcome["poisoned_step"] = poisoned_step
    outcome["collectives"] = per_step  # the trainer's own (DDP's gradient all-reduce is C++)
    return outcome


class count_collectives(list):
    """Counts the ``torch.distributed`` collectives the trainer calls (``self[0]``) until
    :meth:`restore`."""

    NAMES = ("all_reduce", "broadcast", "all_gather_object", "barrier")

    def __init__(self):
        super().__init__([0])
        self.originals = {name: getattr(dist, name) for name in self.NAMES}
        for name, original in self.originals.items():
            setattr(dist, name, self._counting(original))

    def _counting(self, original):
        def call(*args, **kwargs):
            self[0] += 1
            return original(*args, **kwargs)
        return call

    def restore(self):
        for name, original in self.originals.items():
            setattr(dist, name, original)


def poisoned(trainer, step: int, nan_step: int | None) -> bool:
    """Whether ``step`` may carry the NaN input: a real step at or after ``nan_step`` (a
    predicted step would not train on it)."""
    from hybrid_trainer import Phase

    return nan_step is not None and step >= nan_step and trainer.controller.phase is not Phase.PREDICT


def unwrapped(rank: int, world: int, out_dir: str) -> dict:
    """A model not wrapped in DDP on an initialised process group trains as an independent run:
    only rank 0 trains, so a collective would wait for a rank that never joins (a timeout)."""
    from hybrid_trainer import HybridConfig, HybridTrainer

    if rank != 0:
        return {"steps": 0}
    model = mlp(0)
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=0.05), clean_loss,
                            config=HybridConfig(**{**FAST, **ALWAYS}))
    for step_batches in global_batches(world, 30):
        trainer.step(rank_batch(step_batches, rank))
    return {"steps": trainer.step_count, "predicted": trainer.stats.predicted_steps}


def mismatched(rank: int, world: int, out_dir: str) -> dict:
    """Rank 1 is configured with another ``verify_every``: construction must refuse, naming it."""
    try:
        _trainer(rank, {"verify_every": 2 + rank})
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


def outside_model(rank: int, world: int, out_dir: str) -> dict:
    """The optimizer also trains a loss temperature outside the DDP model: construction must
    refuse, since DDP would not average its gradient."""
    from hybrid_trainer import HybridConfig, HybridTrainer

    model = DistributedDataParallel(mlp(0))
    temperature = torch.nn.Parameter(torch.ones(()))
    optimizer = torch.optim.AdamW([*model.parameters(), temperature], lr=0.05)
    try:
        HybridTrainer(model, optimizer, clean_loss, config=HybridConfig(**FAST))
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


def unfreeze(rank: int, world: int, out_dir: str) -> dict:
    """A layer unfrozen after DDP was built: DDP would not average its gradient, so the next
    step must refuse on every rank."""
    from hybrid_trainer import HybridConfig, HybridTrainer

    net = mlp(0)
    net[0].requires_grad_(False)
    model = DistributedDataParallel(net)
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=0.05), clean_loss,
                            config=HybridConfig(**FAST))
    data = global_batches(world, 3)
    trainer.step(rank_batch(data[0], rank))
    net[0].requires_grad_(True)
    try:
        trainer.step(rank_batch(data[1], rank))
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


def resume(rank: int, world: int, out_dir: str, steps: int, save_at: int, config: dict,
           load: bool) -> dict:
    """Uninterrupted (``load=False``: save at ``save_at`` and go on) or resumed (``load=True``:
    a fresh trainer loads that checkpoint and runs the remaining steps) with a noisy loss."""
    trainer = _trainer(rank, config, loss_fn=noisy_loss)
    path = os.path.join(out_dir, "resume.pt")
    data = global_batches(world, steps)
    records = []
    start = 0
    if load:
        trainer.load(path)
        start = save_at
    for step in range(start, steps):
        if not load and step == save_at:
            trainer.save(path)
        records.append(record(trainer.step(rank_batch(data[step], rank))))
    outcome = _outcome(trainer, records)
    outcome["draw"] = torch.rand(4)  # where each rank's own stream ended
    return outcome


SCENARIOS = {"train": train, "unwrapped": unwrapped, "mismatched": mismatched, "outside_model": outside_model,
             "unfreeze": unfreeze, "resume_full": lambda *a, **k: resume(*a, load=False, **k),
             "resume_loaded": lambda *a, **k: resume(*a, load=True, **k)}

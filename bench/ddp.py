"""HybridTrainer under DistributedDataParallel: what keeping the ranks in step costs, measured.

    python -m bench.ddp [--task fashion] [--world 2] [--steps 400] [--seeds 2] [--lr 0.001] [--out docs/results]

Starts ``world`` gloo ranks on this machine (CPU, one thread each). Every rank trains the task's
model wrapped in ``DistributedDataParallel`` on its own shard of the seed's batch stream (rank r
takes every ``world``-th batch, as ``DistributedSampler`` deals them). The arms start from the
same initialisation, see the same batches and run in turn in the same processes, their order
rotated from seed to seed so machine noise hits them alike:

* ``plain DDP``: the AdamW loop (``zero_grad``, ``backward``, ``step``);
* ``HybridTrainer (no-predict)``: the trainer's safety layer, plus the all-reduce of one number
  per step (the loss) that keeps every rank's decisions identical;
* ``HybridTrainer (default)``: predicted steps skip the backward and with it the gradients'
  all-reduce; verifications all-reduce one number;
* ``HybridTrainer (forced)``: predicting at every phase decision whatever it is worth (the
  ``forced`` preset of ``bench.e2e``), so what a predicted step costs under DDP is measured even
  where the worth gate would not predict.

Per arm and seed: the step time of the slowest rank (each step waits for it), median over steps;
the same per kind of step (real; predicted; predicted and verified); training seconds (barrier
to barrier, no evaluation inside); validation loss at the end; phase counts, backward passes and predicted steps (rank 0's: the ranks agree); whether every rank's
weights are bit-identical at the end (SHA-256 of the weights, gathered); and whether the
no-predict arm ends at exactly the plain loop's weights. Writes ``<out>/ddp_<task>.json``,
``<out>/ddp.md`` and ``<out>/ddp_<task>.png``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import hashlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel


KINDS = ("real", "predicted", "predicted, verified")  # steps by what they ran
ARMS = ("plain DDP", "HybridTrainer (no-predict)", "HybridTrainer (default)", "HybridTrainer (forced)")


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in order: equal digests are bit-identical weights."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def rank_batches(task, seed: int, world: int, rank: int, steps: int) -> list:
    """This rank's ``steps`` batches: every ``world``-th of the seed's stream."""
    stream = task.batches(seed)
    batches = [next(stream) for _ in range(world * steps)]
    return batches[rank::world]


def train_arm(arm: str, task, seed: int, lr: float, batches: list) -> dict:
    """One arm on this rank; returns its per-step seconds and what it ends with."""
    from hybrid_trainer import HybridTrainer

    from .protocol import preset_config, training_step

    model = DistributedDataParallel(task.make_model(seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    trainer = None
    if arm != "plain DDP":
        preset = arm.removeprefix("HybridTrainer (").removesuffix(")")
        trainer = HybridTrainer(model, optimizer, task.loss_fn, config=preset_config(preset))
    step = training_step(task, model, optimizer, trainer)
    step_s, kinds = [], []
    dist.barrier()
    started = time.perf_counter()
    for batch in batches:
        mark = time.perf_counter()
        result = step(batch)  # None from the plain loop
        kind = ("real" if result is None or result.backward_done
                else "predicted, verified" if result.verified else "predicted")
        step_s.append(time.perf_counter() - mark)
        kinds.append(kind)
    dist.barrier()
    train_s = time.perf_counter() - started
    out = dict(step_s=step_s, kinds=kinds, train_s=train_s, digest=weights_digest(model),
               val_loss=task.val_loss(model.module))
    if trainer is not None:
        stats = trainer.statistics()
        out.update(steps_by_phase=stats["steps_by_phase"], backward_passes=stats["backward_passes"],
                   predicted_steps=stats["predicted_steps"], acceptance_rate=stats["acceptance_rate"],
                   prediction_disabled_reason=stats["prediction_disabled_reason"])
    else:
        out.update(backward_passes=len(batches), predicted_steps=0)
    return out


def _rank_main(rank: int, world: int, init_file: str, result_file: str, args: dict) -> None:
    from .tasks import get_task

    torch.set_num_threads(1)
    os.environ.setdefault("HYBRID_KERNELS_BACKEND", "eager")  # the CPU product's path
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=dt.timedelta(minutes=10))
    try:
        task = get_task(args["task"])
        runs = []
        progress = None
        if rank == 0:
            from tqdm import tqdm
            progress = tqdm(total=args["seeds"] * len(ARMS), desc=f"ddp {args['task']} x{world}", unit="arm")
        for seed in range(args["seeds"]):
            batches = rank_batches(task, seed, world, rank, args["steps"])
            order = ARMS[seed % len(ARMS):] + ARMS[:seed % len(ARMS)]
            for arm in order:
                local = train_arm(arm, task, seed, args["lr"], batches)
                every = [None] * world
                dist.all_gather_object(every, dict(step_s=local["step_s"], train_s=local["train_s"],
                                                   digest=local["digest"]))
                if rank == 0:
                    slowest = [max(steps) for steps in zip(*(r["step_s"] for r in every))]
                    by_kind: dict[str, list[float]] = {}
                    for kind, seconds in zip(local.pop("kinds"), slowest):  # the ranks' kinds agree
                        by_kind.setdefault(kind, []).append(seconds)
                    local.update(seed=seed, arm=arm, ms_per_step=1e3 * statistics.median(slowest),
                                 ms_by_kind={k: 1e3 * statistics.median(v) for k, v in by_kind.items()},
                                 steps_by_kind={k: len(v) for k, v in by_kind.items()},
                                 train_s=max(r["train_s"] for r in every),
                                 ranks_agree=len({r["digest"] for r in every}) == 1)
                    del local["step_s"]
                    runs.append(local)
                    progress.update(1)
        if rank == 0:
            progress.close()
            Path(result_file).write_text(json.dumps(runs))
    finally:
        # Trainers in reference cycles (a bound method held by their own memory guard) keep their
        # DDP models alive until the cyclic collector runs; one freed after the group is
        # destroyed can abort the process, so they go first.
        gc.collect()
        dist.destroy_process_group()


def summarise(runs: list[dict]) -> dict:
    """Per arm: means over seeds, and the checks across arms."""
    arms = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        arms[arm] = dict(
            ms_per_step=statistics.mean(r["ms_per_step"] for r in mine),
            train_s=statistics.mean(r["train_s"] for r in mine),
            val_loss=statistics.mean(r["val_loss"] for r in mine),
            backward_passes=statistics.mean(r["backward_passes"] for r in mine),
            predicted_steps=statistics.mean(r["predicted_steps"] for r in mine),
            ranks_agree=all(r["ranks_agree"] for r in mine),
            ms_by_kind={kind: statistics.mean(r["ms_by_kind"][kind] for r in mine if kind in r["ms_by_kind"])
                        for kind in KINDS if any(kind in r["ms_by_kind"] for r in mine)},
            seeds=mine,
        )
    plain = arms["plain DDP"]
    plain_s = {r["seed"]: r["train_s"] for r in plain["seeds"]}
    for arm in arms.values():
        arm["time_vs_plain"] = arm["train_s"] / plain["train_s"]
        per_seed = [r["train_s"] / plain_s[r["seed"]] for r in arm["seeds"]]  # same batches, same processes
        arm["time_vs_plain_range"] = [min(per_seed), max(per_seed)]
    no_predict_is_plain = all(
        a["digest"] == b["digest"] for a, b in zip(arms["HybridTrainer (no-predict)"]["seeds"], plain["seeds"]))
    return dict(arms=arms, no_predict_is_plain_bit_for_bit=no_predict_is_plain)


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [f"### DDP, {result['task']}: {result['world']} gloo ranks on CPU, {result['steps']} steps, "
             f"{result['seeds']} seeds, lr {result['lr']}",
             "",
             f"`{meta['command']}` ({meta['device']}, torch {meta['torch']}, 1 thread per rank, {meta['date']})",
             "",
             "| arm | ms / step (slowest rank, median) | by kind: real / predicted / predicted+verified "
             "| training s | vs plain (seeds' range) | validation loss | backward passes | predicted steps | ranks bit-identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, arm in result["arms"].items():
        kinds = " / ".join(f"{arm['ms_by_kind'][k]:.2f}" if k in arm["ms_by_kind"] else "–" for k in KINDS)
        lines.append(f"| {name} | {arm['ms_per_step']:.2f} | {kinds} | {arm['train_s']:.2f} | {arm['time_vs_plain']:.3f}× "
                     f"({arm['time_vs_plain_range'][0]:.2f}–{arm['time_vs_plain_range'][1]:.2f}) "
                     f"| {arm['val_loss']:.4f} | {arm['backward_passes']:.0f} | {arm['predicted_steps']:.0f} "
                     f"| {'yes' if arm['ranks_agree'] else 'NO'} |")
    lines += ["", "no-predict ends at the plain loop's weights bit for bit: "
              + ("yes" if result["no_predict_is_plain_bit_for_bit"] else "NO")]
    default = result["arms"]["HybridTrainer (default)"]["seeds"]
    off = [r for r in default if r.get("prediction_disabled_reason")]
    lines.append(f"default arm: prediction switched itself off in {len(off)} of {len(default)} seeds"
                 + (f" (seed {off[0]['seed']}: {off[0]['prediction_disabled_reason']})" if off else ""))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["arms"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((left, "ms_per_step", "ms per step (slowest rank, median)"),
                           (right, "val_loss", "validation loss at the end")):
        for i, name in enumerate(names):
            seeds = result["arms"][name]["seeds"]
            ax.bar(i, result["arms"][name][key], color=f"C{i}", alpha=0.6)
            ax.plot([i] * len(seeds), [s[key] for s in seeds], "k.", ms=6)
        ax.set_xticks(range(len(names)), [n.replace("HybridTrainer ", "HybridTrainer\n") for n in names], fontsize=8)
        ax.set_ylabel(label)
    fig.suptitle(f"DDP on {result['task']}: {result['world']} gloo ranks, {result['steps']} steps "
                 f"(bars: mean, dots: seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(task: str, world: int, steps: int, seeds: int, lr: float) -> list[dict]:
    """Every arm and seed on ``world`` spawned ranks; rank 0's gathered records."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file, result_file = os.path.join(tmp, "init"), os.path.join(tmp, "result.json")
        mp.start_processes(_rank_main, args=(world, init_file, result_file,
                                             dict(task=task, steps=steps, seeds=seeds, lr=lr)),
                           nprocs=world, join=True, start_method="spawn")
        return json.loads(Path(result_file).read_text())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="fashion", choices=["fashion", "digits", "charlm"])
    parser.add_argument("--world", type=int, default=2, help="gloo ranks (processes), one thread each")
    parser.add_argument("--steps", type=int, default=400, help="steps per arm (each rank)")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate of every arm")
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    args = parser.parse_args(argv)
    if args.world < 2:
        parser.error(f"argument --world: needs at least 2 ranks, got {args.world}")
    if args.steps < 1 or args.seeds < 1:
        parser.error(f"arguments --steps and --seeds must be >= 1, got {args.steps} and {args.seeds}")
    command = (f"python -m bench.ddp --task {args.task} --world {args.world} --steps {args.steps} "
               f"--seeds {args.seeds} --lr {args.lr}")
    runs = run(args.task, args.world, args.steps, args.seeds, args.lr)
    result = dict(task=args.task, world=args.world, steps=args.steps, seeds=args.seeds, lr=args.lr,
                  **summarise(runs))
    from .protocol import cpu_description, run_metadata  # as the workers do: the trainer is imported late

    result["meta"] = run_metadata(command, device=cpu_description())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"ddp_{args.task}.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / f"ddp_{args.task}.png")
    text = markdown(result)
    (args.out / "ddp.md").write_text(text + "\n")
    print("\n" + text)
    print(f"wrote {args.out}/ddp_{args.task}.json, ddp_{args.task}.png and ddp.md")
    return result


if __name__ == "__main__":
    main()

"""Classes added to a run: the divergence guard against the plain loop on Fashion-MNIST.

    python -m experiments.new_classes [--seeds 3] [--before 600] [--after 600]

The Fashion-MNIST task's MLP (784-512-256-10, AdamW at 1e-3, batches of 128, ``bench.tasks``)
steps ``--before`` times over the training images of classes 0-7 only, then ``--after`` times over
all ten classes (shuffled batches, each a fifth new classes on average): what a run meets when data
is added to it (a class-incremental stream, a source joining late). Nothing is wrong; every batch of
the second stage loses far more than the window of the first, whose loss fell to a few thousandths.

Arms, each from the same initial weights over the same batches:

* ``plain``: the plain loop;
* ``trainer, each alarm refused``: ``HybridTrainer(predict=False)`` with
  ``divergence={"blame_lone_alarms_on_the_batch": False}`` (every critical step refused, every
  finite one rolled back);
* ``trainer, runs taken for the weights'``: ``divergence={"blame_runs_at_the_good_state": False}``
  (a lone alarm is the batch's; the second critical step in a row goes back, whatever the weights
  it then meets);
* ``trainer``: as it is (a run of critical steps that meets a good state's weights seen healthy
  is the batches', within bounds; ``DivergenceMonitor``, "Runs of hard batches");
* ``trainer, read every 16 steps, as on a GPU``: as it is, with ``read_every=16``, fused AdamW and
  the guard built as on a GPU (:func:`bench.protocol.guard_as_on_a_gpu`).

Per arm and seed: the second stage's steps refused, rollbacks and alarms taken for the batch's,
whether the guard stopped the run (``TrainingStalledError``), and at the end the validation loss and
accuracy (the first 2,000 test images) on the new classes and on the old ones.
→ ``experiments/results/new_classes.{json,md}``.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import shlex
import sys
from pathlib import Path
from typing import Any, Iterator

import torch

RESULTS = Path(__file__).resolve().parent / "results"
ARMS = ("plain", "trainer, each alarm refused", "trainer, runs taken for the weights'", "trainer",
        "trainer, read every 16 steps, as on a GPU")
OLD_CLASSES = 8  # classes 0-7 in the first stage
BATCH = 128
LR = 1e-3
VALIDATION = 2000


def load() -> dict[str, torch.Tensor]:
    """Fashion-MNIST's training images and the first :data:`VALIDATION` test images, as float32 in
    [0, 1] with their labels (``bench.tasks.load_fashion``)."""
    from bench.tasks import load_fashion

    x_tr, y_tr, x_te, y_te, _ = load_fashion()
    return dict(x=torch.tensor(x_tr, dtype=torch.float32) / 255, y=torch.tensor(y_tr, dtype=torch.long),
                x_val=torch.tensor(x_te[:VALIDATION], dtype=torch.float32) / 255,
                y_val=torch.tensor(y_te[:VALIDATION], dtype=torch.long))


def batches(data: dict[str, torch.Tensor], classes: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Shuffled batches of :data:`BATCH` images of the classes below ``classes``, epoch after epoch."""
    indices = (data["y"] < classes).nonzero().squeeze(1)
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = indices[torch.randperm(len(indices), generator=generator)]
        for start in range(0, len(order) - BATCH + 1, BATCH):
            chosen = order[start:start + BATCH]
            yield data["x"][chosen], data["y"][chosen]


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def run_arm(arm: str, data: dict[str, torch.Tensor], seed: int, before: int, after: int) -> dict[str, Any]:
    """One arm on one seed (the GPU arm inside :func:`bench.protocol.guard_as_on_a_gpu`)."""
    from bench.protocol import guard_as_on_a_gpu
    from hybrid_trainer import HybridConfig, HybridTrainer
    from hybrid_trainer.errors import TrainingStalledError

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    on_gpu = "GPU" in arm
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=on_gpu)
    divergence = ({"blame_lone_alarms_on_the_batch": False} if arm.endswith("each alarm refused")
                  else {"blame_runs_at_the_good_state": False} if arm.endswith("for the weights'") else {})
    first, second = batches(data, OLD_CLASSES, 1000 + seed), batches(data, 10, 2000 + seed)
    trainer, stalled_at, at_start = None, None, {}
    with guard_as_on_a_gpu() if on_gpu else contextlib.nullcontext():
        if arm == "plain":
            def step(batch) -> None:
                optimizer.zero_grad(set_to_none=True)
                _loss(model, batch).backward()
                optimizer.step()
        else:
            trainer = HybridTrainer(model, optimizer, _loss,
                                    HybridConfig(seed=seed, predict=False, read_every=16 if on_gpu else 1,
                                                 divergence=divergence))
            step = trainer.step
        for _ in range(before):
            step(next(first))
        if trainer is not None:
            trainer.statistics()  # settles a block still waiting
            at_start = dict(refused=trainer.stats.skipped_steps, rollbacks=trainer.stats.divergence_rollbacks,
                            tolerated=trainer.monitor.tolerated)
        try:
            for i in range(after):
                step(next(second))
            if trainer is not None:
                trainer.statistics()
        except TrainingStalledError:
            stalled_at = before + i
    out: dict[str, Any] = dict(stalled_at=stalled_at)
    with torch.no_grad():
        new = data["y_val"] >= OLD_CLASSES
        for name, mask in (("new", new), ("old", ~new)):
            x, y = data["x_val"][mask], data["y_val"][mask]
            logits = model(x)
            out[f"{name}_loss"] = float(torch.nn.functional.cross_entropy(logits, y))
            out[f"{name}_accuracy"] = float((logits.argmax(1) == y).float().mean())
    if trainer is not None:
        out.update(refused=trainer.stats.skipped_steps - at_start["refused"],
                   rollbacks=trainer.stats.divergence_rollbacks - at_start["rollbacks"],
                   tolerated=trainer.monitor.tolerated - at_start["tolerated"])
        trainer.close()
    return out


def report(result: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [f"Classes added to a run (CPU, Fashion-MNIST's MLP: {result['before']} steps over classes 0-7, then "
             f"{result['after']} over all ten), `{meta['command']}` ({meta['date']}, commit "
             f"{str(meta['git_commit'])[:10]}{' (dirty tree)' if meta['git_dirty'] else ''}). Per arm, the median over "
             f"{len(result['seeds'])} seeds (each seed's value in brackets): the second stage's steps refused, "
             "rollbacks and alarms taken for the batch's, and at its end the validation loss and accuracy on the "
             "new classes (8, 9) and on the old ones.", "",
             "| arm | steps refused | rollbacks | alarms taken for the batch's | stopped by the guard | "
             "new classes: loss | accuracy | old classes: loss | accuracy |",
             "|---|---|---|---|---|---|---|---|---|"]
    from experiments.spike_cost import median_cell

    for arm, runs in result["arms"].items():
        cell = functools.partial(median_cell, runs)
        said = ", ".join("no" if r["stalled_at"] is None else f"at step {r['stalled_at']}" for r in runs)
        lines.append(f"| {arm} | {cell('refused')} | {cell('rollbacks')} | {cell('tolerated')} | {said} | "
                     f"{cell('new_loss', '{:.3f}')} | {cell('new_accuracy', '{:.3f}')} | {cell('old_loss', '{:.3f}')} | "
                     f"{cell('old_accuracy', '{:.3f}')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds per arm (0, 1, ...)")
    parser.add_argument("--before", type=int, default=600, help="steps over classes 0-7")
    parser.add_argument("--after", type=int, default=600, help="steps over all ten classes")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for new_classes.{json,md}")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.before < 1 or args.after < 1:
        parser.error(f"--seeds, --before and --after must be >= 1, got {args.seeds}, {args.before}, {args.after}")
    from bench.protocol import run_metadata, write_results

    meta = run_metadata("python -m experiments.new_classes " + shlex.join(sys.argv[1:] if argv is None else argv))
    torch.set_num_threads(1)
    logging.getLogger("hybrid_trainer").setLevel(logging.ERROR)  # a warning per refused step
    data = load()
    seeds = list(range(args.seeds))
    arms = {arm: [run_arm(arm, data, seed, args.before, args.after) for seed in seeds] for arm in ARMS}
    result = dict(before=args.before, after=args.after, seeds=seeds, arms=arms)
    write_results(args.out, "new_classes", dict(meta=meta, result=result), report(result, meta))


if __name__ == "__main__":
    main()

"""What keeping the module buffers before each real step's forward costs (StepGuard.before_forward).

A refused step puts batch-norm statistics back as they were before its forward, so every real step
copies them first. This times that copy alone (``BufferGuard.before_forward``, median of many calls) and
whole ``trainer.step`` calls with it and without it (the guard swapped for an empty one; interleaved
blocks, median per step), on a model with batch norm and on one without buffers::

    python -m bench.buffer_guard

Wall-clock timings on a shared machine are noisy; the per-call figure is the stable one.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch

from hybrid_trainer import HybridConfig, HybridTrainer
from hybrid_trainer.anchor import buffer_slots
from hybrid_trainer.buffer_guard import BufferGuard


def models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {
        "Linear-BatchNorm1d-Linear (16-32-1)": torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 1)),
        "MLP with 4 BatchNorm1d (16-256x4-1)": torch.nn.Sequential(
            torch.nn.Linear(16, 256), *[m for _ in range(3) for m in (torch.nn.BatchNorm1d(256), torch.nn.ReLU(),
                                                                       torch.nn.Linear(256, 256))],
            torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 1)),
        "MLP without buffers (16-32-1)": torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)),
    }


def per_call_us(model: torch.nn.Module, calls: int) -> float:
    guard = BufferGuard(buffer_slots(model))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        guard.before_forward()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def step_us(model: torch.nn.Module, blocks: int, steps: int) -> tuple[float, float]:
    """Median µs per trainer.step with the buffer copy and with it swapped out, interleaved."""
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), mse,
                            config=HybridConfig(predict=False))
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randn(64, 16, generator=gen), torch.randn(64, 1, generator=gen))
    guard, kept = trainer.guard, trainer.guard.buffers_before
    empty = BufferGuard([])
    with_copy, without = [], []
    for _ in range(20):
        trainer.step(batch)
    for block in range(blocks):
        for arm, out in ((kept, with_copy), (empty, without)) if block % 2 == 0 else ((empty, without), (kept, with_copy)):
            guard.buffers_before = arm
            for _ in range(steps):
                start = time.perf_counter()
                trainer.step(batch)
                out.append(time.perf_counter() - start)
    guard.buffers_before = kept
    return 1e6 * statistics.median(with_copy), 1e6 * statistics.median(without)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"commit {commit}; torch {torch.__version__}; {torch.get_num_threads()} thread(s)")
    print("| model | buffers | before_forward (µs/call) | step with copy (µs) | step without (µs) |")
    print("|---|---:|---:|---:|---:|")
    for name, model in models().items():
        n = len(buffer_slots(model))
        call = per_call_us(model, args.calls)
        with_copy, without = step_us(model, args.blocks, args.steps)
        print(f"| {name} | {n} | {call:.2f} | {with_copy:.0f} | {without:.0f} |")


if __name__ == "__main__":
    main()

"""Where does a HybridTrainer run spend its time, step by step? (A diagnosis tool.)

    python -m bench.step_times [--task fashion] [--device cpu|cuda] [--seeds 2] [--preset default] [--top 8]

Runs the trainer on a benchmark task for each seed in one process, times every step (on a GPU
after a ``torch.cuda.synchronize()``, so a step's own device work is inside its time) and
reports per seed the median step time per phase and the slowest steps with their phase. On a
GPU it also counts the Triton kernels compiled during each step: the Triton cache is pointed at
a fresh folder (``TRITON_CACHE_DIR``, unless already set), as on a fresh machine, and a step
whose count grows compiled a kernel. Written for the 2.6 s stall seen once per run on the H100
(docs/gpu.md); writes ``<out>/step_times_<task>_<device>.json`` with every step's time.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from hybrid_trainer import HybridTrainer

from .protocol import preset_config, run_metadata, train_clock
from .tasks import get_task


def compiled_kernels(cache_dir: Path | None) -> int:
    """Entries in the Triton cache: one folder per compiled kernel (plus a few for its launcher)."""
    if cache_dir is None or not cache_dir.is_dir():
        return 0
    return sum(1 for _ in cache_dir.iterdir())


def time_steps(task, seed: int, preset: str, steps: int, lr: float, cache_dir: Path | None) -> list[dict]:
    """One run: ``[{step, phase, ms, kernels_compiled}]`` for each of ``steps`` steps."""
    model = task.make_model(seed)
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=lr), task.loss_fn,
                            preset_config(preset))
    stream = task.batches(seed)
    records = []
    kernels = compiled_kernels(cache_dir)
    for step in range(steps):
        batch = next(stream)
        phase = trainer.controller.phase.value
        started = train_clock(task.device)
        trainer.step(batch)
        elapsed = train_clock(task.device) - started
        now = compiled_kernels(cache_dir)
        records.append(dict(step=step, phase=phase, ms=1e3 * elapsed, kernels_compiled=now - kernels))
        kernels = now
    return records


def summarise(records: list[dict], top: int) -> dict:
    by_phase: dict[str, list[float]] = {}
    for r in records:
        by_phase.setdefault(r["phase"], []).append(r["ms"])
    return dict(median_ms_by_phase={p: statistics.median(v) for p, v in by_phase.items()},
                steps_by_phase={p: len(v) for p, v in by_phase.items()},
                total_ms=sum(r["ms"] for r in records),
                slowest=sorted(records, key=lambda r: r["ms"], reverse=True)[:top],
                kernels_compiled=sum(r["kernels_compiled"] for r in records))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="fashion", choices=["fashion", "charlm", "digits"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="default: the task's step budget")
    parser.add_argument("--preset", default="default", help="as bench.e2e --presets (default, no-predict, ...)")
    parser.add_argument("--lr", type=float, default=None, help="default: the middle of the task's sweep grid")
    parser.add_argument("--top", type=int, default=8, help="slowest steps listed per seed")
    parser.add_argument("--quick", action="store_true", help="the task's quick size (tests)")
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    cache_dir = None
    if args.device == "cuda":
        # Read when a kernel is compiled, so setting it now still takes effect.
        cache_dir = Path(os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton_cache_")))
    torch.set_num_threads(1)
    task = get_task(args.task, quick=args.quick, device=args.device)
    steps = args.steps or task.steps
    lr = args.lr or task.lr_grid[len(task.lr_grid) // 2]
    runs = {}
    for seed in range(args.seeds):
        records = time_steps(task, seed, args.preset, steps, lr, cache_dir)
        runs[seed] = dict(summary=summarise(records, args.top), steps=records)
        s = runs[seed]["summary"]
        medians = ", ".join(f"{p} {ms:.2f} ms ({s['steps_by_phase'][p]})" for p, ms in s["median_ms_by_phase"].items())
        print(f"seed {seed}: {s['total_ms'] / 1e3:.2f} s in all; median step by phase: {medians}; "
              f"kernels compiled: {s['kernels_compiled']}")
        for r in s["slowest"]:
            print(f"    step {r['step']:4d} {r['phase']:8s} {r['ms']:9.2f} ms  kernels compiled {r['kernels_compiled']}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"step_times_{args.task}_{args.device}.json"
    path.write_text(json.dumps(dict(run_metadata("python -m bench.step_times " + shlex.join(argv or sys.argv[1:])),
                                    device=args.device, task=args.task, preset=args.preset, lr=lr,
                                    triton_cache_dir=None if cache_dir is None else str(cache_dir), runs=runs),
                               indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

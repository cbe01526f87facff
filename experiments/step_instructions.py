"""Machine instructions per training step, arm by arm, counted by Valgrind (CPU): what the
trainer's steady step adds over the plain loop, free of the timing noise of this project's CI
host, where one process's step time moves by more than the 50 µs the overhead goal allows
(docs/trainer.md, "What a step's instructions show").

    python -m experiments.step_instructions [--model mlp-1ms] [--warmup 100] [--steps 200]

Arms, each built fresh on the ``bench.overhead`` model by ``bench.overhead._arm_step`` (the same
code the timing benchmark steps), plus the compact guard of :mod:`experiments.compact_guard`:

* ``plain``: ``zero_grad``, forward, backward, ``optimizer.step()``;
* ``plain, no profiler scopes``: gradients set to None, the update without torch's scope;
* ``plain + norm and read (guard floor)``: the plain loop plus the loss and gradient read;
* ``compact guard``: the guard's per-step work and nothing else;
* ``predict=False``: the trainer with prediction off (a good-state snapshot every 50 steps);
* ``predict=False, torch dots``: the same with :mod:`hybrid_trainer.blas_dots`'s routines taken
  away while it is built and stepped, so that its dots go through ``torch.dot`` (the trainer
  before that module).

``--as-on-gpu`` steps every arm as a GPU would, on the CPU: ``AdamW(fused=True)`` in every arm
(``bench.overhead --fused-adamw``) and the trainer's guard told that reads wait for the device
(``step_guard.reads_are_free`` false), so that ``predict=False`` takes the path it takes there:
its checks queued and read every 16 steps, the update skipped on the device when a value is
not finite (:mod:`hybrid_trainer.deferred_checks`), and the good state's finiteness check one
multi-tensor norm of every tensor (``resume_check._multi_tensor_norm_pays``): the switches of
``bench.protocol.guard_as_on_a_gpu``, set for the child's whole life. The tensor work is the CPU's; the Python
and the number of ops around it are the GPU step's host work, which a GPU's step pays in full
wherever its host, not the device, sets the pace (docs/gpu.md).

``--cache-sim`` also simulates the caches (Valgrind's ``--cache-sim=yes``: first-level
instruction and data caches and the last level) and adds their misses and Valgrind's own
cycle estimate, ``Ir + 10 (L1 misses) + 100 (last-level misses)`` (callgrind_annotate's
``CEst``): the Python around a step's tensor work runs after the tensors have pushed its code
and objects out of the first-level caches, which instruction counts alone do not show.

One process under ``valgrind --tool=callgrind`` steps every arm in turn: ``--warmup`` steps,
then ``--steps`` counted ones, between a call of ``os.getppid`` (on which Valgrind zeroes its
counts: ``--zero-before=getppid``) and one of ``os.getpgrp`` (on which it writes them out:
``--dump-before=getpgrp``). An arm's figure is its counted instructions over ``--steps``, every
good-state snapshot among them included, and the snapshot thread's instructions with the
step's. The counts do not depend on the machine's load (Valgrind runs the threads one at a time),
but they are not quite the same from run to run: the tiny MLP's plain loop counted 1,448k and
1,455k instructions a step in two runs of the same arms in the same order (0.5%), and an arm's
count moves with what ran before it in the process. Compare arms within one run, or runs of the
same arms in the same order, and read differences under ~1% of a step as noise.
Instructions are not time: a step's Python
runs at a few instructions per nanosecond, its reads of memory far slower, so the count measures
the trainer's bookkeeping, and the guard's pass over the gradients only in part.
→ ``experiments/results/step_instructions_<model>.{json,md}``.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ARMS = ("plain", "plain, no profiler scopes", "plain + norm and read (guard floor)", "compact guard",
        "predict=False", "predict=False, torch dots")
DEFAULT_ARMS = ARMS[:5]
_SUMMARY = re.compile(r"^summary:\s+(\d+)", re.MULTILINE)
_EVENTS = re.compile(r"^events:(.*)$", re.MULTILINE)
_TOTALS = re.compile(r"^summary:(.*)$", re.MULTILINE)


def counted_instructions(dump: str) -> int:
    """The instruction count of one callgrind dump (its ``summary:`` line)."""
    found = _SUMMARY.search(dump)
    if found is None:
        raise ValueError("no 'summary:' line in the callgrind dump")
    return int(found.group(1))


def counted_events(dump: str) -> dict[str, int]:
    """Every event total of one callgrind dump by name (``Ir``, and with the cache simulation
    ``I1mr``, ``D1mr``, ``D1mw``, ``ILmr``, ``DLmr``, ``DLmw``)."""
    names, totals = _EVENTS.search(dump), _TOTALS.search(dump)
    if names is None or totals is None:
        raise ValueError("no 'events:' and 'summary:' lines in the callgrind dump")
    return dict(zip(names.group(1).split(), map(int, totals.group(1).split())))


def cycle_estimate(events: dict[str, float]) -> float:
    """Valgrind's cycle estimate from simulated cache events: each first-level miss 10 cycles,
    each last-level miss 100, on top of one per instruction."""
    first = events["I1mr"] + events["D1mr"] + events["D1mw"]
    last = events["ILmr"] + events["DLmr"] + events["DLmw"]
    return events["Ir"] + 10 * first + 100 * last


def step_arms(model: str, arms: list[str], warmup: int, steps: int, as_on_gpu: bool = False) -> None:
    """The child under valgrind: each arm of ``arms`` on ``model``, ``warmup`` steps and then
    ``steps`` counted ones between ``os.getppid()`` (counts zeroed) and ``os.getpgrp()`` (counts
    written); with ``as_on_gpu``, the trainer's guard built as on a GPU (module docstring)."""
    import torch

    if as_on_gpu:
        from hybrid_trainer import resume_check, step_guard

        step_guard.reads_are_free = lambda device: False
        resume_check._multi_tensor_norm_pays = lambda device: True

    from bench.overhead import _arm_step, make_workload
    from experiments.compact_guard import compact_guard_step

    torch.set_num_threads(1)
    workload = make_workload(model, 64, torch.device("cpu"))
    batches = workload.batches
    from hybrid_trainer import blas_dots

    routines = dict(blas_dots._ROUTINES)
    for arm in arms:
        # This arm only: no routine past the dispatcher, so its reads call torch.dot.
        blas_dots._ROUTINES.clear()
        blas_dots._ROUTINES.update({} if arm == "predict=False, torch dots" else routines)
        step, trainer = ((compact_guard_step(workload)[0], None) if arm == "compact guard"
                         else _arm_step(arm.removesuffix(", torch dots"), workload, torch.device("cpu"))[:2])
        for i in range(warmup):
            step(batches[i % len(batches)])
        if as_on_gpu and trainer is not None and not trainer.guard.defers():
            raise RuntimeError(f"{arm}: the trainer does not defer its checks after {warmup} steps, as on a GPU")
        os.getppid()
        for i in range(warmup, warmup + steps):
            step(batches[i % len(batches)])
        os.getpgrp()


def count(model: str, arms: list[str], warmup: int, steps: int, valgrind: str, scratch: Path,
          cache_sim: bool = False, as_on_gpu: bool = False) -> dict[str, dict[str, float]]:
    """Events per counted step of every arm (instructions ``Ir``, and with ``cache_sim`` the
    simulated cache misses), from one valgrind process (``as_on_gpu``: module docstring)."""
    from bench.overhead import FUSED_ENV

    out = scratch / "callgrind.out"
    command = [valgrind, "--tool=callgrind", f"--cache-sim={'yes' if cache_sim else 'no'}",
               "--zero-before=getppid", "--dump-before=getpgrp",
               f"--callgrind-out-file={out}", sys.executable, "-m", "experiments.step_instructions",
               "--model", model, "--warmup", str(warmup), "--steps", str(steps), "--child", "--arms", *arms,
               *(["--as-on-gpu"] if as_on_gpu else [])]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")  # the same hashing on every run
    env.pop(FUSED_ENV, None)
    if as_on_gpu:
        env[FUSED_ENV] = "1"  # every arm's AdamW fused (bench.overhead.adamw_options)
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1])
    if done.returncode != 0:
        raise RuntimeError(f"valgrind's child failed ({done.returncode}): {done.stderr[-800:]}")
    dumps = sorted(scratch.glob("callgrind.out.*"), key=lambda p: int(p.suffix[1:]))
    if len(dumps) != len(arms):
        raise RuntimeError(f"expected one callgrind dump per arm ({len(arms)}), found {len(dumps)}: "
                           "something else called os.getpgrp")
    return {arm: {name: total / steps for name, total in counted_events(path.read_text()).items()}
            for arm, path in zip(arms, dumps)}


def report(result: dict[str, Any], meta: dict[str, Any]) -> str:
    arms = result["per_step"]
    events = result.get("events")
    plain, lean = arms.get("plain"), arms.get("plain, no profiler scopes")
    as_gpu = (" stepped as on a GPU (fused AdamW in every arm, the trainer's checks read every 16 steps)"
              if result.get("as_on_gpu") else "")
    lines = [f"Machine instructions per step (CPU, {result['model']}{as_gpu}), `{meta['command']}` ({meta['date']}, "
             f"commit {str(meta['git_commit'])[:10]}{' (dirty tree)' if meta['git_dirty'] else ''}, torch "
             f"{meta['torch']}): each arm's instructions over {result['steps']} steps counted by Valgrind's "
             f"callgrind after {result['warmup']} uncounted ones, all arms in one process, in this order.", ""]
    header = "| arm | instructions per step | over the plain loop | over the plain loop without profiler scopes |"
    if events:
        lines[0] += (" With the cache simulation: first-level misses (instruction, data read and write), "
                     "last-level misses, and Valgrind's cycle estimate Ir + 10 L1 misses + 100 LL misses.")
        header += " L1 misses | LL misses | cycle estimate | estimate over the plain loop |"
    lines += [header, "|" + "---|" * header.count(" |")]
    for arm, value in arms.items():
        over = [("–" if base is None else f"{value - base:+,.0f}") for base in (plain, lean)]
        row = f"| {arm} | {value:,.0f} | {over[0]} | {over[1]} |"
        if events:
            e = events[arm]
            estimate, base = cycle_estimate(e), cycle_estimate(events["plain"]) if "plain" in events else None
            row += (f" {e['I1mr'] + e['D1mr'] + e['D1mw']:,.0f} | {e['ILmr'] + e['DLmr'] + e['DLmw']:,.0f} | "
                    f"{estimate:,.0f} | {'–' if base is None else f'{estimate - base:+,.0f}'} |")
        lines.append(row)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mlp-1ms", help="a bench.overhead model (tiny, mlp-1ms, ...)")
    parser.add_argument("--warmup", type=int, default=100, help="uncounted steps per arm first")
    parser.add_argument("--steps", type=int, default=200, help="counted steps per arm")
    parser.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), choices=ARMS)
    parser.add_argument("--cache-sim", action="store_true", help="simulate the caches too (several times slower)")
    parser.add_argument("--as-on-gpu", action="store_true",
                        help="fused AdamW, and the trainer's guard built as on a GPU (its checks deferred)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # the process under valgrind
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.steps < 1:
        parser.error(f"--warmup >= 0 and --steps >= 1, got {args.warmup} and {args.steps}")
    if args.child:
        step_arms(args.model, args.arms, args.warmup, args.steps, args.as_on_gpu)
        return
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        parser.error("valgrind is not installed (the counts come from its callgrind tool)")
    from bench.protocol import run_metadata, write_results

    # Taken before the child imports the code it counts: a commit made during the run is not it.
    meta = run_metadata("python -m experiments.step_instructions " + shlex.join(sys.argv[1:] if argv is None else argv))
    print(f"{len(args.arms)} arms of {args.model} under callgrind (minutes: Valgrind runs ~50-100x slower)", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        events = count(args.model, args.arms, args.warmup, args.steps, valgrind, Path(scratch), args.cache_sim,
                       args.as_on_gpu)
    result = dict(model=args.model, warmup=args.warmup, steps=args.steps, as_on_gpu=args.as_on_gpu,
                  per_step={arm: e["Ir"] for arm, e in events.items()})
    if args.cache_sim:
        result["events"] = events
        result["cycle_estimate"] = {arm: cycle_estimate(e) for arm, e in events.items()}
    name = (f"step_instructions_{args.model}" + ("_as_on_gpu" if args.as_on_gpu else "")
            + ("_cache" if args.cache_sim else ""))
    write_results(args.out, name, dict(meta=meta, result=result), report(result, meta))


if __name__ == "__main__":
    main()

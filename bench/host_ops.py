"""How many torch ops does a training step issue on the host, and which part issues them?

    python -m bench.host_ops [--tasks fashion charlm] [--steps 20] [--out docs/results]

On a GPU every op is a kernel launch or an allocator call, and for small models those, not the
kernels, set the step time: on the H100 (docs/gpu.md) the trainer's recording machinery cost
0.4-0.6 of a core step, and a bare Triton launch from Python 41-53 µs. This benchmark counts them
on the CPU (a proxy for launches; no GPU needed), with the trainer's guard set up as on a GPU
(``step_guard.reads_are_free`` false: on a CPU it reads one norm per gradient, which costs
nothing there, where a GPU stacks them for one read), for the
plain AdamW loop and for HybridTrainer with prediction off, with it on and the per-tensor
reductions of the CPU path, and with it on and the batched reductions of the CUDA path (these two
with a bf16 direction: the default int8 direction is read a bucket at a time either way). The
optimizer is AdamW with ``foreach=True``, the implementation a GPU uses (one op per foreach call).
Two more arms use ``fused=True`` AdamW: its plain loop, and the trainer with prediction off and
``read_every=16`` (a GPU's default), whose steps read nothing back except once per 16 steps
(:mod:`hybrid_trainer.deferred_checks`).
Ops issued inside the Triton interpreter (the test suite's CPU kernels) are not counted.

Each arm warms up for ``--warmup`` steps, then counts the ops of each of ``--steps`` steps and
attributes them to the innermost ``hybrid_trainer`` function on the stack: inside the trainer the
model's forward counts under ``_loss`` and the optimizer under ``_real_step``; the plain loop's
ops are all "model + optimizer". Writes ``<out>/host_ops.{json,md}``.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import shlex
import statistics
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .protocol import guard_as_on_a_gpu, run_metadata


def _caller(frame, package: str) -> str | None:
    """``file:function`` of the innermost frame in ``package``; "interpreter" for Triton's interpreter."""
    while frame is not None:
        name = frame.f_code.co_filename
        if "triton" in name and "interpreter" in name:
            return "interpreter"
        if f"/{package}/" in name:
            return f"{name.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"
        frame = frame.f_back
    return None


def _reader(frame) -> str:
    """Who reads a value: the optimizer (its step counters are host tensors, read by the plain
    loop too), the innermost ``hybrid_trainer`` function, or someone else."""
    while frame is not None:
        name = frame.f_code.co_filename
        if "/torch/optim/" in name:
            return "optimizer"
        if "/hybrid_trainer/" in name:
            return f"{name.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "outside the trainer"


class HostOps(TorchDispatchMode):
    """Context manager recording the aten ops issued inside it, outside the Triton interpreter.

    ``.ops``: op names in order. ``.by_caller``: counts per innermost ``hybrid_trainer``
    function (None: anything else, e.g. the model's forward or the optimizer).

    ``.read_backs``: the reads of a tensor's value by the host, each a wait for the device on a
    GPU, by caller: ``_local_scalar_dense`` (``item()``, ``float()``, ``bool()``) and
    ``Tensor.tolist()``, which copies without dispatching an op and is counted by wrapping it."""

    READ_BACK_OPS = ("_local_scalar_dense",)

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.by_caller: collections.Counter[str | None] = collections.Counter()
        self.read_backs: collections.Counter[str | None] = collections.Counter()
        self._tolist = None

    def __enter__(self):
        original = self._tolist = torch.Tensor.tolist
        counter = self

        def tolist(tensor):
            counter.read_backs[_reader(sys._getframe(1))] += 1
            return original(tensor)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        caller = _caller(sys._getframe(1), "hybrid_trainer")
        if caller != "interpreter":
            name = func.overloadpacket.__name__
            self.ops.append(name)
            self.by_caller[caller] += 1
            if name in self.READ_BACK_OPS:
                self.read_backs[_reader(sys._getframe(1))] += 1
        return func(*args, **(kwargs or {}))


ARMS = ("AdamW loop", "HybridTrainer predict=False", "HybridTrainer, per-tensor reductions",
        "HybridTrainer, batched reductions", "fused AdamW loop", "HybridTrainer predict=False, fused, read_every=16")
FUSED_ARMS = ARMS[4:]  # AdamW(fused=True): its step skips a non-finite update on the device when told to


def count_arm(task, arm: str, warmup: int, steps: int, lr: float) -> dict:
    """Ops per step of one arm: median, max, and the mean per caller over the counted steps."""
    with guard_as_on_a_gpu():
        return _count_arm(task, arm, warmup, steps, lr)


def _count_arm(task, arm: str, warmup: int, steps: int, lr: float) -> dict:
    from hybrid_trainer import HybridTrainer, predict_phase

    from .protocol import preset_config, training_step

    model = task.make_model(0)
    fused = arm in FUSED_ARMS
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, **(dict(fused=True) if fused else dict(foreach=True)))
    trainer = None
    if arm == ARMS[5]:  # the guard reads a block of 16 steps at once (hybrid_trainer.deferred_checks)
        config = dataclasses.replace(preset_config("no-predict"), read_every=16)
        trainer = HybridTrainer(model, optimizer, task.loss_fn, config)
    elif arm not in (ARMS[0], ARMS[4]):
        # The two reduction arms compare the reductions of a float direction (bf16): the trainer's
        # default int8 direction is read a bucket at a time whichever reductions are set.
        float_direction = arm in (ARMS[2], ARMS[3])
        kept_dtype = predict_phase.DIRECTION_DTYPE
        if float_direction:
            predict_phase.DIRECTION_DTYPE = torch.bfloat16
        try:
            # The per-step guard (a GPU's default reads once per 16 steps: the last arm).
            config = (dataclasses.replace(preset_config("no-predict"), read_every=1) if arm == ARMS[1]
                      else preset_config("default"))
            trainer = HybridTrainer(model, optimizer, task.loss_fn, config)
        finally:
            predict_phase.DIRECTION_DTYPE = kept_dtype
        trainer.predictor.batched_reductions = arm == ARMS[3]
    stream = task.batches(0)
    step = training_step(task, model, optimizer, trainer)
    for _ in range(warmup):
        step(next(stream))
    per_step, callers, phases = [], collections.Counter(), collections.Counter()
    reads_per_step, readers = [], collections.Counter()
    for _ in range(steps):
        batch = next(stream)
        if trainer is not None:
            phases[trainer.controller.phase.value] += 1
        with HostOps() as host:
            step(batch)
        per_step.append(len(host.ops))
        reads_per_step.append(sum(host.read_backs.values()))
        readers.update(host.read_backs)
        callers.update({(k or "model + optimizer"): v for k, v in host.by_caller.items()})
    return dict(median=statistics.median(per_step), max=max(per_step), min=min(per_step),
                per_caller={k: v / steps for k, v in callers.most_common()}, phases=dict(phases),
                read_backs_median=statistics.median(reads_per_step), read_backs_max=max(reads_per_step),
                read_backs_mean=statistics.fmean(reads_per_step),
                read_backs_by_caller={k: v / steps for k, v in readers.most_common()},
                parameter_tensors=len(list(model.parameters())),
                prediction_enabled=None if trainer is None else trainer.controller.prediction_enabled)


def markdown(results: dict) -> str:
    lines = [f"Host ops per training step, `{results['command']}` ({results['date']}, torch {results['torch']}, "
             "CPU; every op is a launch or an allocator call on a GPU). Read-backs: the host reading a tensor's "
             "value (`item()`, `float()`, `bool()`, `tolist()`), each a wait for the device on a GPU.", ""]
    for task, arms in results["tasks"].items():
        first = next(iter(arms.values()))
        lines += [f"### {task} ({first['parameter_tensors']} parameter tensors)", "",
                  "| arm | ops per step (median) | min–max | top callers (mean ops per step) | read-backs per step "
                  "(median, max, mean) | read by (mean per step) |", "|---|---|---|---|---|---|"]
        for arm, r in arms.items():
            top = ", ".join(f"{k} {v:.0f}" for k, v in list(r["per_caller"].items())[:4])
            readers = ", ".join(f"{k} {v:.2g}" for k, v in r.get("read_backs_by_caller", {}).items()) or "none"
            lines.append(f"| {arm} | {r['median']:.0f} | {r['min']}–{r['max']} | {top} | "
                         f"{r.get('read_backs_median', 0):.0f}, {r.get('read_backs_max', 0)}, "
                         f"{r.get('read_backs_mean', 0):.2f} | {readers} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from .tasks import get_task

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["fashion", "charlm"], choices=["fashion", "charlm", "digits"])
    parser.add_argument("--warmup", type=int, default=25, help="steps before counting (past WARMUP into FULL)")
    parser.add_argument("--steps", type=int, default=20, help="steps counted per arm")
    parser.add_argument("--quick", action="store_true", help="the tasks' quick sizes (tests)")
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    command = "python -m bench.host_ops " + shlex.join(sys.argv[1:] if argv is None else argv)
    results = dict(run_metadata(command), tasks={})
    for name in args.tasks:
        task = get_task(name, quick=args.quick)
        lr = task.lr_grid[len(task.lr_grid) // 2]
        results["tasks"][name] = {arm: count_arm(task, arm, args.warmup, args.steps, lr) for arm in ARMS}
        print(markdown(dict(results, tasks={name: results["tasks"][name]})), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_ops.json").write_text(json.dumps(results, indent=1))
    (args.out / "host_ops.md").write_text(markdown(results))
    print(f"wrote {args.out}/host_ops.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

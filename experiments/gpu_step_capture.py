"""Where a host-bound GPU step's time goes under the trainer, and what capturing it in a CUDA graph gives.

Question: on a step the GPU finishes faster than the host can launch it (Fashion-MNIST's MLP on
an H100: about 1.1 ms a step, the device mostly idle), the trainer with ``predict=False`` costs
+200 µs a step over the plain loop (``docs/results/overhead_cuda.md``), though with a fused
optimizer it reads nothing back between block reads. Is that its Python, its launches, or both,
and would capturing the steady step in a CUDA graph (one launch for forward, backward, the
guard's device-side check and the update; Nguyen et al., "Accelerating PyTorch with CUDA Graphs",
PyTorch blog 2021; torch.cuda.graphs) make the guard free?

Arms, interleaved chunk by chunk in one process, every one over ``AdamW(fused=True)``:

* ``plain``: ``zero_grad``, forward, backward, ``step``;
* ``trainer``: ``HybridTrainer`` with ``predict=False`` (on CUDA it reads every 16 steps);
* ``plain, lean calls``: the plain loop with gradients set to None and the update without torch's
  profiler scope, as the trainer makes those two calls;
* ``lean + guard ops (...)``: that loop plus the device work of the trainer's deferred guard and
  none of its Python, with the norms taken per gradient (as the trainer does) or as one norm of the
  gradients concatenated: what the guard's ops cost apart from the trainer's bookkeeping;
* ``plain, captured``: the plain step captured whole (``capturable=True``), a step = two copies of
  the batch into static buffers and one replay;
* ``guarded, captured``: the same, with the guard's device work in the graph (the per-gradient
  norms, ``[loss, norms]`` stacked, GradScaler's non-finite check setting ``found_inf``, which the
  fused update reads to skip itself), plus one copy of the step's values into a ring of 16 that is
  read back once per 16 steps, as the trainer's deferred checks read;
* ``trainer, replayed (cuda_graph=True)``: the trainer itself with its steady step replayed from
  a graph (:mod:`hybrid_trainer.captured_step`), on a GPU; its capture and replay counts are
  reported beside.

Before the timing, for the trainer alone: a ``cProfile`` of its steady steps (host time by
function) and the count of device kernels a step launches against the plain loop's
(``torch.profiler``).

Run: ``python -m experiments.gpu_step_capture --device cuda`` (``--device cpu`` runs the eager
arms and the profile, as a check of the probe itself). Writes
``experiments/results/gpu_step_capture_<device>.{json,md}``; with ``--merge``, the models of that
file this run does not time are kept, each with the run that timed it (a lent GPU's calls are
short: one model a call).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from bench.overhead import make_workload, median_interval_ranks
from bench.protocol import run_metadata, write_results

RESULTS = Path(__file__).parent / "results"
RING = 16


def plain_arm(workload, device) -> Callable[[Any], None]:
    model = workload.make_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr, fused=True)

    def step(batch) -> None:
        optimizer.zero_grad(set_to_none=True)
        workload.loss_fn(model, batch).backward()
        optimizer.step()
    return step


def trainer_arm(workload, device, cuda_graph: bool = False) -> tuple[Callable[[Any], Any], Any]:
    from hybrid_trainer import HybridConfig, HybridTrainer

    model = workload.make_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr, fused=True)
    trainer = HybridTrainer(model, optimizer, workload.loss_fn,
                            HybridConfig(seed=0, predict=False, cuda_graph=cuda_graph))
    return trainer.step, trainer


def lean_arm(workload, device) -> Callable[[Any], None]:
    """The plain loop making its two calls as the trainer does: gradients set to None, the update
    without torch's profiler scope (hybrid_trainer.optimizer_call)."""
    from hybrid_trainer.optimizer_call import OptimizerStep

    model = workload.make_model(0)
    params = list(model.parameters())
    update = OptimizerStep(torch.optim.AdamW(params, lr=workload.lr, fused=True))

    def step(batch) -> None:
        for p in params:
            p.grad = None
        workload.loss_fn(model, batch).backward()
        update()
    return step


GUARD_VARIANTS = ("norm per gradient", "one norm of the concatenated gradients")


def guard_ops_arm(workload, device, variant: str) -> Callable[[Any], None]:
    """The lean loop plus the device work of the trainer's deferred guard and nothing of its Python:
    ``[loss, norms]`` stacked, GradScaler's non-finite check setting ``found_inf``, the fused
    update told to skip on it, the values queued and read once per ``RING`` steps. The norms as
    the trainer takes them (``variant`` "norm per gradient": one ``_foreach_norm``, whose outputs are
    one tensor per gradient) or as one norm of the gradients concatenated (two ops whatever their
    number)."""
    from hybrid_trainer.optimizer_call import OptimizerStep

    if variant not in GUARD_VARIANTS:
        raise ValueError(f"variant: one of {GUARD_VARIANTS}, got {variant!r}")
    model = workload.make_model(0)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=workload.lr, fused=True)
    update = OptimizerStep(optimizer)
    found = torch.zeros((), dtype=torch.float32, device=device)
    one = torch.ones((), dtype=torch.float32, device=device)
    queued: list[torch.Tensor] = []
    read: list[list[float]] = []

    def step(batch) -> None:
        for p in params:
            p.grad = None
        loss = workload.loss_fn(model, batch)
        loss.backward()
        grads = [p.grad for p in params]
        if variant == GUARD_VARIANTS[0]:
            values = torch.stack([loss.detach().float(), *torch._foreach_norm(grads)])
        else:
            norm = torch.linalg.vector_norm(torch.cat([g.view(-1) for g in grads]))
            values = torch.stack([loss.detach().float(), norm])
        found.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_([values], found, one)
        optimizer.found_inf = found
        try:
            update()
        finally:
            del optimizer.found_inf
        queued.append(values)
        if len(queued) == RING:
            read.append(torch.cat(queued).tolist())  # the block's one read
            queued.clear()
    step.read, step.model = read, model  # type: ignore[attr-defined]
    return step


def captured_arm(workload, device, guarded: bool) -> Callable[[Any], None]:
    """The whole step as one CUDA graph over static batch buffers (torch.cuda.graphs' whole-network
    capture: warm-up on a side stream so the optimizer state exists, gradients set to None before
    capture so the graph's backward writes them rather than accumulating)."""
    model = workload.make_model(0)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=workload.lr, fused=True, capturable=True)
    first = workload.batches[0]
    static = [t.clone() for t in first]
    found = torch.zeros((), dtype=torch.float32, device=device)
    one = torch.ones((), dtype=torch.float32, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            workload.loss_fn(model, static).backward()
            optimizer.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        loss = workload.loss_fn(model, static)
        loss.backward()
        if guarded:
            norms = torch._foreach_norm([p.grad for p in params])
            values = torch.stack([loss.detach().float(), *norms])
            found.zero_()
            torch._amp_foreach_non_finite_check_and_unscale_([values], found, one)
            optimizer.found_inf = found
        optimizer.step()
    # The graph holds raw addresses of the weights, the optimizer state and these buffers, not
    # the tensors: each step function keeps them alive (without it, the model and optimizer went
    # with this frame, the next capture's empty_cache gave their memory back, and the replay hit
    # an illegal address on the H200).
    keep = (model, optimizer, static, found, one)
    if not guarded:
        def step(batch) -> None:
            for buffer, t in zip(static, batch):
                buffer.copy_(t)
            graph.replay()
        step.keep = keep  # type: ignore[attr-defined]
        return step
    ring = torch.empty((RING, values.numel()), dtype=torch.float32, device=device)
    position = [0]
    read: list[list[float]] = []

    def guarded_step(batch) -> None:
        for buffer, t in zip(static, batch):
            buffer.copy_(t)
        graph.replay()
        ring[position[0] % RING].copy_(values)
        position[0] += 1
        if position[0] % RING == 0:
            read.append(ring.tolist())  # the block's one read, as the trainer's deferred checks
    guarded_step.read, guarded_step.keep = read, (keep, values)  # type: ignore[attr-defined]
    return guarded_step


def time_arms(arms: dict[str, Callable[[Any], Any]], batches: list, device, rounds: int, chunk: int,
              warmup: int) -> dict[str, list[float]]:
    """Each arm's mean step (µs) per round: chunks of ``chunk`` steps between two synchronisations,
    arms in turn, after ``warmup`` untimed steps each."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    positions = dict.fromkeys(arms, 0)
    for name, step in arms.items():
        for i in range(warmup):
            step(batches[i % len(batches)])
        positions[name] = warmup
    means: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, step in arms.items():
            sync()
            started = time.perf_counter()
            for _ in range(chunk):
                step(batches[positions[name] % len(batches)])
                positions[name] += 1
            sync()
            means[name].append(1e6 * (time.perf_counter() - started) / chunk)
    return means


def host_profile(step: Callable[[Any], Any], batches: list, steps: int, top: int = 30) -> str:
    """cProfile of ``steps`` steps: the functions with the most own time, as pstats prints them."""
    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(steps):
        step(batches[i % len(batches)])
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def kernel_counts(step: Callable[[Any], Any], batches: list, device, steps: int) -> dict[str, Any]:
    """Device kernels and host-side ops per step (``torch.profiler`` over ``steps`` steps)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(steps):
            step(batches[i % len(batches)])
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.events()
    kernels = [e for e in events if e.device_type.name == "CUDA"]
    aten = [e for e in events if e.device_type.name == "CPU" and e.name.startswith("aten::")]
    by_name: dict[str, int] = {}
    for e in kernels:
        by_name[e.name[:80]] = by_name.get(e.name[:80], 0) + 1
    return dict(kernels_per_step=len(kernels) / steps, aten_ops_per_step=len(aten) / steps,
                kernels_by_name={k: v / steps for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])})


def run(model: str, device: torch.device, rounds: int, chunk: int, profile_steps: int) -> dict[str, Any]:
    workload = make_workload(model, 64, device)
    trainer_step, trainer = trainer_arm(workload, device)
    arms: dict[str, Callable[[Any], Any]] = {"plain": plain_arm(workload, device), "trainer": trainer_step,
                                              "plain, lean calls": lean_arm(workload, device)}
    for variant in GUARD_VARIANTS:
        arms[f"lean + guard ops ({variant})"] = guard_ops_arm(workload, device, variant)
    capture_error = None
    replayed = None
    if device.type == "cuda":
        try:
            arms["plain, captured"] = captured_arm(workload, device, guarded=False)
            arms["guarded, captured"] = captured_arm(workload, device, guarded=True)
        except Exception as error:  # a model that cannot be captured: say why, time the rest
            capture_error = f"{type(error).__name__}: {error}"
        # The trainer's own replayed step (HybridConfig(cuda_graph=True)), beside the probe's.
        arms["trainer, replayed (cuda_graph=True)"], replayed = trainer_arm(workload, device, cuda_graph=True)
    # The trainer's host profile and kernel counts first: what a failed capture or a cut-off run
    # must not cost (a device error ends the process).
    for i in range(3 * chunk):  # warm-up: past the trainer's first steps
        trainer_step(workload.batches[i % len(workload.batches)])
        arms["plain"](workload.batches[i % len(workload.batches)])
    result: dict[str, Any] = dict(model=model, rounds=rounds, chunk=chunk, capture_error=capture_error)
    result["trainer_profile"] = host_profile(trainer_step, workload.batches, profile_steps)
    result["plain_profile"] = host_profile(arms["plain"], workload.batches, profile_steps)
    result["kernels"] = {name: kernel_counts(arms[name], workload.batches, device, 32) for name in ("plain", "trainer")}
    print(result["trainer_profile"][:3000], flush=True)
    means = time_arms(arms, workload.batches, device, rounds, chunk, warmup=3 * chunk)
    result.update(trainer_phase=trainer.controller.phase.value,
                  trainer_prediction_enabled=trainer.controller.prediction_enabled, arms={},
                  replayed=None if replayed is None else replayed.captured.statistics())
    for name, values in means.items():
        row: dict[str, Any] = dict(step_us=statistics.median(values), per_round_us=values)
        if name != "plain":
            diffs = [a - b for a, b in zip(values, means["plain"])]
            ranks = median_interval_ranks(len(diffs))
            ordered = sorted(diffs)
            row.update(over_plain_us=statistics.median(diffs),
                       interval_us=None if ranks is None else [ordered[ranks[0]], ordered[ranks[1]]],
                       ratio=statistics.median(means["plain"]) / statistics.median(values))
        result["arms"][name] = row
    return result


def merged(previous: dict[str, Any] | None, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``results`` (this run's models) with ``previous``'s (a results file's ``meta`` and
    ``results``) other models kept, in the file's order, this run's new models after them. Each
    kept model keeps the run that timed it (``run``; its file's ``meta`` where it has none)."""
    if not previous:
        return list(results)
    new = {r["model"]: r for r in results}
    kept = [new.pop(r["model"], None) or dict(r, run=r.get("run") or run_of(previous["meta"]))
            for r in previous["results"]]
    return kept + list(new.values())


def run_of(meta: dict[str, Any]) -> dict[str, Any]:
    """What a model's entry records of the run that timed it."""
    return {k: meta[k] for k in ("command", "date", "git_commit", "torch", "device_name") if k in meta}


def report(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# A host-bound step on {meta['device_name']}: the trainer's host time and a captured step",
             "", f"`{meta['command']}` ({meta['date']}, commit {(meta['git_commit'] or 'unknown')[:10]}, torch {meta['torch']}).",
             "Every arm over `AdamW(fused=True)`; median over rounds of each arm's mean step over a chunk "
             "between two synchronisations; over plain: median of the round-by-round differences, 95% sign interval.", ""]
    for r in results:
        lines += [f"## {r['model']} ({r['rounds']} rounds of {r['chunk']} steps)", ""]
        timed_by = r.get("run")
        if timed_by and timed_by["command"] != meta["command"]:
            lines += [f"Timed by `{timed_by['command']}` ({timed_by['date']}, commit "
                      f"{(timed_by['git_commit'] or 'unknown')[:10]}, torch {timed_by['torch']}).", ""]
        if r["capture_error"]:
            lines += [f"Capture failed: {r['capture_error']}", ""]
        lines += ["| arm | step (µs) | over plain (µs) [95%] | speed vs plain |", "|---|---|---|---|"]
        for name, row in r["arms"].items():
            if name == "plain":
                lines.append(f"| {name} | {row['step_us']:.0f} | – | 1.000× |")
            else:
                span = "" if row["interval_us"] is None else " [{:+.0f}, {:+.0f}]".format(*row["interval_us"])
                lines.append(f"| {name} | {row['step_us']:.0f} | {row['over_plain_us']:+.0f}{span} | {row['ratio']:.3f}× |")
        if r.get("replayed") is not None:
            lines += ["", "The trainer with `cuda_graph=True`: " + ", ".join(f"{k} {v}" for k, v in r["replayed"].items())
                      + "."]
        k = r["kernels"]
        lines += ["", f"Kernels per step: plain {k['plain']['kernels_per_step']:.1f}, trainer "
                      f"{k['trainer']['kernels_per_step']:.1f}; aten ops per step: plain "
                      f"{k['plain']['aten_ops_per_step']:.1f}, trainer {k['trainer']['aten_ops_per_step']:.1f}.", "",
                  "Trainer's kernels per step:", "", "```"]
        lines += [f"{v:6.2f}  {name}" for name, v in k["trainer"]["kernels_by_name"].items()]
        lines += ["```", "", "The trainer's host time by function (cProfile, own time):", "", "```",
                  r["trainer_profile"].strip()[:6000], "```", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", nargs="+", default=["fashion"])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--chunk", type=int, default=48)
    parser.add_argument("--profile-steps", type=int, default=400)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--merge", action="store_true",
                        help="keep the other models of the existing results file, each with the run that timed it")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    command = "python -m experiments.gpu_step_capture " + shlex.join(sys.argv[1:] if argv is None else argv)
    meta = run_metadata(command, device_name=name)
    stem = "gpu_step_capture_" + ("cuda" if device.type == "cuda" else "cpu")
    existing = args.out / f"{stem}.json"
    previous = json.loads(existing.read_text()) if args.merge and existing.exists() else None
    results = []
    for model in args.models:
        print(f"[gpu_step_capture] {model} on {device}", flush=True)
        results.append(dict(run(model, device, args.rounds, args.chunk, args.profile_steps), run=run_of(meta)))
        for arm, row in results[-1]["arms"].items():
            print(f"  {arm}: {row['step_us']:.0f} µs" + (f", {row['over_plain_us']:+.0f} µs over plain"
                                                        if "over_plain_us" in row else ""), flush=True)
        # Written after each model: a lent machine's time runs out, or a later model's capture
        # fails (the first run's did), without taking the models done with it.
        written = merged(previous, results)
        write_results(args.out, stem, dict(meta=meta, results=written), report(written, meta))


if __name__ == "__main__":
    main()

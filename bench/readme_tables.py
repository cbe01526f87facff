"""The README's result tables, generated from the committed result JSON so they cannot drift.

    python -m bench.readme_tables [--check] [--readme README.md]

Each table lives between ``<!-- table:NAME -->`` and ``<!-- /table -->`` in the README; this
rewrites what is between the markers from :data:`TABLES` and leaves the rest of the file alone.
``--check`` writes nothing and exits 1 when a table differs from what the JSON gives (a test runs
it, so a result re-run without regenerating the README fails the suite). Every figure a table shows
is read from a file it names, and every row names the command that wrote that file.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable

from bench.results_index import current_command

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
TASKS = {"charlm": "char-LM", "fashion": "Fashion-MNIST", "digits": "digits"}
NOT_MEASURED = "not yet measured"
NOT_RUN = "not run"  # an arm a run left out (--presets)
MARKER = re.compile(r"(<!-- table:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _e2e(task: str) -> dict:
    return _load(f"e2e_{task}.json")


def _cmd(data: dict) -> str:
    """A run's command as it reads today (:func:`bench.results_index.current_command`: a file
    written into another folder and moved here is made by the command with this folder's
    ``--out``)."""
    return f"`{current_command(data['meta']['command'], Path('docs/results/e2e.json'))}`"


def _speedup(data: dict, arm: str) -> str:
    """Mean over seeds of the per-seed speed-up to the target against the tuned AdamW loop, with
    how many seeds reached it when not all did; "not run" for an arm the run left out."""
    if arm not in data["arms"]:
        return NOT_RUN
    a = data["arms"][arm]
    s, n = a["summary"], len(a["seeds"])
    if s["speedup_vs_baseline"]["mean"] is None:
        return f"not reached (0 of {n} seeds)"
    text = f"{s['speedup_vs_baseline']['mean']:.2f}×"
    return text if s["reached_target"] == n else f"{text} ({s['reached_target']} of {n} seeds reached)"


def _switched_off(datas: list[dict], arm: str) -> tuple[int, int, float]:
    """(seeds where prediction ended switched off, seeds run, largest % of backward passes saved)."""
    seeds = [s["hybrid"] for d in datas for s in d["arms"][arm]["seeds"]]
    off = sum(not h["prediction_enabled"] for h in seeds)
    return off, len(seeds), max(100 * h["backward_saved_fraction"] for h in seeds)


def _over_optimizer(data: dict, trainer_arm: str, plain_arm: str, plain_name: str) -> str:
    """The trainer over another optimizer against tuned AdamW, beside that optimizer's plain loop:
    the speed-up to AdamW's target, and whose it is (a gain or a loss shared by the plain loop
    is the optimizer's)."""
    trainer, plain = _speedup(data, trainer_arm), _speedup(data, plain_arm)
    means = [data["arms"][arm]["summary"]["speedup_vs_baseline"]["mean"] for arm in (trainer_arm, plain_arm)]
    if all(m is not None and m > 1 for m in means):
        said, whose = "sooner than tuned AdamW", "the gain is the optimizer's"
    elif all(m is not None and m < 1 for m in means):
        said, whose = "tuned AdamW's speed to its target", "the loss is the optimizer's"
    else:
        said, whose = "tuned AdamW's speed to its target", "against the same optimizer in a plain loop"
    return f"**{trainer}** {said}; {plain_name} {plain}: {whose}"


NO_PREDICT = RESULTS / "e2e_no_predict"  # bench.e2e --presets no-predict: that arm alone, run again on newer code


def _no_predict_row(e2e: dict[str, dict], cmd: str) -> tuple[str, str, str]:
    """What the trainer costs in time with prediction off, end to end: from the run of that arm
    alone (:data:`NO_PREDICT`) where it was made after the full run, else from the full run's arm."""
    what, arm = "The trainer's cost in time, prediction off (`predict=False`)", "HybridTrainer (no-predict)"
    files = {t: NO_PREDICT / f"e2e_{t}.json" for t in TASKS}
    runs = {t: json.loads(f.read_text()) for t, f in files.items() if f.exists()}
    if len(runs) < len(TASKS) or min(r["meta"]["date"] for r in runs.values()) <= max(
            d["meta"]["date"] for d in e2e.values()):  # the full run is as new: its arm
        return what, f"speed-up {' / '.join(_speedup(e2e[t], arm) for t in TASKS)} (1.00× would be free)", cmd
    first = next(iter(runs.values()))
    return (what, f"speed-up {' / '.join(_speedup(runs[t], arm) for t in TASKS)} (1.00× would be free; "
                  f"{_when(first['meta'])}, {first['meta']['device']}: the full run's table below is older)",
            _commands(run["meta"] for run in runs.values()))  # one run, or one per task group


def status() -> str:
    """What pays and what does not: one measured figure per row with its command."""
    e2e = {t: _e2e(t) for t in TASKS}
    ddp = _load("ddp_fashion.json")
    off, runs, saved = _switched_off(list(e2e.values()), "HybridTrainer (default)")
    per_task = lambda arm: " / ".join(_speedup(e2e[t], arm) for t in TASKS)  # noqa: E731
    cmd = " ".join(dict.fromkeys(_cmd(e2e[t]) for t in TASKS))  # the tasks' runs (one call or several)
    no_predict = ddp["arms"]["HybridTrainer (no-predict)"]
    rows = [
        ("Predicted weight updates (the default trainer)",
         f"**do not pay**: prediction switched itself off in {off} of {runs} runs, having saved at most "
         f"{saved:.1f}% of backward passes; speed-up {per_task('HybridTrainer (default)')}", cmd),
        ("The trainer over Muon + AdamW (char-LM)",
         _over_optimizer(e2e["charlm"], "HybridTrainer (muon)", "Muon + AdamW", "the plain Muon loop")
         + "; Muon's bf16 step depends on the host's CPU ([below](#end-to-end-benchmark))", _cmd(e2e["charlm"])),
        ("The trainer over schedule-free AdamW (Fashion-MNIST)",
         _over_optimizer(e2e["fashion"], "HybridTrainer (schedule-free)", "Schedule-free AdamW",
                         "the plain schedule-free loop"), _cmd(e2e["fashion"])),
        _no_predict_row(e2e, cmd),
        ("The same under DDP (2 CPU ranks, Fashion-MNIST)",
         f"{no_predict['time_vs_plain']:.2f}× the plain DDP loop's training time (seeds "
         f"{no_predict['time_vs_plain_range'][0]:.2f}–{no_predict['time_vs_plain_range'][1]:.2f})", _cmd(ddp)),
    ]
    rows += _overhead_rows() + _gpu_overhead_rows() + _capacity_rows() + _nowcast_rows() + _fm16_rows()
    lines = ["| what | measured (char-LM / Fashion-MNIST / digits where three) | command |", "|---|---|---|"]
    lines += [f"| {what} | {figure} | {command} |" for what, figure, command in rows]
    return "\n".join(lines)


OVERHEAD_MODELS = {"tiny": "tiny MLP (fixed cost)", "mlp-1ms": "1 ms MLP", "fashion": "Fashion-MNIST",
                   "charlm": "char-LM", "mlp-50m": "51M MLP"}


FLOOR = "plain + norm and read (guard floor)"  # bench.overhead.GUARD_FLOOR (not imported: torch-free here)


def _vs_plain(arms_by_model, arm: str, key: str, fmt: str) -> str:
    """One figure of ``arm`` against the plain loop (its ``vs_plain[key]``), model after model."""
    return " / ".join(format(arms[arm]["vs_plain"][key], fmt) for arms in arms_by_model)


OVERHEAD_SECTION = "#what-the-trainer-costs-next-to-a-plain-loop"  # README's section with the overhead table


def _overhead_models() -> tuple[dict, dict[str, dict]] | None:
    """``bench.overhead``'s merged results and its models' entries, in :data:`OVERHEAD_MODELS`'
    order; None where it has not run."""
    if not (RESULTS / "overhead.json").exists():
        return None
    data = _load("overhead.json")
    return data, {m: data["models"][m] for m in OVERHEAD_MODELS if m in data["models"]}


def _commands(runs) -> str:
    """Each run's command once, in order, as code (a file merged from several runs)."""
    return " ".join(f"`{c}`" for c in dict.fromkeys(r["command"] for r in runs))


def _time_run(entry: dict, data: dict) -> dict:
    """The run that timed a model's entry last (the whole file's where the entry names none)."""
    return entry.get("time_run") or entry.get("run") or data


def _time_runs(entry: dict, data: dict) -> list[dict]:
    """The runs whose timings a model's entry holds: the run that timed it last, and the runs
    that timed the arms it kept from earlier runs (``--arms``; each arm's ``time_run``)."""
    return ([_time_run(entry, data)]
            + [a["time"]["time_run"] for a in entry["arms"].values() if "time_run" in a.get("time", {})])


def _memory_run(entry: dict, data: dict) -> dict:
    return entry.get("memory_run") or entry.get("run") or data


def _overhead_rows() -> list[tuple[str, str, str]]:
    """The trainer against the plain AdamW loop in isolation (``bench.overhead``): the status
    table's rows, each model's headline figure and verdict; every other figure, model by model
    with its runs' commands, is in :func:`overhead`."""
    loaded = _overhead_models()
    if loaded is None:
        return [("The trainer's per-step overhead in isolation; its memory overhead", NOT_MEASURED, "–")]
    data, entries = loaded
    models = {m: e["arms"] for m, e in entries.items()}
    names = " / ".join(OVERHEAD_MODELS[m] for m in models)

    def vs(arm: str, key: str, fmt: str) -> str:
        return _vs_plain(models.values(), arm, key, fmt)

    # The tiny MLP probes the fixed cost in time; its whole training state is a few kB, so its
    # memory ratio is the trainer's fixed bytes over nothing: given in bytes beside the ratios.
    sized = {m: a for m, a in models.items() if m != "tiny"}

    def memory(arm: str) -> str:
        basis = {"tensors": " T", "rss": " R"}
        return " / ".join(f"{a[arm]['vs_plain']['memory_ratio']:.2f}×{basis.get(a[arm]['vs_plain'].get('memory_basis'), '')}"
                          for a in sized.values())

    def fixed_bytes() -> str:
        if "tiny" not in models:
            return ""
        tiny = models["tiny"]
        return (f"; the tiny MLP's training state is {tiny['plain']['tensors']['tensor_peak_bytes'] / 1e3:.0f} kB "
                f"and the trainer adds {tiny['predict=False']['vs_plain']['extra_bytes'] / 1e3:.1f} kB to it with "
                f"`predict=False`, {tiny['default']['vs_plain']['extra_bytes'] / 1e3:.1f} kB by default")

    def verdicts() -> str:  # on each model's 95% interval where the run has one (bench.overhead.time_goal)
        from bench.overhead import time_goal

        goals = [time_goal(e) for e in entries.values()]
        return "here: " + " / ".join("–" if g is None else g["verdict"].split(" (")[0] for g in goals)

    cmd = _commands(_memory_run(e, data) for e in entries.values())
    explored = {m: e["exploration"] for m, e in entries.items() if e.get("exploration")}
    exploration_rows = [] if not explored else [
        (f"The default config while it finds out whether prediction pays, from the first step until the gate "
         f"switches prediction off ({' / '.join(OVERHEAD_MODELS[m] for m in explored)})",
         "off after " + " / ".join(str(e["steps_on"]) + ("" if e["switched_off"] else "+") for e in explored.values())
         + " steps; " + " / ".join(f"{e['ratio']:.2f}" for e in explored.values())
         + "× the plain loop's time over them (" + " / ".join(f"{e['extra_s']:+.2f}" for e in explored.values())
         + " s in all" + "".join(f"; the {OVERHEAD_MODELS[m]}'s over its timed steps, the first of each chunk of "
                                 f"{e['chunk']} untimed" for m, e in explored.items() if e.get("settle"))
         + "); after that it steps as with prediction off (the row above)", cmd)]
    rows = [
        (f"The trainer's cost per step next to the plain loop, prediction off ({names})",
         f"{vs('predict=False', 'overhead_us', '+.0f')} µs, i.e. {vs('predict=False', 'time_ratio', '.3f')}× "
         f"(goal: ≤ 50 µs, ≤ 1.02× on steps of 5 ms or more; {verdicts()}); each model's interval, "
         f"the floor of any NaN guard, the protocol's own error and every run: [below]({OVERHEAD_SECTION})",
         f"`python -m bench.overhead` (each run's options: [below]({OVERHEAD_SECTION}))"),
        (f"Peak training memory next to the plain loop ({' / '.join(OVERHEAD_MODELS[m] for m in sized)})",
         f"`predict=False` {memory('predict=False')}; default config {memory('default')} (goals 1.03× and 1.10×; "
         f"T: exact peak of live tensor bytes, where peak RSS moves more between runs than 3% of the plain "
         f"loop's; R: peak RSS){fixed_bytes()}", cmd),
    ]
    return rows[:1] + exploration_rows + rows[1:]


def overhead() -> str:
    """The trainer's cost per step next to the plain loop with prediction off, model by model
    (``bench.overhead``): the figure, its interval and verdict, what it was timed over, and the
    figures that place it (the reads every 16 steps, the floor of any per-step NaN guard, two
    identical plain loops, the trainer's own time part by part, the plain loop's two calls made
    as the trainer makes them, the host's speed), then each model's runs' commands."""
    loaded = _overhead_models()
    if loaded is None:
        return NOT_MEASURED
    data, entries = loaded
    from bench.overhead import noise_floor, over_lean_calls, time_goal

    def us(value: float | None) -> str:
        return "–" if value is None else f"{value:+.0f} µs"

    def plain_step(e: dict) -> str:
        step = e["arms"]["plain"]["time"]["chunk_median_us"]
        return f"{step:,.0f} µs"

    def trainer(e: dict) -> str:
        c = e["arms"]["predict=False"]["vs_plain"]
        interval = c.get("overhead_ci95_us")
        return (us(c["overhead_us"]) + ("" if interval is None else " [{:+.0f}, {:+.0f}]".format(*interval))
                + f", {c['time_ratio']:.3f}×")

    def verdict(e: dict) -> str:
        goal = time_goal(e)
        return "–" if goal is None else f"{goal['goal']}: {goal['verdict'].split(' (')[0]}"

    def timed_over(e: dict) -> str:
        runs = e["arms"]["predict=False"]["vs_plain"].get("overhead_runs")
        # One run: its interval is over its rounds (the 51M model's arms each in a process of
        # their own, the others in one); several: over the runs, each in a fresh process.
        return f"the median of {runs} runs, each in a fresh process" if runs else "one run"

    def arm(name: str) -> Callable[[dict], str]:
        return lambda e: us(((e["arms"].get(name) or {}).get("vs_plain") or {}).get("overhead_us"))

    def noise(e: dict) -> str:
        n = noise_floor(e)
        if n is None:
            return "–"
        step = e["arms"]["plain"]["time"]["chunk_median_us"]
        return f"{100 * n['median_us'] / step:+.1f}%" + ("" if n["ci95_us"] is None else
                                                       " [{:+.1f}, {:+.1f}]".format(*(100 * v / step for v in n["ci95_us"])))

    def own_parts(e: dict) -> str:
        b = e.get("breakdown") or {}
        if b.get("own_over_plain_us") is None:
            return "–"
        return f"{b['own_over_plain_us']:+.0f} µs ({100 * b['own_over_plain_us'] / b['plain_step_us']:+.1f}%)"

    def lean(saved: bool) -> Callable[[dict], str]:
        def cell(e: dict) -> str:
            timed = over_lean_calls(e["arms"])
            if timed is None:
                return "–"
            return us(timed[0]) if saved else us(None if timed[1] is None else timed[1]["median_us"])
        return cell

    def host(e: dict) -> str:
        run = _time_run(e, data)
        machine, after = run.get("machine"), run.get("machine_after_time")
        if not machine:
            return "not recorded"
        return (f"{machine['python_ns']:.0f} ns, {machine['read_gb_s']:.1f} GB/s"
                + ("" if not after else f" (after the timing {after['python_ns']:.0f} ns, {after['read_gb_s']:.1f} GB/s)"))

    rows: list[tuple[str, Callable[[dict], str]]] = [
        ("the plain loop's step", plain_step),
        ("`predict=False` over it [95% interval]", trainer),
        ("goal: verdict", verdict),
        ("timed over", timed_over),
        ("reading the guard's values every 16 steps (`read_every=16`, a GPU's default)", arm("predict=False, read_every=16")),
        ("the floor of any per-step NaN guard (the plain loop + the gradient norm and its read)", arm(FLOOR)),
        ("two identical plain loops (the protocol's own error) [95% interval]", noise),
        ("the trainer's own time over the plain loop's outside forward, backward and optimizer, part by part "
         "(what it saves inside them not counted)", own_parts),
        ("the plain loop making its two calls as the trainer does (gradients set to None, the update "
         "without torch's profiler scope)", lean(True)),
        ("`predict=False` over that loop", lean(False)),
        ("the host's speed when timed (a Python loop step, one thread's memory read)", host),
    ]
    lines = ["| prediction off | " + " | ".join(OVERHEAD_MODELS[m] for m in entries) + " |",
             "|---" * (len(entries) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(cell(e) for e in entries.values()) + " |" for label, cell in rows]
    lines.append("")
    lines.append("Each model's runs (time, then the breakdown and memory where another run measured them):")
    lines.append("")
    for m, e in entries.items():
        runs = _time_runs(e, data) + [r for r in [(e.get("breakdown") or {}).get("run"), _memory_run(e, data)] if r]
        lines.append(f"* {OVERHEAD_MODELS[m]}: {_commands(runs)}")
    return "\n".join(lines)


def _when(meta: dict) -> str:
    """When and at which commit a result was made, for rows whose figures are older than the
    code (a GPU is lent to a few sessions only: its figures wait for the next one)."""
    return f"{meta['date'][:10]}, commit {meta['git_commit'][:7]}"


def _gpu_overhead_rows() -> list[tuple[str, str, str]]:
    """The trainer against the plain loop on a GPU: ``bench.overhead --device cuda`` with torch's
    default AdamW (foreach) and with ``--fused-adamw`` (each model's step and overhead, the goal's
    verdict) and the fused end-to-end run's ``no-predict`` arm."""
    from bench.overhead import CUDA_GRAPH, GOAL_GPU_SPEED, time_goal

    rows = []
    for stem, optimizer in (("overhead_cuda", "AdamW foreach"), ("overhead_cuda_fused", "AdamW fused=True")):
        if not (RESULTS / f"{stem}.json").exists():
            continue
        data = _load(f"{stem}.json")
        models = {m: data["models"][m] for m in OVERHEAD_MODELS if m in data["models"]}
        names = " / ".join(OVERHEAD_MODELS[m] for m in models)

        def vs(arm: str, key: str, fmt: str) -> str:
            return _vs_plain((e["arms"] for e in models.values()), arm, key, fmt)

        steps = " / ".join(f"{e['arms']['plain']['time']['chunk_median_us']:.0f}" for e in models.values())
        verdicts = " / ".join(g["verdict"].split(" (")[0] for g in (time_goal(e, "cuda") for e in models.values()))
        device = (data.get("gpu") or "GPU").removeprefix("NVIDIA ")
        text = (f"plain step {steps} µs; `predict=False` {vs('predict=False', 'overhead_us', '+.0f')} µs, i.e. "
                f"{vs('predict=False', 'time_ratio', '.2f')}× the plain step (goal: ≥ {GOAL_GPU_SPEED:.2f}× the "
                f"plain loop's speed; here: {verdicts}); the floor of any per-step NaN guard "
                f"{vs(FLOOR, 'overhead_us', '+.0f')} µs; device memory `predict=False` "
                f"{vs('predict=False', 'memory_ratio', '.2f')}×, default {vs('default', 'memory_ratio', '.2f')}×")
        graph_goals = [CUDA_GRAPH in e["arms"] and time_goal(e, "cuda", CUDA_GRAPH) for e in models.values()]
        if all(graph_goals):
            replayed = [e["arms"][CUDA_GRAPH] for e in models.values()]
            graph_steps = " / ".join(f"{a['time']['chunk_median_us']:.0f}" for a in replayed)
            speeds = " / ".join(f"{1 / a['vs_plain']['time_ratio']:.1f}" for a in replayed)
            graph_verdicts = " / ".join(g["verdict"].split(" (")[0] for g in graph_goals)
            memory = ("" if not all(a.get("memory") for a in replayed) else
                      f"; device memory {vs(CUDA_GRAPH, 'memory_ratio', '.2f')}×")
            text += (f"; with its steady step replayed from a CUDA graph (`cuda_graph=True`, opt-in) "
                     f"{graph_steps} µs a step, "
                     f"{speeds}× the plain loop's speed ({graph_verdicts}{memory}; against the plain loop "
                     f"captured the same way, see docs/gpu.md)")
        cmds = _commands(run for e in models.values() for run in [*_time_runs(e, data), _memory_run(e, data)])
        rows.append((f"The trainer's cost per step on a GPU ({device}, {optimizer}; {_when(data)}), prediction off ({names})",
                     text, cmds))
    if not rows:
        return []
    fused = {t: RESULTS / f"e2e_{t}_cuda_fused.json" for t in ("charlm", "fashion")}
    if all(f.exists() for f in fused.values()):
        runs = [json.loads(f.read_text()) for f in fused.values()]
        rows.append((f"The trainer's cost in time on a GPU ({runs[0]['meta'].get('device', 'GPU').removeprefix('NVIDIA ')}, "
                     f"fused AdamW in every arm; {_when(runs[0]['meta'])}), prediction off "
                     "(`no-predict`; char-LM / Fashion-MNIST)",
                     "speed-up " + " / ".join(_speedup(d, "HybridTrainer (no-predict)") for d in runs)
                     + " (1.00× would be free)", _cmd(runs[0])))
    return rows


def _capacity_rows() -> list[tuple[str, str, str]]:
    """Training state per parameter, loss parity at the fewest bytes and the largest model trained
    here (``bench.capacity``, ``bench.capacity_parity``)."""
    if not (RESULTS / "capacity.json").exists() or not (RESULTS / "capacity_big.json").exists():
        return []
    sweep, big = _load("capacity.json"), _load("capacity_big.json")
    smallest = "in-backward + 4-bit + bf16"
    rows = []
    eager = sweep.get("eager_sweep", {}).get("fits", {})
    if "fp32 AdamW" in eager and smallest in eager:
        fp32, low = eager["fp32 AdamW"], eager[smallest]
        sizes = "/".join(sweep["eager_sweep"]["shapes"])
        rows.append((f"Training state per parameter (slope of peak memory over {sizes} GPTs)",
                     f"fp32 AdamW {fp32['bytes_per_param']:.2f} bytes/param; the stack's smallest (step in the backward + "
                     f"4-bit moments + bf16 weights) {low['bytes_per_param']:.2f} for the whole peak, "
                     f"{low['state_bytes_per_param']:.2f} without the activations (plan: "
                     f"{low['plan_bytes_per_param']:.2f} of training state); its step {low['step_time_factor']:.2f}× fp32's at the "
                     "largest size in that sweep, whose allocator setting (every freed buffer returned at once) "
                     "slows the eager low-bit update",
                     "`python -m bench.capacity --part eager-sweep`"))  # the file's own command is its last part's
    else:
        fits = sweep["sweep"]["fits"]
        rows.append(("Training state per parameter (slope of peak memory over 3 GPT sizes)",
                     f"fp32 AdamW {fits['fp32 AdamW']['bytes_per_param']:.2f} bytes/param; the stack's smallest "
                     f"{fits[smallest]['bytes_per_param']:.2f}", "`python -m bench.capacity --part sweep`"))
    if (RESULTS / "capacity_parity.json").exists():
        parity = _load("capacity_parity.json")
        gaps = []
        for task, label in TASKS.items():
            arm = parity["tasks"].get(task, {}).get("arms", {}).get(smallest, {})
            if "gap_pct" in arm:
                gaps.append((label, arm))
        if gaps:
            plan_bytes = gaps[0][1]["plan_bytes_per_param"]
            worst = max(arm["gap_pct"] for _, arm in gaps)
            # one-sided: the goal is a loss no more than 1% above fp32's
            verdict = ("within" if worst <= 1.0 else "not within") + " 1% of fp32 (one-sided)"
            bytes_verdict = ("≤ 3 bytes/param met" if plan_bytes <= 3.0 else
                             f"≤ 3 bytes/param not met: {plan_bytes:.2f} is the fewest (2 B bf16 weights + "
                             "2 × 0.5 B moments = 3.00 before the quantization scales)")

            def gap_text(label: str, arm: dict) -> str:
                ci = arm.get("paired_gap_ci95_pct")
                return (f"{arm['gap_pct']:+.2f}% ({label}, {len(arm['val_loss'])} seeds"
                        + (f"; paired 95% interval ±{ci:.2f}, {arm['noise_verdict']}" if ci is not None else "") + ")")

            rows.append((f"Loss parity of the smallest configuration ({plan_bytes:.2f} bytes/param of training state) "
                         "against fp32 AdamW",
                         "final validation loss " + " / ".join(gap_text(label, arm) for label, arm in gaps)
                         + f": {verdict}; {bytes_verdict}",
                         # the runs that measured this arm and its fp32 baseline (an arm re-run alone records its own)
                         " and ".join(dict.fromkeys(
                             f"`{t['arms'][a].get('run', t.get('run', {})).get('command', parity['command'])}`"
                             for t in parity["tasks"].values() for a in ("fp32 AdamW", smallest) if a in t["arms"]))))
    largest = max((row for row in big["big"] if "peak_rss" in row), key=lambda row: row["parameters"])
    losses = largest["losses"]
    head, tail = losses[:5], losses[-5:]
    rows.append(
        ("Largest model trained on this 24 GiB, 2-core machine (the planner choosing)",
         f"**{largest['parameters'] / 1e9:.2f}B** parameters (Llama-shaped), {len(losses)} steps on the King James text, "
         f"peak {largest['peak_rss'] / 2 ** 30:.2f} GiB (planned {largest['predicted_peak'] / 2 ** 30:.2f}), "
         f"{largest['peak_rss'] / largest['parameters']:.2f} bytes/param for the whole process, loss "
         f"{sum(head) / len(head):.2f} → {sum(tail) / len(tail):.2f} (mean of first / last 5 steps)",
         f"`{big['command']}`"))
    return rows


NOWCAST_ARMS = (("cosine+nc:trainer", "as the trainer runs it (`HybridConfig(predictor=\"nowcast\")`)"),
                ("cosine+nc:reset", "moments reset"))


def _nowcast_rows() -> list[tuple[str, str, str]]:
    """Learned nowcaster jumps on tasks it never saw, against the tuned cosine run (``bench.nowcast_heldout``),
    with the verdict its summary reads from the same runs."""
    path = RESULTS / "nowcast_heldout.json"
    if not path.exists():
        return []
    from bench.nowcast_heldout import _gmean, arm_runs, speedups, verdict

    data = _load("nowcast_heldout.json")
    parts = []
    for arm, label in NOWCAST_ARMS:
        cells = []
        for task, entry in data["tasks"].items():
            runs = arm_runs(entry, arm)
            if not runs:
                cells.append(f"{task} not run")
                continue
            _, sps, _ = speedups(runs, 0.75)
            cells.append(f"{task} {_gmean(sps):.2f}×" + ("" if len(sps) == len(runs) else f" ({len(sps)} of {len(runs)} seeds)")
                         if sps else f"{task} not reached")
        parts.append(f"{label}: " + ", ".join(cells))
    seeds = max(len(e["seeds"]) for e in data["tasks"].values())
    verdicts = [line.split(":** ", 1)[1] for line in verdict(data) if line.startswith("- **VERDICT")]
    said = "; ".join(f"{who}: {v}" for who, v in zip(("trainer's arm", "best arm"), verdicts))
    return [("Learned nowcaster jumps (opt-in, `predictor=\"nowcast\"`) over a tuned cosine schedule, held-out tasks",
             f"steps to the cosine run's loss at 75% of its steps: {'; '.join(parts)} "
             f"({data['steps']} steps, ≤ {seeds} seeds; goal ≥ 1.5× steps and ≥ 1.3× wall-clock — {said})",
             " ".join(f"`{c}`" for c in data.get("commands") or [data["command"]]))]



def _fm16_rows() -> list[tuple[str, str, str]]:
    """The nowcaster on NiNo's own FM-16 protocol (``bench.nowcast_fm16``): steps to NiNo's two accuracy
    targets for every arm that ran, beside NiNo's checkpoint's figures (a reference the file carries)."""
    path = RESULTS / "nowcast_fm16.json"
    if not path.exists():
        return []
    from bench.nowcast_fm16 import NINO_REFERENCE, reach

    data = _load("nowcast_fm16.json")
    rows = dict(data["runs"])
    if data.get("cosine_lr") is not None:
        rows["cosine"] = data["tuning"][str(data["cosine_lr"])]
    steps = lambda r: " / ".join(f"{s:,}" if s is not None else "never"  # noqa: E731
                                 for s in (reach(r["curve"], t)[0] for t in data["targets"]))
    nino = NINO_REFERENCE["the same + NiNo every 1,000 steps"]["steps"]
    ok = [a for a, r in data["runs"].items() if "+nc" in a
          and all(s is not None and s <= n for s, n in zip((reach(r["curve"], t)[0] for t in data["targets"]), nino))]
    t1, t2 = (f"{100 * t:.1f}%" for t in data["targets"])
    cells = ", ".join(f"`{a}` {steps(r)} (final {100 * r['final_acc']:.2f}%)" for a, r in rows.items())
    return [("Learned nowcaster on NiNo's own FM-16 protocol (Fashion-MNIST CNN, 10,000 steps, one seed)",
             f"steps to {t1} / {t2} test accuracy: {cells}; NiNo's checkpoint every 1,000 steps, run with the authors' "
             f"code on this machine: {nino[0]:,} / {nino[1]:,} "
             f"(final {100 * NINO_REFERENCE['the same + NiNo every 1,000 steps']['final_acc']:.2f}%) — "
             + (f"**at least NiNo's figures**: {', '.join(f'`{a}`' for a in ok)}" if ok else "**no arm reaches NiNo's figures**"),
             " ".join(f"`{c}`" for c in data.get("commands") or [data["command"]]))]

E2E_COLUMNS = (("HybridTrainer (default)", "trainer (default)"), ("HybridTrainer (no-predict)", "`predict=False`"),
               ("HybridTrainer (muon)", "trainer over Muon + AdamW"), ("Muon + AdamW", "plain Muon + AdamW"),
               ("HybridTrainer (schedule-free)", "trainer over schedule-free"),
               ("Schedule-free AdamW", "plain schedule-free"), ("HybridTrainer (weight-average)", "`weight_average=True`"),
               ("AdamW + weight average", "plain AdamW + weight average"), ("AdamW (2x lr)", "AdamW 2× lr"))


def e2e() -> str:
    """Speed-up to the tuned AdamW loop's target of every arm of the end-to-end benchmark."""
    lines = ["| task | tuned AdamW: time to target | " + " | ".join(label for _, label in E2E_COLUMNS) + " |",
             "|---" * (len(E2E_COLUMNS) + 2) + "|"]
    for task, label in TASKS.items():
        data = _e2e(task)
        tuned = data["arms"]["AdamW (tuned lr)"]["summary"]["time_to_target_s"]
        cells = [_speedup(data, arm) for arm, _ in E2E_COLUMNS]
        lines.append(f"| {label} | {tuned['mean']:.2f} ± {tuned['std']:.2f} s | " + " | ".join(cells) + " |")
    return "\n".join(lines)


TABLES: dict[str, Callable[[], str]] = {"status": status, "e2e": e2e, "overhead": overhead}


def render(text: str) -> str:
    """``text`` with every marked table regenerated; an unknown table name is an error."""
    def fill(match: re.Match) -> str:
        name = match.group("name")
        if name not in TABLES:
            raise ValueError(f"README table {name!r}: no generator (known: {sorted(TABLES)})")
        return f"{match.group(1)}{TABLES[name]()}\n{match.group(4)}"

    return MARKER.sub(fill, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table is out of date")
    args = parser.parse_args(argv)
    text = args.readme.read_text()
    names = [m.group("name") for m in MARKER.finditer(text)]
    if not names:
        parser.error(f"--readme: {args.readme} has no <!-- table:NAME --> ... <!-- /table --> region")
    new = render(text)
    if args.check:
        if new != text:
            print(f"{args.readme}: tables out of date with the result JSON (run python -m bench.readme_tables)",
                  file=sys.stderr)
            return 1
        return 0
    args.readme.write_text(new)
    print(f"rewrote {len(names)} table(s) in {args.readme}: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The project's nowcaster on NiNo's own FM-16 protocol, beside NiNo's figures for that protocol.

FM-16 (Knyazev et al., ICLR 2025): a 3-layer CNN with 16/32/32 channels (3x3 stride-2
convolutions, ReLU, global average pooling, linear head; 14,378 parameters) on the first 55k
Fashion-MNIST training images, batch 128, 10,000 steps, one seed, test accuracy on the 10k test
images every 200 steps (steps to a target are accurate to +-200).

Arms (every arm: the same initialisation and batch stream):

* ``adam``: Adam at a constant 6e-3 (NiNo's baseline).
* ``adam+nc``: the same with the project's nowcaster every 1,000 steps, NiNo's horizon schedule
  (40, 33, ..., 1 snapshot spacings) and Adam's state kept, as NiNo is run.
* ``cosine``: AdamW (weight decay 0.01), 5% warm-up then cosine decay, its peak rate the best
  final validation loss over ``--cosine-grid`` on this seed (NiNo's reference tuning).
* ``cosine+nc:reset``: the tuned cosine run with the same jumps every 1,000 steps, Adam's
  moments cleared at each jump (the best held-out arm, :mod:`bench.nowcast_heldout`).
* ``cosine+nc:trainer``: the tuned cosine run with the controller ``HybridConfig(predictor=
  "nowcast")`` builds (its defaults: a judged jump every 300 steps, horizons capped at 16).

The nowcaster reads snapshots at its own spacing (50 steps; NiNo reads 5 states 200 steps apart).
NiNo's figures beside ours (:data:`NINO_REFERENCE`) were measured with the authors' public code
and checkpoint on the same kind of 2-core CPU, one thread, on their own data pipeline; they are a
reference, not produced by this command.

    OMP_NUM_THREADS=1 python -m bench.nowcast_fm16      # about 12 minutes of one core
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from bench import nowcast_heldout as heldout
from bench.nowcaster_meta import ROOT
from bench.protocol import run_metadata
from hybrid_trainer import nowcaster as nc

SPEC = dict(arch="cnn", data="fashion55k", channels=[16, 32, 32], batch=128, nino_layout=True)
TARGETS = (0.885, 0.893)  # NiNo's intermediate and high test-accuracy targets on FM-16
# NiNo's public checkpoint on FM-16, seed 1000, one CPU thread (the authors' code, run unmodified):
# steps to 88.5% / 89.3% test accuracy (None: never), best / final accuracy, final test loss.
NINO_REFERENCE = {
    "Adam, constant lr 6e-3 (NiNo's baseline)": dict(steps=(6400, None), best_acc=0.8920, final_acc=0.8856,
                                                     final_loss=0.312),
    "the same + NiNo every 1,000 steps": dict(steps=(3600, 4400), best_acc=0.8948, final_acc=0.8928, final_loss=0.320),
    "AdamW lr 1e-2, warm-up + cosine (tuned over 3e-3, 1e-2)": dict(steps=(5200, 6400), best_acc=0.8989,
                                                                  final_acc=0.8977, final_loss=0.285),
}


def reach(curve: list[dict[str, Any]], acc: float) -> tuple[int | None, float | None]:
    """The first evaluated step (and training seconds) at which test accuracy is at least ``acc``."""
    for c in curve:
        if c["acc"] >= acc:
            return c["step"], c["train_s"]
    return None, None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.nowcast_fm16", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--call-every", type=int, default=1000)
    parser.add_argument("--adam-lr", type=float, default=6e-3)
    parser.add_argument("--cosine-grid", nargs="*", type=float, default=[3e-3, 1e-2])
    parser.add_argument("--arms", nargs="*", default=["adam", "adam+nc", "cosine", "cosine+nc:reset",
                                                      "cosine+nc:trainer"])
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "nowcast_fm16"))
    parser.add_argument("--summarise", action="store_true", help="only rebuild the .md from the .json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    json_path = out.with_suffix(".json")
    if args.summarise:
        summarise(json.loads(json_path.read_text()), out)
        return
    results = json.loads(json_path.read_text()) if json_path.exists() else {}
    # Each invocation may add arms to the same file: every command that contributed is kept.
    earlier = results.get("commands") or ([results["command"]] if "command" in results else [])
    results.update(run_metadata("python -m bench.nowcast_fm16 " + " ".join(argv if argv is not None
                                                                            else __import__("sys").argv[1:])),
                   spec=SPEC, seed=args.seed, steps=args.steps, eval_every=args.eval_every,
                   call_every=args.call_every, spacing=nc.DEFAULT_SPACING, schedule=list(heldout.SCHEDULE),
                   targets=list(TARGETS), threads=1, nino_reference=NINO_REFERENCE)
    results["commands"] = earlier + ([results["command"]] if results["command"] not in earlier else [])
    runs = results.setdefault("runs", {})
    tuning = results.setdefault("tuning", {})
    caster = nc.load_nowcaster()
    spec = dict(SPEC, seed=args.seed)
    kw = dict(steps=args.steps, spacing=nc.DEFAULT_SPACING, call_every=args.call_every, eval_every=args.eval_every)

    def save() -> None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(results, indent=1))

    for arm in args.arms:
        base, jumps_on, options = heldout.parse_arm(arm)
        if base == "cosine":
            for lr in args.cosine_grid:  # the tuning runs are the cosine arm's candidates
                if str(lr) not in tuning:
                    r = heldout.run_arm(spec, lr, "cosine", None, "keep", **kw)
                    tuning[str(lr)] = r
                    print(f"cosine lr {lr:g}: final loss {r['final_loss']:.4f} acc {r['final_acc']:.4f}, "
                          f"{r['train_s']:.0f}s", flush=True)
                    save()
            if arm == "cosine":  # the best of the tuning runs (every rate tried so far) is the arm
                continue
            missing = [lr for lr in args.cosine_grid if str(lr) not in tuning]
            if missing:
                raise ValueError(f"cosine rates {missing} are not tuned yet: run --arms cosine first")
            lr = float(min(tuning, key=lambda k: tuning[k]["final_loss"]))
        else:
            lr = args.adam_lr
        if arm in runs:
            continue
        moments = next((o for o in options if o in ("reset", "trainer")), "keep")
        r = runs[arm] = heldout.run_arm(spec, lr, base, caster if jumps_on else None, moments, **kw)
        print(f"{arm}: final loss {r['final_loss']:.4f} acc {r['final_acc']:.4f}, {r['train_s']:.0f}s "
              f"(nowcaster {r['nowcaster_s']:.2f}s)", flush=True)
        save()
    if tuning:
        results["cosine_lr"] = float(min(tuning, key=lambda k: tuning[k]["final_loss"]))
    save()
    summarise(results, out)


def summarise(results: dict[str, Any], out: Path) -> None:
    t1, t2 = (f"{100 * t:.1f}%" for t in results["targets"])
    lines = ["# The nowcaster on NiNo's FM-16 protocol", "",
             "Commands (each adds its arms to the same file): "
             + ", ".join(f"`OMP_NUM_THREADS=1 {c}`" for c in results.get("commands") or [results["command"]]),
             "", f"Last run: git commit {results['git_commit']}, {results['date']}, one CPU thread on a shared "
                 "2-core machine: wall-clock noisy.", "",
             f"3-layer 16/32/32 CNN on the first 55k Fashion-MNIST training images, batch 128, {results['steps']:,} "
             f"steps, seed {results['seed']}, test accuracy and loss on the 10k test images every "
             f"{results['eval_every']} steps. Nowcast arms: a jump every {results['call_every']} steps "
             f"(`cosine+nc:trainer`: the trainer's defaults, a judged jump every 300 steps with horizons capped "
             f"at 16), horizons {results['schedule']} snapshot spacings of {results['spacing']} steps. "
             + (f"Cosine tuned over {sorted(float(k) for k in results['tuning'])} on this seed (final test loss "
                + ", ".join(f"{k}: {v['final_loss']:.4f}" for k, v in results["tuning"].items())
                + f") -> {results.get('cosine_lr')}." if results.get("tuning") else "The cosine arm has not run yet."),
             "",
             "## This repository's nowcaster", "",
             f"| arm | steps to {t1} | steps to {t2} | best / final accuracy | final test loss | "
             f"train s to {t1} / {t2} | train s | nowcaster s (calls) |",
             "|---|---|---|---|---|---|---|---|"]
    fmt = lambda x: f"{x:,}" if x is not None else "never"  # noqa: E731
    sec = lambda x: f"{x:.0f}" if x is not None else "–"  # noqa: E731
    rows = dict(results["runs"])
    for lr, r in results["tuning"].items():
        rows["cosine" if float(lr) == results.get("cosine_lr") else f"cosine at {float(lr):g} (not chosen)"] = r
    for arm, r in rows.items():
        (s1, w1), (s2, w2) = (reach(r["curve"], t) for t in results["targets"])
        calls = len([j for j in r["jumps"] if j.get("event", "jump") == "jump"])
        lines.append(f"| {arm} | {fmt(s1)} | {fmt(s2)} | {100 * max(c['acc'] for c in r['curve']):.2f}% / "
                     f"{100 * r['final_acc']:.2f}% | {r['final_loss']:.3f} | {sec(w1)} / {sec(w2)} | "
                     f"{r['train_s']:.0f} | {r['nowcaster_s']:.2f} ({calls}) |")
    lines += ["", "## NiNo's checkpoint on the same protocol (reference, not produced by this command)", "",
              "Measured with the authors' public code and checkpoint, unmodified, on the same kind of 2-core CPU, "
              "one thread, seed 1000, on their data pipeline; steps accurate to ±200.", "",
              f"| arm | steps to {t1} | steps to {t2} | best / final accuracy | final test loss |", "|---|---|---|---|---|"]
    for arm, r in results["nino_reference"].items():
        lines.append(f"| {arm} | {fmt(r['steps'][0])} | {fmt(r['steps'][1])} | {100 * r['best_acc']:.2f}% / "
                     f"{100 * r['final_acc']:.2f}% | {r['final_loss']:.3f} |")
    lines += ["", "## Against NiNo", ""] + verdict(results) + [""]
    jump_rows = [f"| {arm} | " + " ".join(f"{j['pre_acc'] * 100:.1f}→{j['post_acc'] * 100:.1f}%" for j in r["jumps"]) + " |"
                 for arm, r in results["runs"].items() if r["jumps"] and "pre_acc" in r["jumps"][0]]
    if jump_rows:
        lines += ["Test accuracy right before → right after each jump:", "", "| arm | jumps |", "|---|---|"] + jump_rows + [""]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def verdict(results: dict[str, Any]) -> list[str]:
    """Per nowcast arm: its steps to both targets against NiNo's, then like with like: its speed-up
    in steps over this repository's own plain loop of the same optimizer and over the tuned cosine
    run, beside NiNo's speed-up over its Adam baseline and over its tuned cosine run."""
    ref = results["nino_reference"]
    nino = ref["the same + NiNo every 1,000 steps"]["steps"]
    nino_over = {"adam": ref["Adam, constant lr 6e-3 (NiNo's baseline)"]["steps"],
                 "cosine": ref["AdamW lr 1e-2, warm-up + cosine (tuned over 3e-3, 1e-2)"]["steps"]}
    plain = {"adam": results["runs"].get("adam"),
             "cosine": results.get("tuning", {}).get(str(results.get("cosine_lr")))}

    def ratio(base: int | None, arm: int | None) -> str:
        if arm is None:
            return "never reached"
        return f"{base / arm:.2f}×" if base is not None else "the plain loop never reached it"

    lines = []
    for arm, r in results["runs"].items():
        if "+nc" not in arm:
            continue
        ours = [reach(r["curve"], t)[0] for t in results["targets"]]
        ok = all(o is not None and n is not None and o <= n for o, n in zip(ours, nino))
        line = (f"- `{arm}`: {' / '.join(f'{o:,}' if o is not None else 'never' for o in ours)} steps to the two "
                f"targets against NiNo's {nino[0]:,} / {nino[1]:,}: "
                + ("**at least NiNo's figures**" if ok else "**short of NiNo's figures**") + ".")
        own = arm.split("+")[0]
        for name in dict.fromkeys((own, "cosine")):
            if plain.get(name) is None or name not in nino_over:
                continue
            base = [reach(plain[name]["curve"], t)[0] for t in results["targets"]]
            line += (f" Over this repository's `{name}` run: "
                     + " / ".join(ratio(b, o) for b, o in zip(base, ours))
                     + f" (NiNo over its {'Adam baseline' if name == 'adam' else 'tuned cosine run'}: "
                     + " / ".join(ratio(b, o) for b, o in zip(nino_over[name], nino)) + ").")
        lines.append(line)
    return lines


if __name__ == "__main__":
    main()

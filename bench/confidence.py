"""Does the dynamics model's confidence predict which predicted phases a verification accepts?

    python -m bench.confidence [--tasks fashion charlm digits] [--seeds 3] [--out docs/results]

The trainer enters PREDICT only when its confidence (geometric mean of the running acceptance
rate and the dynamics model's confidence at the phase's horizon) passes a threshold. Whether that
gate can work depends on the confidence ranking accepted predictions above rejected ones. This
benchmark forces prediction on (``bench.e2e.FORCED_PREDICTION``: worth and confidence thresholds
at their floor, never switched off; the verdicts across the whole run are wanted, not the
gate's choice of them) so every phase decision predicts, and records at each verification: the
horizon, the dynamics model's confidence at it (from the forecast the phase started with), the
running acceptance estimate, their combination, and the verdict. Reported per task: acceptance
rate, ROC AUC of each score for acceptance (0.5 = no information, 1 = perfect ranking), and
the acceptance rate per confidence quartile. Writes ``<out>/confidence.{json,md,png}``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import statistics
import sys
from pathlib import Path

import torch

from hybrid_trainer import HybridConfig, HybridTrainer, Phase

from .e2e import FORCED_PREDICTION
from .tasks import get_task

TUNED_LR = {"fashion": 1e-3, "charlm": 2e-3, "digits": 3e-3}  # the end-to-end benchmark's sweeps
SCORES = ("dynamics_confidence", "acceptance_estimate", "combined_confidence")


def verifications(task, seed: int, lr: float, steps: int) -> tuple[list[dict], dict]:
    """One forced run; returns (a record per verification, the trainer's statistics)."""
    model = task.make_model(seed)
    trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=lr), task.loss_fn,
                            HybridConfig(**FORCED_PREDICTION))
    stream = task.batches(seed)
    records = []
    for _ in range(steps):
        ctl = trainer.controller
        scores = None
        if ctl.phase is Phase.PREDICT:
            horizon = ctl.phase_step + 1
            dynamics = trainer.dynamics
            # The forecast is the one the phase started from: it is refreshed on real steps only.
            model_conf = dynamics.confidence(trainer.forecaster.forecast, min(horizon, dynamics.horizon),
                                             trainer.loss_trend.noise_std)
            estimate = ctl.acceptance_estimate()
            scores = dict(step=trainer.step_count, horizon=horizon, phase_length=ctl.length,
                          dynamics_confidence=model_conf, acceptance_estimate=estimate,
                          combined_confidence=math.sqrt(model_conf * estimate))
        result = trainer.step(next(stream))
        if scores is not None and result.verified:
            records.append(dict(scores, accepted=bool(result.accepted), loss=result.loss,
                                forecast_loss=result.predicted_loss))
    s = trainer.statistics()
    return records, {k: s[k] for k in ("predicted_steps", "predicted_steps_kept", "predict_phases",
                                       "predict_phases_rejected", "verifications", "verifications_accepted",
                                       "prediction_enabled", "prediction_disabled_reason")}


def roc_auc(scores: list[float], labels: list[bool]) -> float | None:
    """P(score of an accepted > score of a rejected), ties counting half; None without both kinds."""
    accepted = [s for s, y in zip(scores, labels) if y]
    rejected = [s for s, y in zip(scores, labels) if not y]
    if not accepted or not rejected:
        return None
    wins = sum((a > r) + 0.5 * (a == r) for a in accepted for r in rejected)
    return wins / (len(accepted) * len(rejected))


def quartile_rates(scores: list[float], labels: list[bool]) -> list[dict]:
    """Acceptance rate in each quarter of the verifications ordered by score."""
    ordered = sorted(zip(scores, labels))
    n = len(ordered)
    out = []
    for q in range(4):
        part = ordered[q * n // 4:(q + 1) * n // 4]
        if part:
            out.append(dict(score_min=part[0][0], score_max=part[-1][0], n=len(part),
                            acceptance=sum(y for _, y in part) / len(part)))
    return out


def summarise(records: list[dict]) -> dict:
    labels = [r["accepted"] for r in records]
    summary = dict(verifications=len(records),
                   acceptance_rate=statistics.fmean(labels) if labels else None,
                   auc={k: roc_auc([r[k] for r in records], labels) for k in SCORES},
                   quartiles={k: quartile_rates([r[k] for r in records], labels) for k in SCORES})
    by_horizon: dict[int, list[bool]] = {}
    for r in records:
        by_horizon.setdefault(r["horizon"], []).append(r["accepted"])
    summary["acceptance_by_horizon"] = {h: dict(n=len(v), acceptance=statistics.fmean(v))
                                        for h, v in sorted(by_horizon.items())}
    return summary


def markdown(results: dict, command: str) -> str:
    lines = ["# Does the trainer's confidence predict acceptance?", "",
             f"`{command}` ({results['date']}, torch {results['torch']}, 1 thread). Prediction forced on in "
             "every phase decision; one row per task over all seeds. AUC: probability that an accepted "
             "verification scored above a rejected one (0.5 = no information).", "",
             "| task | verifications | accepted | AUC dynamics confidence | AUC acceptance estimate | "
             "AUC combined | acceptance by dynamics-confidence quartile (low → high) |",
             "|---|---|---|---|---|---|---|"]

    def num(v):
        return "–" if v is None else f"{v:.2f}"

    for task, r in results["tasks"].items():
        s = r["summary"]
        quarts = " / ".join(f"{q['acceptance']:.0%}" for q in s["quartiles"]["dynamics_confidence"])
        lines.append(f"| {task} | {s['verifications']} | {num(s['acceptance_rate'])} | "
                     f"{num(s['auc']['dynamics_confidence'])} | {num(s['auc']['acceptance_estimate'])} | "
                     f"{num(s['auc']['combined_confidence'])} | {quarts} |")
    lines += ["", "Acceptance by horizon (predicted steps since the phase began):", ""]
    for task, r in results["tasks"].items():
        per = ", ".join(f"{h}: {v['acceptance']:.0%} of {v['n']}" for h, v in r["summary"]["acceptance_by_horizon"].items())
        lines.append(f"* {task}: {per}")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SCORES), figsize=(12, 3.8), sharey=True)
    for ax, score in zip(axes, SCORES):
        for task, r in results["tasks"].items():
            quarts = r["summary"]["quartiles"][score]
            if quarts:
                centres = [(q["score_min"] + q["score_max"]) / 2 for q in quarts]
                ax.plot(centres, [q["acceptance"] for q in quarts], marker="o", label=task)
        ax.set_xlabel(f"{score.replace('_', ' ')} (quartile centre)")
        ax.set_title(score.replace("_", " "), fontsize=9)
    axes[0].set_ylabel("share of verifications accepted")
    axes[0].legend(fontsize=8)
    fig.suptitle("Acceptance against the trainer's confidence scores (prediction forced on)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=["fashion", "charlm", "digits"], choices=sorted(TUNED_LR))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the tasks' quick sizes (tests)")
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    command = "python -m bench.confidence " + " ".join(argv if argv is not None else sys.argv[1:])
    results = dict(command=command, date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                   torch=torch.__version__, forced_config=FORCED_PREDICTION, tasks={})
    for name in args.tasks:
        task = get_task(name, quick=args.quick)
        runs, stats = [], []
        for seed in range(args.seeds):
            records, s = verifications(task, seed, TUNED_LR[name], task.steps)
            runs.append(records)
            stats.append(s)
            print(f"{name} seed {seed}: {len(records)} verifications, "
                  f"{sum(r['accepted'] for r in records)} accepted", flush=True)
        results["tasks"][name] = dict(lr=TUNED_LR[name], steps=task.steps, data_source=task.data_source,
                                      summary=summarise([r for run in runs for r in run]),
                                      trainer_statistics=stats, records=runs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "confidence.json").write_text(json.dumps(results, indent=1))
    (args.out / "confidence.md").write_text(markdown(results, command))
    plot(results, args.out / "confidence.png")
    print("\n" + markdown(results, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())

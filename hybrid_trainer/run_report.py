"""What a run reports: one step's :class:`StepResult`, the run's counters
(:class:`RunStatistics`) and their human-readable summary."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .phases import Phase


@dataclass
class StepResult:
    """What one ``trainer.step`` did."""

    step: int
    phase: str
    loss: float | None  # training loss (real steps) or verification loss (verified predicted steps)
    backward_done: bool
    predicted_loss: float | None = None  # loss the trajectory forecast expected at a verification
    verified: bool = False
    accepted: bool | None = None  # outcome of the verification, None if none happened
    rolled_back: bool = False
    skipped: bool = False  # a real step whose update was refused (non-finite or divergent)
    divergence: str = "OK"
    grad_norm: float | None = None
    lr: float | None = None
    confidence: float | None = None
    wall_time_s: float = 0.0


@dataclass
class RunStatistics:
    steps_by_phase: dict[str, int] = field(default_factory=lambda: {p.value: 0 for p in Phase})
    time_by_phase_s: dict[str, float] = field(default_factory=lambda: {p.value: 0.0 for p in Phase})
    backward_passes: int = 0
    forward_passes: int = 0
    optimizer_steps: int = 0
    predicted_steps: int = 0
    predicted_steps_kept: int = 0
    predicted_steps_rolled_back: int = 0
    verifications: int = 0
    verifications_accepted: int = 0
    predict_phases: int = 0
    predict_phases_rejected: int = 0
    divergence_rollbacks: int = 0
    skipped_steps: int = 0
    trained_set_changes: int = 0  # freezing / unfreezing followed (see _follow_trainable_change)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """In place: the collaborators hold this object."""
        vars(self).update(vars(RunStatistics(**state)))


def format_summary(s: dict[str, Any]) -> str:
    """A short human-readable report of :meth:`HybridTrainer.statistics` ``s``."""
    lines = [
        f"steps {s['steps']}: " + ", ".join(f"{k} {v}" for k, v in s["steps_by_phase"].items()),
        f"backward passes {s['backward_passes']} done, {s['backward_passes_saved']} saved "
        f"({100 * s['backward_saved_fraction']:.1f}% of steps predicted)",
        f"predicted steps {s['predicted_steps']}: {s['predicted_steps_kept']} kept, "
        f"{s['predicted_steps_rolled_back']} rolled back; verifications {s['verifications']} "
        f"({s['verifications_accepted']} accepted); predict phases {s['predict_phases']} "
        f"({s['predict_phases_rejected']} rejected)",
        f"divergence rollbacks {s['divergence_rollbacks']}, skipped updates {s['skipped_steps']}",
        "time per phase: " + ", ".join(f"{k} {v:.2f}s" for k, v in s["time_by_phase_s"].items()),
    ]
    if s["dynamics_error_by_horizon"]:
        errs = s["dynamics_error_by_horizon"]
        shown = {h: errs[h] for h in sorted(errs) if h in (1, 2, 4, 8, 16, 32) or h == max(errs)}
        lines.append("dynamics |error| by horizon (loss units): "
                     + ", ".join(f"h{h} {v:.3g}" for h, v in shown.items())
                     + f"; batch noise {s['loss_noise_std']:.3g}")
    if not s["prediction_enabled"]:
        lines.append(f"prediction disabled: {s['prediction_disabled_reason']}")
    return "\n".join(lines)

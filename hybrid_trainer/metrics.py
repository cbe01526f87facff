"""Per-step metrics as JSON lines, and a plot of a run with its phases shaded.

One record per line, strict JSON (RFC 8259): non-finite floats become ``null``, so any JSON reader can load
the file. Each line is flushed as soon as it is logged, so a crashed run keeps every record logged before
the crash; :func:`read_jsonl` tolerates a torn final line (a crash in the middle of a write).

Record fields the plot understands (others are kept and ignored): ``step`` (int), ``phase``
("WARMUP", "FULL", "PREDICT", "CORRECT"), ``loss`` (training loss of the step, or None when no loss was
computed), ``verify_loss`` (forward-only loss of a verification), ``predicted_loss`` (what the trainer
expected that verification to give), ``rejected`` (bool, the verification failed and the weights were rolled
back), ``val_loss`` (held-out loss).
"""
from __future__ import annotations

import enum
import json
import math
import numbers
import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["MetricsLogger", "read_jsonl", "plot_run", "to_json_safe", "PHASE_COLOURS"]

#: Light shading per phase (the figure is meant to be read with the loss curve on top).
PHASE_COLOURS = {
    "WARMUP": "#d9d9d9",   # grey: nothing to learn yet
    "FULL": "#c6dbef",     # light blue: normal optimizer steps
    "PREDICT": "#c7e9c0",  # light green: backward passes skipped
    "CORRECT": "#fdd0a2",  # light orange: optimizer steps that recalibrate the predictor
}
# For phase names outside the four above, so that they still get a distinct shade.
_EXTRA_COLOURS = ["#dadaeb", "#fcbba1", "#f6e8c3", "#c7eae5", "#fde0ef"]


def to_json_safe(value, _where: str = "record"):
    """Convert ``value`` into plain JSON types.

    Non-finite floats become None; numpy/torch scalars and arrays become Python numbers and lists (via
    ``tolist``); enums become their name (so an ``IntEnum`` phase logs as "PREDICT", not 2); tuples become
    lists; mapping keys become strings. Anything else raises ``TypeError`` naming where it sits.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else None
    if isinstance(value, Mapping):
        return {str(key): to_json_safe(item, f"{_where}[{key!r}]") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_safe(item, f"{_where}[{i}]") for i, item in enumerate(value)]
    if hasattr(value, "tolist"):  # numpy scalars/arrays, torch tensors (moved to CPU by tolist)
        return to_json_safe(value.tolist(), _where)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"{_where} has a value of type {type(value).__name__} that cannot be written as JSON")


class MetricsLogger:
    """Appends metric records to a JSON-lines file and keeps them in ``self.records``.

    Args:
        path: file to append to (created with its parent folders; an existing file is continued, which is
            what a resumed run wants), or None to keep records in memory only.
        fsync: also ``os.fsync`` after each line, so records survive a power loss, not just a process crash
            (slower; off by default).
        keep_records: also keep every record in ``self.records`` (memory grows with the run; a
            long run that logs to a file should pass False).
    """

    def __init__(self, path: str | os.PathLike | None, fsync: bool = False, keep_records: bool = True):
        self.path = Path(path) if path is not None else None
        self.fsync = bool(fsync)
        self.keep_records = bool(keep_records)
        self.records: list[dict] = []
        self._file = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")

    @property
    def closed(self) -> bool:
        return self.path is not None and self._file is None

    def log(self, record: dict) -> None:
        """Write one record as one JSON line and flush it; the stored copy is the JSON-safe form."""
        if not isinstance(record, Mapping):
            raise TypeError(f"record must be a dict, got {type(record).__name__}")
        if self.closed:
            raise ValueError(f"MetricsLogger for {self.path} is closed")
        safe = to_json_safe(record)
        if self._file is not None:
            # allow_nan=False double-checks the conversion: the file must stay strict JSON.
            line = json.dumps(safe, allow_nan=False, separators=(",", ":"))
            self._file.write(line + "\n")
            self._file.flush()
            if self.fsync:
                os.fsync(self._file.fileno())
        if self.keep_records:
            self.records.append(safe)

    def close(self) -> None:
        """Close the file (idempotent). The in-memory records stay available."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.close()

    def __del__(self):  # a logger dropped without close() should not leak a file handle
        try:
            self.close()
        except Exception:
            pass


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read the records of a JSON-lines file.

    Blank lines are skipped. A final line that is cut off (no trailing newline and not valid JSON: the
    writer crashed mid-write) is dropped; a bad line anywhere else raises ``ValueError`` with its line number.
    """
    text = Path(path).read_text(encoding="utf-8")
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            is_torn_tail = number == len(lines) and not text.endswith("\n")
            if is_torn_tail:
                break
            raise ValueError(f"{path}: line {number} is not valid JSON: {exc.msg}") from exc
        if not isinstance(record, dict):
            raise ValueError(f"{path}: line {number} is a JSON {type(record).__name__}, expected an object")
        records.append(record)
    return records


def _finite(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _phase_spans(records: list[dict]) -> list[tuple[str, int, int]]:
    """Contiguous runs of one phase as (phase, first step, last step), in step order."""
    spans: list[tuple[str, int, int]] = []
    for record in records:
        phase = record.get("phase")
        if phase is None:
            continue
        phase = str(phase)
        step = record["step"]
        if spans and spans[-1][0] == phase:
            spans[-1] = (phase, spans[-1][1], step)
        else:
            spans.append((phase, step, step))
    return spans


def require_matplotlib(feature: str) -> None:
    """Plots need matplotlib, an optional dependency (the ``plot`` extra); the trainer trains
    without it. Raises ImportError naming the extra when it is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise ImportError(f"{feature} draws with matplotlib, which is not installed: "
                          "pip install 'hybrid-trainer[plot]' (or matplotlib)") from error


def plot_run(records: list[dict] | str | os.PathLike, path: str | os.PathLike, title: str | None = None,
             log_scale: bool | None = None) -> None:
    """Save a PNG of loss over steps with phases shaded.

    Args:
        records: metric records, or the path of a JSON-lines file written by :class:`MetricsLogger`.
        path: PNG file to write (parent folders are created).
        title: figure title.
        log_scale: log y axis; None chooses it when all plotted losses are positive and span more than a
            factor of 10.

    Drawn: training loss as a line with dots (broken where a step has no loss), accepted verification losses as green
    circles, rejected ones as red crosses, predicted losses as hollow diamonds, validation loss as a black
    dashed line with dots, and each contiguous span of a phase as a light band (one legend entry per phase).
    """
    if isinstance(records, (str, os.PathLike)):
        records = read_jsonl(records)
    records = [dict(r) for r in records]
    if not records:
        raise ValueError("records is empty: nothing to plot")
    for i, record in enumerate(records):
        if not isinstance(record.get("step"), numbers.Integral) or isinstance(record.get("step"), bool):
            raise ValueError(f"records[{i}] has no integer 'step'")
    records.sort(key=lambda r: r["step"])  # stable: several records at one step keep their order

    # Build the figure without pyplot: no global backend switch, no figure registry, safe in any process.
    require_matplotlib("plot_run")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    figure = Figure(figsize=(10, 5), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)

    def series(key, keep=lambda r: True):
        pairs = [(r["step"], r[key]) for r in records if _finite(r.get(key)) and keep(r)]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def is_verification(r):
        return _finite(r.get("verify_loss"))

    _, losses = series("loss")  # finite training losses, for the y-scale decision
    # The drawn curve breaks (NaN) wherever a step has no loss, e.g. across a PREDICT span, so that the
    # figure does not suggest losses that were never measured.
    curve_steps = [r["step"] for r in records]
    curve_losses = [r["loss"] if _finite(r.get("loss")) else math.nan for r in records]
    verify_steps, verify_losses = series("verify_loss", lambda r: not r.get("rejected"))
    # A rejected verification is drawn at its verify_loss, or at the step's loss when only that was logged.
    rejected = [(r["step"], r["verify_loss"] if is_verification(r) else r.get("loss"))
                for r in records if r.get("rejected")]
    rejected = [(s, v) for s, v in rejected if _finite(v)]
    predicted_steps, predicted_losses = series("predicted_loss")
    val_steps, val_losses = series("val_loss")

    handles = []
    if losses:
        axes.plot(curve_steps, curve_losses, color="#1f4e79", linewidth=1.0, marker=".", markersize=3, zorder=3)
        handles.append(Line2D([], [], color="#1f4e79", marker=".", markersize=3, label="train loss"))
    if verify_losses:
        axes.scatter(verify_steps, verify_losses, marker="o", s=28, color="#238b45", zorder=4)
        handles.append(Line2D([], [], marker="o", linestyle="", color="#238b45", label="verification (accepted)"))
    if rejected:
        axes.scatter([s for s, _ in rejected], [v for _, v in rejected], marker="x", s=48, color="red",
                     linewidths=2, zorder=5)
        handles.append(Line2D([], [], marker="x", linestyle="", color="red", markeredgewidth=2,
                              label="verification (rejected)"))
    if predicted_losses:
        axes.scatter(predicted_steps, predicted_losses, marker="D", s=24, facecolors="none",
                     edgecolors="#6a51a3", zorder=4)
        handles.append(Line2D([], [], marker="D", linestyle="", markerfacecolor="none",
                              markeredgecolor="#6a51a3", label="predicted loss"))
    if val_losses:
        axes.plot(val_steps, val_losses, color="black", linestyle="--", marker=".", zorder=4)
        handles.append(Line2D([], [], color="black", linestyle="--", marker=".", label="validation loss"))

    extra_colours = iter(_EXTRA_COLOURS * 4)
    colours = dict(PHASE_COLOURS)
    phases_seen = []
    for phase, first, last in _phase_spans(records):
        if phase not in colours:
            colours[phase] = next(extra_colours, "#eeeeee")
        # Half a step either side, so a one-step phase is still visible and spans tile without gaps.
        axes.axvspan(first - 0.5, last + 0.5, color=colours[phase], alpha=0.6, linewidth=0, zorder=1)
        if phase not in phases_seen:
            phases_seen.append(phase)
    handles.extend(Patch(facecolor=colours[p], alpha=0.6, label=p.lower()) for p in phases_seen)

    plotted = losses + verify_losses + [v for _, v in rejected] + predicted_losses + val_losses
    if log_scale is None:
        log_scale = bool(plotted) and min(plotted) > 0 and max(plotted) / min(plotted) > 10
    if log_scale:
        axes.set_yscale("log")

    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.set_xlim(records[0]["step"] - 0.5, records[-1]["step"] + 0.5)
    axes.grid(True, alpha=0.3, zorder=0)
    if title:
        axes.set_title(title)
    if handles:
        axes.legend(handles=handles, loc="upper right", fontsize=8, framealpha=0.9)
    figure.tight_layout()

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png")

"""Memory measurement around the training loop: readers, a per-step profiler and a VRAM guard.

All quantities are in **bytes** unless a name says otherwise (``*_mib`` in reports and plots).

* :func:`default_reader` returns a zero-argument callable producing a :class:`MemorySample`. On CUDA it
  combines ``torch.cuda`` allocator counters (this process's tensors) with NVML (device capacity and the
  device-wide usage of every process); on CPU it reads the process resident set size through ``psutil``.
  A missing driver or NVML library never raises: the reader degrades to what is available.
* :class:`MemoryProfiler` records one :class:`MemorySnapshot` per (every ``every``-th) step, tagged with the
  trainer phase, and derives per-phase statistics, the peak and spikes. It only observes, in constant memory:
  the last ``max_snapshots`` snapshots are kept, the statistics are running aggregates over all of them.
* :class:`VRAMGuard` compares a reading with a warning and a critical threshold, logs each upward crossing
  once, and on a critical crossing calls a callback (e.g. an emergency checkpoint) and then returns the CUDA
  caching allocator's free blocks to the driver.

Readers are injectable everywhere so the logic runs and is tested on machines without a GPU.
"""
from __future__ import annotations

import csv
import json
import logging
import math
import os
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass, fields
from itertools import islice
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["MemorySample", "MemorySnapshot", "MemoryProfiler", "VRAMGuard", "default_reader"]

logger = logging.getLogger("hybrid_trainer.memory")

MIB = 1024 ** 2
SPIKE_WINDOW = 20  # snapshots whose median is the baseline a new snapshot is compared with
DEFAULT_MAX_SNAPSHOTS = 10_000  # snapshots MemoryProfiler keeps (a ring); its aggregates cover all of them


@dataclass
class MemorySample:
    """One memory reading, in bytes.

    Attributes:
        bytes_in_use: GPU: ``torch.cuda.memory_allocated`` (live tensors of this process), or NVML's device
            usage when torch's CUDA is unavailable; CPU: process resident set size.
        peak_bytes: GPU: ``torch.cuda.max_memory_allocated``; CPU: the largest RSS this reader has seen.
        total_bytes: device capacity (NVML total, else ``total_memory`` of the torch device properties; CPU:
            physical memory), or None when unknown.
        source: where the numbers come from, e.g. ``"nvml+torch.cuda"``, ``"torch.cuda"``, ``"psutil-rss"``.
        reserved_bytes: GPU only: ``torch.cuda.memory_reserved`` (allocator cache included), else None.
        device_used_bytes: GPU only: NVML's used memory of the whole device (all processes, CUDA context
            included), else None. This is the number that decides an out-of-memory error.
    """

    bytes_in_use: int
    peak_bytes: int
    total_bytes: int | None
    source: str
    reserved_bytes: int | None = None
    device_used_bytes: int | None = None


# ====================================================================================== readers ====
def _cpu_reader() -> Callable[[], MemorySample]:
    import psutil

    process = psutil.Process()
    total = int(psutil.virtual_memory().total)
    highest = 0

    def read() -> MemorySample:
        nonlocal highest
        rss = int(process.memory_info().rss)
        highest = max(highest, rss)
        return MemorySample(bytes_in_use=rss, peak_bytes=highest, total_bytes=total, source="psutil-rss")

    return read


def _nvml_handle(index: int):
    """NVML handle of the torch CUDA device ``index``, or None when NVML is unusable.

    NVML numbers physical devices while torch numbers the devices left visible by
    ``CUDA_VISIBLE_DEVICES``; the UUID is the unambiguous link, the index mapping the fallback.
    """
    try:
        import pynvml  # provided by the nvidia-ml-py distribution
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        logger.info("NVML unavailable (%s); reading GPU memory from torch.cuda only", error)
        return None
    try:
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    except Exception:  # noqa: BLE001 - any failure here only means "no UUID": use the index instead
        uuid = None
    if uuid is not None:
        text = str(uuid)
        for candidate in (text, f"GPU-{text}"):
            try:
                return pynvml.nvmlDeviceGetHandleByUUID(candidate)
            except pynvml.NVMLError:
                continue
    physical = index
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
        if index < len(entries) and entries[index].isdigit():
            physical = int(entries[index])
    try:
        return pynvml.nvmlDeviceGetHandleByIndex(physical)
    except pynvml.NVMLError as error:
        logger.info("NVML has no handle for CUDA device %d (%s); using torch.cuda only", index, error)
        return None


def _cuda_reader(device: torch.device) -> Callable[[], MemorySample]:
    torch_available = torch.cuda.is_available()
    index = device.index
    if index is None:
        index = torch.cuda.current_device() if torch_available else 0
    handle = _nvml_handle(index)
    if handle is None and not torch_available:
        logger.warning("no CUDA driver and no NVML for %s: reporting process RSS (psutil) instead", device)
        return _cpu_reader()
    torch_total = int(torch.cuda.get_device_properties(index).total_memory) if torch_available else None

    def read_nvml():
        if handle is None:
            return None
        import pynvml

        try:
            return pynvml.nvmlDeviceGetMemoryInfo(handle)
        except pynvml.NVMLError as error:  # e.g. the GPU fell off the bus: keep the torch numbers
            logger.debug("NVML read failed: %s", error)
            return None

    highest_nvml_used = 0

    def read() -> MemorySample:
        nonlocal highest_nvml_used
        info = read_nvml()
        nvml_used = None if info is None else int(info.used)
        total = torch_total if info is None else int(info.total)
        if torch_available:
            return MemorySample(bytes_in_use=int(torch.cuda.memory_allocated(index)),
                                peak_bytes=int(torch.cuda.max_memory_allocated(index)),
                                total_bytes=total,
                                source="torch.cuda" if info is None else "nvml+torch.cuda",
                                reserved_bytes=int(torch.cuda.memory_reserved(index)),
                                device_used_bytes=nvml_used)
        if nvml_used is None:  # NVML only, and it failed this time: report nothing rather than crash
            return MemorySample(bytes_in_use=0, peak_bytes=highest_nvml_used, total_bytes=total,
                                source="unavailable")
        highest_nvml_used = max(highest_nvml_used, nvml_used)
        return MemorySample(bytes_in_use=nvml_used, peak_bytes=highest_nvml_used, total_bytes=total, source="nvml",
                            device_used_bytes=nvml_used)

    return read


def default_reader(device: torch.device | str = "cpu") -> Callable[[], MemorySample]:
    """A zero-argument callable returning a :class:`MemorySample` for ``device`` (bytes).

    CUDA devices: NVML (``nvidia-ml-py``) for capacity and device-wide usage, ``torch.cuda`` for this
    process's allocations; either may be missing (``pynvml.NVMLError`` is caught) and with neither the
    reader falls back to process RSS with a logged warning. Other devices: process RSS via ``psutil``.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_reader(device)
    return _cpu_reader()


# ===================================================================================== profiler ====
@dataclass
class MemorySnapshot:
    """Memory at one step. ``bytes_in_use``/``peak_bytes`` in bytes (see :class:`MemorySample`);
    ``time_s`` in seconds since the profiler started (continued across ``load_state_dict``)."""

    step: int
    phase: str
    bytes_in_use: int
    peak_bytes: int
    time_s: float


_SNAPSHOT_FIELDS = [f.name for f in fields(MemorySnapshot)]


def _snapshot_from_row(row: dict[str, Any]) -> MemorySnapshot:
    return MemorySnapshot(step=int(row["step"]), phase=str(row["phase"]), bytes_in_use=int(row["bytes_in_use"]),
                          peak_bytes=int(row["peak_bytes"]), time_s=float(row["time_s"]))


class MemoryProfiler:
    """Per-step memory snapshots, tagged with the trainer phase, in constant memory.

    The last ``max_snapshots`` snapshots are kept (``snapshots``, a ring, oldest first). Per-phase
    statistics, the peak, the high-water mark and the spike count are running aggregates over
    *every* snapshot recorded, so they stay exact on a run of any length while the profiler's
    memory stays bounded; the last ``max_snapshots`` spikes are kept as well.

    Args:
        reader: returns a :class:`MemorySample`; default :func:`default_reader` of ``device``.
        device: device measured when no reader is given.
        spike_threshold: a snapshot is a spike when its ``bytes_in_use`` exceeds ``1 + spike_threshold``
            times the median of the previous (up to 20) snapshots; must be > 0.
        every: record only steps with ``step % every == 0`` (a reading costs a syscall or an NVML call).
        max_snapshots: snapshots (and spikes) kept; at least 20, the spike baseline's window.
            The default keeps 10,000 (2.5 MB of Python objects, measured with tracemalloc).
    """

    def __init__(self, reader: Callable[[], MemorySample] | None = None, device: torch.device | str = "cpu",
                 spike_threshold: float = 0.25, every: int = 1, max_snapshots: int = DEFAULT_MAX_SNAPSHOTS):
        if not (isinstance(spike_threshold, (int, float)) and math.isfinite(spike_threshold) and spike_threshold > 0):
            raise ValueError(f"spike_threshold must be a finite number > 0, got {spike_threshold!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an integer >= 1, got {every!r}")
        if isinstance(max_snapshots, bool) or not isinstance(max_snapshots, int) or max_snapshots < SPIKE_WINDOW:
            raise ValueError(f"max_snapshots must be an integer >= {SPIKE_WINDOW} (the spike baseline's window), "
                             f"got {max_snapshots!r}")
        self.reader = reader if reader is not None else default_reader(device)
        self.spike_threshold = float(spike_threshold)
        self.every = every
        self.max_snapshots = max_snapshots
        self.source: str | None = None  # source of the latest sample
        self._reset()
        self._started = time.perf_counter()

    def _reset(self) -> None:
        self.snapshots: deque[MemorySnapshot] = deque(maxlen=self.max_snapshots)
        self._spike_flags: deque[bool] = deque(maxlen=self.max_snapshots)  # one per kept snapshot
        self._spikes: deque[MemorySnapshot] = deque(maxlen=self.max_snapshots)
        self._phases: dict[str, dict[str, int]] = {}  # phase -> count, sum, min, max of bytes_in_use
        self._peak: MemorySnapshot | None = None
        self._high_water: int | None = None
        self.total_snapshots = 0  # recorded since the start, kept or not
        self.total_spikes = 0

    def _count(self, snap: MemorySnapshot, is_spike: bool) -> None:
        """Fold one snapshot into the running aggregates."""
        value = snap.bytes_in_use
        agg = self._phases.get(snap.phase)
        if agg is None:
            self._phases[snap.phase] = {"count": 1, "sum": value, "min": value, "max": value}
        else:
            agg["count"] += 1
            agg["sum"] += value  # Python ints: exact however long the run
            agg["min"] = min(agg["min"], value)
            agg["max"] = max(agg["max"], value)
        if self._peak is None or value > self._peak.bytes_in_use:  # strict: the earliest peak on ties
            self._peak = snap
        self._high_water = snap.peak_bytes if self._high_water is None else max(self._high_water, snap.peak_bytes)
        self.total_snapshots += 1
        if is_spike:
            self._spikes.append(snap)
            self.total_spikes += 1

    def snapshot(self, step: int, phase: str) -> MemorySnapshot | None:
        """Read memory and record it for ``step`` in ``phase``; None (nothing read) off the ``every`` grid."""
        if step % self.every != 0:
            return None
        sample = self.reader()
        self.source = sample.source
        snap = MemorySnapshot(step=int(step), phase=str(phase), bytes_in_use=int(sample.bytes_in_use),
                              peak_bytes=int(sample.peak_bytes), time_s=time.perf_counter() - self._started)
        previous = [s.bytes_in_use for s in islice(reversed(self.snapshots), SPIKE_WINDOW)]
        is_spike = bool(previous) and snap.bytes_in_use > (1.0 + self.spike_threshold) * statistics.median(previous)
        self.snapshots.append(snap)
        self._spike_flags.append(is_spike)
        self._count(snap, is_spike)
        return snap

    # ------------------------------------------------------------------------------ analysis ----
    def per_phase_stats(self) -> dict[str, dict[str, float]]:
        """phase -> {"mean", "max", "min", "count"} of ``bytes_in_use`` (bytes; count as a float), over
        every snapshot recorded (not only the kept ones)."""
        return {phase: {"mean": agg["sum"] / agg["count"], "max": float(agg["max"]), "min": float(agg["min"]),
                        "count": float(agg["count"])}
                for phase, agg in self._phases.items()}

    def peak(self) -> MemorySnapshot | None:
        """The snapshot with the largest ``bytes_in_use`` ever recorded (the earliest on ties), None if none.

        The allocator's high-water mark between snapshots is in each snapshot's ``peak_bytes``
        (:meth:`high_water_mark` is their maximum)."""
        return self._peak

    def high_water_mark(self) -> int | None:
        """The largest ``peak_bytes`` of any snapshot recorded (bytes), None if none."""
        return self._high_water

    def spikes(self) -> list[MemorySnapshot]:
        """The last ``max_snapshots`` snapshots flagged as spikes when recorded, in step order
        (``total_spikes`` counts them all)."""
        return list(self._spikes)

    # -------------------------------------------------------------------------------- export ----
    def to_csv(self, path) -> None:
        """One row per kept snapshot: step, phase, bytes_in_use, peak_bytes, time_s, spike (0/1)."""
        with open(path, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(_SNAPSHOT_FIELDS + ["spike"])
            for snap, is_spike in zip(self.snapshots, self._spike_flags):
                writer.writerow([getattr(snap, name) for name in _SNAPSHOT_FIELDS] + [int(is_spike)])

    def to_json(self, path) -> None:
        """The :meth:`state_dict` plus per-phase statistics, as one JSON document."""
        document = self.state_dict()
        document["per_phase_stats"] = self.per_phase_stats()
        Path(path).write_text(json.dumps(document, indent=1))

    @staticmethod
    def read_csv(path) -> list[MemorySnapshot]:
        """Snapshots written by :meth:`to_csv`."""
        with open(path, newline="") as handle:
            return [_snapshot_from_row(row) for row in csv.DictReader(handle)]

    @staticmethod
    def read_json(path) -> list[MemorySnapshot]:
        """Snapshots written by :meth:`to_json`."""
        return [_snapshot_from_row(row) for row in json.loads(Path(path).read_text())["snapshots"]]

    def report(self) -> str:
        """A short human-readable summary (MiB) over every snapshot recorded."""
        if not self.total_snapshots:
            return "memory: no snapshots recorded"
        peak = self._peak
        kept = "" if len(self.snapshots) == self.total_snapshots else f" (last {len(self.snapshots)} kept)"
        lines = [f"memory ({self.source or 'unknown source'}): {self.total_snapshots} snapshots{kept}; "
                 f"peak in use {peak.bytes_in_use / MIB:.1f} MiB at step {peak.step} ({peak.phase}); "
                 f"high-water mark {self._high_water / MIB:.1f} MiB"]
        for phase, stats in self.per_phase_stats().items():
            lines.append(f"  {phase}: mean {stats['mean'] / MIB:.1f} MiB, min {stats['min'] / MIB:.1f}, "
                         f"max {stats['max'] / MIB:.1f} ({int(stats['count'])} snapshots)")
        spikes = self.spikes()
        if spikes:
            shown = ", ".join(f"step {s.step} ({s.bytes_in_use / MIB:.1f} MiB)" for s in spikes[:5])
            more = f" and {self.total_spikes - 5} more" if self.total_spikes > 5 else ""
            lines.append(f"  spikes (> {1 + self.spike_threshold:.2f}x the recent median): {shown}{more}")
        else:
            lines.append("  no spikes")
        return "\n".join(lines)

    def plot(self, path) -> None:
        """Memory in use (and the allocator high-water mark) over the kept steps, points coloured by phase (PNG etc.)."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        from .metrics import PHASE_COLOURS

        # A Figure with its own Agg canvas: no pyplot, so the global backend and figure registry stay untouched.
        figure = Figure(figsize=(9, 4))
        FigureCanvasAgg(figure)
        axes = figure.add_subplot(1, 1, 1)
        snapshots = list(self.snapshots)
        steps = [s.step for s in snapshots]
        axes.plot(steps, [s.bytes_in_use / MIB for s in snapshots], color="#555555", linewidth=0.8,
                  label="in use")
        axes.plot(steps, [s.peak_bytes / MIB for s in snapshots], color="#999999", linewidth=0.8,
                  linestyle="--", label="high-water mark")
        fallback = iter(["#9e9ac8", "#fb6a4a", "#bf812d", "#35978f", "#de77ae"] * 4)
        for phase in dict.fromkeys(s.phase for s in snapshots):
            # PHASE_COLOURS are light background shades: a dark edge keeps the points visible on white.
            colour = PHASE_COLOURS.get(phase) or next(fallback)
            members = [s for s in snapshots if s.phase == phase]
            axes.scatter([s.step for s in members], [s.bytes_in_use / MIB for s in members], s=14, color=colour,
                         edgecolors="#333333", linewidths=0.4, label=phase, zorder=3)
        spikes = [s for s, is_spike in zip(snapshots, self._spike_flags) if is_spike]
        if spikes:
            axes.scatter([s.step for s in spikes], [s.bytes_in_use / MIB for s in spikes], marker="x", s=40,
                         color="#cb181d", label="spike", zorder=4)
        axes.set_xlabel("step")
        axes.set_ylabel("memory (MiB)")
        kept = "" if len(snapshots) == self.total_snapshots else f", last {len(snapshots)} of {self.total_snapshots}"
        axes.set_title(f"memory over steps ({self.source or 'unknown source'}{kept})")
        if snapshots:
            axes.legend(loc="best", fontsize="small")
        figure.tight_layout()
        figure.savefig(path)

    # ---------------------------------------------------------------------------- checkpoint ----
    def state_dict(self) -> dict:
        """JSON-safe state: the kept snapshots and spikes, and the running aggregates over all of them."""
        return {"snapshots": [asdict(s) for s in self.snapshots],
                "spike_indices": [i for i, is_spike in enumerate(self._spike_flags) if is_spike],
                "spike_threshold": self.spike_threshold, "every": self.every, "source": self.source,
                "max_snapshots": self.max_snapshots, "spikes": [asdict(s) for s in self._spikes],
                "phase_stats": {phase: dict(agg) for phase, agg in self._phases.items()},
                "peak": None if self._peak is None else asdict(self._peak), "high_water": self._high_water,
                "total_snapshots": self.total_snapshots, "total_spikes": self.total_spikes}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output; a state from before the aggregates existed (every
        snapshot in its list) is folded in snapshot by snapshot. Settings stay those of the
        constructor (a resumed run may deliberately sample differently); the ring keeps the last
        ``max_snapshots`` of the saved snapshots."""
        rows = [_snapshot_from_row(row) for row in state["snapshots"]]
        spike_indices = {int(i) for i in state.get("spike_indices", [])}
        flags = [i in spike_indices for i in range(len(rows))]
        self._reset()
        self.source = state.get("source")
        if "phase_stats" in state:
            self.snapshots.extend(rows)
            self._spike_flags.extend(flags)
            self._spikes.extend(_snapshot_from_row(row) for row in state["spikes"])
            self._phases = {str(phase): {key: int(agg[key]) for key in ("count", "sum", "min", "max")}
                            for phase, agg in state["phase_stats"].items()}
            self._peak = None if state["peak"] is None else _snapshot_from_row(state["peak"])
            self._high_water = None if state["high_water"] is None else int(state["high_water"])
            self.total_snapshots = int(state["total_snapshots"])
            self.total_spikes = int(state["total_spikes"])
        else:
            for snap, is_spike in zip(rows, flags):
                self.snapshots.append(snap)
                self._spike_flags.append(is_spike)
                self._count(snap, is_spike)
        elapsed = rows[-1].time_s if rows else 0.0
        self._started = time.perf_counter() - elapsed  # time_s keeps increasing across a resume


# ======================================================================================== guard ====
class VRAMGuard:
    """Warning and critical memory thresholds checked once per step.

    Args:
        warning, critical: a value in (0, 1] is a fraction of the reader's ``total_bytes``; a value > 1 is an
            absolute number of bytes. Both must be of the same kind and ``warning < critical``.
        reader: returns a :class:`MemorySample` (``bytes_in_use`` is compared).
        on_critical: called with the sample once per upward crossing of the critical threshold (an emergency
            checkpoint, typically). Exceptions propagate.
        hysteresis: a crossed level re-arms only once usage drops below ``(1 - hysteresis) * threshold``;
            default 0 (re-arm as soon as usage is below the threshold again).

    Attributes:
        events: one ``{"step", "level", "bytes_in_use", "threshold_bytes"}`` per upward crossing.
    """

    LEVELS = ("warning", "critical")

    def __init__(self, warning: float, critical: float, reader: Callable[[], MemorySample],
                 on_critical: Callable[[MemorySample], None] | None = None, hysteresis: float = 0.0):
        for name, value in (("warning", warning), ("critical", critical)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"{name} must be a fraction in (0, 1] or a byte count > 1, got {value!r}")
        if (warning <= 1) != (critical <= 1):
            raise ValueError(f"warning ({warning!r}) and critical ({critical!r}) must both be fractions in (0, 1] "
                             "or both be byte counts > 1")
        if warning >= critical:
            raise ValueError(f"warning ({warning!r}) must be below critical ({critical!r})")
        if not (0.0 <= hysteresis < 1.0):
            raise ValueError(f"hysteresis must be in [0, 1), got {hysteresis!r}")
        if not callable(reader):
            raise ValueError("reader must be callable, returning a MemorySample")
        self.warning, self.critical = warning, critical
        self.reader, self.on_critical, self.hysteresis = reader, on_critical, hysteresis
        self.is_fraction = critical <= 1
        self.events: list[dict] = []
        self._armed = {level: True for level in self.LEVELS}
        self.last_level = "ok"

    def thresholds_bytes(self, total_bytes: int | None) -> dict[str, float]:
        """{"warning", "critical"} in bytes for a device of ``total_bytes``."""
        if not self.is_fraction:
            return {"warning": float(self.warning), "critical": float(self.critical)}
        if total_bytes is None:
            raise ValueError("warning/critical are fractions of total memory, but the reader gives "
                             "total_bytes=None; pass absolute byte thresholds (> 1) instead")
        return {"warning": self.warning * total_bytes, "critical": self.critical * total_bytes}

    def check(self, step: int) -> str:
        """Read memory and return ``"ok"``, ``"warning"`` or ``"critical"`` (usage >= threshold).

        Logs each upward crossing of a level once (re-armed when usage falls back below it); a crossing into
        critical calls ``on_critical(sample)`` and then, on CUDA, ``torch.cuda.empty_cache()``."""
        sample = self.reader()
        thresholds = self.thresholds_bytes(sample.total_bytes)
        used = sample.bytes_in_use
        crossed_critical = False
        for level in self.LEVELS:
            threshold = thresholds[level]
            if used >= threshold:
                if self._armed[level]:
                    self._armed[level] = False
                    self.events.append({"step": int(step), "level": level, "bytes_in_use": int(used),
                                        "threshold_bytes": int(threshold)})
                    logger.warning("step %d: memory %s: %.1f MiB in use >= %.1f MiB threshold (%s)", step, level,
                                   used / MIB, threshold / MIB, sample.source)
                    crossed_critical = crossed_critical or level == "critical"
            elif used < (1.0 - self.hysteresis) * threshold:
                self._armed[level] = True
        if crossed_critical:
            if self.on_critical is not None:
                self.on_critical(sample)
            if _is_cuda_source(sample.source) and torch.cuda.is_available():
                # Cached free blocks count as used for other processes and for NVML; hand them back.
                torch.cuda.empty_cache()
        if used >= thresholds["critical"]:
            self.last_level = "critical"
        elif used >= thresholds["warning"]:
            self.last_level = "warning"
        else:
            self.last_level = "ok"
        return self.last_level


def _is_cuda_source(source: str) -> bool:
    return "cuda" in source or "nvml" in source

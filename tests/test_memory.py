"""Memory readers, profiler and VRAM guard, driven by injected fake readers (no GPU needed)."""
import json
import logging
from types import SimpleNamespace

import pytest
import torch

from hybrid_trainer import memory
from hybrid_trainer.memory import MemoryProfiler, MemorySample, MemorySnapshot, VRAMGuard, default_reader

GIB = 1024 ** 3


class ScriptedReader:
    """Returns samples with the scripted ``bytes_in_use`` values, one per call."""

    def __init__(self, values, total_bytes=16 * GIB, source="fake"):
        self.values, self.total_bytes, self.source = list(values), total_bytes, source
        self.calls = 0

    def __call__(self) -> MemorySample:
        value = self.values[min(self.calls, len(self.values) - 1)]
        self.calls += 1
        return MemorySample(bytes_in_use=value, peak_bytes=value + 1, total_bytes=self.total_bytes,
                            source=self.source)


def profile(values, phases, **kwargs):
    profiler = MemoryProfiler(reader=ScriptedReader(values), **kwargs)
    for step, phase in enumerate(phases):
        profiler.snapshot(step, phase)
    return profiler


# ====================================================================================== profiler ====
def test_per_phase_stats_and_peak():
    profiler = profile([100, 300, 200, 50, 60], ["FULL", "FULL", "PREDICT", "PREDICT", "PREDICT"])
    stats = profiler.per_phase_stats()
    assert stats == {"FULL": {"mean": 200.0, "max": 300.0, "min": 100.0, "count": 2.0},
                     "PREDICT": {"mean": pytest.approx(310 / 3), "max": 200.0, "min": 50.0, "count": 3.0}}
    peak = profiler.peak()
    assert (peak.step, peak.phase, peak.bytes_in_use, peak.peak_bytes) == (1, "FULL", 300, 301)


def test_peak_of_empty_profiler_is_none():
    profiler = MemoryProfiler(reader=ScriptedReader([1]))
    assert profiler.peak() is None and profiler.spikes() == [] and profiler.per_phase_stats() == {}
    assert "no snapshots" in profiler.report()


def test_every_skips_steps_without_reading():
    reader = ScriptedReader([10, 20, 30])
    profiler = MemoryProfiler(reader=reader, every=3)
    results = [profiler.snapshot(step, "FULL") for step in range(7)]
    assert [r is not None for r in results] == [True, False, False, True, False, False, True]
    assert [s.step for s in profiler.snapshots] == [0, 3, 6]
    assert reader.calls == 3  # off-grid steps cost no reading


def test_spike_is_relative_to_median_of_previous_20():
    # 30 steady snapshots at 1000, then 1250 (exactly 1.25x: not a spike), 1300 (a spike), and after a long
    # plateau at 1300 the median has moved, so 1300 is no longer a spike.
    values = [1000] * 30 + [1250, 1300] + [1300] * 25 + [1300]
    profiler = profile(values, ["FULL"] * len(values), spike_threshold=0.25)
    spikes = profiler.spikes()
    assert [s.step for s in spikes] == list(range(31, 40))
    # A plateau value stays a spike while at least 11 of the previous 20 are 1000 (median 1000): up to step 39.
    assert all(s.bytes_in_use == 1300 for s in spikes)
    assert profiler.snapshots[-1].step not in {s.step for s in spikes}


def test_first_snapshot_is_never_a_spike_and_threshold_matters():
    strict = profile([10, 12], ["A", "A"], spike_threshold=0.1)
    loose = profile([10, 12], ["A", "A"], spike_threshold=0.5)
    assert [s.step for s in strict.spikes()] == [1]
    assert loose.spikes() == []


@pytest.mark.parametrize("kwargs, name", [({"spike_threshold": 0}, "spike_threshold"),
                                          ({"spike_threshold": -0.1}, "spike_threshold"),
                                          ({"spike_threshold": float("nan")}, "spike_threshold"),
                                          ({"every": 0}, "every"), ({"every": 1.5}, "every"),
                                          ({"max_snapshots": 19}, "max_snapshots"),
                                          ({"max_snapshots": 100.0}, "max_snapshots")])
def test_profiler_validation_names_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        MemoryProfiler(reader=ScriptedReader([1]), **kwargs)


def test_csv_and_json_round_trip(tmp_path):
    profiler = profile([100, 100, 500, 120], ["WARMUP", "FULL", "PREDICT", "CORRECT"])
    profiler.to_csv(tmp_path / "memory.csv")
    profiler.to_json(tmp_path / "memory.json")
    # time_s goes through text: compare the rest exactly and time to float precision.
    loaded_back = [MemoryProfiler.read_csv(tmp_path / "memory.csv"), MemoryProfiler.read_json(tmp_path / "memory.json")]
    for loaded in loaded_back:
        assert [(s.step, s.phase, s.bytes_in_use, s.peak_bytes) for s in loaded] == \
               [(s.step, s.phase, s.bytes_in_use, s.peak_bytes) for s in profiler.snapshots]
        assert [s.time_s for s in loaded] == pytest.approx([s.time_s for s in profiler.snapshots], rel=1e-12)
        assert all(isinstance(s, MemorySnapshot) for s in loaded)
    rows = (tmp_path / "memory.csv").read_text().splitlines()
    assert rows[0] == "step,phase,bytes_in_use,peak_bytes,time_s,spike"
    assert [row.rsplit(",", 1)[1] for row in rows[1:]] == ["0", "0", "1", "0"]
    document = json.loads((tmp_path / "memory.json").read_text())
    assert document["per_phase_stats"]["PREDICT"]["max"] == 500.0 and document["spike_indices"] == [2]


def test_state_dict_resume_keeps_snapshots_spikes_and_clock():
    profiler = profile([100, 100, 500], ["FULL", "FULL", "PREDICT"])
    resumed = MemoryProfiler(reader=ScriptedReader([100]))
    resumed.load_state_dict(json.loads(json.dumps(profiler.state_dict())))  # must survive JSON
    assert resumed.snapshots == profiler.snapshots
    assert [s.step for s in resumed.spikes()] == [2]
    later = resumed.snapshot(3, "FULL")
    assert later.time_s >= profiler.snapshots[-1].time_s
    # The spike window continues from the restored snapshots: median(100, 100, 500) = 100 -> 100 is not one.
    assert [s.step for s in resumed.spikes()] == [2]


def test_report_mentions_phases_peak_and_spikes():
    profiler = profile([1 << 20, 1 << 20, 8 << 20], ["FULL", "FULL", "PREDICT"])
    text = profiler.report()
    assert "fake" in text and "FULL" in text and "PREDICT" in text
    assert "8.0 MiB at step 2" in text and "step 2 (8.0 MiB)" in text


def test_plot_writes_a_png(tmp_path):
    profiler = profile([100, 200, 900, 150], ["FULL", "FULL", "PREDICT", "NEWPHASE"])
    path = tmp_path / "memory.png"
    profiler.plot(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def _reference_summary(values, phases, spike_threshold=0.25):
    """What an unbounded profiler reports: statistics, peak and spikes from the whole list."""
    import statistics
    spikes = [i for i in range(1, len(values))
              if values[i] > (1 + spike_threshold) * statistics.median(values[max(0, i - 20):i])]
    by_phase = {}
    for value, phase in zip(values, phases):
        by_phase.setdefault(phase, []).append(value)
    stats = {phase: {"mean": sum(v) / len(v), "max": float(max(v)), "min": float(min(v)), "count": float(len(v))}
             for phase, v in by_phase.items()}
    peak_step = max(range(len(values)), key=lambda i: values[i])  # the first maximum
    return stats, peak_step, spikes


def _long_run(n, seed=0):
    """n readings with a slow drift, noise, rare spikes and an early all-time peak."""
    import random
    rng = random.Random(seed)
    values = [int(1e6 + 1e3 * (i % 500) + rng.randrange(1000) + (6e6 if rng.random() < 0.03 else 0)) for i in range(n)]
    values[7] = 10 ** 8  # the peak, long dropped from any ring
    phases = [("WARMUP", "FULL", "PREDICT", "CORRECT")[min(3, i // 40 % 5)] for i in range(n)]
    return values, phases


def test_long_run_keeps_a_ring_and_exact_aggregates():
    values, phases = _long_run(3000)
    profiler = profile(values, phases, max_snapshots=50)
    stats, peak_step, spikes = _reference_summary(values, phases)
    assert len(profiler.snapshots) == 50 and [s.step for s in profiler.snapshots] == list(range(2950, 3000))
    assert profiler.total_snapshots == 3000
    assert profiler.per_phase_stats() == stats  # integer sums: exactly the unbounded figures
    assert profiler.peak().step == peak_step == 7 and profiler.peak().bytes_in_use == 10 ** 8
    assert profiler.high_water_mark() == 10 ** 8 + 1
    assert profiler.total_spikes == len(spikes) > 50  # the ring keeps enough history for the same baseline
    assert [s.step for s in profiler.spikes()] == spikes[-50:]
    text = profiler.report()
    assert "3000 snapshots (last 50 kept)" in text and "95.4 MiB at step 7 (WARMUP)" in text
    assert f"and {len(spikes) - 5} more" in text


def test_memory_stays_constant_on_a_long_run():
    import tracemalloc
    values, phases = _long_run(6000)
    profiler = MemoryProfiler(reader=ScriptedReader(values), max_snapshots=100)
    tracemalloc.start()
    try:
        for step in range(1000):
            profiler.snapshot(step, phases[step])
        after_1000 = tracemalloc.get_traced_memory()[0]
        for step in range(1000, 6000):
            profiler.snapshot(step, phases[step])
        after_6000 = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert after_6000 - after_1000 < 16 * 1024, (after_1000, after_6000)  # 5000 more snapshots: ~1.2 MB unbounded


def test_default_ring_is_bounded():
    profiler = MemoryProfiler(reader=ScriptedReader([5]))
    assert profiler.max_snapshots == memory.DEFAULT_MAX_SNAPSHOTS == 10_000
    for step in range(memory.DEFAULT_MAX_SNAPSHOTS + 10):
        profiler.snapshot(step, "FULL")
    assert len(profiler.snapshots) == 10_000 and profiler.snapshots[0].step == 10
    assert profiler.per_phase_stats()["FULL"]["count"] == 10_010.0


def test_csv_and_state_of_a_long_run_round_trip(tmp_path):
    values, phases = _long_run(500)
    profiler = profile(values, phases, max_snapshots=40)
    profiler.to_csv(tmp_path / "memory.csv")
    rows = MemoryProfiler.read_csv(tmp_path / "memory.csv")
    assert [s.step for s in rows] == list(range(460, 500))
    flagged = [int(line.rsplit(",", 1)[1]) for line in (tmp_path / "memory.csv").read_text().splitlines()[1:]]
    _, _, spikes = _reference_summary(values, phases)
    assert [s.step for s, f in zip(rows, flagged) if f] == [i for i in spikes if i >= 460]
    resumed = MemoryProfiler(reader=ScriptedReader([10 ** 6]), max_snapshots=40)
    resumed.load_state_dict(json.loads(json.dumps(profiler.state_dict())))
    assert resumed.per_phase_stats() == profiler.per_phase_stats() and resumed.peak() == profiler.peak()
    assert (resumed.total_snapshots, resumed.total_spikes, resumed.spikes()) == \
           (profiler.total_snapshots, profiler.total_spikes, profiler.spikes())
    assert list(resumed.snapshots) == list(profiler.snapshots) and resumed.report() == profiler.report()


def test_state_written_before_the_ring_still_loads():
    """A state holding every snapshot and no aggregates (the earlier format) is folded in."""
    old_state = {"snapshots": [{"step": i, "phase": "FULL", "bytes_in_use": v, "peak_bytes": v, "time_s": 0.1 * i}
                               for i, v in enumerate([100, 100, 500, 100] * 10)],
                 "spike_indices": [2], "spike_threshold": 0.25, "every": 1, "source": "fake"}
    resumed = MemoryProfiler(reader=ScriptedReader([100]), max_snapshots=20)
    resumed.load_state_dict(old_state)
    assert len(resumed.snapshots) == 20 and resumed.total_snapshots == 40
    assert resumed.per_phase_stats()["FULL"] == {"mean": 200.0, "max": 500.0, "min": 100.0, "count": 40.0}
    assert resumed.peak().step == 2 and [s.step for s in resumed.spikes()] == [2]


# ======================================================================================= readers ====
def test_default_reader_on_cpu_reads_process_rss():
    import psutil

    reader = default_reader("cpu")
    first = reader()
    assert first.source == "psutil-rss"
    assert first.bytes_in_use > 0 and first.peak_bytes >= first.bytes_in_use
    assert first.total_bytes == psutil.virtual_memory().total
    rss_now = psutil.Process().memory_info().rss
    assert abs(first.bytes_in_use - rss_now) < 256 * 1024 ** 2  # the same quantity, read moments apart


def test_cpu_reader_peak_is_the_highest_rss_seen(monkeypatch):
    import psutil

    rss_values = iter([300, 500, 200])
    monkeypatch.setattr(psutil.Process, "memory_info", lambda self: SimpleNamespace(rss=next(rss_values)))
    reader = default_reader("cpu")
    assert [(s.bytes_in_use, s.peak_bytes) for s in (reader(), reader(), reader())] == \
           [(300, 300), (500, 500), (200, 500)]


@pytest.fixture
def fake_torch_cuda(monkeypatch):
    """torch.cuda as seen on a machine with one GPU: allocator counters and properties, all fakes."""
    counters = {"allocated": 3 * GIB, "max_allocated": 5 * GIB, "reserved": 6 * GIB}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: counters["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: counters["max_allocated"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: counters["reserved"])
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(total_memory=80 * GIB, uuid="1234-abcd"))
    return counters


def _nvml_missing(*args, **kwargs):
    import pynvml

    raise pynvml.NVMLError_LibraryNotFound(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)


def test_cuda_reader_falls_back_to_torch_when_nvml_library_is_missing(monkeypatch, fake_torch_cuda):
    import pynvml

    monkeypatch.setattr(pynvml, "nvmlInit", _nvml_missing)
    reader = default_reader("cuda")
    sample = reader()
    assert sample.source == "torch.cuda"
    assert (sample.bytes_in_use, sample.peak_bytes, sample.total_bytes) == (3 * GIB, 5 * GIB, 80 * GIB)
    assert sample.reserved_bytes == 6 * GIB and sample.device_used_bytes is None
    fake_torch_cuda["allocated"] = 4 * GIB
    assert reader().bytes_in_use == 4 * GIB  # read live, not cached at construction


def test_cuda_reader_combines_nvml_and_torch(monkeypatch, fake_torch_cuda):
    import pynvml

    handles = []
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByUUID",
                        lambda uuid: handles.append(uuid) or ("handle", uuid))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo",
                        lambda handle: SimpleNamespace(total=79 * GIB, used=7 * GIB, free=72 * GIB))
    sample = default_reader(torch.device("cuda", 0))()
    assert sample.source == "nvml+torch.cuda"
    assert (sample.bytes_in_use, sample.total_bytes, sample.device_used_bytes) == (3 * GIB, 79 * GIB, 7 * GIB)
    assert handles == ["1234-abcd"]


def test_cuda_reader_keeps_torch_numbers_when_an_nvml_read_fails(monkeypatch, fake_torch_cuda):
    import pynvml

    def lost(handle):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByUUID", lambda uuid: "handle")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lost)
    sample = default_reader("cuda:0")()
    assert (sample.source, sample.bytes_in_use, sample.total_bytes) == ("torch.cuda", 3 * GIB, 80 * GIB)


def test_cuda_reader_maps_visible_devices_to_nvml_index(monkeypatch, fake_torch_cuda):
    import pynvml

    def no_uuid(uuid):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    asked = []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByUUID", no_uuid)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: asked.append(index) or "handle")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lambda handle: SimpleNamespace(total=1, used=1))
    default_reader("cuda:1")
    assert asked == [5]  # torch's cuda:1 is physical GPU 5


def test_cuda_reader_without_driver_or_nvml_does_not_crash(monkeypatch):
    import pynvml

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(pynvml, "nvmlInit", _nvml_missing)
    sample = default_reader("cuda")()
    assert sample.source == "psutil-rss" and sample.bytes_in_use > 0


# ========================================================================================= guard ====
def guard_with(values, warning, critical, total=1000, **kwargs):
    reader = ScriptedReader(values, total_bytes=total)
    return VRAMGuard(warning, critical, reader, **kwargs)


def warnings_logged(caplog):
    return [r for r in caplog.records if r.name == "hybrid_trainer.memory" and r.levelno == logging.WARNING]


def test_warning_logged_once_per_crossing_and_rearms(caplog):
    values = [100, 850, 860, 870, 100, 900]  # fractions 0.8/0.95 of 1000 -> warning at 800, critical at 950
    guard = guard_with(values, 0.8, 0.95)
    with caplog.at_level(logging.WARNING, logger="hybrid_trainer.memory"):
        levels = [guard.check(step) for step in range(len(values))]
    assert levels == ["ok", "warning", "warning", "warning", "ok", "warning"]
    logged = warnings_logged(caplog)
    assert len(logged) == 2 and all("warning" in r.getMessage() for r in logged)
    assert [(e["step"], e["level"], e["bytes_in_use"], e["threshold_bytes"]) for e in guard.events] == \
           [(1, "warning", 850, 800), (5, "warning", 900, 800)]


def test_critical_calls_callback_once_per_crossing_and_rearms(caplog):
    values = [990, 995, 900, 999, 100, 960]  # absolute thresholds 800 / 950 bytes
    seen = []
    guard = guard_with(values, 800, 950, total=None, on_critical=lambda sample: seen.append(sample.bytes_in_use))
    with caplog.at_level(logging.WARNING, logger="hybrid_trainer.memory"):
        levels = [guard.check(step) for step in range(len(values))]
    assert levels == ["critical", "critical", "warning", "critical", "ok", "critical"]
    assert seen == [990, 999, 960]
    assert [(e["step"], e["level"]) for e in guard.events] == [
        (0, "warning"), (0, "critical"), (3, "critical"), (5, "warning"), (5, "critical")]
    assert len(warnings_logged(caplog)) == 5


def test_hysteresis_delays_rearming():
    seen = []
    guard = guard_with([960, 940, 960, 800, 960], 0.5, 0.95, on_critical=seen.append, hysteresis=0.1)
    for step in range(5):
        guard.check(step)
    assert [s.bytes_in_use for s in seen] == [960, 960]  # 940 is within 10% of 950: no re-arm; 800 re-arms


@pytest.mark.parametrize("warning, critical, total", [(800, 950, None), (0.5, 0.75, 1000)],
                         ids=["bytes", "fractions"])
def test_usage_exactly_at_a_threshold_crosses_it(warning, critical, total):
    """check()'s contract is usage >= threshold: a reading equal to a threshold is an event (and at
    critical a callback), one byte below is not. Thresholds resolve exactly to whole bytes here."""
    low, high = (800, 950) if total is None else (500, 750)
    values = [low - 1, low, high - 1, high, low - 1, low, high]
    seen = []
    guard = guard_with(values, warning, critical, total=total,
                       on_critical=lambda sample: seen.append(sample.bytes_in_use))
    levels = [guard.check(step) for step in range(len(values))]
    assert levels == ["ok", "warning", "warning", "critical", "ok", "warning", "critical"]
    assert [(e["step"], e["level"], e["bytes_in_use"], e["threshold_bytes"]) for e in guard.events] == [
        (1, "warning", low, low), (3, "critical", high, high), (5, "warning", low, low), (6, "critical", high, high)]
    assert seen == [high, high]
    assert guard.last_level == "critical"


def test_hysteresis_rearms_only_strictly_below_the_band():
    """Re-armed "once usage drops below (1 - hysteresis) * threshold": exactly at that level is not below."""
    seen = []
    guard = guard_with([1000, 500, 1000, 499, 1000], 400, 1000, total=None, on_critical=seen.append,
                       hysteresis=0.5)
    assert [guard.check(step) for step in range(5)] == ["critical", "warning", "critical", "warning", "critical"]
    assert [(e["step"], e["level"]) for e in guard.events] == [(0, "warning"), (0, "critical"), (4, "critical")]
    assert len(seen) == 2


def test_critical_empties_the_cuda_cache_after_the_callback(monkeypatch):
    order = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: order.append("empty_cache"))
    cuda = VRAMGuard(0.5, 0.9, ScriptedReader([950], total_bytes=1000, source="nvml+torch.cuda"),
                     on_critical=lambda sample: order.append("on_critical"))
    cuda.check(0)
    cuda.check(1)
    assert order == ["on_critical", "empty_cache"]
    cpu = VRAMGuard(0.5, 0.9, ScriptedReader([950], total_bytes=1000, source="psutil-rss"))
    cpu.check(0)
    assert order == ["on_critical", "empty_cache"]  # no CUDA cache behind an RSS reading


def test_fraction_and_absolute_thresholds_resolve_to_bytes():
    assert guard_with([0], 0.5, 1.0, total=2000).thresholds_bytes(2000) == {"warning": 1000.0, "critical": 2000.0}
    assert guard_with([0], 1500, 2000).thresholds_bytes(None) == {"warning": 1500.0, "critical": 2000.0}
    assert guard_with([1000], 0.5, 0.9, total=2000).check(0) == "warning"
    assert guard_with([1000], 1001, 2000, total=2000).check(0) == "ok"


def test_fraction_thresholds_need_total_bytes():
    guard = guard_with([10], 0.5, 0.9, total=None)
    with pytest.raises(ValueError, match="total_bytes"):
        guard.check(0)


@pytest.mark.parametrize("warning, critical, name", [
    (0.9, 0.5, "warning"), (0.5, 0.5, "warning"), (2000, 1000, "warning"),
    (0.5, 2000, "critical"), (0, 0.5, "warning"), (0.5, -1, "critical"),
    (float("nan"), 0.9, "warning"), (0.5, float("inf"), "critical"),
])
def test_guard_validation_names_the_argument(warning, critical, name):
    with pytest.raises(ValueError, match=name):
        VRAMGuard(warning, critical, ScriptedReader([0]))


def test_logger_name_is_the_documented_one():
    assert memory.logger.name == "hybrid_trainer.memory"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_default_reader_on_a_real_gpu_sees_an_allocation():
    reader = default_reader("cuda")
    before = reader()
    block = torch.empty(64 * 1024 ** 2, dtype=torch.uint8, device="cuda")
    after = reader()
    assert "torch.cuda" in after.source and after.total_bytes > 0
    assert after.bytes_in_use - before.bytes_in_use >= block.numel()

"""MetricsLogger / read_jsonl / plot_run: strict JSON lines that survive a crash, and a real PNG."""
import enum
import json
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hybrid_trainer import metrics as metrics_module
from hybrid_trainer.metrics import MetricsLogger, plot_run, read_jsonl, to_json_safe
from _images import assert_plot


def synthetic_run() -> list[dict]:
    """A small run through all four phases, with verifications (one rejected) and validation losses."""
    rng = np.random.default_rng(0)
    schedule = ["WARMUP"] * 10 + ["FULL"] * 15 + (["PREDICT"] * 8 + ["CORRECT"] * 4) * 3 + ["FULL"] * 10
    records = []
    for step, phase in enumerate(schedule):
        loss = float(3.0 * np.exp(-step / 40) + 0.5 + rng.normal(0, 0.03))
        record = {"step": step, "phase": phase, "loss": None if phase == "PREDICT" else loss}
        if phase == "PREDICT" and step % 4 == 3:
            record["verify_loss"] = loss
            record["predicted_loss"] = loss * 0.98
            record["rejected"] = step == 43
            if record["rejected"]:
                record["verify_loss"] = loss * 1.5
        if step % 20 == 19:
            record["val_loss"] = loss + 0.1
        records.append(record)
    return records


def test_round_trip_of_logged_records(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"  # parent folder is created
    records = synthetic_run()
    with MetricsLogger(path) as logger:
        for record in records:
            logger.log(record)
        assert logger.records == records
    assert logger.closed
    assert read_jsonl(path) == records
    assert len(path.read_text().splitlines()) == len(records)


def test_non_finite_floats_become_null_and_file_is_strict_json(tmp_path):
    class Phase(enum.IntEnum):
        FULL = 1

    path = tmp_path / "m.jsonl"
    with MetricsLogger(path) as logger:
        logger.log({"step": np.int64(3), "phase": Phase.FULL, "loss": float("nan"), "grad": np.float32(2.5),
                    "band": (1.0, float("inf")), "nested": {"x": -math.inf}, "ok": np.bool_(True)})
    line = path.read_text().strip()
    # json.loads with a hook that refuses NaN/Infinity proves the line is RFC 8259 JSON.
    parsed = json.loads(line, parse_constant=lambda name: pytest.fail(f"non-standard constant {name}"))
    assert parsed == {"step": 3, "phase": "FULL", "loss": None, "grad": 2.5, "band": [1.0, None],
                      "nested": {"x": None}, "ok": True}
    assert logger.records[0] == parsed


def test_unserialisable_value_raises_type_error_naming_it():
    with pytest.raises(TypeError, match=r"record\['model'\]"):
        to_json_safe({"model": object()})


def test_memory_only_logger_keeps_records():
    logger = MetricsLogger(None)
    logger.log({"step": 0, "loss": 1.0})
    logger.close()
    assert logger.records == [{"step": 0, "loss": 1.0}]


def test_logging_after_close_is_an_error(tmp_path):
    logger = MetricsLogger(tmp_path / "m.jsonl")
    logger.close()
    with pytest.raises(ValueError, match="closed"):
        logger.log({"step": 0})


def test_existing_file_is_continued_on_resume(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsLogger(path) as logger:
        logger.log({"step": 0})
    with MetricsLogger(path) as logger:
        logger.log({"step": 1})
    assert [r["step"] for r in read_jsonl(path)] == [0, 1]


def test_crash_mid_run_keeps_every_logged_line(tmp_path):
    path = tmp_path / "crash.jsonl"
    # A separate interpreter logs records and dies without closing the logger or running any cleanup.
    # It loads metrics.py by file path: importing the package would pull in torch and cost seconds.
    script = textwrap.dedent(f"""
        import importlib.util, os
        spec = importlib.util.spec_from_file_location("metrics_under_test", {metrics_module.__file__!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        logger = module.MetricsLogger({str(path)!r})
        for step in range(25):
            logger.log({{"step": step, "phase": "FULL", "loss": 1.0 / (step + 1)}})
        os._exit(3)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert result.returncode == 3, result.stderr.decode()
    records = read_jsonl(path)
    assert [r["step"] for r in records] == list(range(25))
    assert records[-1]["loss"] == pytest.approx(1.0 / 25)


def test_read_jsonl_drops_torn_last_line_but_rejects_corruption_inside(tmp_path):
    torn = tmp_path / "torn.jsonl"
    torn.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "lo')
    assert read_jsonl(torn) == [{"step": 0}, {"step": 1}]
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text('{"step": 0}\n{"step": \n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_jsonl(corrupt)


def test_plot_run_writes_png_with_all_phases(tmp_path):
    from matplotlib.image import imread

    records = synthetic_run()
    assert {r["phase"] for r in records} == {"WARMUP", "FULL", "PREDICT", "CORRECT"}
    out = tmp_path / "plots" / "run.png"
    plot_run(records, out, title="synthetic run")
    assert out.stat().st_size > 1024
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = imread(out)
    assert image.shape[0] >= 400 and image.shape[1] >= 800 and image.shape[2] in (3, 4)
    # Phase shading and curves put many distinct colours on the canvas; a blank figure has a handful.
    colours = np.unique((image[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 50
    # The rejected verification is drawn in pure red.
    red = (image[..., 0] > 0.95) & (image[..., 1] < 0.1) & (image[..., 2] < 0.1)
    assert red.sum() > 10


def test_plot_run_accepts_a_jsonl_path_and_null_losses(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsLogger(path) as logger:
        for record in synthetic_run():
            logger.log({**record, "loss": float("nan") if record["step"] == 5 else record["loss"]})
    out = tmp_path / "from_file.png"
    plot_run(path, out)
    assert_plot(out, (10, 5), dpi=100)


def test_plot_run_rejects_empty_records(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        plot_run([], tmp_path / "x.png")

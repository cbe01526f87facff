"""experiments.queued_read: both ways of queueing hold the same values, and the report's per-step
saving is the check's and the look's difference plus the block read's over its steps."""
import json

import pytest

from experiments import queued_read


@pytest.mark.parametrize("k", [2, 6])
def test_the_two_ways_queue_the_same_values_and_read_them_the_same(k):
    from hybrid_trainer.run_report import split_read, stack_queued

    rows = {}
    for as_vector in (False, True):
        queued = queued_read.queued_steps(k, as_vector)
        assert len(queued) == queued_read.BLOCK
        assert all(len(values) == (2 if as_vector else k + 1) for values in queued)
        flat, flags = stack_queued(queued, vectors=as_vector)
        rows[as_vector] = split_read(queued, flags, flat.tolist())
    assert rows[True] == rows[False]


def test_the_saving_a_step_counts_the_block_read_once_per_block():
    rows = [dict(norms=6, measure="check, a step", one_by_one_us=3.0, as_one_vector_us=1.0),
            dict(norms=6, measure=f"block read, {queued_read.BLOCK} steps", one_by_one_us=48.0, as_one_vector_us=16.0),
            dict(norms=6, measure="layout look, a step", one_by_one_us=0.0, as_one_vector_us=1.5),
            dict(norms=40, measure="check, a step", one_by_one_us=9.0, as_one_vector_us=1.0)]
    assert queued_read.saving_per_step(rows, 6) == pytest.approx(2.0 + 32.0 / queued_read.BLOCK - 1.5)
    assert queued_read.saving_per_step(rows, 40) == pytest.approx(8.0)


def test_a_short_run_writes_every_measure_for_every_k(tmp_path):
    queued_read.main(["--norms", "3", "5", "--rounds", "2", "--calls", "2", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "queued_read.json").read_text())
    assert saved["meta"]["command"] == "python -m experiments.queued_read --norms 3 5 --rounds 2 --calls 2 " \
                                       f"--out {tmp_path}"
    assert [(r["norms"], r["measure"]) for r in saved["rows"]] == [
        (k, m) for k in (3, 5) for m in ("check, a step", f"block read, {queued_read.BLOCK} steps",
                                         "layout look, a step")]
    assert all(r["one_by_one_us"] > 0 and r["as_one_vector_us"] > 0 for r in saved["rows"])
    assert "| 5 | check, a step |" in (tmp_path / "queued_read.md").read_text()

"""bench.recording_cost runs and times every arm (a smoke test on the tiny model; no timing asserted)."""
from bench import recording_cost


def test_recording_cost_times_every_arm(capsys):
    assert recording_cost.main(["--models", "tiny", "--repeats", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert len(cells) == 2 + len(recording_cost.ARMS) and all(float(c) > 0 for c in cells[2:])


def test_measure_returns_a_time_per_arm():
    best = recording_cost.measure("tiny", 1)
    assert set(best) == set(recording_cost.ARMS) and all(v > 0 for v in best.values())

"""experiments.quiet_probe: probes are taken only at the guard's rollbacks for a second critical
step in a row, change none of its decisions, and the report counts them."""
import json

from experiments import quiet_probe, spike_cost


def test_probes_come_only_at_rollbacks_and_leave_the_run_as_the_guard_made_it(tmp_path):
    quiet_probe.main(["--seeds", "1", "--before", "1000", "--after", "1600", "--scenarios", "learning rate x100",
                      "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "quiet_probe.json").read_text())
    run = saved["result"]["scenarios"]["learning rate x100"][0]
    assert run["probes"], "the learning-rate fault rolls back at least once"
    assert len(run["probes"]) <= run["rollbacks"]
    assert all(p["probe_then"] > 0 and p["probe_now"] > 0 for p in run["probes"])
    # The same run through spike_cost's per-step arm, unprobed: the same rollbacks, the same end.
    unprobed = spike_cost.run_arm("learning rate x100", "read every step", 0, 1000, 1600)
    assert run["final_loss"] == unprobed["final_loss"] and run["rollbacks"] == unprobed["rollbacks"]
    quiet = sum(not p["probe_critical"] for p in run["probes"])
    assert f"- learning rate x100: {quiet} of {len(run['probes'])} probes quiet" in (tmp_path / "quiet_probe.md").read_text()

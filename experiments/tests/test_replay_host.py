"""experiments.replay_host: every timed step is a replay (an empty one), and the report says what it timed."""
import json

from experiments import replay_host


def test_every_timed_step_is_replayed_and_the_report_holds_the_time_and_profile(tmp_path):
    replay_host.main(["--models", "tiny", "--rounds", "6", "--warmup", "40", "--profile-steps", "40",
                      "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "replay_host.json").read_text())
    assert saved["meta"]["command"] == ("python -m experiments.replay_host --models tiny --rounds 6 --warmup 40 "
                                        "--profile-steps 40 --out " + str(tmp_path))
    (result,) = saved["results"]
    assert result["timed_steps"] == 6 * replay_host.CHUNK == result["replayed_steps"]
    assert result["step_us"] > 0 and result["interval_us"] is not None
    assert "_captured_step" in result["profile"]  # the trainer's replayed step, not its eager one
    assert "| tiny |" in (tmp_path / "replay_host.md").read_text()


def test_the_empty_replay_runs_the_step_once_at_capture_and_never_again():
    trainer, batches = replay_host.replaying_trainer("tiny", 8)
    for b in batches * 5:
        trainer.step(b)
    assert trainer.captured.captures == 1 and trainer.captured.replays > 0
    weights = [p.detach().clone() for p in trainer.params]
    for b in batches:  # all replays: no block read brings a good state or a rollback
        trainer.step(b)
    assert all((p == w).all() for p, w in zip(trainer.params, weights))

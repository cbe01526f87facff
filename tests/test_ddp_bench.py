"""bench.ddp: the summary arithmetic, and a short two-rank run's record of every arm."""
import json

import pytest

from bench import ddp
from _images import assert_plot


def _seed(arm, seed, train_s, digest, agree=True):
    return dict(arm=arm, seed=seed, ms_per_step=train_s, train_s=train_s, val_loss=1.0, backward_passes=10,
                predicted_steps=0, ranks_agree=agree, digest=digest, ms_by_kind={"real": 2 * train_s})


def test_summary_compares_each_arm_with_the_plain_loop_and_checks_the_weights():
    plain, no_predict, default, forced = ddp.ARMS
    runs = [_seed(plain, 0, 2.0, "a"), _seed(plain, 1, 4.0, "b"),
            _seed(no_predict, 0, 3.0, "a"), _seed(no_predict, 1, 3.0, "b"),
            _seed(default, 0, 1.5, "x"), _seed(default, 1, 1.5, "y", agree=False),
            _seed(forced, 0, 1.0, "z"), _seed(forced, 1, 1.0, "w")]
    runs[-1]["ms_by_kind"]["predicted"] = 0.5  # one seed only: the mean is over the seeds that had it
    summary = ddp.summarise(runs)
    assert summary["arms"][plain]["ms_by_kind"] == {"real": pytest.approx(6.0)}
    assert summary["arms"][forced]["ms_by_kind"] == {"real": pytest.approx(2.0), "predicted": pytest.approx(0.5)}
    assert summary["arms"][no_predict]["time_vs_plain"] == pytest.approx(1.0)  # mean 3 s against mean 3 s
    assert summary["arms"][default]["time_vs_plain"] == pytest.approx(0.5)
    assert summary["arms"][no_predict]["time_vs_plain_range"] == pytest.approx([0.75, 1.5])  # 3/4 and 3/2 per seed
    assert summary["no_predict_is_plain_bit_for_bit"]
    assert summary["arms"][plain]["ranks_agree"] and not summary["arms"][default]["ranks_agree"]
    runs[3]["digest"] = "c"
    assert not ddp.summarise(runs)["no_predict_is_plain_bit_for_bit"]


@pytest.mark.slow
def test_two_rank_run_writes_every_arm_with_identical_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", "eager")
    result = ddp.main(["--task", "digits", "--steps", "60", "--seeds", "1", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "ddp_digits.json").read_text())
    assert saved["arms"].keys() == set(ddp.ARMS) and saved == json.loads(json.dumps(result))
    for arm in saved["arms"].values():
        assert arm["ranks_agree"] and arm["train_s"] > 0 and arm["ms_per_step"] > 0
    assert saved["no_predict_is_plain_bit_for_bit"]
    for name in ("HybridTrainer (default)", "HybridTrainer (forced)"):
        arm = saved["arms"][name]
        assert arm["backward_passes"] + arm["predicted_steps"] == 60
        assert sum(arm["seeds"][0]["steps_by_kind"].values()) == 60
    forced = saved["arms"]["HybridTrainer (forced)"]["seeds"][0]
    kinds = forced["steps_by_kind"]
    assert forced["predicted_steps"] > 0  # a PREDICT phase starts after 20 warm-up and 20 FULL steps
    assert forced["predicted_steps"] == kinds.get("predicted", 0) + kinds.get("predicted, verified", 0)
    assert_plot(tmp_path / "ddp_digits.png", (10, 4), dpi=110)
    assert "plain DDP" in (tmp_path / "ddp.md").read_text()


def test_bad_arguments_name_themselves(tmp_path, capsys):
    for argv, name in ((["--world", "1"], "--world"), (["--steps", "0"], "--steps")):
        with pytest.raises(SystemExit):
            ddp.main([*argv, "--out", str(tmp_path)])
        assert name in capsys.readouterr().err

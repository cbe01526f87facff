"""experiments.confidence: the ranking statistic, and a forced run's verdicts with their scores."""
import json

import pytest

from experiments import confidence
from _images import assert_plot


def test_roc_auc_is_the_probability_an_accepted_outscores_a_rejected():
    labels = [False, False, True, True]
    assert confidence.roc_auc([0.1, 0.2, 0.3, 0.4], labels) == 1.0
    assert confidence.roc_auc([0.4, 0.3, 0.2, 0.1], labels) == 0.0
    assert confidence.roc_auc([0.5] * 4, labels) == 0.5  # ties count half
    assert confidence.roc_auc([0.1, 0.3, 0.2, 0.4], labels) == pytest.approx(0.75)
    assert confidence.roc_auc([0.1, 0.2], [True, True]) is None  # no rejected verdict to rank against


def test_quartile_rates_split_by_score():
    scores = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    labels = [False, False, False, True, True, True, True, True]
    quarts = confidence.quartile_rates(scores, labels)
    assert [q["n"] for q in quarts] == [2, 2, 2, 2]
    assert [q["acceptance"] for q in quarts] == [0.0, 0.5, 1.0, 1.0]
    assert quarts[0]["score_min"] == 0.1 and quarts[-1]["score_max"] == 0.8


def test_forced_run_records_every_verification_with_its_scores(tmp_path):
    assert confidence.main(["--tasks", "digits", "--quick", "--seeds", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "confidence.json").read_text())
    digits = result["tasks"]["digits"]
    records, stats = digits["records"][0], digits["trainer_statistics"][0]
    assert stats["verifications"] == len(records) > 0  # one record per verification the trainer made
    assert stats["verifications_accepted"] == sum(r["accepted"] for r in records)
    for r in records:
        assert 0.0 <= r["dynamics_confidence"] <= 1.0 and 0.0 < r["acceptance_estimate"] < 1.0
        assert r["combined_confidence"] == pytest.approx((r["dynamics_confidence"] * r["acceptance_estimate"]) ** 0.5)
        assert 1 <= r["horizon"] <= r["phase_length"]
    assert digits["summary"]["verifications"] == len(records)
    assert (tmp_path / "confidence.md").read_text().count("| digits |") == 1
    assert_plot(tmp_path / "confidence.png", (12, 3.8), dpi=110)

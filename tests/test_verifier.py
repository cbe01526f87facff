"""Verification bands and the loss trend behind the worth gate (hybrid_trainer/verifier.py)."""
import math

import pytest

from hybrid_trainer.verifier import LossTrend, verify

BAND = dict(noise_std=0.1, loss_tolerance=0.01, noise_z=2.0)


def test_a_loss_must_be_within_both_bands_the_tighter_decides():
    # last verified 2.0 + max(0.02, 0.2·√2) ≈ 2.283; expected 1.9 + max(0.019, 0.2) = 2.1
    inside_one_band_only = verify(2.2, expected=1.9, last_verified=2.0, last_verified_is_single_batch=True, **BAND)
    assert not inside_one_band_only.accepted
    assert inside_one_band_only.upper_bound == pytest.approx(2.1)
    assert "expected trajectory" in inside_one_band_only.reason
    assert verify(2.05, 1.9, 2.0, True, **BAND).accepted
    # Without a forecast only the anchor's band applies; a smoothed anchor's band is √2 narrower.
    assert verify(2.2, None, 2.0, True, **BAND).upper_bound == pytest.approx(2.0 + 0.2 * math.sqrt(2))
    assert verify(2.2, None, 2.0, False, **BAND).upper_bound == pytest.approx(2.2)


def test_relative_tolerance_takes_over_when_the_noise_is_small():
    verdict = verify(10.05, None, 10.0, False, noise_std=0.001, loss_tolerance=0.01, noise_z=2.0)
    assert verdict.accepted and verdict.upper_bound == pytest.approx(10.1)


def test_non_finite_loss_is_rejected():
    assert not verify(float("nan"), 1.0, 1.0, False, **BAND).accepted
    assert not verify(float("inf"), None, 1.0, False, **BAND).accepted


def test_slope_is_the_least_squares_loss_change_per_step():
    trend = LossTrend(window=16)
    for i in range(7):
        trend.update(3.0 - 0.05 * i)
    assert trend.slope() is None  # too few losses to fit
    for i in range(7, 40):
        trend.update(3.0 - 0.05 * i + (0.01 if i % 2 else -0.01))  # alternating noise averages out
    assert trend.slope() == pytest.approx(-0.05, rel=0.02)
    assert len(trend.recent) == 16


def test_noise_is_the_spread_around_the_trend_and_ignores_non_finite_losses():
    trend = LossTrend(beta=0.9)
    for i in range(400):
        trend.update(1.0 + (0.1 if i % 2 else -0.1))
        trend.update(float("nan"))
    assert trend.count == 400
    assert trend.noise_std == pytest.approx(0.1, rel=0.1)
    assert trend.mean == pytest.approx(1.0, abs=0.02)

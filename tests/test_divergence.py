"""DivergenceMonitor: each signal fires when it should, stays quiet when it should not, and round-trips."""
import json
import math
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_trainer.divergence import REASON_KINDS, DivergenceMonitor, DivergenceReport, Severity


def noisy_decreasing_losses(seed: int, steps: int = 200, start: float = 2.5, noise: float = 0.05) -> list[float]:
    """Exponentially decaying loss plus Gaussian minibatch noise: what an ordinary healthy run looks like."""
    rng = np.random.default_rng(seed)
    t = np.arange(steps)
    return list(start * np.exp(-t / 150) + 0.5 + rng.normal(0.0, noise, steps))


def fed_monitor(losses, grad_norms=None, **kwargs) -> DivergenceMonitor:
    monitor = DivergenceMonitor(**kwargs)
    for i, loss in enumerate(losses):
        monitor.observe(loss, None if grad_norms is None else grad_norms[i])
    return monitor


def test_report_critical_property():
    assert DivergenceReport(Severity.CRITICAL, ["x"]).critical
    assert not DivergenceReport(Severity.WARNING, ["x"]).critical
    assert not DivergenceReport(Severity.OK, []).critical


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_loss_is_critical_even_without_history(bad):
    monitor = DivergenceMonitor()
    report = monitor.check(bad)
    assert report.severity == Severity.CRITICAL and report.critical
    assert any("nan" in r or "inf" in r for r in report.reasons)
    assert report.kinds == ["nan"]
    assert monitor.counts["nan"] == 1


def test_nan_loss_reason_mentions_nan():
    report = DivergenceMonitor().check(float("nan"), grad_norm=1.0)
    assert report.critical
    assert any("nan" in reason.lower() for reason in report.reasons)


def test_non_finite_grad_norm_is_critical():
    monitor = fed_monitor([1.0] * 20, [1.0] * 20)
    report = monitor.check(1.0, grad_norm=float("inf"))
    assert report.critical
    assert any("grad norm is inf" in r for r in report.reasons)


@pytest.mark.parametrize("seed", range(8))
def test_steady_noisy_decreasing_loss_stays_ok_for_200_steps(seed):
    monitor = DivergenceMonitor()
    rng = np.random.default_rng(100 + seed)
    for step, loss in enumerate(noisy_decreasing_losses(seed)):
        grad_norm = float(abs(rng.normal(2.0, 0.3)))
        report = monitor.check(loss, grad_norm)
        assert report.severity == Severity.OK, (step, report.reasons)
        monitor.observe(loss, grad_norm)
    assert sum(monitor.counts.values()) == 0


def test_tenfold_spike_is_critical_and_not_recorded_by_check():
    losses = noisy_decreasing_losses(0, steps=60)
    monitor = fed_monitor(losses, blame_lone_alarms_on_the_batch=False)  # the rule alone (tolerance: below)
    before = monitor.state_dict()
    spike = 10 * losses[-1]
    report = monitor.check(spike)
    assert report.critical
    assert report.kinds == ["loss_z"]
    assert any(r.startswith("loss z-score") and "> 6" in r for r in report.reasons)
    assert monitor.counts["loss_z"] == 1
    # check() is pure with respect to history: the spike did not move the baseline.
    after = monitor.state_dict()
    assert after["losses"] == before["losses"] and after["grad_norms"] == before["grad_norms"]
    assert monitor.check(spike, count=False).critical
    assert monitor.counts["loss_z"] == 1


def test_moderate_rise_is_warning_not_critical():
    rng = np.random.default_rng(3)
    losses = list(1.0 + rng.normal(0.0, 0.01, 50))
    monitor = fed_monitor(losses)
    z_target = 4.5  # between the warning (3) and critical (6) thresholds
    scale = (monitor.loss_z_score(2.0) - monitor.loss_z_score(1.0))  # z per unit of loss
    candidate = float(np.median(losses)) + z_target / scale
    report = monitor.check(candidate)
    assert report.severity == Severity.WARNING, report.reasons
    assert report.kinds == ["loss_z"]


def test_sudden_drop_after_steady_decline_is_ok():
    losses = noisy_decreasing_losses(1, steps=80)
    monitor = fed_monitor(losses)
    report = monitor.check(losses[-1] * 0.1)
    assert report.severity == Severity.OK, report.reasons


def test_before_min_history_no_z_test_but_a_jump_is_critical():
    """The z-score needs min_history losses; a loss ten times the largest seen needs one, so the
    first steps of a run (and the steps after a rollback) are not blind to a blow-up."""
    monitor = fed_monitor([1.0, 1.01, 0.99], min_history=10)
    assert monitor.loss_z_score(100.0) is None
    assert monitor.check(5.0).severity == Severity.OK  # a rise the z-score would judge, not a jump
    report = monitor.check(100.0)
    assert report.critical and report.kinds == ["loss_jump"], report.reasons
    assert monitor.check(1.01 + 9 * 1.01).severity == Severity.OK  # exactly at the factor is not above it
    assert monitor.check(1.01 + 9 * 1.01 * 1.001).critical
    assert DivergenceMonitor().check(1e9).severity == Severity.OK  # nothing seen, nothing to compare with
    monitor = fed_monitor([1.0, 1.01, 0.99] * 4, min_history=10)
    assert monitor.check(100.0).kinds == ["loss_jump", "loss_z"]


def test_a_jump_of_a_negative_loss_is_measured_against_its_magnitude():
    monitor = fed_monitor([-5.0, -4.0])
    assert monitor.check(-4.0 + 8.9 * 5.0).severity == Severity.OK
    assert monitor.check(-4.0 + 9.1 * 5.0).critical


def test_grad_jump_is_critical_from_the_first_grad_norm():
    monitor = fed_monitor([1.0], [2.0])
    assert monitor.check(1.0, grad_norm=199.0).severity == Severity.OK
    report = monitor.check(1.0, grad_norm=201.0)
    assert report.critical and report.kinds == ["grad_explosion"], report.reasons


def test_rewind_window_goes_back_to_the_remembered_history():
    losses = noisy_decreasing_losses(4, steps=40)
    monitor = fed_monitor(losses, [1.0] * 40, blame_lone_alarms_on_the_batch=False)
    monitor.remember_window()
    kept = monitor.state_dict()
    for loss in losses[:5]:  # the abandoned trajectory
        monitor.observe(loss * 3, 5.0)
    monitor.rewind_window()
    now = monitor.state_dict()
    assert (now["losses"], now["grad_norms"]) == (kept["losses"], kept["grad_norms"])
    assert monitor.check(10 * losses[-1]).critical  # judged at once, as before the rollback
    fresh = DivergenceMonitor()
    fresh.observe(1.0, 1.0)
    fresh.rewind_window()  # nothing remembered: forget
    assert fresh.history_length == 0


def test_rewound_holds_from_a_rollback_until_the_next_good_state_and_survives_a_checkpoint():
    monitor = fed_monitor(noisy_decreasing_losses(4, steps=20), [1.0] * 20)
    assert not monitor.rewound
    monitor.remember_window()
    monitor.rewind_window()
    assert monitor.rewound
    restored = DivergenceMonitor()
    restored.load_state_dict(json.loads(json.dumps(monitor.state_dict())))
    assert restored.rewound
    monitor.remember_window()  # the next good state
    assert not monitor.rewound
    older = monitor.state_dict()
    del older["rewound"]  # written before the key existed
    restored.load_state_dict(older)
    assert not restored.rewound
    with pytest.raises(ValueError, match="rewound"):
        restored.load_state_dict(dict(monitor.state_dict(), rewound=1))


# ------------------------------------------------------------------------------- lone outliers ----
def _flat_monitor(**kwargs) -> DivergenceMonitor:
    """50 accepted steps near 1.0 (std 0.01) with grad norms near 1: 1.5 scores z ~ 50, far below the
    loss_jump rule's bound (~10)."""
    rng = np.random.default_rng(7)
    return fed_monitor(list(1.0 + rng.normal(0.0, 0.01, 50)), list(1.0 + rng.normal(0.0, 0.01, 50)), **kwargs)


def test_a_lone_z_outlier_is_a_warning_and_the_next_critical_step_in_a_row_is_not():
    monitor = _flat_monitor()
    report = monitor.check(1.5, 1.0)
    assert report.severity is Severity.WARNING and not report.critical and report.kinds == ["loss_z"]
    assert report.reasons[-1].startswith("a lone outlier, tolerated")
    assert (monitor.tolerated, monitor.critical_in_a_row, monitor.counts["loss_z"]) == (1, 1, 1)
    monitor.observe(1.5, 1.0)  # the trainer applies a tolerated step
    second = monitor.check(3.0, 1.0)  # z ~ 14 against the window that now holds 1.5
    assert second.critical and second.kinds == ["loss_z"] and monitor.tolerated == 1
    assert monitor.critical_in_a_row == 2
    # A step that raises nothing critical ends the run: the next outlier is lone again.
    assert monitor.check(1.0, 1.0).severity is Severity.OK and monitor.critical_in_a_row == 0
    assert not monitor.check(3.0, 1.0).critical and monitor.tolerated == 2
    monitor.check(1.0, 1.0)
    monitor.check(1.0, 1.0, count=False)  # a re-check of a step judged already is not a step
    monitor.check(3.0, 1.0, count=False)
    assert (monitor.critical_in_a_row, monitor.tolerated) == (0, 2)
    # Steps found quiet in a block read (observe_quiet, never checked) end a run too.
    monitor.check(3.0, 1.0)
    assert monitor.critical_in_a_row == 1
    monitor.observe_quiet(1.0, 1.0)
    assert monitor.critical_in_a_row == 0


@pytest.mark.parametrize("loss, grad_norm, kinds", [
    (1.0, 100.0, ["grad_explosion"]),  # an exploding gradient is what an update would carry into the weights
    (1.5, 100.0, ["loss_z", "grad_explosion"]),
    (100.0, 1.0, ["loss_jump", "loss_z"]),  # the history-free rules: a poisoned batch, a blow-up
    (math.nan, 1.0, ["nan"]),
    (1.0, math.inf, ["nan"]),
])
def test_only_the_loss_z_score_is_tolerated(loss, grad_norm, kinds):
    monitor = _flat_monitor()
    report = monitor.check(loss, grad_norm)
    assert report.critical and report.kinds == kinds and monitor.tolerated == 0


def test_the_early_grad_jump_and_a_switched_off_tolerance_are_critical():
    early = fed_monitor([1.0, 1.0], [1.0, 1.0])  # below min_history: the history-free grad rule
    assert early.check(1.0, 1e3).critical
    monitor = _flat_monitor(blame_lone_alarms_on_the_batch=False)
    assert monitor.check(1.5, 1.0).critical and monitor.tolerated == 0
    with pytest.raises(ValueError, match="blame_lone_alarms_on_the_batch"):
        DivergenceMonitor(blame_lone_alarms_on_the_batch=1)


def test_the_run_of_critical_steps_and_the_tolerated_count_survive_a_checkpoint():
    monitor = _flat_monitor()
    monitor.check(1.5, 1.0)
    state = json.loads(json.dumps(monitor.state_dict()))
    restored = DivergenceMonitor()
    restored.load_state_dict(state)
    assert (restored.critical_in_a_row, restored.tolerated) == (1, 1)
    assert restored.check(1.5, 1.0).critical  # the second in a row, as in the run saved
    older = dict(state)
    del older["critical_in_a_row"], older["tolerated"]  # written before the keys existed
    restored.load_state_dict(older)
    assert (restored.critical_in_a_row, restored.tolerated) == (0, 0)
    for key, bad in (("critical_in_a_row", -1), ("tolerated", True), ("critical_in_a_row", 1.5)):
        with pytest.raises(ValueError, match=key):
            restored.load_state_dict(dict(state, **{key: bad}))


def test_refusals_in_a_row_stall_and_an_accepted_step_ends_them():
    monitor = DivergenceMonitor(max_refused_in_a_row=3)
    assert not monitor.record_refusal() and not monitor.record_refusal()
    monitor.observe(1.0, 1.0)
    assert monitor.refused_in_a_row == 0
    assert [monitor.record_refusal() for _ in range(3)] == [False, False, True] and monitor.stalled
    restored = DivergenceMonitor(max_refused_in_a_row=3)
    restored.load_state_dict(json.loads(json.dumps(monitor.state_dict())))
    assert restored.stalled


def test_flat_loss_does_not_turn_rounding_into_alarm():
    monitor = fed_monitor([2.0] * 30, blame_lone_alarms_on_the_batch=False)
    assert monitor.check(2.0 + 1e-6).severity == Severity.OK
    assert monitor.check(2.0 * 3).critical  # the relative floor still lets a real jump through


def test_grad_explosion_is_critical():
    rng = np.random.default_rng(0)
    grads = list(np.abs(rng.normal(2.0, 0.2, 30)))
    monitor = fed_monitor([1.0] * 30, grads)
    report = monitor.check(1.0, grad_norm=1e5)
    assert report.critical
    assert report.kinds == ["grad_explosion"]
    assert any(r.startswith("grad norm 1e+05 > 10x median") for r in report.reasons), report.reasons
    # Just below the factor is fine.
    assert monitor.check(1.0, grad_norm=9.0 * float(np.median(grads))).severity == Severity.OK
    assert monitor.counts["grad_explosion"] == 1


def test_grad_explosion_against_the_median_needs_history():
    monitor = fed_monitor([1.0] * 3, [1.0] * 3)
    assert monitor.check(1.0, grad_norm=50.0).severity == Severity.OK  # 50x the median, below the jump factor
    assert fed_monitor([1.0] * 10, [1.0] * 10).check(1.0, grad_norm=50.0).critical


def test_vanishing_gradient_is_warning():
    monitor = fed_monitor([1.0] * 30, [1.0] * 30)
    report = monitor.check(1.0, grad_norm=1e-12)
    assert report.severity == Severity.WARNING
    assert report.kinds == ["grad_vanish"]
    assert "vanishing" in report.reasons[0]
    assert monitor.counts["grad_vanish"] == 1


def test_loss_none_runs_only_grad_checks():
    monitor = fed_monitor([1.0] * 30, [1.0] * 30)
    assert monitor.check(None, grad_norm=1.0).severity == Severity.OK
    assert monitor.check(None, grad_norm=100.0).critical
    assert monitor.check(None).severity == Severity.OK


def test_oscillation_without_progress_is_warning():
    # Zig-zag around a flat level: every difference changes sign and nothing is gained.
    zigzag = [1.0 + (0.05 if i % 2 else -0.05) for i in range(40)]
    monitor = fed_monitor(zigzag)
    report = monitor.check(zigzag[-2])  # continues the pattern
    assert report.severity == Severity.WARNING, report.reasons
    assert report.kinds == ["oscillation"]
    assert monitor.oscillation_share(zigzag[-2]) == 1.0
    assert monitor.counts["oscillation"] == 1


def test_oscillation_while_decreasing_is_ok():
    zigzag_down = [2.0 - 0.02 * i + (0.05 if i % 2 else -0.05) for i in range(40)]
    monitor = fed_monitor(zigzag_down)
    nxt = 2.0 - 0.02 * 40 - 0.05
    assert monitor.oscillation_share(nxt) == 1.0
    assert monitor.check(nxt).severity == Severity.OK


def test_iid_noise_is_not_oscillation():
    # Independent noise changes direction about 2/3 of the time: below the 0.85 threshold.
    rng = np.random.default_rng(5)
    monitor = fed_monitor(list(1.0 + rng.normal(0, 0.01, 50)), oscillation_window=40)
    share = monitor.oscillation_share()
    assert 0.4 < share < 0.85
    assert "oscillation" not in monitor.check(1.0).kinds


def test_observe_ignores_non_finite_and_reset_window_forgets():
    monitor = DivergenceMonitor()
    monitor.observe(float("nan"), float("inf"))
    monitor.observe(None, None)
    assert monitor.history_length == 0
    for loss in [1.0] * 12:
        monitor.observe(loss, 1.0)
    assert monitor.check(50.0).critical
    monitor.reset_window()
    assert monitor.history_length == 0
    assert monitor.check(50.0).severity == Severity.OK  # no baseline left to compare with
    assert monitor.counts["loss_z"] == 1  # counts survive the reset


def test_history_is_bounded_by_window():
    monitor = fed_monitor([float(i) for i in range(200)], [1.0] * 200, window=30, oscillation_window=10)
    state = monitor.state_dict()
    assert len(state["losses"]) == 30 and state["losses"][-1] == 199.0
    assert len(state["grad_norms"]) == 30


def test_state_dict_round_trip_is_exact_and_json_able():
    losses = noisy_decreasing_losses(2, steps=70)
    rng = np.random.default_rng(9)
    grads = list(np.abs(rng.normal(1.0, 0.1, 70)))
    monitor = fed_monitor(losses, grads)
    monitor.check(float("nan"))
    monitor.check(losses[-1] * 20)
    state = json.loads(json.dumps(monitor.state_dict()))
    restored = DivergenceMonitor()
    restored.load_state_dict(state)
    assert restored.state_dict() == monitor.state_dict()
    assert restored.counts == monitor.counts and set(restored.counts) == set(REASON_KINDS)
    for loss, grad in [(losses[-1], 1.0), (losses[-1] * 1.3, 1.0), (losses[-1], 50.0), (losses[-1] * 0.5, 1e-12)]:
        a, b = monitor.check(loss, grad, count=False), restored.check(loss, grad, count=False)
        assert (a.severity, a.reasons) == (b.severity, b.reasons)


def test_load_state_dict_rejects_malformed_state():
    monitor = DivergenceMonitor()
    good = monitor.state_dict()
    with pytest.raises(ValueError, match="missing keys"):
        monitor.load_state_dict({"version": 1})
    with pytest.raises(ValueError, match="losses"):
        monitor.load_state_dict({**good, "losses": [1.0, math.nan]})
    with pytest.raises(ValueError, match="counts"):
        monitor.load_state_dict({**good, "counts": {"nan": 1}})


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"window": 1}, "window"),
        ({"window": 2.5}, "window"),
        ({"loss_z_warning": 0}, "loss_z_warning"),
        ({"loss_z_warning": float("nan")}, "loss_z_warning"),
        ({"loss_z_critical": 2.0}, "loss_z_critical"),
        ({"grad_explosion_factor": 1.0}, "grad_explosion_factor"),
        ({"grad_vanish_threshold": -1.0}, "grad_vanish_threshold"),
        ({"oscillation_window": 2}, "oscillation_window"),
        ({"oscillation_threshold": 0.0}, "oscillation_threshold"),
        ({"oscillation_threshold": 1.5}, "oscillation_threshold"),
        ({"min_history": 1}, "min_history"),
        ({"min_history": 60}, "min_history"),
        ({"min_history": True}, "min_history"),
    ],
)
def test_constructor_validation_names_argument_and_range(kwargs, name):
    with pytest.raises(ValueError, match=name) as info:
        DivergenceMonitor(**kwargs)
    message = str(info.value)
    assert any(token in message for token in (">", "in [", "in (")), message


def test_negative_grad_norm_is_rejected():
    with pytest.raises(ValueError, match="grad_norm"):
        DivergenceMonitor().check(1.0, grad_norm=-1.0)


# ------------------------------------------------------------------ the fast check against a reference
# DivergenceMonitor.check skips the exact z-score on most steps (an upper bound of z decides) and counts
# oscillation sign changes incrementally. The reference below computes every rule the straightforward way,
# from the accepted values alone, so any shortcut that changes a finding, a z-score or a share fails here.

def reference_check(monitor, accepted, accepted_grads, loss, grad_norm):
    """(findings as [(severity, kind)], z or None, share or None) by the rules in the module docstring."""
    findings = []
    z = None
    recent = accepted[-monitor.window:]
    if recent and loss - max(recent) > (monitor.loss_jump_factor - 1) * max(max(abs(v) for v in recent), 1e-12):
        findings.append((Severity.CRITICAL, "loss_jump"))
    if len(recent) >= monitor.min_history:
        center = statistics.median(recent)
        mad_scale = 1.4826 * statistics.median([abs(v - center) for v in recent])
        mean = sum(recent) / len(recent)
        std = math.sqrt(sum((v - mean) ** 2 for v in recent) / (len(recent) - 1))
        z = (loss - center) / max(mad_scale, std, monitor.relative_scale_floor * abs(center), 1e-12)
        if z > monitor.loss_z_critical:
            findings.append((Severity.CRITICAL, "loss_z"))
        elif z > monitor.loss_z_warning:
            findings.append((Severity.WARNING, "loss_z"))
    share = None
    points = (accepted + [loss])[-(monitor.oscillation_window + 1):]
    if len(points) == monitor.oscillation_window + 1:
        diffs = [b - a for a, b in zip(points, points[1:])]
        share = sum(1 for a, b in zip(diffs, diffs[1:]) if a * b < 0) / (len(diffs) - 1)
        x_mean, y_mean = (len(points) - 1) / 2, sum(points) / len(points)
        slope = (sum((i - x_mean) * (y - y_mean) for i, y in enumerate(points))
                 / sum((i - x_mean) ** 2 for i in range(len(points))))
        if share > monitor.oscillation_threshold and slope >= 0:
            findings.append((Severity.WARNING, "oscillation"))
    if grad_norm < monitor.grad_vanish_threshold:
        findings.append((Severity.WARNING, "grad_vanish"))
    grads = accepted_grads[-monitor.window:]
    if 0 < len(grads) < monitor.min_history:
        if max(grads) > monitor.grad_vanish_threshold and grad_norm > monitor.grad_jump_factor * max(grads):
            findings.append((Severity.CRITICAL, "grad_explosion"))
    elif len(grads) >= monitor.min_history:
        reference = statistics.median(grads)
        if reference > monitor.grad_vanish_threshold and grad_norm > monitor.grad_explosion_factor * reference:
            findings.append((Severity.CRITICAL, "grad_explosion"))
    return findings, z, share


@st.composite
def monitor_histories(draw):
    """Monitor settings, a history (runs of constants, zig-zags, noise, spikes, a low and a high extreme,
    non-finite values, resets and a state round trip) and candidate losses, some placed within rounding
    of the z thresholds."""
    window = draw(st.integers(2, 12))
    settings_ = dict(
        window=window,
        min_history=draw(st.integers(2, window)),
        oscillation_window=draw(st.integers(3, 10)),  # above window - 1 the history outlives the z window
        loss_z_warning=draw(st.sampled_from([0.5, 1.0, 3.0])),
        oscillation_threshold=draw(st.sampled_from([0.5, 0.85, 1.0])),
        relative_scale_floor=draw(st.sampled_from([0.0, 0.01])),
    )
    settings_["loss_z_critical"] = settings_["loss_z_warning"] * draw(st.sampled_from([1.0, 2.0]))
    level = draw(st.sampled_from([0.0, 1e-6, 1.0, 3.0, -2.0, 1e6]))
    steps = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["constant", "zigzag", "noise", "spike", "extremes", "nonfinite", "reset"]))
        n = draw(st.integers(1, 12))
        size = draw(st.sampled_from([0.0, 1e-12, 1e-3, 0.1, 1.0])) * max(1.0, abs(level))
        if kind == "constant":
            steps += [("loss", level)] * n
        elif kind == "zigzag":
            steps += [("loss", level + (size if i % 2 else -size) + 1e-3 * size * i) for i in range(n)]
        elif kind == "noise":
            steps += [("loss", level + size * draw(st.floats(-1, 1))) for _ in range(n)]
        elif kind == "spike":
            steps += [("loss", level + 100 * size + 1.0)]
        elif kind == "extremes":  # among constants: the std equals the bound the fast check uses
            steps += [("loss", level - size), ("loss", level + size)]
        elif kind == "nonfinite":
            steps += [("loss", draw(st.sampled_from([math.nan, math.inf, -math.inf])))]
        else:
            steps += [(draw(st.sampled_from(["reset", "round_trip"])), None)]
    return settings_, steps, draw(st.lists(st.floats(-3, 3), min_size=1, max_size=4))


def _candidates(monitor, accepted, offsets):
    """Losses at each offset times the reference scale above the median, and next to both thresholds."""
    recent = accepted[-monitor.window:]
    if len(recent) < 2:
        return [0.0, 1.0]
    center = statistics.median(recent)
    unit = reference_check(monitor, accepted, [], center + 1.0, 1.0)[1]  # z of one loss unit above
    scale = 1.0 / unit if unit else 1.0
    out = [recent[-1], center] + [center + k * scale for k in offsets]
    for threshold in (monitor.loss_z_warning, monitor.loss_z_critical):
        at = center + threshold * scale
        out += [at, math.nextafter(at, math.inf), math.nextafter(at, -math.inf),
                at * (1 + 1e-12), center + threshold * scale * 1.001]
    return [c for c in out if math.isfinite(c)]


@given(monitor_histories())
@settings(max_examples=150, deadline=None)
def test_check_gives_exactly_the_reference_findings(case):
    settings_, steps, offsets = case
    settings_ = dict(settings_, blame_lone_alarms_on_the_batch=False)  # the rules alone, as the reference
    monitor = DivergenceMonitor(**settings_)
    accepted, accepted_grads = [], []
    expected_counts = dict.fromkeys(REASON_KINDS, 0)
    for i, (what, value) in enumerate(steps + [("loss", None)]):
        if what == "reset":
            monitor.reset_window()
            accepted, accepted_grads = [], []
            continue
        if what == "round_trip":
            restored = DivergenceMonitor(**settings_)
            restored.load_state_dict(json.loads(json.dumps(monitor.state_dict())))
            monitor = restored
            continue
        grad_norm = 1.0 + 0.01 * (i % 5)
        for candidate in _candidates(monitor, accepted, offsets):
            for g in (grad_norm, 1e-12, 100.0):
                findings, z, share = reference_check(monitor, accepted, accepted_grads, candidate, g)
                report = monitor.check(candidate, g)
                assert report.kinds == [kind for _, kind in findings], (candidate, g, z, share)
                assert report.severity == max((s for s, _ in findings), default=Severity.OK)
                for kind in set(report.kinds):
                    expected_counts[kind] += 1
                assert monitor.loss_z_score(candidate) == z
                assert monitor.oscillation_share(candidate) == share
                for severity, kind in findings:
                    if kind == "loss_z":
                        limit = monitor.loss_z_critical if severity is Severity.CRITICAL else monitor.loss_z_warning
                        assert f"loss z-score {z:.1f} > {limit:g}" in report.reasons
        points = accepted[-(monitor.oscillation_window + 1):]
        assert monitor.oscillation_share() == (reference_check(monitor, accepted[:-1], [], accepted[-1], 1.0)[2]
                                               if len(points) == monitor.oscillation_window + 1 else None)
        if value is None:
            break
        monitor.observe(value, grad_norm)
        if math.isfinite(value):
            accepted.append(value)
        accepted_grads.append(grad_norm)
    assert monitor.counts == expected_counts
    assert monitor.history_length == min(len(accepted), max(monitor.window, monitor.oscillation_window + 1))


def test_a_vanished_gradient_history_is_no_reference_for_an_explosion():
    """After a stretch of zero gradients (a frozen or saturated model) any finite norm is
    'infinitely' larger than the median; that is the vanish regime, not a spike to roll back."""
    monitor = fed_monitor([1.0] * 30, [0.0] * 30)
    report = monitor.check(1.0, 1.0)
    assert not report.critical, report.reasons
    # With a healthy history the same factor is an explosion.
    assert fed_monitor([1.0] * 30, [0.01] * 30).check(1.0, 1.0).critical


@settings(max_examples=300, deadline=None, derandomize=True)
@given(history=st.lists(st.tuples(st.floats(0.01, 100), st.floats(1e-6, 100)), min_size=1, max_size=70),
       loss=st.one_of(st.floats(-1e3, 1e4), st.sampled_from([math.nan, math.inf, -math.inf])),
       grad_norm=st.one_of(st.none(), st.floats(0, 1e5), st.sampled_from([math.nan, math.inf])))
def test_quiet_limits_never_pass_what_check_would_flag(history, loss, grad_norm):
    """Inside quiet_limits, the per-value check finds nothing but (at most) the oscillation warning,
    which blocks of steps look at once; outside them, something or nothing (they are exact bounds
    of the jump, z-score and gradient rules, so most values outside are flagged)."""
    monitor = DivergenceMonitor(window=20, min_history=5)
    for value, norm in history:
        monitor.observe(value, norm)
    limits = monitor.quiet_limits()
    if limits.quiet(loss, grad_norm):
        report = monitor.check(loss, grad_norm, count=False)
        assert set(report.kinds) <= {"oscillation"}, report.reasons


@settings(max_examples=300, deadline=None, derandomize=True)
@given(history=st.lists(st.tuples(st.floats(0.01, 100), st.floats(1e-6, 100)), min_size=0, max_size=70),
       block=st.lists(st.tuples(st.one_of(st.floats(-1e3, 1e4), st.sampled_from([math.nan, math.inf])),
                                st.one_of(st.none(), st.floats(0, 1e5), st.sampled_from([math.nan, math.inf]))),
                      min_size=1, max_size=16))
def test_a_block_found_quiet_by_the_cheap_bounds_is_quiet_by_quiet_limits(history, block):
    """A block whose values are all inside the cheap bounds (judged quiet without quiet_limits)
    holds none that quiet_limits would not pass; without a history none is found quiet."""
    monitor = DivergenceMonitor(window=20, min_history=5)
    for value, norm in history:
        monitor.observe(value, norm)
    exact, quiet = monitor.quiet_limits(), monitor.block_is_quiet(block)
    if exact is None:
        assert not quiet
        return
    if quiet:
        assert all(exact.quiet(loss, norm) for loss, norm in block)


def test_quiet_limits_need_a_history_and_bound_the_rules_exactly():
    monitor = DivergenceMonitor(window=10, min_history=3, loss_z_warning=3.0, grad_explosion_factor=10.0)
    assert monitor.quiet_limits() is None
    for value in (1.0, 1.1, 0.9, 1.0, 1.05):
        monitor.observe(value, 2.0)
    limits = monitor.quiet_limits()
    assert limits.grad_ceiling == pytest.approx(20.0)
    assert monitor.check(limits.loss_ceiling, 2.0, count=False).kinds == []
    assert "loss_z" in monitor.check(limits.loss_ceiling * 1.001, 2.0, count=False).kinds
    assert not limits.quiet(float("-inf"), 2.0) and not limits.quiet(1.0, float("inf"))


@given(window=st.integers(2, 8), oscillation_window=st.integers(3, 12),
       operations=st.lists(st.one_of(
           st.tuples(st.just("observe"), st.sampled_from([0.0, -0.0, 1.0, 2.0, -1.0, 1e6, math.nan, math.inf]),
                     st.sampled_from([0.0, 0.5, 1.0, 3.0, math.nan, None])),
           st.tuples(st.sampled_from(["quiet", "remember", "rewind", "reset", "round_trip"]), st.none(), st.none())),
           max_size=60))
@settings(max_examples=200, deadline=None)
def test_sorted_windows_follow_every_change_of_the_history(window, oscillation_window, operations):
    """The rules read the median and extremes from sorted copies kept in step with the windows; after
    any sequence of accepted values, rewinds, resets and state round trips they must equal the windows
    sorted afresh (what the rules sorted on every check before)."""
    settings_ = dict(window=window, min_history=2, oscillation_window=oscillation_window)
    monitor = DivergenceMonitor(**settings_)
    for what, loss, grad_norm in operations:
        if what == "observe":
            monitor.observe(loss, grad_norm)
        elif what == "quiet":
            monitor.observe_quiet(0.25, 0.75)
        elif what == "remember":
            monitor.remember_window()
        elif what == "rewind":
            monitor.rewind_window()
        elif what == "reset":
            monitor.reset_window()
        else:
            restored = DivergenceMonitor(**settings_)
            restored.load_state_dict(json.loads(json.dumps(monitor.state_dict())))
            monitor = restored
        assert monitor._losses_sorted == sorted(list(monitor._losses)[-window:])
        assert monitor._grad_norms_sorted == sorted(monitor._grad_norms)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(history=st.lists(st.tuples(st.floats(0.01, 100), st.floats(1e-6, 100)), min_size=1, max_size=70),
       nudge=st.integers(-3, 3), grad_nudge=st.integers(-3, 3))
def test_the_quiet_bounds_pass_only_what_the_exact_quiet_test_passes(history, nudge, grad_nudge):
    """check's fast path compares against bounds solved from the rules; at and around each bound
    (the z-score rule's exact boundary among them, a few floats either side), a value inside the
    bounds is one the exact test calls quiet."""
    monitor = DivergenceMonitor(window=20, min_history=5)
    for value, norm in history:
        monitor.observe(value, norm)
    ceiling, grad_floor, grad_ceiling = monitor._quiet_bounds()
    ordered = monitor._losses_sorted
    center = statistics.median(ordered)
    spread = 0.999 * (ordered[-1] - ordered[0]) / math.sqrt(2 * max(len(ordered) - 1, 1))
    z_boundary = center + monitor.loss_z_warning * max(spread, monitor.relative_scale_floor * abs(center), 1e-12)

    def nudged(x: float, n: int) -> float:
        for _ in range(abs(n)):
            x = math.nextafter(x, math.inf if n > 0 else -math.inf)
        return x
    for loss in (nudged(ceiling, nudge), nudged(z_boundary, nudge), nudged(ordered[-1], nudge), ordered[0]):
        for grad_norm in (nudged(grad_ceiling, grad_nudge), nudged(grad_floor, grad_nudge), statistics.median(
                monitor._grad_norms_sorted)):
            if -math.inf < loss <= ceiling and grad_floor <= grad_norm <= grad_ceiling:
                assert monitor._quiet(loss, grad_norm), (loss, grad_norm)


def test_the_quiet_bounds_follow_every_change_of_the_window():
    """Bounds left from an older window would pass what the window now flags: after each change
    (a step recorded, a rollback's rewind, a reset, a loaded state) they are gone or current."""
    monitor = DivergenceMonitor(window=20, min_history=5)

    def current() -> None:
        assert monitor._bounds is None or monitor._bounds == monitor._quiet_bounds()
    for i in range(30):
        monitor.observe(5.0 - 0.1 * i, 1.0)
        current()
    monitor.remember_window()
    for i in range(30):
        monitor.observe(0.5 - 0.001 * i, 50.0)
        current()
    assert monitor.check(0.45, 40.0).severity is Severity.OK
    monitor.rewind_window()  # back to the 5.0 -> 2.1 losses with norms of 1: a norm of 40 explodes
    current()
    assert monitor.check(0.45, 40.0).critical
    state = DivergenceMonitor(window=20, min_history=5)
    for i in range(30):
        state.observe(0.5, 50.0)
    monitor.check(0.45, 40.0)  # bounds cached for the rewound window
    monitor.load_state_dict(state.state_dict())
    current()
    assert monitor.check(0.45, 40.0).severity is Severity.OK
    monitor.observe_quiet(0.5, 50.0)
    current()
    monitor.reset_window()
    current()
    assert not monitor.check(1e6, 1e6).critical  # no history: nothing to compare with


def test_quiet_checks_share_one_report_that_nothing_changes():
    from hybrid_trainer.divergence import QUIET_REPORT

    monitor = DivergenceMonitor()
    reports = []
    for i in range(40):
        loss, norm = 1.0 - 0.01 * i, 0.5
        reports.append(monitor.check(loss, norm))
        monitor.observe(loss, norm)
    assert all(report is QUIET_REPORT for report in reports)
    spike = monitor.check(1e6, 0.5)
    assert spike.critical and spike is not QUIET_REPORT
    assert QUIET_REPORT.severity is Severity.OK and QUIET_REPORT.reasons == [] and QUIET_REPORT.kinds == []


HARD = (1.5, 8.0)  # a batch the run has not seen: (loss, grad norm)
QUIET = (0.01, 0.01)


def _learnt_by_heart(seen_healthy: bool = True, **kwargs) -> DivergenceMonitor:
    """A run that began high (loss 2.0, norm 3.0) and learnt its data by heart (loss ~0.01, norm
    ~0.01): a batch it has never seen (loss 1.5, norm 8.0) jumps, scores far above the window and
    explodes its gradient against it, but lies within the jump rules' bounds around the run's own
    first steps (loss <= 20, norm <= 30). Its window is remembered as a good state's, and the step
    after it (at the good state's weights) is quiet (``seen_healthy``) or not."""
    rng = np.random.default_rng(3)
    monitor = fed_monitor([2.0] * 20 + list(0.01 + rng.normal(0.0, 1e-4, 60)),
                          [3.0] * 20 + list(0.01 + rng.normal(0.0, 1e-4, 60)), **kwargs)
    monitor.remember_window()
    assert not monitor.good_state_seen_healthy
    if seen_healthy:
        assert not monitor.check(*QUIET).critical
        monitor.observe(*QUIET)
    return monitor


def test_a_run_of_critical_steps_that_meets_the_good_state_is_the_batches_until_a_quiet_step():
    monitor = _learnt_by_heart()
    assert (monitor.highest_loss, monitor.highest_grad_norm) == (2.0, 3.0)
    first = monitor.check(*HARD)
    assert first.critical and set(first.kinds) == {"loss_jump", "loss_z", "grad_explosion"}
    assert monitor.check(*HARD).critical  # the second in a row: the guard goes back to the good state
    monitor.rewind_window()
    assert monitor.at_good_state
    at_good = monitor.check(*HARD)  # critical at weights judged healthy: the batch's
    assert at_good.severity is Severity.WARNING and at_good.reasons[-1].startswith("taken for the batches'")
    assert monitor.tolerated == 1
    monitor.observe(*HARD)  # the trainer applies it: the weights are no longer the good state's
    assert not monitor.at_good_state
    assert not monitor.check(*HARD).critical and monitor.tolerated == 2  # the run goes on
    monitor.observe(*HARD)
    # Beyond the jump rules' bounds around the run's largest accepted values: refused even in the run.
    assert monitor.check(1.5, 31.0).critical and monitor.check(21.0, 8.0).critical
    assert monitor.check(math.nan, 8.0).critical and monitor.tolerated == 2
    assert not monitor.blamed_run_ended()  # still in the run
    assert monitor.check(*QUIET).severity is not Severity.CRITICAL and monitor.critical_in_a_row == 0
    monitor.observe(*QUIET)
    assert monitor.blamed_run_ended() and not monitor.blamed_run_ended()  # once a run
    # The next run does not meet the good state: its second critical step is refused as before.
    monitor.check(*HARD)
    assert monitor.check(*HARD).critical


def test_a_good_state_whose_next_step_was_critical_is_not_taken_for_healthy():
    """Its weights are those after an update judged by the loss before it (a learning rate gone
    wrong can be in them): the step after it is the first to see them."""
    monitor = _learnt_by_heart(seen_healthy=False)
    assert monitor.check(*HARD).critical and not monitor.good_state_seen_healthy
    assert monitor.check(*HARD).critical
    monitor.rewind_window()
    assert not monitor.at_good_state and monitor.check(*HARD).critical and monitor.tolerated == 0
    # A gradient alarm alone does not: the batches a model knew by heart have gradients ten times
    # the window's right after it learnt others, at healthy weights.
    knew = _learnt_by_heart(seen_healthy=False)
    report = knew.check(0.01, 1.0)
    assert report.critical and report.kinds == ["grad_explosion"] and knew.good_state_seen_healthy
    # Steps found quiet in a block read see it healthy as well.
    block = _learnt_by_heart(seen_healthy=False)
    block.observe_quiet(*QUIET)
    assert block.good_state_seen_healthy
    block.remember_window()
    assert not block.check(*QUIET, count=False).critical and not block.good_state_seen_healthy  # not a step


def test_a_quiet_step_at_the_good_state_leaves_the_next_run_to_the_weights():
    """What a learning rate gone wrong looks like: the step from the good state is quiet (its loss
    is measured before its update); the critical steps after it are the weights'."""
    monitor = _learnt_by_heart()
    monitor.rewind_window()
    assert not monitor.check(*QUIET).critical
    monitor.observe(*QUIET)
    assert not monitor.at_good_state
    monitor.check(*HARD)
    assert monitor.check(*HARD).critical and monitor.check(*HARD).critical and monitor.tolerated == 0


def test_at_the_good_state_too_high_a_step_or_a_switched_off_rule_is_refused():
    for loss, norm in ((21.0, 8.0), (1.5, 31.0), (math.inf, 8.0)):
        monitor = _learnt_by_heart()
        monitor.rewind_window()
        assert monitor.check(loss, norm).critical and monitor.tolerated == 0
    for switched_off in (dict(blame_lone_alarms_on_the_batch=False), dict(blame_runs_at_the_good_state=False)):
        strict = _learnt_by_heart(**switched_off)
        strict.rewind_window()
        assert strict.check(*HARD).critical and strict.tolerated == 0
    with pytest.raises(ValueError, match="blame_runs_at_the_good_state"):
        DivergenceMonitor(blame_runs_at_the_good_state="yes")


def test_the_largest_accepted_values_go_back_with_the_window_and_survive_a_checkpoint():
    monitor = _learnt_by_heart()
    monitor.observe(5.0, 20.0)  # accepted after the good state, then rolled back
    assert (monitor.highest_loss, monitor.highest_grad_norm) == (5.0, 20.0)
    monitor.rewind_window()
    assert (monitor.highest_loss, monitor.highest_grad_norm) == (2.0, 3.0)
    monitor.check(*HARD)
    state = json.loads(json.dumps(monitor.state_dict()))
    restored = DivergenceMonitor()
    restored.load_state_dict(state)
    assert (restored.highest_loss, restored.highest_grad_norm, restored.at_good_state) == (2.0, 3.0, True)
    assert restored.good_state_seen_healthy
    assert not restored.check(*HARD).critical  # the run met the good state in the saved run too
    restored.observe(*QUIET)
    restored.rewind_window()
    assert (restored.highest_loss, restored.highest_grad_norm) == (2.0, 3.0)  # the remembered ones
    # A state saved before these keys existed: the largest of its windows stand for them.
    older = {k: v for k, v in state.items() if k not in ("highest_loss", "highest_grad_norm", "at_good_state",
                                                          "run_blamed", "snapshot_unjudged",
                                                          "good_state_seen_healthy")}
    older["remembered"] = {k: v for k, v in state["remembered"].items()
                           if k not in ("highest_loss", "highest_grad_norm")}
    restored.load_state_dict(older)
    assert restored.highest_loss == max(state["losses"]) and not restored.at_good_state
    assert not restored.good_state_seen_healthy
    restored.rewind_window()
    assert restored.highest_loss == max(state["remembered"]["losses"])
    for key, bad in (("highest_loss", math.nan), ("highest_grad_norm", "x"), ("at_good_state", 1)):
        with pytest.raises(ValueError, match=key):
            restored.load_state_dict(dict(state, **{key: bad}))
    empty = DivergenceMonitor()
    empty.load_state_dict(json.loads(json.dumps(DivergenceMonitor().state_dict())))
    assert empty.highest_loss == -math.inf

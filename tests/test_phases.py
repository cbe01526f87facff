"""The phase machine driven directly (no model): length choice, back-off, rejection and worth switch-offs."""
import pytest

from hybrid_trainer import HybridConfig, Phase
from hybrid_trainer.phases import PhaseController

CONFIG = HybridConfig(warmup_steps=2, full_steps=3, max_consecutive_declines=5)


def never_confident(horizon):
    return 0.0


def always_confident(horizon):
    return 1.0


def finish_phase(controller, margin, confidence=never_confident):
    """Advance to the end of the current phase; the decision sees ``worth − required = margin``."""
    for _ in range(controller.length - controller.phase_step):
        controller.advance(confidence, worth_margin=margin)


def decisions_until_off(margins):
    controller = PhaseController(CONFIG)
    finish_phase(controller, None)  # WARMUP → FULL, no decision
    for n, margin in enumerate(margins, start=1):
        finish_phase(controller, margin)
        if not controller.prediction_enabled:
            return n, controller
    return None, controller


def test_a_clear_shortfall_switches_off_after_three_decisions():
    n, controller = decisions_until_off([-0.20, -0.25, -0.18, -0.2, -0.2])
    assert n == 3
    assert "by 0.21 on average, beyond 2 standard errors" in controller.disabled_reason


def test_a_near_miss_keeps_measuring_until_the_limit():
    # mean −0.10, standard error 0.052: not significant after 3, nor after 4; the limit ends it.
    n, controller = decisions_until_off([-0.10, -0.19, -0.01, -0.01, -0.01])
    assert n == 5 and "standard errors" not in controller.disabled_reason


def test_unmeasured_worth_counts_towards_the_limit_only():
    n, controller = decisions_until_off([None, None, None, None, None])
    assert n == 5 and controller.decline_margins == []


def test_a_passing_worth_resets_the_evidence():
    controller = PhaseController(CONFIG)
    finish_phase(controller, None)
    finish_phase(controller, -0.3)
    finish_phase(controller, -0.3)
    # Worth passes but the dynamics model is not confident: no PREDICT, no decline, evidence reset.
    finish_phase(controller, 0.05)
    assert controller.phase is Phase.FULL and controller.consecutive_declines == 0
    assert controller.decline_margins == []
    finish_phase(controller, -0.3)
    finish_phase(controller, -0.3)
    assert controller.prediction_enabled


def test_decline_margins_survive_a_checkpoint_and_old_states_load():
    _, controller = decisions_until_off([-0.1, -0.12])
    state = controller.state_dict()
    resumed = PhaseController(CONFIG)
    resumed.load_state_dict(state)
    assert resumed.decline_margins == [-0.1, -0.12] and resumed.consecutive_declines == 2
    del state["decline_margins"]
    older = PhaseController(CONFIG)
    older.load_state_dict(state)
    assert older.decline_margins == [] and older.consecutive_declines == 2


def restarted_every_other_step(controller, margin, confidence=never_confident, steps=60):
    """FULL steps with a divergence rollback (``force_full``) after every second one, so that no
    FULL phase of 3 steps ever ends; returns the steps taken until prediction went off (or all)."""
    for step in range(1, steps + 1):
        controller.advance(confidence, worth_margin=margin(step) if callable(margin) else margin)
        assert controller.phase is Phase.FULL  # no PREDICT phase so soon after a divergence
        if not controller.prediction_enabled:
            return step
        if step % 2 == 0:
            controller.force_full()
    return steps


def test_rollbacks_that_restart_every_full_phase_do_not_keep_the_worth_from_being_judged():
    controller = PhaseController(CONFIG)
    finish_phase(controller, None)  # WARMUP → FULL
    # Judged every full_steps (3) FULL steps however the phases were cut: three clear declines.
    steps = restarted_every_other_step(controller, lambda step: -0.2 - 0.01 * (step % 3))
    assert steps == 9 and not controller.prediction_enabled
    assert controller.consecutive_declines == 3 and "standard errors" in controller.disabled_reason


def test_a_passing_worth_between_rollbacks_resets_the_evidence_and_starts_nothing():
    controller = PhaseController(CONFIG)
    finish_phase(controller, None)
    finish_phase(controller, -0.3)
    finish_phase(controller, -0.3)
    assert controller.consecutive_declines == 2
    assert restarted_every_other_step(controller, 0.1, confidence=always_confident, steps=12) == 12
    assert controller.prediction_enabled and controller.consecutive_declines == 0 and controller.decline_margins == []
    # The phase that finally runs to its end decides as before: worth and confidence start PREDICT.
    finish_phase(controller, 0.1, confidence=always_confident)
    assert controller.phase is Phase.PREDICT


def test_steps_since_the_last_judgment_survive_a_checkpoint_and_old_states_count_the_phase():
    controller = PhaseController(CONFIG)
    finish_phase(controller, None)
    controller.advance(never_confident, worth_margin=-0.3)
    controller.force_full()  # a rollback one step into the phase: that step still counts
    controller.advance(never_confident, worth_margin=-0.3)
    state = controller.state_dict()
    assert state["steps_since_decision"] == 2 and state["phase_step"] == 1
    resumed = PhaseController(CONFIG)
    resumed.load_state_dict(state)
    assert resumed.steps_since_decision == 2
    resumed.advance(never_confident, worth_margin=-0.3)  # the third FULL step: judged
    assert resumed.consecutive_declines == 1 and resumed.steps_since_decision == 0
    del state["steps_since_decision"]
    older = PhaseController(CONFIG)
    older.load_state_dict(state)
    assert older.steps_since_decision == 1  # the FULL phase's own steps


@pytest.mark.parametrize("margins", [[0.1] * 6,  # the worth passes; the forecaster is never confident
                                     [-0.3, 0.1, -0.3, 0.1, -0.3, 0.1]])  # neither rule's evidence piles up
def test_decisions_that_never_start_a_predict_phase_switch_it_off_at_their_limit(margins):
    controller = PhaseController(HybridConfig(warmup_steps=2, full_steps=3, max_consecutive_declines=5,
                                              max_decisions_without_predict=4))
    finish_phase(controller, None)
    for n, margin in enumerate(margins, start=1):
        finish_phase(controller, margin)
        if not controller.prediction_enabled:
            break
    assert n == 4 and controller.decisions_without_predict == 4
    assert controller.disabled_reason.startswith("4 phase decisions in a row started no PREDICT phase")


def test_a_predict_phase_restarts_the_count_of_decisions_without_one():
    controller = controller_in_full(max_decisions_without_predict=3)
    finish_phase(controller, 0.1)  # not confident: one decision without PREDICT
    finish_phase(controller, 0.1)
    assert controller.decisions_without_predict == 2
    finish_phase(controller, 0.1, confidence=always_confident)
    assert controller.phase is Phase.PREDICT and controller.decisions_without_predict == 0
    state = controller.state_dict()
    assert state["decisions_without_predict"] == 0
    finish_phase(controller, 0.1)  # PREDICT → CORRECT
    state = dict(controller.state_dict(), decisions_without_predict=2)
    resumed = PhaseController(controller.config)
    resumed.load_state_dict(state)
    assert resumed.decisions_without_predict == 2
    del state["decisions_without_predict"]
    older = PhaseController(controller.config)
    older.load_state_dict(state)
    assert older.decisions_without_predict == 0 and older.prediction_enabled


@pytest.mark.parametrize("margins", [[-0.5, -0.5], [-0.01, -0.4, -0.02, -0.01]])
def test_fewer_than_three_or_scattered_declines_do_not_end_early(margins):
    n, _ = decisions_until_off(margins)
    assert n is None


def controller_in_full(**overrides):
    config = HybridConfig(**{**dict(warmup_steps=2, full_steps=3, correct_steps=2, predict_lengths=(4, 8, 16),
                                    confidence_threshold=0.5, use_bandit=False), **overrides})
    controller = PhaseController(config)
    finish_phase(controller, None)  # WARMUP → FULL
    assert controller.phase is Phase.FULL
    return controller


def test_the_longest_horizon_still_confident_is_chosen():
    controller = controller_in_full()
    finish_phase(controller, 0.1, lambda h: {4: 0.9, 8: 0.6, 16: 0.4}[h])
    assert (controller.phase, controller.length) == (Phase.PREDICT, 8)
    # A confident long horizon behind an unconfident short one does not count: confidence falls with h.
    controller = controller_in_full()
    finish_phase(controller, 0.1, lambda h: {4: 0.4, 8: 0.9, 16: 0.9}[h])
    assert controller.phase is Phase.FULL


def test_rejections_double_the_full_phase_and_switch_prediction_off_at_the_limit():
    controller = controller_in_full(max_consecutive_rejections=3)
    for rejections, backoff in ((1, 2), (2, 4)):
        finish_phase(controller, 0.1, always_confident)
        assert controller.phase is Phase.PREDICT
        controller.reject_predict_phase()
        assert (controller.phase, controller.backoff, controller.prediction_enabled) == (Phase.CORRECT, backoff, True)
        finish_phase(controller, 0.1, always_confident)  # CORRECT after a rejection → FULL, backed off
        assert (controller.phase, controller.length) == (Phase.FULL, 3 * backoff)
    finish_phase(controller, 0.1, always_confident)
    controller.reject_predict_phase()
    assert not controller.prediction_enabled and "3 predict phases in a row were rejected" in controller.disabled_reason


def test_an_accepted_predict_phase_resets_the_back_off_and_the_rejection_count():
    controller = controller_in_full(max_consecutive_rejections=2)
    finish_phase(controller, 0.1, always_confident)
    controller.reject_predict_phase()
    finish_phase(controller, 0.1, always_confident)  # CORRECT → FULL (length 6)
    finish_phase(controller, 0.1, always_confident)  # FULL → PREDICT
    finish_phase(controller, 0.1, always_confident)  # PREDICT completes: accepted
    assert (controller.phase, controller.backoff, controller.consecutive_rejections) == (Phase.CORRECT, 1, 0)
    finish_phase(controller, 0.1, always_confident)  # CORRECT → PREDICT again (cycles below max_consecutive_predict)
    controller.reject_predict_phase()
    assert controller.prediction_enabled  # one rejection in a row, not two


def test_predict_correct_cycles_end_in_a_full_phase_after_max_consecutive_predict():
    controller = controller_in_full(max_consecutive_predict=2)
    phases = []
    for _ in range(5):
        finish_phase(controller, 0.1, always_confident)
        phases.append(controller.phase)
    assert phases == [Phase.PREDICT, Phase.CORRECT, Phase.PREDICT, Phase.CORRECT, Phase.FULL]


def test_acceptance_estimate_is_the_beta_posterior_mean():
    controller = controller_in_full()
    assert controller.acceptance_estimate() == 0.5
    for accepted in (True, True, True, False):
        controller.record_verification(accepted)
    assert controller.acceptance_estimate() == pytest.approx(4 / 6)

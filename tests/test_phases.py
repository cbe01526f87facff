"""The phase machine's switch-off rules, driven directly (no model)."""
import pytest

from hybrid_trainer import HybridConfig, Phase
from hybrid_trainer.phases import PhaseController

CONFIG = HybridConfig(warmup_steps=2, full_steps=3, max_consecutive_declines=5)


def never_confident(horizon):
    return 0.0


def finish_phase(controller, margin):
    """Advance to the end of the current phase; the decision sees ``worth − required = margin``."""
    for _ in range(controller.length - controller.phase_step):
        controller.advance(never_confident, worth_margin=margin)


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


@pytest.mark.parametrize("margins", [[-0.5, -0.5], [-0.01, -0.4, -0.02, -0.01]])
def test_fewer_than_three_or_scattered_declines_do_not_end_early(margins):
    n, _ = decisions_until_off(margins)
    assert n is None

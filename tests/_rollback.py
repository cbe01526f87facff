"""The rejected-prediction check the optimizer-specific trainer tests share."""
import torch

from hybrid_trainer import Phase

from _resume import assert_same_state, copy_state_value, is_wrapper_subclass


def reject_a_prediction_and_check_the_optimizer_untouched(trainer, stream, extra=lambda: None) -> list:
    """Steps ``trainer`` (built with ``ALWAYS, loss_tolerance=0, noise_z=0``) into PREDICT, forces
    a predicted step far too large, and asserts that its verification rejects it, the weights
    come back exactly and every optimizer state tensor is as before (predicted steps never step
    the optimizer), as is ``extra()`` (further state to compare, e.g. param-group counters).
    Returns the predicted steps' results."""
    i = 0
    while trainer.controller.phase is not Phase.PREDICT:
        trainer.step(stream[i])
        i += 1
    weights = [p.detach().clone() for p in trainer.params]
    # Tensors and numbers (a step count kept as an int); other objects (a projector) by identity.
    state = {id(p): {k: copy_state_value(v) for k, v in trainer.optimizer.state[p].items()} for p in trainer.params}
    extra_before = extra()
    trainer.predictor.scales.fill_(50.0)  # a huge predicted step: the loss must go up
    results = [trainer.step(stream[i + k]) for k in range(4)]
    assert results[-1].verified and results[-1].accepted is False and results[-1].rolled_back
    for p, saved in zip(trainer.params, weights):
        assert torch.equal(p.detach(), saved)
    for p in trainer.params:
        assert state[id(p)].keys() == trainer.optimizer.state[p].keys()
        for key, value in state[id(p)].items():
            now = trainer.optimizer.state[p][key]
            if is_wrapper_subclass(now):  # torchao's quantized moments: codes and scales bit for bit
                assert_same_state(now, value, key)
            else:
                assert torch.equal(now, value) if torch.is_tensor(value) else now == value or now is value, key
    assert extra() == extra_before
    return results

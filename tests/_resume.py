"""The save/resume check the trainer tests share: a run cut, saved, loaded into a trainer built
from another initialisation and continued must reproduce the uninterrupted run bit for bit, with
every part of the trainer's state restored (as ``test_trainer.py``'s own resume test checks)."""
import math

import torch


def is_wrapper_subclass(t) -> bool:
    """A tensor subclass wrapping plain tensors (torchao's 8/4-bit optimizer state), which
    implements neither clone nor equality: compared and copied through its inner tensors."""
    return isinstance(t, torch.Tensor) and type(t) not in (torch.Tensor, torch.nn.Parameter) \
        and hasattr(t, "__tensor_flatten__")


def inner_tensors(t) -> dict:
    names, context = t.__tensor_flatten__()
    return {"class": type(t), "context": context, **{name: getattr(t, name) for name in names}}


def copy_state_value(value):
    """A copy of one optimizer-state value to compare with later: tensors cloned (a wrapper
    subclass as its inner tensors), numbers kept, other objects by identity."""
    if is_wrapper_subclass(value):
        return {k: v.clone() if torch.is_tensor(v) else v for k, v in inner_tensors(value).items()}
    return value.clone() if torch.is_tensor(value) else value


def assert_same_state(got, want, path="state"):
    """Recursive equality of two state dicts: tensors bit for bit (dtype and shape included), NaN
    equal to NaN, every key present on both sides."""
    if is_wrapper_subclass(want) and isinstance(got, dict):  # a copy_state_value() copy
        want = inner_tensors(want)
    elif is_wrapper_subclass(got) and isinstance(want, dict):
        got = inner_tensors(got)
    assert type(got) is type(want), f"{path}: {type(got).__name__} vs {type(want).__name__}"
    if is_wrapper_subclass(want):
        assert_same_state(inner_tensors(got), inner_tensors(want), path)
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), f"{path}: keys {sorted(map(str, got))} vs {sorted(map(str, want))}"
        for key in want:
            assert_same_state(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_state(g, w, f"{path}[{i}]")
    elif isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=path)
    elif hasattr(want, "__dict__") and not isinstance(want, type):  # e.g. GaLore's projector objects
        assert_same_state(vars(got), vars(want), path)
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got), path
    else:
        assert got == want, path


def assert_resume_reproduces(make_trainer, stream, steps: int, cut: int, path, **overrides):
    """Runs ``make_trainer(**overrides)`` over ``stream[:steps]`` once straight and once cut at
    ``cut`` (saved to ``path``, loaded into ``make_trainer(seed=7, ...)``); asserts that the loaded
    trainer's whole state equals the saved one's, then the same weights, phases, losses and
    verification outcomes, and the same statistics. Returns ``(reference, resumed)``."""
    reference = make_trainer(**overrides)
    ref_results = [reference.step(b) for b in stream[:steps]]
    assert any(r.phase == "PREDICT" for r in ref_results[cut:]), "the resumed part must include predicted steps"
    first = make_trainer(**overrides)
    for b in stream[:cut]:
        first.step(b)
    first.save(path)
    resumed = make_trainer(seed=7, **overrides)  # another init: everything must come from the file
    resumed.load(path)
    # Every part of the state, not only what the remaining steps happen to read.
    assert_same_state(resumed.state_dict(), first.state_dict())
    results = [resumed.step(b) for b in stream[cut:steps]]
    for p, q in zip(reference.params, resumed.params):
        assert torch.equal(p, q)
    assert [(r.phase, r.loss, r.accepted, r.rolled_back) for r in ref_results[cut:]] == \
        [(r.phase, r.loss, r.accepted, r.rolled_back) for r in results]
    want, got = reference.statistics(), resumed.statistics()
    for key in ("predicted_steps", "predicted_steps_kept", "predicted_steps_rolled_back", "verifications",
                "verifications_accepted", "predict_phases", "backward_saved_fraction"):
        assert got[key] == want[key], key
    return reference, resumed

"""The save/resume check the trainer tests share: a run cut, saved, loaded into a trainer built
from another initialisation and continued must reproduce the uninterrupted run bit for bit."""
import torch


def assert_resume_reproduces(make_trainer, stream, steps: int, cut: int, path, **overrides):
    """Runs ``make_trainer(**overrides)`` over ``stream[:steps]`` once straight and once cut at
    ``cut`` (saved to ``path``, loaded into ``make_trainer(seed=7, ...)``); asserts the same
    weights, phases and losses. Returns ``(reference, resumed)`` for further checks."""
    reference = make_trainer(**overrides)
    ref_results = [reference.step(b) for b in stream[:steps]]
    assert any(r.phase == "PREDICT" for r in ref_results[cut:]), "the resumed part must include predicted steps"
    first = make_trainer(**overrides)
    for b in stream[:cut]:
        first.step(b)
    first.save(path)
    resumed = make_trainer(seed=7, **overrides)  # another init: everything must come from the file
    resumed.load(path)
    results = [resumed.step(b) for b in stream[cut:steps]]
    for p, q in zip(reference.params, resumed.params):
        assert torch.equal(p, q)
    assert [(r.phase, r.loss) for r in ref_results[cut:]] == [(r.phase, r.loss) for r in results]
    return reference, resumed

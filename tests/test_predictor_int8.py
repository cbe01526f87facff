"""The predictor's EMA direction stored in int8 blocks (``direction_dtype=torch.int8``, the trainer's default).

What it must keep: the direction within a stated distance of the fp32 one over a long run, the
statistics and the predicted step computed from exactly the stored values, and checkpoints,
rollback and resume as exact as with a float direction.
"""
import pytest
import torch

import hybrid_kernels as hk
from hybrid_trainer.int8_direction import BLOCK, Int8BlockVector
from hybrid_trainer.predictor import DeltaPredictor
from hybrid_trainer.update_recovery import CHUNK

from _configs import ALWAYS
from _resume import assert_resume_reproduces
from _rollback import reject_a_prediction_and_check_the_optimizer_untouched

pytestmark = pytest.mark.usefixtures("eager_backend")


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.ReLU(), torch.nn.Linear(300, 10))


def _train(predictors: dict, steps: int, recover: bool, seed: int = 0):
    """Steps one AdamW model, recording every update in a predictor per entry of ``predictors``
    (name: direction dtype, replaced by the predictor); returns ``predictors``."""
    model = _model(seed)
    params = list(model.parameters())
    for name in list(predictors):
        predictors[name] = DeltaPredictor(params, direction_dtype=predictors[name])
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 64, generator=gen)
    y = x[:, :10].argmax(1)
    for _ in range(steps):
        i = torch.randint(0, 512, (32,), generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i]), y[i]).backward()
        for p in predictors.values():
            p.begin_step(optimizer if recover else None)  # None: measured against a before-copy
        optimizer.step()
        for p in predictors.values():
            p.end_step()
    return predictors


def test_the_layout_gives_each_parameter_its_own_blocks_and_buckets_cut_on_block_boundaries():
    params = [torch.zeros(3, 100), torch.zeros(0), torch.zeros(7), torch.zeros(CHUNK + 300)]
    vector = Int8BlockVector(params, torch.device("cpu"))
    assert [tuple(v.shape) for v in vector.code_views] == [(3, 100), (0,), (7,), (CHUNK + 300,)]
    assert [v.numel() for v in vector.scale_views] == [2, 0, 1, CHUNK // BLOCK + 2]
    values = [torch.randn(p.shape) for p in params]
    vector.quantize_from(torch.cat([v.reshape(-1) for v in values]))
    for v, codes, scales in zip(values, vector.code_views, vector.scale_views):  # as if quantized alone
        q, s = hk.quantize_int8(v, "block", BLOCK)
        assert torch.equal(codes, q) and torch.equal(scales, s)
    assert int(vector.codes.count_nonzero()) == sum(int(q.count_nonzero()) for q in vector.code_views)  # pads 0
    flat = torch.cat([v.reshape(-1) for v in values])
    assert float((vector.dequantized() - flat).abs().max()) <= float(flat.abs().max()) / 254 * 1.0001


def test_the_first_recorded_update_is_stored_as_its_block_quantization():
    predictors = _train({"int8": torch.int8, "fp32": torch.float32}, 1, recover=True)
    q, ref = predictors["int8"], predictors["fp32"]
    for codes, scales, d in zip(q._ema_q.code_views, q._ema_q.scale_views, ref._ema):
        expected_codes, expected_scales = hk.quantize_int8(d, "block", BLOCK)
        assert torch.equal(codes, expected_codes) and torch.equal(scales, expected_scales)


@pytest.mark.parametrize("recover", [True, False])
def test_over_a_long_run_the_int8_direction_stays_close_to_the_fp32_one(recover):
    """Each stored step rounds the whole EMA to its blocks' grid again, so the part of a step under
    half a grid step is lost; the error does not grow without bound. Measured on this run (300
    AdamW steps): relative L2 distance 0.046 (bf16: 0.010), cosine 0.9989 (bf16: 0.99995), per-tensor
    scale fits within 0.011 (bf16: 0.008) of the fp32 run's; bounds 0.08, 0.995 and 0.02 + 5%."""
    predictors = _train({"int8": torch.int8, "fp32": torch.float32}, 300, recover=recover)
    q, ref = predictors["int8"], predictors["fp32"]
    d, d_ref = q.current_direction()[0], ref.current_direction()[0]
    assert float((d - d_ref).norm() / d_ref.norm()) < 0.08
    assert float(d @ d_ref / (d.norm() * d_ref.norm())) > 0.995
    torch.testing.assert_close(q.scales, ref.scales, rtol=0.05, atol=0.02)
    assert q._ema_flat is None  # no float direction kept beside the codes
    if recover:
        assert q._before_flat is None


def test_predicted_gain_and_step_use_exactly_the_stored_direction():
    predictors = _train({"int8": torch.int8}, 20, recover=True)
    predictor = predictors["int8"]
    params = predictor.params
    direction = [d.double() for d in predictor._views(predictor.current_direction()[0])]
    scales = predictor.scales.clone()
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    grads[1] = None  # a parameter without a gradient contributes nothing
    expected = -sum(float(s) * float((g.double() * d).sum()) for g, d, s in zip(grads, direction, scales)
                    if g is not None)
    assert predictor.predicted_gain(grads) == pytest.approx(expected, rel=1e-5)
    before = [p.detach().clone() for p in params]
    pointers = [p.data_ptr() for p in params]
    with torch.no_grad():
        norms = predictor.apply_predicted_step()
    for p, b, d, s in zip(params, before, direction, scales):  # p += s·d in fp32, one rounding
        torch.testing.assert_close(p.detach(), (b.double() + float(s) * d).float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(norms, torch.stack([float(s) * d.norm() for d, s in zip(direction, scales)]).float())
    assert [p.data_ptr() for p in params] == pointers


def test_a_saved_int8_direction_loads_bit_exactly_and_goes_on_identically():
    predictors = _train({"int8": torch.int8}, 15, recover=True)
    original = predictors["int8"]
    state = original.state_dict()
    assert state["ema"].dtype == torch.int8 and state["ema"].numel() == original.numel  # no pads saved
    copy = DeltaPredictor(original.params, direction_dtype=torch.int8)
    copy.load_state_dict(state)
    assert torch.equal(copy._ema_q.codes, original._ema_q.codes) and torch.equal(copy._ema_q.scales, original._ema_q.scales)
    assert torch.equal(copy.scales, original.scales) and copy.n_updates == original.n_updates
    update = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 1e-3
              for i, p in enumerate(original.params)]
    # The weights are put back by copy, not by subtracting the update: (p + u) - u is not p in
    # float32, and the second predictor would then measure a slightly different update (it did
    # on this machine's CPU, whose trained weights differ in the last bits from another's).
    weights = [p.detach().clone() for p in original.params]
    for predictor in (original, copy):  # one more recorded step each, measured: the same update
        predictor.begin_step()
        with torch.no_grad():
            for p, u in zip(predictor.params, update):
                p.add_(u)
        predictor.end_step()
        with torch.no_grad():
            for p, w in zip(predictor.params, weights):
                p.copy_(w)
    assert torch.equal(copy._ema_q.codes, original._ema_q.codes) and torch.equal(copy.scales, original.scales)


def test_a_direction_saved_in_another_dtype_converts():
    predictors = _train({"int8": torch.int8, "bf16": torch.bfloat16}, 10, recover=True)
    q, bf16 = predictors["int8"], predictors["bf16"]
    as_int8 = DeltaPredictor(q.params, direction_dtype=torch.int8)
    as_int8.load_state_dict(bf16.state_dict())  # quantized once, a bucket at a time
    expected = Int8BlockVector(q.params, torch.device("cpu"))
    expected.quantize_from(bf16._ema_flat.float())
    assert torch.equal(as_int8._ema_q.codes, expected.codes)
    as_fp32 = DeltaPredictor(q.params, direction_dtype=torch.float32)
    as_fp32.load_state_dict(q.state_dict())  # dequantized
    assert torch.equal(as_fp32._ema_flat, q.current_direction()[0])


def test_int8_is_for_the_ema_direction_only():
    with pytest.raises(ValueError, match="direction_dtype"):
        DeltaPredictor([torch.zeros(4)], direction="linear", direction_dtype=torch.int8)


# -- in the trainer (its default) ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def stream():
    from _digits import batches, digits_tensors

    x, y = digits_tensors()
    return batches(x, y, 64, 80)


def _trainer(seed: int = 0, **overrides):
    from hybrid_trainer import HybridConfig, HybridTrainer

    from _configs import FAST
    from _digits import cross_entropy, mlp

    model = mlp(seed)
    return HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=0.05), cross_entropy,
                         config=HybridConfig(**{**FAST, **ALWAYS, **overrides}))


def test_the_trainer_keeps_an_int8_direction_and_rolls_a_rejected_prediction_back_exactly(stream):
    trainer = _trainer(loss_tolerance=0.0, noise_z=0.0)
    reject_a_prediction_and_check_the_optimizer_untouched(trainer, stream)
    assert trainer.predictor.direction_dtype == torch.int8 and trainer.predictor._ema_flat is None


def test_a_trainer_with_an_int8_direction_resumes_bit_exactly(stream, tmp_path):
    reference, resumed = assert_resume_reproduces(_trainer, stream, steps=60, cut=30, path=tmp_path / "int8.pt")
    assert reference.predictor._ema_q is not None and resumed.predictor._ema_q is not None  # the int8 store ran


def test_a_checkpoint_whose_int8_direction_lacks_its_scales_is_refused_before_loading(stream, tmp_path):
    trainer = _trainer()
    for b in stream[:30]:
        trainer.step(b)
    state = trainer.state_dict()
    assert state["predictor"]["ema"].dtype == torch.int8
    state["predictor"] = dict(state["predictor"], ema_scales=state["predictor"]["ema_scales"][:-1])
    with pytest.raises(ValueError, match="block scales"):
        _trainer().load_state_dict(state)

"""The update recomputed from Adam/AdamW's state agrees with the measured θ_after − θ_before.

Tolerance: the measured difference is itself rounded (θ_after is rounded to fp32 by the step's
last op, half an ulp of θ, and by the weight decay's multiply, another half), while the
recomputed one carries a few ulps of u. So per element:
``|u_recovered − u_measured| ≤ 2·ulp(|θ_after|) + 1e-5·|u_measured|``.
"""
import pytest
import torch

from hybrid_trainer.predictor import DeltaPredictor
from hybrid_trainer.update_recovery import CHUNK, CHUNK_ALIGN, MIN_CHUNK, AdamUpdateRecovery, chunk_for


def _model_params(seed=0):
    torch.manual_seed(seed)
    return [torch.randn(37, 19, requires_grad=True), torch.randn(19, requires_grad=True),
            torch.randn(5, requires_grad=True)]


def _set_grads(params, step, skip_last=False):
    generator = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        p.grad = None if (skip_last and i == len(params) - 1) else torch.randn(p.shape, generator=generator)


def _within_tolerance(recovered, measured, after):
    bound = 2 * torch.abs(torch.nextafter(after.abs(), torch.full_like(after, float("inf"))) - after.abs()) \
        + 1e-5 * measured.abs()
    return bool(((recovered - measured).abs() <= bound).all())


VARIANTS = [
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, foreach=True)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, fused=True)),
    (torch.optim.AdamW, dict(lr=3e-3, weight_decay=0.0, amsgrad=True)),
    (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05)),  # L2: inside the moments
    (torch.optim.Adam, dict(lr=1e-2, maximize=True, betas=(0.8, 0.9), eps=1e-6)),
    (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05, decoupled_weight_decay=True, foreach=False)),
]


def _recovered_flat(recovery):
    """The whole update, bucket by bucket, laid out as the parameters end to end."""
    out = torch.empty(recovery.buckets[-1][1])
    for bucket, (start, stop, _) in enumerate(recovery.buckets):
        recovery.bucket_update(bucket, out[start:stop])
    return out


@pytest.mark.parametrize("cls,kwargs", VARIANTS)
def test_recovered_update_matches_the_measured_one(cls, kwargs):
    params = _model_params()
    optimizer = cls(params, **kwargs)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)  # lr changes after each step
    recovery = AdamUpdateRecovery.for_optimizer(optimizer, params)
    assert recovery is not None
    for step in range(6):
        _set_grads(params, step, skip_last=step == 3)
        before = torch.cat([p.detach().reshape(-1) for p in params])
        recovery.capture()
        optimizer.step()
        scheduler.step()
        after = torch.cat([p.detach().reshape(-1) for p in params])
        measured = after - before
        recovered = _recovered_flat(recovery)
        if step == 3:  # the last parameter had no gradient: no update, recovered as zero
            assert bool((measured[-5:] == 0).all()) and bool((recovered[-5:] == 0).all())
        assert _within_tolerance(recovered, measured, after), (step, (recovered - measured).abs().max())


def test_buckets_split_a_large_tensor_and_group_small_ones():
    torch.manual_seed(1)
    params = [torch.randn(7, requires_grad=True), torch.randn(CHUNK + 1000, requires_grad=True),
              torch.randn(3, 5, requires_grad=True)]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    recovery = AdamUpdateRecovery.for_optimizer(optimizer, params)
    chunk = chunk_for(sum(p.numel() for p in params))  # an eighth of this model, under 8 CHUNKs
    assert chunk < CHUNK and chunk % CHUNK_ALIGN == 0
    assert all(stop - start <= chunk for start, stop, _ in recovery.buckets)
    big_pieces = [(start, stop) for _, _, pieces in recovery.buckets for index, start, stop in pieces if index == 1]
    assert big_pieces == [(a, min(a + chunk, CHUNK + 1000)) for a in range(0, CHUNK + 1000, chunk)]  # split at chunks
    assert recovery.buckets[0][2] == [(0, 0, 7)]  # the big tensor's first piece would overflow it
    assert recovery.buckets[-1][2][-1] == (2, 0, 15) and recovery.buckets[-1][1] == sum(p.numel() for p in params)
    for p in params:
        p.grad = torch.randn_like(p)
    before = torch.cat([p.detach().reshape(-1) for p in params])
    recovery.capture()
    optimizer.step()
    after = torch.cat([p.detach().reshape(-1) for p in params])
    assert _within_tolerance(_recovered_flat(recovery), after - before, after)


def test_other_optimizers_and_dtypes_keep_the_measured_update():
    params = _model_params()
    assert AdamUpdateRecovery.for_optimizer(torch.optim.SGD(params, lr=0.1), params) is None
    assert AdamUpdateRecovery.for_optimizer(None, params) is None
    half = [torch.randn(4, dtype=torch.bfloat16, requires_grad=True)]
    assert AdamUpdateRecovery.for_optimizer(torch.optim.AdamW(half), half) is None
    assert AdamUpdateRecovery.for_optimizer(torch.optim.AdamW(params, differentiable=True), params) is None
    other = [torch.randn(3, requires_grad=True)]
    assert AdamUpdateRecovery.for_optimizer(torch.optim.AdamW(other), params) is None  # not its parameters


def _record(with_optimizer, steps=8):
    params = _model_params()
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    predictor = DeltaPredictor(params)
    stats = []
    for step in range(steps):
        _set_grads(params, step, skip_last=step == 4)
        predictor.begin_step(optimizer if with_optimizer else None)
        optimizer.step()
        stats.append(predictor.end_step())
        assert (predictor._before_flat is None) == with_optimizer  # no before-copy when recovered
    return predictor, stats


def test_predictor_records_the_same_direction_and_scales_without_a_before_copy():
    measured, measured_stats = _record(False)
    recovered, recovered_stats = _record(True)
    assert recovered.n_updates == measured.n_updates == 8
    torch.testing.assert_close(recovered._ema_flat, measured._ema_flat, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(recovered.scales, measured.scales, rtol=1e-4, atol=1e-6)
    for a, b in zip(recovered_stats, measured_stats):
        assert a.update_norm == pytest.approx(b.update_norm, rel=1e-5)
        assert a.cosine == pytest.approx(b.cosine, rel=1e-4, abs=1e-6, nan_ok=True)


def _record_bf16(with_optimizer, steps=8):
    params = _model_params()
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    predictor = DeltaPredictor(params, direction_dtype=torch.bfloat16)
    for step in range(steps):
        _set_grads(params, step, skip_last=step == 4)  # as _record
        predictor.begin_step(optimizer if with_optimizer else None)
        optimizer.step()
        predictor.end_step()
    return predictor


def test_bf16_direction_is_the_fp32_one_rounded_and_loads_an_fp32_checkpoint():
    fp32, _ = _record(True)
    for with_optimizer in (True, False):
        bf16 = _record_bf16(with_optimizer)
        assert bf16._ema_flat.dtype == torch.bfloat16
        # Rounded once per recorded step: the errors (half a bf16 ulp, 2^-9 of the value then) decay
        # with the average, so they stay within a couple of ulps of the direction's magnitude;
        # an element the average brings near zero keeps its absolute, not its relative, error.
        bound = 2 * 2 ** -8 * float(fp32._ema_flat.abs().max())
        assert float((bf16._ema_flat.float() - fp32._ema_flat).abs().max()) <= bound
        torch.testing.assert_close(bf16.scales, fp32.scales, rtol=2e-2, atol=1e-4)
    state = fp32.state_dict()  # an fp32 direction, as checkpoints before bf16 hold it
    bf16.load_state_dict(state)
    assert bf16._ema_flat.dtype == torch.bfloat16
    assert torch.equal(bf16._ema_flat, state["ema"].to(torch.bfloat16))
    again = _record_bf16(True, steps=1)
    again.load_state_dict(bf16.state_dict())  # the bf16 layout round-trips exactly
    assert torch.equal(again._ema_flat, bf16._ema_flat) and again.n_updates == bf16.n_updates


def test_direction_dtype_is_checked():
    with pytest.raises(ValueError, match="direction_dtype"):
        DeltaPredictor(_model_params(), direction_dtype=torch.float16)


def test_a_small_model_is_recovered_in_eight_buckets_a_large_one_in_chunks():
    """The bucket is the recording's transient: a whole small model in one would be a copy of it."""
    assert chunk_for(100 * CHUNK) == CHUNK and chunk_for(8 * CHUNK) == CHUNK
    assert chunk_for(1000) == MIN_CHUNK
    assert chunk_for(540_000) == 69_632 and 8 * 69_632 >= 540_000 > 7 * 69_632

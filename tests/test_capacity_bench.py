"""bench.capacity's pieces: the Llama-shaped model's parameter count, the fitted slope, the
optimizer factories, and the reports from a result."""
import pytest
import torch

from bench.capacity import ARMS, BIG_SHAPES, Llama, big_markdown, fit_line, llama_parameters, lm_loss, make_optimizer, markdown


def test_parameter_formula_matches_the_model():
    shape = (64, 2, 172, 4)
    model = Llama(80, *shape)
    assert sum(p.numel() for p in model.parameters()) == llama_parameters(80, *shape)
    assert llama_parameters(80, *BIG_SHAPES["4B"]) >= 4e9  # the big run is at least 4B parameters


def test_model_trains_one_step():
    model = Llama(20, 32, 1, 64, 2)
    x = torch.randint(0, 20, (2, 16))
    loss = lm_loss(model, (x, x))
    loss.backward()
    assert torch.isfinite(loss) and model.head.weight.grad is not None


def test_fit_line_recovers_slope():
    slope, intercept = fit_line([1e6, 2e6, 4e6], [3e6 + 5e8, 6e6 + 5e8, 12e6 + 5e8])
    assert slope == pytest.approx(3.0) and intercept == pytest.approx(5e8)


@pytest.mark.parametrize("arm", [a for a, (kind, _) in ARMS.items() if kind == "adamw"])
def test_own_arms_build(arm):
    assert isinstance(make_optimizer(ARMS[arm][0], Llama(20, 32, 1, 64, 2), lr=1e-3), torch.optim.AdamW)


def test_reports_render():
    row = {"arm": "fp32 AdamW", "shape": [1, 1, 1, 1], "parameters": 4_000_000_000, "peak_rss": 13 * 2**30,
           "predicted_peak": 12 * 2**30, "plan": {"techniques": ["step_in_backward"], "bytes_per_param": 3.0},
           "losses": [4.4, 3.0], "step_seconds": [60.0, 55.0], "size": "4B"}
    text = big_markdown({"command": "c", "commit": "abcdef1234", "date": "d", "machine": "m", "big": [row]})
    assert "4.000B" in text and "13.00 GiB" in text and "4.400 → 3.000" in text
    assert "Capacity" in markdown({"commit": "abcdef1234", "date": "d", "machine": "m"})


def test_eager_sweep_report_renders():
    from bench.capacity import EAGER_ARMS, EAGER_SHAPES

    plan = {"techniques": [], "bytes_per_param": 3.06, "breakdown": {"activations": 2**20}}
    row = {"label": "in-backward + 4-bit + bf16", "arm": "in-backward + 4-bit + bf16", "built_in": "bfloat16",
           "size": "25M", "parameters": 25_000_000, "construct_peak_rss": 500 * 2**20, "step_peak_rss": 520 * 2**20,
           "peak_rss": 520 * 2**20, "predicted_peak": 510 * 2**20, "plan": plan}
    fit = {"bytes_per_param": 3.5, "step_bytes_per_param": 3.4, "state_bytes_per_param": 3.1,
           "activation_bytes_per_param": 0.3, "plan_bytes_per_param": 3.06, "predicted_bytes_per_param": 3.3,
           "max_abs_prediction_error": 0.02, "step_seconds_largest": 9.0, "step_time_factor": 1.5}
    assert set(EAGER_SHAPES) == {"25M", "125M", "350M"} and "fp32 AdamW" in EAGER_ARMS
    text = markdown({"commit": "abcdef1234", "date": "d", "machine": "m",
                     "eager_sweep": {"rows": [row], "fits": {row["label"]: fit}, "steps": 3, "shapes": EAGER_SHAPES}})
    assert "| in-backward + 4-bit + bf16 | bfloat16 | 3.50 | 3.40 | 3.10 | 0.30 | 3.06 |" in text
    assert "| 25M | 25.0M | 500 MiB | 520 MiB | 1 MiB | 510 MiB |" in text

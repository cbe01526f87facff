"""bench.launch_overhead: refuses to run without a GPU and tabulates what it measured."""
import pytest
import torch

from bench import launch_overhead


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is available")
def test_refuses_to_run_without_a_gpu(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        launch_overhead.main(["--out", str(tmp_path)])
    assert exit_info.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_markdown_has_a_row_per_measurement():
    times = {"kernel, device time": 8.8, "bare Triton launch": 40.8, "_forward_triton": 72.0,
             "flash_attention": 84.0, "SDPA": 32.6}
    result = dict(command="python -m bench.launch_overhead", device="GPU", torch="2", triton="3", date="d",
                  flash_forward=[dict(shape=[4, 8, 256, 64], times=times)],
                  flash_forward_backward=[dict(shape=[4, 8, 256, 64], per_call={"flash_attention": 787.4, "SDPA": 236.6},
                                               kernels={"flash_attention": {"_flash_bwd_dkdv_kernel": 12.5},
                                                        "SDPA": {"cudnn_bprop": 10.3}})],
                  quantize={"tensor": {"per call": 157.1, "device time": 20.0}},
                  trainer_step_ms={"foreach": {"AdamW loop": 1.58, "no-predict": 2.01, "default": 1.92},
                                   "fused": {"AdamW loop": 1.5, "no-predict": 1.6, "default": 1.7}})
    text = launch_overhead.markdown(result)
    assert "| (4, 8, 256, 64) | 8.8 | 40.8 | 72.0 | 84.0 | 32.6 |" in text
    assert "| (4, 8, 256, 64) | 787.4 | 236.6 | flash_attention: _flash_bwd_dkdv_kernel 12.5; SDPA: cudnn_bprop 10.3 |" in text
    assert "| tensor | 157.1 | 20.0 |" in text
    assert "| AdamW foreach | 1.58 | 2.01 | 1.92 |" in text and "| AdamW fused | 1.50 | 1.60 | 1.70 |" in text

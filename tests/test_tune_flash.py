"""bench.tune_flash_attention: never picks a configuration that failed its accuracy check, and
refuses to run without a GPU."""
import pytest
import torch

from bench import tune_flash_attention as tune


def _row(m, n, fwd_ms, bwd_ms, fwd_ok=True, bwd_ok=True):
    return dict(BLOCK_M=m, BLOCK_N=n, num_warps=4, num_stages=3, fwd_ms=fwd_ms, bwd_ms=bwd_ms,
                fwd_ok=fwd_ok, bwd_ok=bwd_ok)


def test_best_is_the_fastest_correct_configuration_per_pass():
    result = dict(shape=[2, 8, 1024, 64], dtype="float16", causal=False, flops_fwd=1e9,
                  sdpa=dict(fwd_ms=0.02, bwd_ms=0.1),
                  current=dict(fwd=dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
                               bwd=dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)),
                  rows=[_row(64, 64, 0.08, 0.27), _row(64, 128, 0.01, 0.30, fwd_ok=False),
                        _row(128, 64, 0.02, 0.12), dict(BLOCK_M=128, BLOCK_N=128, failed="OutOfResources")])
    assert tune._best(result, "fwd")["BLOCK_N"] == 64 and tune._best(result, "fwd")["BLOCK_M"] == 128
    assert tune._best(result, "bwd")["BLOCK_M"] == 128
    table = tune.summary([result])
    assert "| fwd | 0.020 | 64x64 w4 s3 | 0.080 | 128x64 w4 s3 | 0.020 | 50.0 |" in table
    for row in result["rows"][:3]:
        row["bwd_ok"] = False
    assert "none correct" in tune.summary([result])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is available")
def test_refuses_to_run_without_a_gpu(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tune.main(["--quick", "--out", str(tmp_path)])
    assert exit_info.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_shape_and_block_arguments_parse_and_reject_bad_values():
    import argparse
    assert tune.parse_shape("2x8x1024x64") == (2, 8, 1024, 64)
    assert tune.parse_block("64X128") == (64, 128)
    for bad in ("2x8x1024", "2x8x0x64", "2x8xNx64"):
        with pytest.raises(argparse.ArgumentTypeError, match="BxHxNxD"):
            tune.parse_shape(bad)
    for bad in ("64x96", "8x64", "64"):
        with pytest.raises(argparse.ArgumentTypeError, match="powers of two"):
            tune.parse_block(bad)

"""bench.tasks finds Fashion-MNIST where FASHION_MNIST_DIR points (a lent machine has no root)."""
import gzip
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


def _write_idx(path: Path, header: bytes, payload: np.ndarray) -> None:
    with gzip.open(path, "wb") as f:
        f.write(header + payload.astype(np.uint8).tobytes())


@pytest.mark.slow
def test_fashion_dir_comes_from_the_environment(tmp_path):
    images = np.arange(3 * 784) % 256
    for split, n in (("train", 3), ("t10k", 3)):
        _write_idx(tmp_path / f"{split}-images-idx3-ubyte.gz", bytes(16), images[: n * 784])
        _write_idx(tmp_path / f"{split}-labels-idx1-ubyte.gz", bytes(8), np.array([1, 2, 3]))
    code = ("from bench.tasks import load_fashion; x, y, xt, yt, src = load_fashion(); "
            "print(x.shape, y.tolist(), src.split(' ')[0])")
    env = dict(os.environ, FASHION_MNIST_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], check=True).stdout
    assert out.split() == ["(3,", "784)", "[1,", "2,", "3]", "Fashion-MNIST"]

"""What the checkpoint digest costs: save and load times with and without it, on a state of a given size.

    python -m bench.checkpoint_digest [--mib 100] [--repeats 5] [--dir /tmp] [--out FILE.json]

Arms, timed alternately (median of ``--repeats``):

* ``plain``: the file layer without a digest: ``torch.save`` to a temporary file, fsync, rename
  (what ``atomic_save`` did before), and ``torch.load(path, weights_only=True)``;
* ``digest``: ``hybrid_trainer.checkpoint.atomic_save`` (SHA-256 computed while writing, trailer,
  folder fsync, stale temporary clean-up) and ``checkpoint.load`` (hashes the file, then loads).

The state is a dict of float32 tensors of 4 MiB each (a model's and an optimizer's tensors look
alike to the file layer). Loads read a file just written, so from the page cache: the figure is
the CPU cost of the digest, not disk speed. Timings on a shared machine are noisy.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.protocol import run_metadata
from hybrid_trainer import checkpoint


def _plain_save(obj, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=100, help="state size in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where the files are written")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    state = {f"tensor{i}": torch.randn(1 << 20, generator=generator) for i in range(args.mib // 4)}
    state["step_count"] = 1
    size_mib = sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor)) / 2**20
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        plain_path, digest_path = Path(folder) / "plain.pt", Path(folder) / "digest.pt"
        times: dict[str, list[float]] = {"plain save": [], "digest save": [], "plain load": [], "digest load": []}
        for _ in range(args.repeats):
            times["plain save"].append(_timed(lambda: _plain_save(state, plain_path)))
            times["digest save"].append(_timed(lambda: checkpoint.atomic_save(state, digest_path)))
            times["plain load"].append(_timed(lambda: torch.load(plain_path, weights_only=True)))
            times["digest load"].append(_timed(lambda: checkpoint.load(digest_path)))
    medians = {name: statistics.median(values) for name, values in times.items()}
    command = "python -m bench.checkpoint_digest " + shlex.join(sys.argv[1:] if argv is None else argv)
    results = run_metadata(command, state_mib=size_mib, median_s=medians, all_s=times,
                   extra_s={op: medians[f"digest {op}"] - medians[f"plain {op}"] for op in ("save", "load")})
    commit = (results["git_commit"] or "?")[:10]
    print(f"{command.strip()} (commit {commit}, torch {torch.__version__}): state {size_mib:.0f} MiB, "
          f"median of {args.repeats}")
    for op in ("save", "load"):
        plain, digest = medians[f"plain {op}"], medians[f"digest {op}"]
        print(f"  {op}: plain {plain * 1e3:.0f} ms, with digest {digest * 1e3:.0f} ms "
              f"({(digest - plain) * 1e3:+.0f} ms, {digest / plain:.2f}x)")
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

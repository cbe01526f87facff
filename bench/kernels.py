"""Run the kernel microbenchmarks and write a results table.

    python -m bench.kernels [--quick] [--out DIR] [-k EXPR]

Runs every ``bench/test_bench_*.py`` with pytest-benchmark in a child process (without the
Triton interpreter: CPU timings are of the eager path, GPU timings of the compiled kernels),
then writes ``DIR/kernels_<device>.json`` (machine, versions, thread count, every benchmark's
statistics, GB/s or TFLOP/s where the benchmark declares bytes or flops), ``DIR/kernels_<device>.md``
(the table printed at the end) and ``DIR/kernels_<device>.png`` (speed relative to each group's
reference implementation).

``--quick`` keeps the small shapes and few rounds (about a minute); the full run takes longer.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from .protocol import run_metadata

QUICK_FILTER = "not 100M and not 16M and not N1024 and not E8"


def device_tag() -> tuple[str, str]:
    """(file-name tag, human-readable device name)."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-"), name
    cpu = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return "cpu", f"{cpu} ({os.cpu_count()} cores)"


def run_pytest(json_path: Path, quick: bool, keyword: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "pytest", "bench", "-q", "-p", "no:cacheprovider",
           f"--benchmark-json={json_path}", "--benchmark-columns=median,rounds",
           "--benchmark-sort=name"]
    filters = [f for f in (QUICK_FILTER if quick else None, keyword) if f]
    if filters:
        cmd += ["-k", " and ".join(f"({f})" for f in filters)]
    cmd += (["--benchmark-min-rounds=3", "--benchmark-max-time=0.2"] if quick
            else ["--benchmark-min-rounds=5", "--benchmark-max-time=1.0"])
    print("running:", " ".join(cmd[2:]), flush=True)
    return subprocess.call(cmd, env=env, cwd=Path(__file__).resolve().parent.parent)


def summarize(raw: dict) -> list[dict]:
    rows = []
    for b in raw["benchmarks"]:
        info, stats = b.get("extra_info", {}), b["stats"]
        median = stats["median"]
        row = {
            "group": b.get("group") or b["name"],
            "impl": info.get("impl", b["name"]),
            "median_s": median, "min_s": stats["min"], "max_s": stats["max"],
            "mean_s": stats["mean"], "stddev_s": stats["stddev"], "rounds": stats["rounds"],
            "baseline": bool(info.get("baseline", False)),
            "extra_info": info,
        }
        if "bytes" in info:
            row["gb_per_s"] = info["bytes"] / median / 1e9
        if "flops" in info:
            row["tflop_per_s"] = info["flops"] / median / 1e12
        rows.append(row)
    by_group: dict[str, list[dict]] = {}
    for row in rows:
        by_group.setdefault(row["group"], []).append(row)
    for group in by_group.values():
        reference = next((r for r in group if r["baseline"]), max(group, key=lambda r: r["median_s"]))
        for r in group:
            r["speedup_vs_reference"] = reference["median_s"] / r["median_s"]
            r["reference_impl"] = reference["impl"]
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = ["| benchmark | implementation | median | GB/s or TFLOP/s | × vs reference | rounds |",
             "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["group"], r["median_s"])):
        median = r["median_s"]
        shown = f"{median * 1e3:.3f} ms" if median >= 1e-3 else f"{median * 1e6:.1f} µs"
        rate = (f"{r['gb_per_s']:.2f} GB/s" if "gb_per_s" in r else
                f"{r['tflop_per_s']:.3f} TFLOP/s" if "tflop_per_s" in r else "")
        ref = " (reference)" if r["impl"] == r["reference_impl"] else ""
        lines.append(f"| {r['group']} | {r['impl']}{ref} | {shown} | {rate} | "
                     f"{r['speedup_vs_reference']:.2f} | {r['rounds']} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: (r["group"], -r["median_s"]))
    labels = [f"{r['group']} · {r['impl']}" for r in rows]
    values = [r["speedup_vs_reference"] for r in rows]
    fig, ax = plt.subplots(figsize=(11, 0.28 * len(rows) + 1.2))
    colors = ["tab:gray" if r["impl"] == r["reference_impl"] else
              ("tab:blue" if "hybrid" in r["impl"] or r["impl"].startswith(("quantize", "dequantize", "gru_cell",
                                                                             "encode_state", "flash"))
               else "tab:orange") for r in rows]
    ax.barh(range(len(rows)), values, color=colors)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xlabel("speed relative to the group's reference (higher is faster; median time)")
    ax.set_title(title, fontsize=9)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, few rounds (about a minute)")
    parser.add_argument("--out", type=Path, default=Path("docs/results"), help="output folder")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression to select benchmarks")
    args = parser.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    tag, device_name = device_tag()
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = Path(tmp) / "raw.json"
        code = run_pytest(raw_path, args.quick, args.keyword)
        if not raw_path.exists():
            print("benchmarks produced no results", file=sys.stderr)
            return code or 1
        raw = json.loads(raw_path.read_text())

    rows = summarize(raw)
    command = "python -m bench.kernels" + (" --quick" if args.quick else "") + (
        f" -k '{args.keyword}'" if args.keyword else "")
    result = {
        **run_metadata(command),
        "device": device_name,
        "triton": _version("triton"),
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "1"),
        "path": "triton (compiled)" if torch.cuda.is_available() else "eager PyTorch (CPU)",
        "benchmarks": rows,
    }
    stem = f"kernels_{tag}" + ("_quick" if args.quick else "")
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    table = markdown_table(rows)
    header = (f"Kernel microbenchmarks on {device_name}, {result['path']}, torch {result['torch']}, "
              f"OMP_NUM_THREADS={result['omp_num_threads']}; `{command}` ({result['date']}).")
    if code:  # a failed benchmark has no row: say so where the table is read
        header += f" **pytest exited with {code}: failed benchmarks are missing from this table.**"
        print(f"benchmarks failed (pytest exit code {code}); their rows are missing", file=sys.stderr)
    (args.out / f"{stem}.md").write_text(header + "\n\n" + table + "\n")
    plot(rows, args.out / f"{stem}.png", header[:160])
    print("\n" + header + "\n\n" + table)
    print(f"\nwrote {args.out / stem}.json/.md/.png")
    return code


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())

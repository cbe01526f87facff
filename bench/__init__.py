"""Benchmarks: kernel microbenchmarks (pytest-benchmark, `python -m bench.kernels`)."""

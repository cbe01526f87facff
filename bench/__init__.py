"""The product's benchmarks, each run as ``python -m bench.<name>`` from the repository root:
``e2e`` (the trainer against tuned AdamW on real data), ``ddp``, ``memory``, ``kernels`` (with the
pytest-benchmark files ``test_bench_*.py``), ``tune_flash_attention``, ``host_ops``,
``launch_overhead`` and ``step_times``; ``tasks`` holds the data sets and models they share and
``protocol`` the comparison protocol and result metadata. ``readme_tables`` and ``results_index``
generate the README's tables and the results index from the result files."""

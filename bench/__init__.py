"""Benchmarks: ``python -m bench.NAME`` from the repo root (``python bench/NAME.py`` works too,
see bench/_bootstrap.py). They use the test harness in tests/support."""

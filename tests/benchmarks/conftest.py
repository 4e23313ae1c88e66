"""Benchmarks are scripts (``python tests/benchmarks/bench.py``), not tests."""

collect_ignore_glob = ["*.py"]

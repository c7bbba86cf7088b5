"""Baselines and the benchmark harness; results in bench/RESULTS.md."""

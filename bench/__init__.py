"""Benchmarks, each a script: run them from the repository root as modules (`python -m bench.NAME`),
so that they import one another and tests/support/ by their package names."""

"""The liger-losses benchmarks: ``python -m benchmark.NAME`` from the repository root (see README.md)."""

"""One-off GPU investigations, each headed by its question, verdict and status:
``python -m benchmark.experiments.NAME`` from the repository root."""

"""Benchmarks of the engine and its kernels, run from the repository root as modules (`python -m bench.<script>`).

Each script measures and appends JSONL rows; none asserts anything about speed (bench/README.md)."""

"""Benchmarks, probes and the CUDA run (not tests): each runs as a module from the repository root,
``.venv/bin/python -m scripts.bench.NAME --help``, and times what it compares with the shared
harness (``scripts.bench.harness``: timing, variants interleaved side by side, the mlx-vlm peer)."""

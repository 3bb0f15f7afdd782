"""The user-facing tools (setup.sh, demo.sh, test.sh, install_chromium.sh) and, in ``scripts.bench``,
the benchmarks, run as modules from the repository root: ``.venv/bin/python -m scripts.bench.runtime``."""

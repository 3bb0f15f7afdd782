"""Set-up, demo, training and benchmark scripts. The Python ones that share code (scripts.demo_task,
tests.builders) run as modules from the repository root: ``.venv/bin/python -m scripts.bench_runtime``."""

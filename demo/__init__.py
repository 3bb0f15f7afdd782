"""The bundled demo models (diffusion_gemma_sort/, llada2_sort/), their task (``demo.task``: sort a
list of digits) and their training scripts, run as modules from the repository root:
``.venv/bin/python -m demo.train_diffusion_gemma --out demo/diffusion_gemma_sort``."""

"""dlm-convert: Hugging Face checkpoints to MLX safetensors (see pipeline.py)."""

import dlm.runtime  # noqa: F401  (first: the BLAS, float32 precision and MLX backend check, before MLX)

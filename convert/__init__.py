"""dlm-convert: Hugging Face checkpoints to MLX safetensors (see pipeline.py)."""

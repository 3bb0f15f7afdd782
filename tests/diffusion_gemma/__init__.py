"""DiffusionGemma: the MLX model, generation loop, samplers, loader, CLI, dlm-convert and dlm-verify."""

"""LLaDA2.0 MoE: the MLX model, block unmasking, CLI, server, dlm-convert and dlm-verify."""

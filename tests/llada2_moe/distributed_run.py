"""What tests/llada2_moe/test_distributed.py compares: ``results`` runs on every rank
of an ``mlx.launch`` job (tests/distributed.py: family_ranks, with DiffusionGemma's
checks) and in-process for the single-process twin. By hand:
``distributed_run.py MODEL_DIR... OUT.json`` (rank 0 writes the JSON)."""

from __future__ import annotations

import json
import sys

import numpy as np

from dlm.runtime import api  # before MLX: dlm.runtime loads the optimized BLAS ahead of it

import mlx.core as mx  # noqa: E402  (isort: skip)

PROMPTS = [[5, 17, 29, 41, 53], list(range(60, 100))]
RUNS = [{"max_tokens": 24, "block_length": 8, "max_denoising_steps": 4},
        {"max_tokens": 24, "block_length": 8, "max_denoising_steps": 4, "temp": 0.8, "top_p": 0.9, "seed": 7}]


def results(model_dir: str) -> dict:
    loaded = api.load(model_dir)
    out = {"generate": [], "notes": list(loaded.shard_notes)}
    sampled = not loaded.args.block_routing  # LLaDA2.2 decodes greedily
    for prompt in PROMPTS:
        for options in RUNS[: 2 if sampled else 1]:
            r = api.generate(loaded, prompt, options)
            out["generate"].append([r.token_ids, r.finish_reason, r.stats.steps_per_block])
    batch = api.generate_batch(loaded, PROMPTS, [RUNS[0], RUNS[0]])
    out["batch"] = [r.token_ids for r in batch]
    structured = api.generate(loaded, PROMPTS[0], dict(RUNS[0], max_tokens=32),
                              response_format={"type": "json_object"})
    out["structured"] = structured.token_ids
    ids = mx.array([PROMPTS[1][:32]])
    out["logits"] = np.array(loaded.model(ids)[0, -4:]).tolist()
    return out


def main() -> None:
    """Every model directory in turn (one launch for several); rank 0 writes {dir: results}."""
    *model_dirs, path = sys.argv[1:]
    data = {d: results(d) for d in model_dirs}
    from dlm.runtime.platform.distributed import primary

    if primary():
        with open(path, "w") as f:
            json.dump(data, f)


if __name__ == "__main__":
    main()

"""The checks test_distributed.py runs in one process and on every rank of an
``mlx.launch`` job (tests/distributed.py: family_ranks, with LLaDA-2's checks; by
hand: ``python distributed_checks.py OUT MODEL_DIR[+image] ...``):
greedy and seeded generations, a prompt with an image, a batch, a structured
request and the logits of two decoder forwards (the second self-conditioned),
per model directory. Each rank writes what it got to OUT.<rank>.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from dlm.runtime import api  # before MLX: dlm.runtime loads the optimized BLAS ahead of it

import mlx.core as mx  # noqa: E402  (isort: skip)

SHORT = list(range(2, 14))
LONG = [2] + [(7 * i + 3) % 500 + 5 for i in range(27)]  # 28 tokens > sliding window 16
GREEDY = {"max_tokens": 16, "max_denoising_steps": 4, "temp": 0.0, "seed": 1}
SEEDED = {"max_tokens": 16, "max_denoising_steps": 4, "seed": 7}


def picture(width: int, height: int, seed: int = 0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8))


def forward_logits(loaded) -> list:
    """Logits of a canvas after LONG's prefill, then of the same canvas self-conditioned on them."""
    model = loaded.model
    cache = model.make_cache()
    model.prefill(LONG, cache)
    canvas = mx.array((np.arange(8) * 37 + 5).astype(np.int32))
    first = model.decode(canvas, cache)
    second = model.decode(canvas, cache, sc_logits=first)
    return [np.array(first).tolist(), np.array(second).tolist()]


def checks(model_dir: str, image: bool) -> dict:
    loaded = api.load(model_dir)
    out = {
        "notes": loaded.shard_notes,
        "greedy": api.generate(loaded, SHORT, GREEDY).token_ids,
        "seeded": api.generate(loaded, LONG, SEEDED).token_ids,
        "batch": [r.token_ids for r in api.generate_batch(loaded, [SHORT, LONG, SHORT], [SEEDED, GREEDY, GREEDY])],
        "json": api.generate(loaded, SHORT, {"max_tokens": 24, "seed": 3},
                             response_format={"type": "json_object"}).token_ids,
        "logits": forward_logits(loaded),
    }
    if image:
        inputs = api.encode_inputs(loaded, "describe", images=[picture(40, 30, 1)])
        out["image"] = api.generate(loaded, inputs, SEEDED).token_ids
    return out


def run(targets: list[str]) -> list[dict]:
    """``checks`` of each MODEL_DIR[+image], in order."""
    return [checks(*_target(t)) for t in targets]


def _target(target: str) -> tuple[str, bool]:
    path, _, flag = target.partition("+")
    return path, flag == "image"


def main(argv: list[str]) -> None:
    from dlm.runtime.platform import distributed

    out, targets = argv[0], argv[1:]
    results = run(targets)
    w = distributed.world()
    rank = 0 if w is None else w.rank
    Path(f"{out}.{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])

"""In-process cost of batched generation (dlm.runtime.batch), no HTTP: the
milliseconds of one shared step at batch sizes 1..16 (steady state: every
request mid-way through long canvases/blocks), and api.generate_batch against
the same requests run one after the other with api.generate (interleaved,
medians; the results are checked to be identical).

    .venv/bin/python -m scripts.bench.batch --tiny [--family llada2]
    .venv/bin/python -m scripts.bench.batch --model path/to/mlx-model

The step costs are what ``--max-batch`` trades: past the size where the cost
per request stops falling, a bigger batch only makes every request slower.
"""

from __future__ import annotations

import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

from dlm.runtime import api
from dlm.runtime.batch import Batcher
from scripts.bench import harness
from scripts.bench.serve import tiny_model


def requests(loaded, n: int, max_tokens: int, block_length: int = 8):
    llada = loaded.family.name == "llada2_moe"
    prompts = [list(range(3, 14 + i)) for i in range(n)]
    base = {"block_length": block_length, "temp": 0.8} if llada else {"max_denoising_steps": 8}
    return prompts, [{**base, "max_tokens": max_tokens, "seed": i} for i in range(n)]


class Steady:
    """``size`` busy requests in one Batcher, timed a window of steps at a time.

    A request that ends (a stop token: the random tiny models emit them) leaves
    the batch, and a step of fewer requests, or of none, is not the cost of
    ``size``: before each window the batch is topped up with fresh requests (new
    seeds) and stepped twice, so they are mid-canvas/block, and a window in which
    any request ended does not count."""

    def __init__(self, loaded, size: int, block_length: int = 8):
        self.size, self.batcher = size, Batcher(loaded, max_batch=size)
        self.prompts, self.options = requests(loaded, size, min(loaded.args.max_position_embeddings - 64, 4096),
                                              block_length)
        self.seeds = itertools.count(size)
        self.slots: list = [None] * size  # the entry holding each prompt (the mix of lengths stays)
        self.times: list[float] = []

    def window(self, steps: int = 10) -> None:
        b = self.batcher
        live = {id(e) for e in b.active} | {id(e) for e in b.waiting}
        for i, entry in enumerate(self.slots):
            if entry is None or id(entry) not in live:
                self.slots[i] = b.add(self.prompts[i], {**self.options[i], "seed": next(self.seeds)})
        for _ in range(2):
            b.step()
        if len(b.active) < self.size:
            return
        t = time.perf_counter()
        for _ in range(steps):
            b.step()
        if len(b.active) == self.size:
            self.times.append((time.perf_counter() - t) / steps * 1e3)


def step_ms(loaded, sizes: list[int], windows: int = 5, steps: int = 10, block_length: int = 8) -> dict[int, float]:
    """The median ms of one step at each batch size, windows of ``steps`` steps
    interleaved across the sizes (a shared machine drifts)."""
    runs = [Steady(loaded, size, block_length) for size in sizes]
    for _ in range(20 * windows):
        short = [r for r in runs if len(r.times) < windows]
        if not short:
            break
        for r in short:
            r.window(steps)
    for r in runs:
        if len(r.times) < windows:
            raise RuntimeError(f"{r.size} requests kept ending within a window: no steady batch to time")
    return {r.size: statistics.median(r.times) for r in runs}


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--model")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--family", choices=("diffusion_gemma", "llada2"), default="diffusion_gemma")
    p.add_argument("--sizes", default="1,2,4,8,16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--windows", type=int, default=5, help="timed windows per batch size")
    p.add_argument("--window-steps", type=int, default=10, help="steps of a timed window")
    p.add_argument("--block-length", type=int, default=8, help="LLaDA-2's block length")
    p.add_argument("--steps-only", action="store_true", help="the step costs only, no generate runs")
    p.add_argument("--merged-rows", action="store_true",
                   help="measurement only: a batch's float GEMMs run merged, not one per sequence "
                        "(rows.py), to see what the bit-for-bit batch = solo property costs on this backend")
    args = p.parse_args()
    if args.merged_rows:
        if not args.steps_only:
            p.error("--merged-rows gives up batch = solo bit for bit: use it with --steps-only")
        from dlm.runtime.models import rows

        rows._batched = lambda x: False
    if not args.model and not args.tiny:
        p.error("give --model DIR or --tiny")
    model = Path(args.model) if args.model else tiny_model(Path(tempfile.mkdtemp()), args.family)
    loaded = api.load(model)
    out = {"model": str(model), "step_ms": {}, "generate": []}
    for size, ms in step_ms(loaded, [int(s) for s in args.sizes.split(",")], args.windows, args.window_steps,
                             args.block_length).items():
        out["step_ms"][size] = {"step": round(ms, 2), "per_request": round(ms / size, 2)}
        print(json.dumps({"batch": size, **out["step_ms"][size]}), flush=True)
    for size in [] if args.steps_only else [int(s) for s in args.sizes.split(",") if int(s) <= 8]:
        prompts, options = requests(loaded, size, args.max_tokens, args.block_length)
        api.generate_batch(loaded, prompts, options)  # warm-up
        runs = harness.interleave(
            {"serial": lambda: [api.generate(loaded, p, o) for p, o in zip(prompts, options)],
             "batched": lambda: api.generate_batch(loaded, prompts, options)},
            args.rounds, run=lambda fn, r: harness.timed(fn, evaluate=False))
        for (_, alone), (_, together) in zip(runs["serial"], runs["batched"]):
            assert [r.token_ids for r in alone] == [r.token_ids for r in together]
        serial, batched = ([t for t, _ in runs[name]] for name in ("serial", "batched"))
        tokens = sum(len(r.token_ids) for r in together)
        row = {"requests": size, "serial_tokens_per_s": round(tokens / statistics.median(serial), 1),
               "batched_tokens_per_s": round(tokens / statistics.median(batched), 1),
               "ratio": round(harness.paired(serial, batched)["median"], 2)}
        out["generate"].append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

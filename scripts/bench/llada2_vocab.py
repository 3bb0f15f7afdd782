"""Benchmark LLaDA-2's per-step work over the vocabulary (not a test): the
sampler (greedy: argmax and the chosen token's probability, one softmax
denominator per position; with a temperature: softmax, running sum and an
inverse-CDF draw) over a block's [positions, vocab] float32 logits, on one CPU
stream against its rows split over the CPU streams (as ``batch.reveal_rows``
ran it; checks the two bit for bit) and through numpy's vector loops
(cpu_vocab.py, the CPU backend's path at scale; the same tokens), side by side
with interleaved repeats.

    .venv/bin/python -m scripts.bench.llada2_vocab              # LLaDA2.0-mini: a 32-position block, vocab 157184
    .venv/bin/python -m scripts.bench.llada2_vocab --positions 128 --repeats 5
"""

from __future__ import annotations

import json
import os
import statistics
from types import SimpleNamespace

from dlm.runtime.platform import blas  # noqa: F401  (the optimized BLAS ahead of MLX)

import mlx.core as mx  # noqa: E402  (isort: skip)
import numpy as np  # noqa: E402

from dlm.runtime.models.cpu.streams import cpu_streams, split_rows  # noqa: E402
from dlm.runtime.models.llada2_moe.sampling import sample  # noqa: E402
from scripts.bench import harness  # noqa: E402


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--positions", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=157184)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    logits = mx.random.normal((a.positions, a.vocab), key=mx.random.key(0)) * 3
    bias = mx.where(mx.arange(a.vocab) == a.vocab - 1, -mx.inf, 0.0)  # the mask token, never sampled
    u = mx.random.uniform(shape=(a.positions,), key=mx.random.key(1))
    mx.eval(logits, bias, u)
    out = {"streams": len(cpu_streams()), "positions": a.positions, "vocab": a.vocab}
    for temperature in (0.0, 0.8):
        s = SimpleNamespace(temperature=temperature, reference_sampling=False, top_k=None, top_p=None)
        draws = [u] if temperature else []

        def score(x, *uu, s=s):
            return sample(x + bias, s, uu[0] if uu else None)

        def on_numpy(*args):
            os.environ["DLM_CPU_VOCAB"] = "numpy"
            try:
                return score(*args)
            finally:
                os.environ["DLM_CPU_VOCAB"] = "mlx"

        os.environ["DLM_CPU_VOCAB"] = "mlx"  # the first two on MLX's ops, the third through cpu_vocab.py
        ways = {"one stream": lambda: score(logits, *draws), "split": lambda: split_rows(score, logits, *draws),
                "numpy": lambda: on_numpy(logits, *draws)}
        outs = [w() for w in ways.values()]
        same = all(np.array_equal(np.array(p), np.array(q)) for p, q in zip(outs[0], outs[1]))
        numpy_tokens = np.array_equal(np.array(outs[0][0]), np.array(outs[2][0]))
        numpy_conf = float(mx.abs(outs[0][1] - outs[2][1]).max())
        times = harness.interleave(ways, a.repeats, warmup=1)
        row = {name: round(statistics.median(t) * 1e3, 1) for name, t in times.items()}
        out[f"temperature {temperature}"] = {**row, "ratio": round(row["one stream"] / row["split"], 2),
                                              "bitwise same": same,
                                              "split / numpy": round(row["split"] / row["numpy"], 2),
                                              "numpy: same tokens": numpy_tokens,
                                              "numpy: max |confidence diff|": numpy_conf}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

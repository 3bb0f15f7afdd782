"""Benchmark a DiffusionGemma denoising step's work over the full vocabulary (not a test).

Times, at one shape ([positions, vocab], hidden for the two products) and side
by side in one process with interleaved repeats, the pieces of a step that
touch every vocabulary entry:

* ``before``: what the step ran until scores.py (one CPU stream): the softcap,
  ``proc = logits / T`` with its argmax and torch's entropy formula (two
  exponentials), a Gumbel categorical draw (V uniforms and two logarithms per
  position) and the next step's softmax for self-conditioning;
* ``after``: the softcap and scores.py's single exponential pass (proc, argmax,
  entropy, the softmax) and the inverse-CDF draw, rows split over the CPU
  streams;
* ``numpy``: the same with the softcap and the pass through numpy's vector
  loops on one thread per core (cpu_vocab.py, the CPU backend's path at scale);
* for scale, the two products over the vocabulary every step also runs (the tied
  head and the self-conditioning product) on the BLAS in use.

    .venv/bin/python -m scripts.bench.vocab                       # the released geometry: 256 x 262144, hidden 2816
    .venv/bin/python -m scripts.bench.vocab --positions 64 --vocab 32768 --hidden 512 --repeats 5

Prints the median [min-max] ms of each, and checks that both paths give the same
argmax and entropies within 1e-3 (the draws differ by construction: other
random numbers, the same distribution; tests/diffusion_gemma/test_scores.py).
"""

from __future__ import annotations

import json
import os

from dlm.runtime.platform import blas  # noqa: F401  (the optimized BLAS ahead of MLX)

import mlx.core as mx  # noqa: E402  (isort: skip)

from dlm.runtime.models.diffusion_gemma import sampling as S  # noqa: E402
from dlm.runtime.models.diffusion_gemma import scores as V  # noqa: E402
from dlm.runtime.models.diffusion_gemma.model import softcap  # noqa: E402
from scripts.bench import harness  # noqa: E402


@mx.compile
def _before_score(logits, t):
    proc = logits / t
    return proc, mx.argmax(proc, axis=-1).astype(mx.int32), S.token_entropy(proc)


def before(raw, t, key):
    logits = mx.tanh(raw.astype(mx.float32) / 30.0) * 30.0
    proc, argmax, entropy = _before_score(logits, t)
    draw = mx.random.categorical(proc, axis=-1, key=key)
    return [argmax, entropy, draw, mx.softmax(proc, axis=-1)]


def after(raw, t, key, path="mlx"):
    os.environ["DLM_CPU_VOCAB"] = path  # cpu_vocab.py's switch: MLX's ops or numpy's loops
    s = V.score(softcap(raw, 30.0), t)
    draw = V.sample(s, 1.0, mx.random.uniform(shape=s.argmax.shape, key=key))
    return [s.argmax, s.entropy, draw, s.probs]


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--hidden", type=int, default=2816)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    mx.random.seed(0)
    embedding = mx.random.normal((a.vocab, a.hidden)) * 0.02
    h = mx.random.normal((1, a.positions, a.hidden))
    raw = h @ embedding.T * 40.0  # logits of a realistic spread before the softcap
    probs = mx.softmax(raw, axis=-1)
    mx.eval(embedding, h, raw, probs)
    t = mx.array(0.6, dtype=mx.float32)
    pieces = {
        "before: softcap, scores, Gumbel draw, softmax (1 stream)": lambda k: before(raw, t, k),
        "after: softcap, scores.py pass, inverse-CDF draw (split)": lambda k: after(raw, t, k),
        "numpy: the same, softcap and pass through cpu_vocab.py": lambda k: after(raw, t, k, "numpy"),
        "head product [L, H] @ [H, V]": lambda k: [h @ embedding.T],
        "self-conditioning product [L, V] @ [V, H]": lambda k: [probs @ embedding],
    }
    # The first round warms up; round r draws with key r.
    times = harness.interleave(pieces, a.repeats, warmup=1,
                               run=lambda fn, r: harness.seconds(lambda: fn(mx.random.key(r))))
    old, new = before(raw, t, mx.random.key(0)), after(raw, t, mx.random.key(0))
    fast = after(raw, t, mx.random.key(0), "numpy")
    same_argmax = bool(mx.all(old[0] == new[0]).item() and mx.all(fast[0] == new[0]).item())
    entropy_diff = max(mx.max(mx.abs(old[1] - new[1])).item(), mx.max(mx.abs(fast[1] - new[1])).item())
    rows = {}
    for name, ts in times.items():
        ms = harness.spread(ts, "ms")
        rows[name] = dict(ms=ms["median_ms"], range=ms["range_ms"])
        print(f"{name:60s} {rows[name]['ms']:9.1f} ms [{ms['range_ms'][0]:.1f}-{ms['range_ms'][1]:.1f}]")
    names = list(pieces)
    ratio = rows[names[0]]["ms"] / rows[names[1]]["ms"]
    numpy_ratio = rows[names[1]]["ms"] / rows[names[2]]["ms"]
    print(f"before / after: {ratio:.2f}x; after / numpy: {numpy_ratio:.2f}x; argmax identical: {same_argmax}; "
          f"max |entropy diff| {entropy_diff:.2e}")
    assert same_argmax and entropy_diff < 1e-3
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(shape=[a.positions, a.vocab, a.hidden], pieces=rows, ratio=ratio, numpy_ratio=numpy_ratio),
                      f, indent=2)


if __name__ == "__main__":
    main()

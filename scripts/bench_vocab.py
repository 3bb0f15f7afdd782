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

    .venv/bin/python -m scripts.bench_vocab                       # the released geometry: 256 x 262144, hidden 2816
    .venv/bin/python -m scripts.bench_vocab --positions 64 --vocab 32768 --hidden 512 --repeats 5

Prints the median [min-max] ms of each, and checks that both paths give the same
argmax and entropies within 1e-3 (the draws differ by construction: other
random numbers, the same distribution; tests/diffusion_gemma/test_scores.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from dlm.runtime import blas  # noqa: F401  (the optimized BLAS ahead of MLX)

import mlx.core as mx  # noqa: E402  (isort: skip)

from dlm.runtime.models.diffusion_gemma import sampling as S  # noqa: E402
from dlm.runtime.models.diffusion_gemma import scores as V  # noqa: E402
from dlm.runtime.models.diffusion_gemma.model import softcap  # noqa: E402


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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    times = {name: [] for name in pieces}
    for r in range(a.repeats + 1):  # the first round warms up
        for name, fn in pieces.items():
            start = time.perf_counter()
            mx.eval(fn(mx.random.key(r)))
            if r:
                times[name].append(time.perf_counter() - start)
    old, new = before(raw, t, mx.random.key(0)), after(raw, t, mx.random.key(0))
    fast = after(raw, t, mx.random.key(0), "numpy")
    same_argmax = bool(mx.all(old[0] == new[0]).item() and mx.all(fast[0] == new[0]).item())
    entropy_diff = max(mx.max(mx.abs(old[1] - new[1])).item(), mx.max(mx.abs(fast[1] - new[1])).item())
    rows = {}
    for name, ts in times.items():
        ms = [1000 * x for x in ts]
        rows[name] = dict(ms=statistics.median(ms), range=[min(ms), max(ms)])
        print(f"{name:60s} {rows[name]['ms']:9.1f} ms [{min(ms):.1f}-{max(ms):.1f}]")
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

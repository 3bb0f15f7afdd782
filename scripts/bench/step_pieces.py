"""Where a DiffusionGemma denoising step's time goes (not a test).

Runs the pieces of one steady-state step (a step with self-conditioning, as
every step after a canvas's first is) on a loaded model, each evaluated on its
own with its inputs already computed, in the form the runtime runs them
(compiled ends, CPU-stream splits, per-call dequantization):

* the decoder's input: the self-conditioning product (softmax @ embedding) and block;
* each decoder layer (attention over the prefix cache, router, experts, dense MLP);
* the head product ([L, H] @ [H, V]) and the softcap;
* the vocabulary pass (scores.py: proc, argmax, entropy, the softmax);
* the draw, the entropy-bound acceptance and the renoising.

The pieces' sum is a little more than a pipelined step (each piece here waits
for its own evaluation). Used by ``scripts.bench.runtime --pieces``; alone:

    .venv/bin/python -m scripts.bench.step_pieces --model .bench/release2L-f32
"""

from __future__ import annotations

import statistics

from dlm.runtime import api  # noqa: F401  (the optimized BLAS ahead of MLX)

import mlx.core as mx  # noqa: E402  (isort: skip)

from dlm.runtime.models.diffusion_gemma import scores as V  # noqa: E402
from dlm.runtime.models.diffusion_gemma.canvas import RandomDraws, _entropy_bound_step  # noqa: E402
from dlm.runtime.models.diffusion_gemma.model import softcap  # noqa: E402
from scripts.bench import harness  # noqa: E402


def _time(fn, repeats: int) -> tuple[float, object]:
    """The median seconds of ``fn()`` after a warm-up (compilation, first touch), and its result."""
    times, out = harness.repeat(fn, repeats)
    return statistics.median(times), out


def _fields(s: V.Scores) -> list[mx.array]:
    return [s.argmax, s.entropy, s.probs, s.total]


def pieces(loaded, prompt_ids: list[int], repeats: int = 2) -> dict[str, float]:
    """Seconds per piece of one steady-state step (median of ``repeats``)."""
    model, args = loaded.model, loaded.args
    dec = model.model.decoder
    ends = dec.ends(model.compile)
    cache = model.make_cache()
    model.prefill(prompt_ids, cache)
    length = args.canvas_length
    draws = RandomDraws(args.vocab_size, 0)
    canvas = draws.canvas((1, length))
    sc_probs = mx.softmax(mx.random.normal((1, length, args.vocab_size), key=mx.random.key(1)) * 4, axis=-1)
    mx.eval(canvas, sc_probs)
    offset = mx.array(cache[0].offset, dtype=mx.int32) if model.compile else cache[0].offset
    out: dict[str, float] = {}
    out["self-conditioning input"], h = _time(lambda: ends.inputs_probs(canvas, sc_probs), repeats)
    for i, layer in enumerate(dec.layers):
        out[f"decoder layer {i}"], h = _time(
            lambda layer=layer, i=i, h=h: layer(h, cache[i], offset, False, compiled=model.compile), repeats)
    out["head product"], raw = _time(lambda: dec.project(h), repeats)
    out["softcap"], logits = _time(lambda: softcap(raw, dec.softcap), repeats)
    t = mx.array(0.6, dtype=mx.float32)
    out["vocabulary pass (scores)"], parts = _time(lambda: _fields(V.score(logits, t)), repeats)
    s = V.Scores(logits, t, *parts)

    def draw_accept_renoise():
        sample = draws.sample(s, 1.0)
        noise = draws.canvas(canvas.shape)
        return _entropy_bound_step(s.entropy, sample, noise, 0.1)

    out["draw, accept, renoise"], _ = _time(draw_accept_renoise, repeats)
    return out


def report(loaded, prompt_ids: list[int], repeats: int = 2) -> dict:
    parts = pieces(loaded, prompt_ids, repeats)
    total = sum(parts.values())
    return {"seconds": parts, "total": total, "share": {k: v / total for k, v in parts.items()}}


def format_report(rep: dict) -> str:
    return "; ".join(f"{k} {v * 1000:.0f} ms ({rep['share'][k]:.0%})" for k, v in rep["seconds"].items()) + \
        f"; sum {rep['total'] * 1000:.0f} ms"


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--model", required=True, help="a converted DiffusionGemma directory")
    ap.add_argument("--prompt-tokens", type=int, default=45)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    loaded = api.load(a.model)
    ids = [2] + [(37 * i + 11) % 90 + 110 for i in range(a.prompt_tokens - 1)]
    print(format_report(report(loaded, ids, a.repeats)))


if __name__ == "__main__":
    main()

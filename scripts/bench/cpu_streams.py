"""Quantized kernels on MLX's CPU backend: one stream vs the rows split over
one stream per core (dlm.runtime.models.cpu.streams), side by side (not a test).

    .venv/bin/python -m scripts.bench.cpu_streams [--repeats 3] [--experts 32] [--vocab 8192]

* experts: ``QuantizedSwitchLinear`` (4-bit affine, g64) at the released
  DiffusionGemma expert shape (2816 -> 2 x 704, ``--experts`` of the 128), on the
  sorted token copies of one 256-token canvas, top-8;
* head: an 8-bit tied head (``QuantizedEmbedding.as_linear``, the mixed recipe's
  head precision) over 256 canvas rows, at a ``--vocab`` slice of the vocabulary
  (the time scales linearly with it: x32 for the released 262144).

Interleaved repeats, median [min-max]; the outputs are compared bit for bit.
"""

from __future__ import annotations

import argparse
import statistics

import dlm.runtime  # noqa: F401  (the optimized BLAS, before MLX)
from scripts.bench import harness


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args()
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    from dlm.runtime.models.cpu import streams as cpu_streams
    from dlm.runtime.models.switch import SwitchLinear

    streams = cpu_streams.cpu_streams()
    rng = np.random.default_rng(0)
    E, H, M, tokens, k = args.experts, 2816, 704, 256, 8
    layer = SwitchLinear(H, 2 * M, E)
    layer.weight = mx.array(rng.normal(size=(E, 2 * M, H)).astype(np.float32) * 0.02)
    experts = layer.to_quantized(group_size=64, bits=4)
    ids = np.sort(rng.integers(0, E, size=tokens * k)).astype(np.uint32)
    x = mx.array(rng.normal(size=(tokens * k, 1, H)).astype(np.float32))
    idx = mx.array(ids)
    emb = nn.Embedding(args.vocab, H)
    emb.weight = mx.array(rng.normal(size=(args.vocab, H)).astype(np.float32) * 0.02)
    head = nn.QuantizedEmbedding.from_embedding(emb, group_size=64, bits=8)
    h = mx.array(rng.normal(size=(tokens, H)).astype(np.float32))
    mx.eval(experts.parameters(), head.parameters(), x, h)

    cases = {
        "experts": lambda: experts(x, idx, True),
        "head": lambda: cpu_streams.split_positions(head.as_linear, h) if cpu_streams.parallel() else head.as_linear(h),
    }
    print(f"CPU streams: {len(streams)} (one per core; DLM_CPU_STREAMS overrides)")
    for name, fn in cases.items():
        outs = {}

        def on(n, fn=fn, outs=outs) -> float:  # the seconds of fn on n streams
            saved = list(streams)  # the thread's own list (cpu_streams.cpu_streams()), cut in place
            if n == 1:  # one stream: parallel() is off
                streams[:] = saved[:1]
            t, outs[n] = harness.timed(fn)
            streams[:] = saved
            return t

        times = harness.interleave({n: (lambda n=n: on(n)) for n in (1, len(streams))}, args.repeats, warmup=1,
                                   run=harness.returned)  # the first round warms up
        same = all(mx.array_equal(outs[1], o).item() for o in outs.values())
        row = [f"{n} stream(s) {harness.spread_text(ts)}" for n, ts in times.items()]
        ratio = statistics.median(times[1]) / statistics.median(times[len(streams)])
        print(f"{name}: " + " | ".join(row) + f" | {ratio:.2f}x | bit-identical: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

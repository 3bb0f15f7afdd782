"""Quantized kernels on MLX's CPU backend: one stream vs the rows split over
one stream per core (dlm.runtime.models.cpu_streams), side by side (not a test).

    .venv/bin/python -m scripts.bench_cpu_streams [--repeats 3] [--experts 32] [--vocab 8192]

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
import time

import dlm.runtime  # noqa: F401  (the optimized BLAS, before MLX)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args()
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    from dlm.runtime.models import cpu_streams
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
        times = {1: [], len(streams): []}
        outs = {}
        for _ in range(args.repeats + 1):  # the first round warms up
            for n in times:
                saved = list(cpu_streams._streams)
                if n == 1:  # one stream: parallel() is off (an empty list would be refilled)
                    cpu_streams._streams[:] = saved[:1]
                start = time.perf_counter()
                out = fn()
                mx.eval(out)
                times[n].append(time.perf_counter() - start)
                cpu_streams._streams[:] = saved
                outs[n] = out
        same = all(mx.array_equal(outs[1], o).item() for o in outs.values())
        row = []
        for n, ts in times.items():
            ts = ts[1:]
            row.append(f"{n} stream(s) {statistics.median(ts):.3f} s [{min(ts):.3f}-{max(ts):.3f}]")
        ratio = statistics.median(times[1][1:]) / statistics.median(times[len(streams)][1:])
        print(f"{name}: " + " | ".join(row) + f" | {ratio:.2f}x | bit-identical: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The routed experts of a batch at the released DiffusionGemma geometry on the
MLX CPU backend (not a test): B canvases through one ``Experts`` call (the batch
path: float experts run ``cpu/experts.by_count``, the canvases' groups of one copy
count in one op, an expert's groups adjacent, so where they share a count its
weight is read once for them; experts dequantized per call run
``cpu/experts.by_expert``, expert by expert across the canvases, each dequantized
once for all of them) against the same B canvases one call each. The two give
the same bits, checked.

One decoder layer's experts: 128 experts top-8, hidden 2816 -> 704, 256 token
positions a canvas, random weights and routing; float32 (the layer's experts
are 3 GB, 24 MB an expert) and 4-bit dequantized per call (how the released
model runs on the CPU when its float32 weights do not fit). Interleaved
repeats, medians [min-max]:

    .venv/bin/python -m scripts.bench.batch_experts [--batch 4] [--repeats 3] [--dtypes f32 q4]

``--llada2``: why a float32 LLaDA2.0-mini batch shares nothing here: one projection's ``gather_mm`` at
its released expert shape (256 experts of 2048 -> 512, top-8) over one 32-position block's token copies
and over the batch's, sorted by expert; and the head (vocab 157184) per block, whole and cut into 32 MB
vocabulary slices (each slice's batch of GEMMs reading it once).
"""

from __future__ import annotations

import json

from scripts.bench import harness
from scripts.bench.experts import RELEASED, quantize_experts, random_params


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", nargs="+", default=["f32", "q4"], choices=["f32", "q4"])
    harness.add_options(ap, "json")
    ap.add_argument("--llada2", action="store_true", help="the LLaDA2.0-mini probes instead")
    a = ap.parse_args()
    if a.llada2:
        return llada2(a.batch, a.repeats)

    from dlm.runtime.platform import blas  # first: loads the optimized BLAS ahead of MLX

    import mlx.core as mx
    import numpy as np

    from dlm.runtime.models.cpu import experts as cpu_experts
    from dlm.runtime.models.diffusion_gemma import ModelArgs
    from dlm.runtime.models.diffusion_gemma.layers import Experts

    mx.set_default_device(mx.cpu)
    args = ModelArgs.from_config(dict(RELEASED, num_hidden_layers=1, vocab_size=4096))
    B, L, E, K = a.batch, args.canvas_length, args.num_experts, args.top_k_experts
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((B * L, args.hidden_size)).astype(np.float32))
    idx = mx.array(np.argsort(-rng.standard_normal((B * L, E)), axis=1)[:, :K].astype(np.int32))
    w = mx.softmax(mx.array(rng.standard_normal((B * L, K)).astype(np.float32)), axis=-1)
    rows = [slice(s * L, (s + 1) * L) for s in range(B)]
    results = {}
    for dtype in a.dtypes:
        experts = Experts(args)
        random_params(experts)
        if dtype == "q4":
            quantize_experts(experts)
        layers = experts.gate_up_proj, experts.down_proj
        assert cpu_experts.stacks(*layers) or cpu_experts.grouped(L * K, E, *layers), "not the CPU's grouped kernels"

        def together():
            return experts(x, idx, w, sequences=B)

        def apart():
            return mx.concatenate([experts(x[r], idx[r], w[r]) for r in rows])

        same = bool(mx.array_equal(together(), apart()))
        runs = harness.interleave({"apart": apart, "together": together}, a.repeats)
        row = {name: harness.spread(t) for name, t in runs.items()}
        row["speedup"] = row["apart"]["median_s"] / row["together"]["median_s"]
        row["bitwise_equal"] = same
        results[dtype] = row
        p, t = row["apart"], row["together"]
        print(f"{dtype}: {B} canvases one call each {p['median_s']:.2f} s [{p['range_s'][0]:.2f}-{p['range_s'][1]:.2f}]"
              f" | one batched call {t['median_s']:.2f} s [{t['range_s'][0]:.2f}-{t['range_s'][1]:.2f}]"
              f" | {row['speedup']:.2f}x | same bits: {same}", flush=True)
        del experts
    meta = {"command": harness.command(), "mlx": mx.__version__, "blas": blas.STATUS, "batch": B, "repeats": a.repeats}
    harness.finish(meta, results, a.json)


def llada2(batch: int, repeats: int) -> None:
    from dlm.runtime.platform import blas  # first: loads the optimized BLAS ahead of MLX

    import mlx.core as mx
    import numpy as np

    mx.set_default_device(mx.cpu)
    E, H, inter, V, L, K = 256, 2048, 512, 157184, 32, 8
    rng = np.random.default_rng(0)

    def timed(fn):
        return harness.spread_text(harness.repeat(fn, repeats, warmup=0)[0])

    w = mx.random.normal((E, inter, H)) * 0.02
    for b in (1, batch):
        ids = np.sort(np.concatenate([np.argsort(-rng.standard_normal((L, E)), axis=1)[:, :K].ravel()
                                      for _ in range(b)]))
        x, idx = mx.random.normal((b * L * K, 1, H)), mx.array(ids.astype(np.uint32))
        mx.eval(w, x, idx)
        print(f"gather_mm, {b} block(s): {b * L * K} copies sorted by expert: "
              f"{timed(lambda: mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=True))}")
    del w
    head, s = mx.random.normal((V, H)) * 0.02, (32 << 20) // (4 * H)
    for b in (1, batch):
        x = mx.random.normal((b, L, H))
        mx.eval(head, x)
        whole = timed(lambda: x @ mx.broadcast_to(head.T, (b, H, V)))
        sliced = timed(lambda: mx.concatenate(
            [x @ mx.broadcast_to(head[a:a + s].T, (b, H, min(s, V - a))) for a in range(0, V, s)], axis=-1))
        print(f"head, {b} block(s), one GEMM per block: whole {whole} | in 32 MB vocabulary slices {sliced}")
    print(json.dumps({"blas": blas.STATUS, "mlx": mx.__version__, "batch": batch, "repeats": repeats}))


if __name__ == "__main__":
    main()

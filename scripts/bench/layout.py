"""The CPU backend's weight layout (runtime/models/cpu/layout.py), not a test: the
same products with the weight stored [out, in] (the checkpoint's order) and
[in, out] (``layout.relaid``), interleaved in one process, random float32
weights at the released shapes, medians; each pair also checked bit for bit.

* head: LLaDA2.0-mini's untied head, [rows, 2048] @ [2048, 157184], at the rows
  of a 32-position block as its masks go (32 down to 1);
* tied head: DiffusionGemma's [256, 2816] @ [2816, 262144] (a control: the
  embedding is not relaid, and at 256 rows the order does not matter);
* experts: one routed-experts call on a block's (LLaDA2.0-mini ``SwitchGLU``,
  256 experts top-8: ~1 token copy an expert) or a canvas's (DiffusionGemma
  ``Experts``, 128 experts top-8: ~16 copies an expert; a control, not relaid)
  token copies, through ``cpu/experts.by_count``.

    .venv/bin/python -m scripts.bench.layout [--repeats 7] [--json out.json]
"""

from __future__ import annotations

from scripts.bench import harness
from scripts.bench.experts import RELEASED, random_params


def pair(name: str, native, relaid, repeats: int) -> dict:
    """Time ``native()`` and ``relaid()`` interleaved; check their bits."""
    import mlx.core as mx

    a, b = native(), relaid()
    mx.eval(a, b)
    same = bool(mx.array_equal(a, b))
    runs = harness.interleave({"native": native, "relaid": relaid}, repeats)
    row = {k: harness.spread(t) for k, t in runs.items()}
    row["speedup"] = row["native"]["median_s"] / row["relaid"]["median_s"]
    row["bitwise_equal"] = same
    print(f"{name:28s} | [out, in] {1e3 * row['native']['median_s']:8.1f} ms | [in, out] "
          f"{1e3 * row['relaid']['median_s']:8.1f} ms | {row['speedup']:.2f}x | same bits: {same}", flush=True)
    return row


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--repeats", type=int, default=7)
    harness.add_options(ap, "json")
    a = ap.parse_args()

    from dlm.runtime.platform import blas  # first: loads the optimized BLAS ahead of MLX

    import mlx.core as mx
    import numpy as np

    from dlm.runtime.models.diffusion_gemma import ModelArgs
    from dlm.runtime.models.diffusion_gemma.layers import Experts
    from dlm.runtime.models.cpu.layout import relaid
    from dlm.runtime.models.llada2_moe.model import SwitchGLU

    mx.set_default_device(mx.cpu)
    rng = np.random.default_rng(0)
    results = {}

    w = 0.02 * mx.random.normal((157184, 2048))
    mx.eval(w)
    v = relaid(w)
    for rows in (32, 16, 8, 1):
        x = mx.array(rng.standard_normal((1, rows, 2048)).astype(np.float32))
        results[f"head_{rows}"] = pair(f"head, {rows} rows", lambda: x @ w.T, lambda: x @ v.T, a.repeats)
    del w, v

    w = 0.02 * mx.random.normal((262144, 2816))
    mx.eval(w)
    v = relaid(w)
    x = mx.array(rng.standard_normal((1, 256, 2816)).astype(np.float32))
    results["tied_head_256"] = pair("tied head, 256 rows", lambda: x @ w.T, lambda: x @ v.T, a.repeats)
    del w, v

    def experts_pair(name, module, projections, rows, experts, call):
        random_params(module)
        x = mx.array(rng.standard_normal((rows, projections[0]["weight"].shape[-1])).astype(np.float32))
        idx = mx.array(np.argsort(-rng.standard_normal((rows, experts)), axis=1)[:, :8].astype(np.int32))
        native = [p["weight"] for p in projections]
        laid = [relaid(wt) for wt in native]

        def run(weights):
            def fn():
                for p, wt in zip(projections, weights):
                    p.weight = wt
                return call(module, x, idx)
            return fn

        return pair(name, run(native), run(laid), a.repeats)

    glu = SwitchGLU(2048, 512, 256)
    results["experts_llada2"] = experts_pair(
        "LLaDA2.0-mini experts, block", glu, [glu.gate_proj, glu.up_proj, glu.down_proj], 32, 256,
        lambda m, x, idx: m(x, idx))
    del glu
    args = ModelArgs.from_config(dict(RELEASED, num_hidden_layers=1, vocab_size=4096))
    experts = Experts(args)
    weights = mx.softmax(mx.array(rng.standard_normal((256, 8)).astype(np.float32)), axis=-1)
    results["experts_dg"] = experts_pair(
        "DiffusionGemma experts, canvas", experts, [experts.gate_up_proj, experts.down_proj], 256, 128,
        lambda m, x, idx: m(x, idx, weights))

    meta = {"command": harness.command(), "mlx": mx.__version__, "blas": blas.STATUS, "repeats": a.repeats}
    harness.finish(meta, results, a.json)


if __name__ == "__main__":
    main()

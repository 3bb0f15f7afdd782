"""Routed experts on the MLX CPU backend, at the released expert shapes (not a
test): dlm's CPU default for float experts (``cpu/experts.by_count``: one GEMM per
expert, the experts with as many token copies stacked in one ``gather_mm``)
against one matmul op per expert (``by_expert``, the default before it;
DLM_CPU_EXPERTS=each) and gather_mm over the copies sorted by expert (mlx-lm's
and mlx-vlm's kernel; DLM_CPU_EXPERTS=gather).

Measured side by side in one process, the kernels interleaved:

* kernel: one DiffusionGemma ``Experts`` call, 128 experts top-8, hidden
  2816 -> 704, on the token copies of one 256-token canvas, float32 (random
  weights);
* llada2: one LLaDA2.0-mini ``SwitchGLU`` call, 256 experts top-8, hidden
  2048 -> 512, on one 32-position block's token copies;
* step: one DiffusionGemma decoder pass (canvas 256 over a 64-token prefix) of
  a model with the released text geometry but ``--layers`` layers and a
  ``--vocab`` vocabulary (random weights; the full vocabulary's head is timed
  by scripts/bench/runtime.py).
* kernel q4 (``--q4``): the kernel's experts in 4 bits, dequantized per call,
  which run ``by_expert`` (dequantizing one expert at a time, the experts taking
  turns on the CPU streams) in both non-gather modes: by_count's stacked
  dequantization measured slower (2.29 vs 1.56 s, a /tmp probe); gather: MLX's
  single-threaded quantized kernel, split over the CPU streams.

    .venv/bin/python -m scripts.bench.experts [--repeats 5] [--layers 2] [--json out.json]
"""

from __future__ import annotations

import functools
import os

from scripts.bench import harness

RELEASED = dict(
    model_type="diffusion_gemma_text", hidden_size=2816, intermediate_size=2112, num_attention_heads=16,
    num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2,
    sliding_window=1024, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
    max_position_embeddings=262144, canvas_length=256,
)


def timed(fn, mode: str) -> float:
    """The seconds of ``fn()`` (evaluated) on ``mode``'s kernel."""
    os.environ["DLM_CPU_EXPERTS"] = MODES[mode]
    return harness.seconds(fn)


def random_params(module, seed: int = 0):
    """Random weights at a sane scale for every float parameter of ``module``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    mx.random.seed(seed)
    params = []
    for name, value in tree_flatten(module.parameters()):
        if name.endswith(("norm.weight", "scale", "layer_scalar")):
            params.append((name, mx.ones(value.shape) + 0.1 * mx.random.normal(value.shape)))
        else:
            params.append((name, 0.02 * mx.random.normal(value.shape)))
    module.load_weights(params)
    mx.eval(module.parameters())


def quantize_experts(experts) -> None:
    """A DiffusionGemma ``Experts``' projections in 4 bits (affine, g64), dequantized per call
    (dlm.runtime.models.cpu.dequant), as the released model runs on a 24 GB machine's CPU."""
    import mlx.core as mx

    from dlm.runtime.models.cpu import dequant

    experts.gate_up_proj = experts.gate_up_proj.to_quantized(group_size=64, bits=4)
    experts.down_proj = experts.down_proj.to_quantized(group_size=64, bits=4)
    dequant.mark(experts)
    mx.eval(experts.parameters())


MODES = {"gather": "gather", "each": "each", "by_count": ""}  # name -> DLM_CPU_EXPERTS


def bench(name: str, fn, repeats: int) -> dict:
    """``fn(mode)`` (seconds) in every mode, interleaved, after a warm-up round (it traces the
    compiled pieces of each path once)."""
    runs = harness.interleave({mode: functools.partial(fn, mode) for mode in MODES}, repeats, warmup=1,
                              run=harness.returned)
    row = {mode: harness.spread(t) for mode, t in runs.items()}
    best = row["by_count"]["median_s"]
    row["speedup"] = {mode: row[mode]["median_s"] / best for mode in ("gather", "each")}
    line = f"{name:7s}"
    for mode in MODES:
        m = row[mode]
        line += f" | {mode} {1e3 * m['median_s']:8.1f} ms [{1e3 * m['range_s'][0]:.0f}-{1e3 * m['range_s'][1]:.0f}]"
    print(line + "".join(f" | by_count vs {mode} {x:.2f}x" for mode, x in row["speedup"].items()), flush=True)
    return row


def compare(fn) -> float:
    """The largest difference of ``fn()`` between the kernels."""
    import mlx.core as mx

    outs = []
    for env in MODES.values():
        os.environ["DLM_CPU_EXPERTS"] = env
        outs.append(fn())
    return max(float(mx.abs(o - outs[0]).max()) for o in outs[1:])


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    harness.add_options(ap, "json")
    ap.add_argument("--q4", action="store_true",
                    help="also the kernel in 4 bits dequantized per call (gather: MLX's quantized kernel)")
    a = ap.parse_args()

    from dlm.runtime.platform import blas  # first: loads the optimized BLAS ahead of MLX

    import mlx.core as mx
    import numpy as np

    from dlm.runtime.models.diffusion_gemma import Model, ModelArgs
    from dlm.runtime.models.diffusion_gemma.layers import Experts
    from dlm.runtime.models.llada2_moe.model import SwitchGLU

    mx.set_default_device(mx.cpu)
    args = ModelArgs.from_config(dict(RELEASED, num_hidden_layers=a.layers, vocab_size=a.vocab))
    results = {}

    experts = Experts(args)
    random_params(experts)
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((256, args.hidden_size)).astype(np.float32))
    idx = mx.array(np.argsort(-rng.standard_normal((256, args.num_experts)), axis=1)[:, :8].astype(np.int32))
    w = mx.softmax(mx.array(rng.standard_normal((256, 8)).astype(np.float32)), axis=-1)
    diff = compare(lambda: experts(x, idx, w))
    print(f"kernel: max difference between the kernels {diff:.2e}")
    results["kernel"] = bench("kernel", lambda mode: timed(lambda: experts(x, idx, w), mode), a.repeats)
    results["kernel"]["max_abs_diff"] = diff
    if a.q4:  # the same experts in 4 bits, dequantized per call (the released model on a 24 GB machine)
        quantize_experts(experts)
        diff = compare(lambda: experts(x, idx, w))
        print(f"kernel q4: max difference between the kernels {diff:.2e}")
        results["kernel_q4"] = bench("kernel q4", lambda mode: timed(lambda: experts(x, idx, w), mode), a.repeats)
        results["kernel_q4"]["max_abs_diff"] = diff
    del experts

    glu = SwitchGLU(2048, 512, 256)  # LLaDA2.0-mini's routed experts
    random_params(glu)
    x = mx.array(rng.standard_normal((32, 2048)).astype(np.float32))
    idx = mx.array(np.argsort(-rng.standard_normal((32, 256)), axis=1)[:, :8].astype(np.int32))
    diff = compare(lambda: glu(x, idx))
    print(f"llada2: max difference between the kernels {diff:.2e}")
    results["llada2"] = bench("llada2", lambda mode: timed(lambda: glu(x, idx), mode), a.repeats)
    results["llada2"]["max_abs_diff"] = diff
    del glu

    model = Model(args)
    random_params(model)
    cache = model.make_cache()
    model.prefill(list(range(3, 67)), cache)
    canvas = mx.array(np.arange(256, dtype=np.int32) % a.vocab)

    pieces = {}  # each path keeps its own compiled pieces (traced once, in the warm-up)
    for mode in MODES:
        os.environ["DLM_CPU_EXPERTS"] = MODES[mode]
        for layer in model.layers:
            object.__setattr__(layer, "_compiled", None)
        pieces[mode] = [layer.compiled() for layer in model.layers]

    def step(mode):
        for layer, compiled in zip(model.layers, pieces[mode]):
            object.__setattr__(layer, "_compiled", compiled)
        return timed(lambda: model.decode(canvas, cache), mode)

    results["step"] = bench(f"step x{a.layers}", step, a.repeats)
    meta = {"command": harness.command(), "mlx": mx.__version__, "blas": blas.STATUS, "layers": a.layers,
            "vocab": a.vocab, "repeats": a.repeats}
    harness.finish(meta, results, a.json)


if __name__ == "__main__":
    main()

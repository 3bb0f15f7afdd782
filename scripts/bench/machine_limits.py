"""This machine's limits for a DiffusionGemma denoising step, and the step's bound (not a test).

``measure(loaded)`` times, on the MLX device in use, each kind of matrix
product one decoder pass over the canvas runs, at the loaded model's own
shapes and in the form the runtime holds each weight (float32 or bfloat16
``matmul``; ``quantized_matmul`` / ``gather_qmm`` at the stored bits when the
weight stayed quantized, split by rows over the CPU streams as the runtime
runs them: runtime/models/cpu/streams.py), plus the memory bandwidth one MLX op streams at.
``step_bound(loaded, rates)`` then adds up the step's matrix-product FLOPs
per piece (attention projections, dense MLP, router, routed experts, the
tied head over the vocabulary and the self-conditioning product with the
embedding, attention scores over prefix + canvas) and divides each piece by
its measured rate: the time a step would take if it did nothing but those
products at this machine's speed. ``scripts.bench.runtime --limits`` prints it
beside the measured step (dlm's step as a multiple of the bound).

The bound leaves out the element-wise work over the [canvas, vocab] logits
(softcap, softmax, entropy, the draw: ``bytes_per_vocab_pass`` gives what one
pass over them moves, to set against the bandwidth).

    .venv/bin/python -m scripts.bench.machine_limits --model .bench/small-f32
    .venv/bin/python -m scripts.bench.machine_limits --model MODEL --steps 2   # + one timed step against its bound
    .venv/bin/python -m scripts.bench.machine_limits --model MODEL --rates '{"dense float32": 50}'

``--rates`` (GFLOP/s per kind of product, keyed as ``measure`` keys them) measures nothing: it
prints the step's FLOPs per piece and the bound at those rates.
"""

from __future__ import annotations

import json

import dlm.runtime  # noqa: F401  (loads the optimized BLAS before MLX: dlm.runtime.platform.blas)
import mlx.core as mx
from mlx.utils import tree_flatten

from dlm.runtime.models.cpu.streams import split_rows
from scripts.bench import harness

ROWS_CAP = 8192  # output rows timed per product: rates do not depend on N beyond this


def _time(fn, repeats: int) -> float:
    return harness.median_seconds(fn, repeats)  # after a warm-up (and any lazy weights)


def bandwidth_gbs(gb: float = 0.5, repeats: int = 3) -> dict:
    """GB/s that one MLX reduction reads and one MLX copy moves (read + write),
    each one op on one thread, and ``host_read``: what the cores read together
    (numpy sums, one thread a core; numpy's loops let go of the GIL). On this
    project's 2-core machine: ~4.7 GB/s for the MLX op, ~30 for the cores (the
    bound for weights that several threads stream, as OpenBLAS's do)."""
    import threading

    import numpy as np

    from dlm.runtime.models.cpu.streams import cores

    a = mx.random.uniform(shape=(int(gb * 1e9) // 4,))
    mx.eval(a)
    read = a.nbytes / _time(lambda: a.sum(), repeats) / 1e9
    copy = 2 * a.nbytes / _time(lambda: a * 1.5, repeats) / 1e9
    host = np.array(a)
    parts = np.array_split(host, cores())

    def together():
        threads = [threading.Thread(target=np.sum, args=(part,)) for part in parts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    host_read = host.nbytes / _time(together, repeats) / 1e9
    return {"read": round(read, 2), "copy": round(copy, 2), "host_read": round(host_read, 2)}


def _weights(loaded) -> dict[str, dict]:
    """Decoder matrices as held: ``{path: {shape (out, in) or (E, out, in), bits or dtype}}``."""
    params = dict(tree_flatten(loaded.model.parameters()))
    group = int((loaded.config.get("quantization") or {}).get("group_size", 64))
    out = {}
    for path, w in params.items():
        if not path.startswith("model.decoder.") or not path.endswith(".weight") or w.ndim < 2:
            continue
        base = path[: -len(".weight")]
        scales = params.get(base + ".scales")
        if scales is not None:
            in_dim = scales.shape[-1] * group
            bits = w.shape[-1] * 32 // in_dim
            out[base] = {"shape": tuple(w.shape[:-1]) + (in_dim,), "bits": int(bits), "group_size": group}
        else:
            out[base] = {"shape": tuple(w.shape), "dtype": w.dtype}
    return out


def _kind(info: dict) -> str:
    return f"q{info['bits']}" if "bits" in info else str(info["dtype"]).split(".")[-1]


def measure(loaded, repeats: int = 3) -> dict:
    """GFLOP/s per (piece kind, storage) at this model's shapes and canvas."""
    L = int(loaded.args.canvas_length)
    text = loaded.args
    k, E = int(text.top_k_experts), int(text.num_experts)
    rates: dict[str, float] = {}
    weights = _weights(loaded)
    # Each kind at its largest matrix (the pieces that dominate the step), capped at ROWS_CAP outputs.
    for path in sorted(weights, key=lambda p: -weights[p]["shape"][-2] * weights[p]["shape"][-1]):
        info = weights[path]
        expert = ".experts." in path
        key = ("experts " if expert else "dense ") + _kind(info)
        if key in rates:
            continue
        shape = info["shape"]
        n_out, n_in = min(shape[-2], ROWS_CAP), shape[-1]
        if expert:
            # The tokens routed to one expert: the grouped products the runtime runs.
            rows = max(1, L * k // E)
            x = mx.random.normal((L * k, n_in))
            if "bits" in info:
                flops = 2 * L * k * n_out * n_in
                w = mx.random.normal((E, n_out, n_in)) * 0.02
                wq, s, b = mx.quantize(w, group_size=info["group_size"], bits=info["bits"])
                idx = mx.sort(mx.random.randint(0, E, (L * k,)))
                fn = lambda: split_rows(lambda xx, ii: mx.gather_qmm(  # noqa: E731
                    xx[:, None], wq, s, b, rhs_indices=ii, transpose=True, group_size=info["group_size"],
                    bits=info["bits"], sorted_indices=True), x, idx)
            else:  # cpu/experts.by_count: one GEMM an expert, the experts stacked in one gather_mm
                n = min(E, 16)  # experts enough to stream from memory, not all of a layer's
                w = (mx.random.normal((n, n_out, n_in)) * 0.02).astype(info["dtype"])
                xe = x[: n * rows].reshape(n, rows, n_in).astype(info["dtype"])
                ids = mx.arange(n, dtype=mx.uint32)
                fn = lambda: mx.gather_mm(xe, w.swapaxes(-1, -2), rhs_indices=ids)  # noqa: E731
                flops = 2 * n * rows * n_out * n_in
        else:
            x = mx.random.normal((L, n_in))
            w = mx.random.normal((n_out, n_in)) * 0.02
            if "bits" in info:
                wq, s, b = mx.quantize(w, group_size=info["group_size"], bits=info["bits"])
                fn = lambda: split_rows(lambda xx: mx.quantized_matmul(  # noqa: E731
                    xx, wq, s, b, transpose=True, group_size=info["group_size"], bits=info["bits"]), x)
            else:
                w, xd = w.astype(info["dtype"]), x.astype(info["dtype"])
                fn = lambda: xd @ w.T  # noqa: E731
            flops = 2 * L * n_out * n_in
        rates[key] = round(flops / _time(fn, repeats) / 1e9, 2)
    return rates


def step_flops(loaded, prefix: int) -> dict[str, dict]:
    """``{piece: {"flops", "rate_key"}}`` of one decoder pass over the canvas after a ``prefix``-token prompt."""
    a = loaded.args
    L, k = int(a.canvas_length), int(a.top_k_experts)
    pieces: dict[str, dict] = {}

    def add(piece, flops, key):
        p = pieces.setdefault(piece, {"flops": 0, "rate_key": key})
        p["flops"] += flops

    for path, info in _weights(loaded).items():
        shape, kind = info["shape"], _kind(info)
        per_token = 2 * shape[-2] * shape[-1]
        if ".experts." in path:
            add("routed experts", L * k * per_token, "experts " + kind)
        elif path.endswith("embed_tokens"):
            # Tied: the head (hidden -> vocab) and self-conditioning's probabilities @ embedding.
            add("head over the vocab", L * per_token, "dense " + kind)
            add("self-conditioning @ embedding", L * per_token, "dense " + kind)
        elif ".self_attn." in path:
            add("attention projections", L * per_token, "dense " + kind)
        elif ".router." in path:
            add("router", L * per_token, "dense " + kind)
        else:
            add("dense MLPs", L * per_token, "dense " + kind)
    scores = 0
    window = int(getattr(a, "sliding_window", 0) or 0)
    for kind, hd in zip(a.layer_types, a.layer_head_dims):
        full = kind == "full_attention"
        ctx = prefix + L if full or not window else min(window, prefix + L)
        scores += 2 * 2 * L * int(a.num_attention_heads) * int(hd) * ctx  # QK^T and PV
    add("attention scores", scores, "dense float32")
    return pieces


def step_bound(loaded, rates: dict, prefix: int) -> dict:
    """Seconds per piece at the measured rates, and their sum."""
    out, total = {}, 0.0
    for piece, p in step_flops(loaded, prefix).items():
        rate = rates.get(p["rate_key"]) or rates.get("dense float32") or next(iter(rates.values()))
        s = p["flops"] / (rate * 1e9)
        out[piece] = {"gflop": round(p["flops"] / 1e9, 2), "rate": p["rate_key"], "seconds": round(s, 4)}
        total += s
    return {"pieces": out, "seconds": round(total, 4)}


def bytes_per_vocab_pass(loaded) -> int:
    """Bytes one float32 pass over the [canvas, vocab] logits reads."""
    return 4 * int(loaded.args.canvas_length) * int(loaded.args.vocab_size)


def report(loaded, prefix: int, repeats: int = 3) -> dict:
    rates = measure(loaded, repeats)
    return {"device": str(mx.default_device()), "bandwidth_gbs": bandwidth_gbs(repeats=repeats),
            "gflops": rates, "bound": step_bound(loaded, rates, prefix),
            "vocab_pass_gb": round(bytes_per_vocab_pass(loaded) / 1e9, 3)}


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--model", required=True, help="a converted DiffusionGemma directory")
    ap.add_argument("--prefix", type=int, default=45, help="prompt tokens before the canvas")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=0,
                    help="also time one generation of one canvas with this many denoising steps in the same process "
                         "(the step against the bound)")
    ap.add_argument("--rates", default=None,
                    help="GFLOP/s per kind of product as JSON, e.g. '{\"dense float32\": 50}': measure nothing, "
                         "print the step's FLOPs per piece and its bound at these rates")
    a = ap.parse_args()
    from dlm.runtime import api

    loaded = api.load(a.model)
    if a.rates is not None:
        rates = json.loads(a.rates)
        print(json.dumps({"flops": step_flops(loaded, a.prefix), "bound": step_bound(loaded, rates, a.prefix)},
                         indent=2))
        return
    out = report(loaded, a.prefix, a.repeats)
    if a.steps:
        from scripts.bench.runtime import run_dlm

        prompt = [2, 105] + [(37 * i + 11) % 90 + 110 for i in range(a.prefix - 5)] + [106, 10, 105]
        run = run_dlm(loaded, prompt, int(loaded.args.canvas_length), a.steps, 0)
        step_s = run["gen_seconds"] / run["steps"]
        out["step"] = {"seconds": round(step_s, 3), "forwards": run["steps"],
                       "over_bound": round(step_s / out["bound"]["seconds"], 3)}
    out["command"] = harness.command()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

"""Matmul throughput of MLX's CPU backend under each BLAS (not a test).

MLX's Linux CPU wheel bundles the reference BLAS; dlm.runtime loads an
optimized one ahead of it (dlm.runtime.blas). This measures, side by side in
one run, float32 matmul, bfloat16 matmul and the 4-bit quantized matmul at a
shape of the released DiffusionGemma head ([rows, hidden] @ [vocab, hidden]^T),
once per BLAS (each in a fresh interpreter: the BLAS is chosen before MLX
loads), interleaved, and prints GFLOP/s (median of the repeats).

    .venv/bin/python -m scripts.bench_blas                       # 64 x 2816 @ 32768 x 2816
    .venv/bin/python -m scripts.bench_blas --rows 256 --vocab 262144 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import dlm.runtime.blas as blas
import mlx.core as mx
rows, hidden, vocab, repeats = (int(a) for a in sys.argv[1:5])
x = mx.random.normal((rows, hidden)); w = mx.random.normal((vocab, hidden)) * 0.02
wq, s, b = mx.quantize(w, group_size=64, bits=4)
cases = {
    "f32 matmul": lambda: x @ w.T,
    "bf16 matmul": lambda: x.astype(mx.bfloat16) @ w.astype(mx.bfloat16).T,
    "q4 quantized_matmul": lambda: mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=4),
}
flops = 2 * rows * hidden * vocab
out = {"blas": blas.STATUS}
for name, fn in cases.items():
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter(); mx.eval(fn()); times.append(time.perf_counter() - t)
    out[name] = flops / sorted(times)[len(times) // 2] / 1e9
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64, help="canvas positions")
    ap.add_argument("--hidden", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds per BLAS")
    a = ap.parse_args()
    results: dict[str, list[dict]] = {"reference": [], "default": []}
    for _ in range(a.rounds):
        for mode in results:
            env = dict(os.environ, DLM_BLAS="reference" if mode == "reference" else "")
            r = subprocess.run([sys.executable, "-c", CHILD, str(a.rows), str(a.hidden), str(a.vocab), str(a.repeats)],
                               env=env, capture_output=True, text=True, check=True)
            results[mode].append(json.loads(r.stdout))
    print(f"[{a.rows}, {a.hidden}] @ [{a.vocab}, {a.hidden}]^T, GFLOP/s (median of {a.rounds} rounds x {a.repeats})")
    for mode, runs in results.items():
        cells = "  ".join(f"{k} {statistics.median(r[k] for r in runs):7.2f}" for k in runs[0] if k != "blas")
        print(f"  {mode:9s} ({runs[0]['blas']}): {cells}")
    print(json.dumps({"command": "python -m scripts.bench_blas " + " ".join(sys.argv[1:]), "results": results}))


if __name__ == "__main__":
    main()

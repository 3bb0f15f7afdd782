"""Matmul throughput of MLX's CPU backend under each BLAS (not a test).

MLX's Linux CPU wheel bundles the reference BLAS; dlm.runtime loads an
optimized one ahead of it (dlm.runtime.platform.blas). This measures, side by side in
one run, float32 matmul, bfloat16 matmul and the 4-bit quantized matmul at a
shape of the released DiffusionGemma head ([rows, hidden] @ [vocab, hidden]^T),
once per BLAS (each in a fresh interpreter: the BLAS is chosen before MLX
loads), interleaved, and prints GFLOP/s (median of the repeats).

    .venv/bin/python -m scripts.bench.blas                       # 64 x 2816 @ 32768 x 2816
    .venv/bin/python -m scripts.bench.blas --rows 256 --vocab 262144 --repeats 1
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from scripts.bench import harness

CHILD = r"""
import json, sys
import dlm.runtime.platform.blas as blas
import mlx.core as mx
from scripts.bench.harness import median_seconds
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
    out[name] = flops / median_seconds(fn, repeats) / 1e9
print(json.dumps(out))
"""


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--rows", type=int, default=64, help="canvas positions")
    ap.add_argument("--hidden", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds per BLAS")
    a = ap.parse_args()

    def child(mode: str) -> dict:  # a fresh interpreter: the BLAS is chosen before MLX loads
        env = dict(os.environ, DLM_BLAS="reference" if mode == "reference" else "",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(harness.ROOT), os.environ.get("PYTHONPATH")])))
        r = subprocess.run([sys.executable, "-c", CHILD, str(a.rows), str(a.hidden), str(a.vocab), str(a.repeats)],
                           env=env, capture_output=True, text=True, check=True)
        return json.loads(r.stdout)

    results: dict[str, list[dict]] = harness.interleave(
        {"reference": lambda: child("reference"), "default": lambda: child("default")}, a.rounds, run=harness.returned)
    print(f"[{a.rows}, {a.hidden}] @ [{a.vocab}, {a.hidden}]^T, GFLOP/s (median of {a.rounds} rounds x {a.repeats})")
    for mode, runs in results.items():
        cells = "  ".join(f"{k} {statistics.median(r[k] for r in runs):7.2f}" for k in runs[0] if k != "blas")
        print(f"  {mode:9s} ({runs[0]['blas']}): {cells}")
    print(json.dumps({"command": harness.command(), "results": results}))


if __name__ == "__main__":
    main()

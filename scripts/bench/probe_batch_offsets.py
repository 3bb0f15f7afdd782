"""MLX's CPU matmul with a broadcast weight past 32-bit batch offsets (not a test).

A batch's float GEMMs run as ``x [B, L, in] @ broadcast(W)`` (dlm.runtime.models.rows).
MLX (0.32.4) locates batch element i's matrix at element offset i * in * out in 32
bits, so from (B - 1) * in * out >= 2^31 it reads outside the weight. Each case runs
in a child process (a segfault ends only the child) with random weights, through
MLX directly and through ``rows.matmul``, and reports ok or the signal:

    .venv/bin/python -m scripts.bench.probe_batch_offsets

Needs ~3 GB free for the released DiffusionGemma head (262144 x 2816 float32).
"""

from __future__ import annotations

import json
import subprocess
import sys

from scripts.bench import harness

CASES = [  # (name, vocab, hidden, batch sizes)
    ("DiffusionGemma head (262144 x 2816)", 262144, 2816, (3, 4)),
    ("LLaDA2.0-mini head (157184 x 2048)", 157184, 2048, (7, 8)),
]

CHILD = """
import sys
from dlm.runtime.platform import blas
import mlx.core as mx
from dlm.runtime.models import rows
V, H, B, how = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
w = mx.random.normal((V, H)) * 0.02
x = mx.random.normal((B, 4, H))
mx.eval(w, x)
y = x @ mx.broadcast_to(w.T, (B, H, V)) if how == "mlx" else rows.matmul(x, w.T)
print(float(mx.abs(y[-1] - x[-1] @ w.T).max()))
"""


def main() -> None:
    harness.parser(__doc__).parse_args()  # no options: --help shows what it does
    for name, vocab, hidden, sizes in CASES:
        for batch in sizes:
            for how in ("mlx", "rows"):
                run = subprocess.run([sys.executable, "-c", CHILD, str(vocab), str(hidden), str(batch), how],
                                     capture_output=True, text=True)
                result = (f"ok, last sequence off by {float(run.stdout.split()[-1]):.1e}" if run.returncode == 0
                          else f"died (signal {-run.returncode})" if run.returncode < 0 else run.stderr[-300:])
                past = (batch - 1) * vocab * hidden >= 2**31
                print(json.dumps({"case": name, "batch": batch, "offset_past_2^31": past,
                                  "via": "MLX broadcast" if how == "mlx" else "rows.matmul", "result": result}),
                      flush=True)


if __name__ == "__main__":
    main()

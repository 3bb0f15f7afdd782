"""Quantized kernels vs dequantized per call on MLX's CPU backend, at the released DiffusionGemma shapes.

    .venv/bin/python -m scripts.bench.cpu_dequant [--repeats 3]

For each piece of a denoising step (the released google/diffusiongemma-26B-A4B-it text geometry: hidden
2816, 8-bit attention projections and dense MLP, 4-bit experts 704 wide, an 8-bit tied head), one
``mx.eval`` of: MLX's quantized kernel (``quantized_matmul``, rows split over the CPU streams as the
runtime runs it) and dlm's per-call path (dlm.runtime.models.cpu.dequant: the weight dequantized to
float32 just before a BLAS GEMM). Repeats are interleaved; median and min per piece, the ratio, the
max |difference| between the two (the same dequantized weights: float32 rounding only) and each path's peak
memory beyond what it held before (the output included).
Measured (2-core shared machine, OpenBLAS, a full-size dlm-run generate running beside it, so absolute
times are inflated and only the ratios count): see the README's "Benchmarks" section.
"""

from __future__ import annotations

import argparse
import statistics

from dlm.runtime.platform import blas  # before MLX: loads the optimized BLAS

import mlx.core as mx  # noqa: E402  (isort: skip)
import mlx.nn as nn  # noqa: E402
from dlm.runtime.models import rows
from dlm.runtime.models.cpu import streams as cpu_streams  # noqa: E402
from dlm.runtime.models.switch import SwitchLinear, project  # noqa: E402
from scripts.bench import harness  # noqa: E402

H = 2816
PIECES = [  # name, rows, out, in, bits
    ("q_proj, canvas (256 rows)", 256, 4096, H, 8),
    ("o_proj, canvas (256 rows)", 256, H, 4096, 8),
    ("q_proj, prompt (54 rows)", 54, 4096, H, 8),
    ("tied head, 16384-token vocab slice", 256, 16384, H, 8),
    ("tied head, the released 262144-token vocabulary", 256, 262144, H, 8),
]
EXPERTS = 8  # a sample of the 128 experts, each 16 rows (256 positions x top-8 / 128)


def _linear(out: int, inn: int, bits: int) -> nn.QuantizedLinear:
    lin = nn.Linear(inn, out, bias=False)
    lin.weight = mx.random.normal((out, inn)) * 0.02
    q = nn.QuantizedLinear.from_linear(lin, group_size=64, bits=bits)
    mx.eval(q.parameters())
    return q


def _kernel(q, x):
    fn = lambda rows: mx.quantized_matmul(rows, q["weight"], q["scales"], q["biases"], transpose=True,  # noqa: E731
                                          group_size=q.group_size, bits=q.bits)
    return cpu_streams.split_positions(fn, x) if cpu_streams.parallel() else fn(x)


def _per_call(q, x):
    return rows.dequantized_linear(q, x)


def _experts():
    gate_up = SwitchLinear(H, 2 * 704, EXPERTS)
    gate_up.weight = mx.random.normal(gate_up.weight.shape) * 0.02
    q = gate_up.to_quantized(group_size=64, bits=4)
    mx.eval(q.parameters())
    xs = [mx.random.normal((16, H)) for _ in range(EXPERTS)]

    def kernel():
        fn = lambda rows, ids: mx.gather_qmm(rows, q["weight"], q["scales"], q["biases"], rhs_indices=ids,  # noqa: E731
                                             transpose=True, group_size=64, bits=4, sorted_indices=True)
        x = mx.concatenate(xs)[:, None, :]
        ids = mx.repeat(mx.arange(EXPERTS, dtype=mx.uint32), 16)
        return cpu_streams.split_rows(fn, x, ids)[:, 0, :] if cpu_streams.parallel() else fn(x, ids)[:, 0, :]

    def per_call():
        streams = cpu_streams.cpu_streams()
        outs = []
        for e in range(EXPERTS):
            with mx.stream(streams[e % len(streams)]) if streams else mx.stream(mx.cpu):
                outs.append(project(xs[e], q.expert_weight(e)))
        return mx.concatenate(outs)

    return kernel, per_call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"BLAS: {blas.STATUS}; CPU streams: {len(cpu_streams.cpu_streams())}")
    cases = []
    for name, rows, out, inn, bits in PIECES:
        q = _linear(out, inn, bits)
        x = mx.random.normal((1, rows, inn))
        mx.eval(x)
        cases.append((f"{name}, {out}x{inn} {bits}-bit", lambda q=q, x=x: _kernel(q, x),
                      lambda q=q, x=x: _per_call(q, x), 2 * rows * out * inn))
    kernel, per_call = _experts()
    cases.append((f"{EXPERTS} experts x 16 rows, {2 * 704}x{H} 4-bit", kernel, per_call, 2 * 16 * 2 * 704 * H * EXPERTS))
    print(f"{'piece':58} {'kernel ms':>16} {'per call ms':>16} {'ratio':>6} {'max|d|':>8} {'peak GB k/p':>12}")
    for name, k, p, flops in cases:
        diff = float(mx.abs(k() - p()).max())
        peaks = harness.peak_bytes(k) / 1e9, harness.peak_bytes(p) / 1e9  # GB beyond what was held before
        runs = harness.interleave({"kernel": k, "per call": p}, args.repeats)
        tk, tp = runs["kernel"], runs["per call"]
        mk, mp = statistics.median(tk), statistics.median(tp)
        print(f"{name:58} {mk * 1e3:8.1f} ({min(tk) * 1e3:6.1f}) {mp * 1e3:8.1f} ({min(tp) * 1e3:6.1f}) "
              f"{mk / mp:5.1f}x {diff:8.1e} {peaks[0]:5.2f}/{peaks[1]:5.2f}   "
              f"[{flops / mk / 1e9:.1f} vs {flops / mp / 1e9:.1f} GFLOP/s]")


if __name__ == "__main__":
    main()

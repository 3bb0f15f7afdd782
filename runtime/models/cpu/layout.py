"""The CPU backend's weight layout: large float matmul weights kept [in, out] in memory.

Checkpoints store a linear's weight [out, in] (experts [E, out, in]) and the
model multiplies by its transpose: on the CPU that is a ``cblas_sgemm`` with a
transposed B, which OpenBLAS (0.3.21, this project's CPU) packs before its
kernel. With few rows per product that packing is much of the time; stored
[in, out], the same call runs untransposed, with the same bits at the sizes
relaid here (at tiny sizes OpenBLAS's small-matrix kernels differ in the last
bits: tests/test_layout.py). With many rows it can be slower. Measured by ``python -m scripts.bench.layout``
(and /tmp probes of single gather_mm calls):

* LLaDA2.0-mini's untied head over 157184 tokens: 1.27x at a block's 32 rows,
  1.4x at 8-16, 1.5x at 1; DiffusionGemma's at a canvas's 256 rows: 0.94x
  (its head is the tied embedding, which is not relaid anyway);
* experts: 1.4x for a [512, 2048] expert at 1-2 copies, 1.08x for its down
  projection; 0.8x for DiffusionGemma's [1408, 2816] at a canvas's 16 copies.

So a weight is relaid where the family's denoising forward gives it few rows
(``Model.product_rows``): float ``SwitchLinear`` experts that run
``by_count`` (experts.stacks) with at most ``MAX_EXPERT_COPIES`` token copies
per expert, and float linears of at least ``MIN_LINEAR`` elements (a
vocabulary head) at most ``MAX_LINEAR_ROWS`` rows. Quantized modules,
embeddings and a tied head (whose rows the embedding lookup reads) keep the
checkpoint's order, and so do Metal and CUDA (their kernels are tuned for it),
and a CPU without the optimized BLAS dlm loads on Linux (blas.py: the order
was measured with OpenBLAS only).

Nothing else changes: each weight keeps its shape, [out, in] or [E, out, in],
as a strided view of the [in, out] buffer (``relaid``), so every product,
slice and shape check reads it as before; MLX's matmul and gather_mm take
either memory order without a copy.

``DLM_CPU_LAYOUT=native`` keeps the checkpoint's order (for A/B runs; ``auto``,
the default, relays as above); it and
``DLM_CPU_EXPERTS`` (experts.py) are read at load.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ...platform import blas, settings
from ..switch import SwitchLinear
from .experts import stacks

MIN_LINEAR = 1 << 26  # weight elements: an untied head (LLaDA2.0-mini's 157184 x 2048), not a layer's projection
MAX_LINEAR_ROWS = 64
MAX_EXPERT_COPIES = 4


def relaid(w: mx.array) -> mx.array:
    """``w`` [..., out, in] with its last two axes stored the other way round
    in memory (the same values and shape; evaluated)."""
    out = mx.contiguous(w.swapaxes(-1, -2)).swapaxes(-1, -2)
    mx.eval(out)
    return out


def wants(module, rows: dict) -> bool:
    """Whether ``module``'s weight runs faster stored [in, out] on this backend,
    given the family's ``product_rows`` (rows per "linear" product, token copies
    per routed expert)."""
    if mx.default_device() != mx.cpu or "scales" in module or "weight" not in module:
        return False
    if module["weight"].dtype != mx.float32:
        return False
    if isinstance(module, SwitchLinear):
        return stacks(module) and rows.get("experts", float("inf")) <= MAX_EXPERT_COPIES
    return (isinstance(module, nn.Linear) and module["weight"].size >= MIN_LINEAR
            and rows.get("linear", float("inf")) <= MAX_LINEAR_ROWS)


def measured() -> bool:
    """Whether this process runs the BLAS the layout was measured with (blas.py
    loaded an optimized one), and DLM_CPU_LAYOUT does not say ``native`` (another
    value: a ConfigError naming it, platform/settings.py)."""
    return settings.CPU_LAYOUT.get() != "native" and blas.STATUS not in ("off", "reference")


def cpu_layout(model) -> int:
    """Relay every weight ``wants`` picks, one module at a time (the peak stays
    one weight above the model); returns how many."""
    if not measured():
        return 0
    rows = model.product_rows()  # every family declares it (tests/test_family_conformance.py)
    n = 0
    for _, module in model.named_modules():
        if wants(module, rows) and not getattr(module, "relaid", False):
            module.weight = relaid(module["weight"])
            module.relaid = True  # a plain attribute (not a parameter): what --profile reports
            n += 1
    return n

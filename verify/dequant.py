"""Affine dequantization on torch's threads, for the same-weights reference.

A layer-streamed same-weights reference dequantizes every layer again on each
forward pass. MLX's CPU ``mx.dequantize`` runs on one thread (LLaDA2.0-mini: 18
s a layer, 3.7 s for one [256, 512, 2048] expert stack with its copy out);
this does the same arithmetic with torch's elementwise ops on every core
(0.7 s for that stack on 2 cores), writing the float32 result once.

The arithmetic is MLX's: ``q * scale + bias`` in float32, a multiply then an
add (``tests/test_verify_dequant.py`` checks the result is bit-identical to
``mx.dequantize``). Only the layouts whose values sit inside one byte (2, 4, 8
bits) with float32 scales and biases take this path; everything else
(3/5/6 bits, half-precision scales, other modes) goes to ``mx.dequantize``.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

FAST_BITS = (2, 4, 8)


def supported(bits: int, mode: str, packed, scales, biases) -> bool:
    """Whether ``dequantize`` handles this layout (else use mx.dequantize)."""
    import mlx.core as mx

    return (mode == "affine" and int(bits) in FAST_BITS and biases is not None
            and packed.dtype == mx.uint32 and scales.dtype == mx.float32 and biases.dtype == mx.float32)


def dequantize(packed, scales, biases, group_size: int, bits: int) -> np.ndarray:
    """float32 numpy ``[..., in]`` from MLX's packed uint32 ``[..., in * bits / 32]``
    and its float32 ``scales`` / ``biases`` ``[..., in / group_size]``."""
    import mlx.core as mx
    import torch

    mx.eval(packed, scales, biases)
    # Little-endian uint32 words: element j of a word sits at bits [j*bits, (j+1)*bits),
    # so in the byte view byte k holds elements k*per .. k*per + per - 1, lowest bits first.
    q = torch.from_numpy(np.asarray(packed).view(np.uint8))
    s = torch.from_numpy(np.asarray(scales))
    b = torch.from_numpy(np.asarray(biases))
    per = 8 // bits
    shape = tuple(q.shape[:-1]) + (q.shape[-1] * per,)
    out = torch.empty(shape, dtype=torch.float32)
    lanes = out.view(*q.shape, per)
    mask = (1 << bits) - 1
    for k in range(per):
        lanes[..., k] = (q >> (bits * k)) & mask if k else q & mask
    groups = out.view(*shape[:-1], shape[-1] // group_size, group_size)
    groups.mul_(s[..., None]).add_(b[..., None])
    return out.numpy()


def maybe_dequantize(packed, scales, biases, params: dict) -> Optional[np.ndarray]:
    """``dequantize`` when the layout is supported, else None."""
    if not supported(params["bits"], params.get("mode", "affine"), packed, scales, biases):
        return None
    return dequantize(packed, scales, biases, int(params["group_size"]), int(params["bits"]))

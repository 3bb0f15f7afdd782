"""Stacked-expert ("switch") linears shared by the MoE families.

``weight`` is [experts, out, in] (the HF / mlx-lm layout) and is applied with
``gather_mm``; the quantized twin uses ``gather_qmm``. CPU strategy: the CPU
backend's ``gather_mm`` is float32-only, so the loader keeps half-precision
expert weights in float32 there (``cpu_float32_experts``) and the layer rounds
its output back to the activation dtype.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ...quantize.modes import mode_defaults


class SwitchLinear(nn.Module):
    def __init__(self, input_dims: int, output_dims: int, num_experts: int):
        super().__init__()
        self.weight = mx.zeros((num_experts, output_dims, input_dims))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        w = self["weight"]
        if w.dtype != mx.float32 and mx.default_device() == mx.cpu:
            w = w.astype(mx.float32)  # a model built outside the loader
        xd = x.astype(w.dtype) if x.dtype != w.dtype else x
        y = mx.gather_mm(xd, w.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
        return y.astype(x.dtype)

    def to_quantized(self, group_size: int = None, bits: int = None, mode: str = "affine", **_):
        return QuantizedSwitchLinear.from_float(self, group_size, bits, mode)


class QuantizedSwitchLinear(nn.Module):
    """SwitchLinear with a packed weight + scales (+ biases for affine), as mx.quantize writes."""

    def __init__(self, weight, scales, biases, group_size: int, bits: int, mode: str):
        super().__init__()
        self.weight, self.scales = weight, scales
        if biases is not None:
            self.biases = biases
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.freeze()

    @classmethod
    def from_float(cls, layer: SwitchLinear, group_size, bits, mode):
        group_size, bits = mode_defaults(mode, group_size, bits)
        w, scales, *biases = mx.quantize(layer.weight, group_size, bits, mode=mode)
        return cls(w, scales, biases[0] if biases else None, group_size, bits, mode)

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        return mx.gather_qmm(
            x, self["weight"], self["scales"], self.get("biases"), rhs_indices=indices,
            transpose=True, group_size=self.group_size, bits=self.bits, mode=self.mode,
            sorted_indices=sorted_indices,
        )


def cpu_float32_experts(model) -> None:
    """On the CPU backend keep unquantized half-precision expert weights in float32."""
    if mx.default_device() != mx.cpu:
        return
    updates = [
        (f"{name}.weight", module["weight"].astype(mx.float32))
        for name, module in model.named_modules()
        if isinstance(module, SwitchLinear) and module["weight"].dtype != mx.float32
    ]
    if updates:
        model.load_weights(updates, strict=False)

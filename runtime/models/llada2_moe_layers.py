"""Building blocks of the LLaDA-2 MLX model: switch (stacked-expert) linears,
their SwiGLU, and the committed-prefix KV cache of the block loop."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def _needs_f32(dtype) -> bool:
    # The CPU backend only has a float32 gather_mm.
    return dtype != mx.float32 and mx.default_device() == mx.cpu


class SwitchLinear(nn.Module):
    """E stacked [out, in] matrices; ``weight`` is [E, out, in] (mlx-lm layout)."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int):
        super().__init__()
        self.weight = mx.zeros((num_experts, output_dims, input_dims))

    def __call__(self, x, indices, sorted_indices: bool = False):
        w = self.weight
        if _needs_f32(w.dtype) or _needs_f32(x.dtype):
            out = mx.gather_mm(
                x.astype(mx.float32), w.astype(mx.float32).swapaxes(-1, -2),
                rhs_indices=indices, sorted_indices=sorted_indices,
            )
            return out.astype(x.dtype)
        return mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)

    def to_quantized(self, group_size=None, bits=None, mode="affine", quantize_input=False):
        return QuantizedSwitchLinear(self.weight, group_size, bits, mode)


_MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}


class QuantizedSwitchLinear(nn.Module):
    """SwitchLinear with a packed weight + scales (+ biases for affine), as mx.quantize writes."""

    def __init__(self, weight, group_size=None, bits=None, mode="affine"):
        super().__init__()
        g, b = _MODE_DEFAULTS.get(mode, (64, 4))
        self.group_size, self.bits, self.mode = group_size or g, bits or b, mode
        parts = mx.quantize(weight, self.group_size, self.bits, mode=mode)
        self.weight, self.scales = parts[0], parts[1]
        if mode == "affine":
            self.biases = parts[2]
        self.freeze()

    def __call__(self, x, indices, sorted_indices: bool = False):
        return mx.gather_qmm(
            x, self["weight"], self["scales"], self.get("biases"), rhs_indices=indices,
            transpose=True, group_size=self.group_size, bits=self.bits, mode=self.mode,
            sorted_indices=sorted_indices,
        )


class SwitchGLU(nn.Module):
    """Routed experts: ``down(silu(gate(x)) * up(x))`` for each (token, slot)."""

    def __init__(self, hidden: int, inter: int, num_experts: int):
        super().__init__()
        self.gate_proj = SwitchLinear(hidden, inter, num_experts)
        self.up_proj = SwitchLinear(hidden, inter, num_experts)
        self.down_proj = SwitchLinear(inter, hidden, num_experts)

    def __call__(self, x, indices):
        """x [T, H], indices [T, k] -> [T, k, H]."""
        T, k = indices.shape
        if T * k >= 64:
            # Sort (token, slot) pairs by expert so each expert's rows are contiguous.
            flat = indices.reshape(-1)
            order = mx.argsort(flat)
            inverse = mx.argsort(order)
            xs = x[order // k][:, None, :]
            idx = flat[order]
            h = nn.silu(self.gate_proj(xs, idx, True)) * self.up_proj(xs, idx, True)
            y = self.down_proj(h, idx, True)[:, 0, :]
            return y[inverse].reshape(T, k, -1)
        xs = x[:, None, None, :]
        h = nn.silu(self.gate_proj(xs, indices)) * self.up_proj(xs, indices)
        return self.down_proj(h, indices)[:, :, 0, :]


class CommittedKVCache:
    """Per-layer KV cache holding only committed positions.

    ``update_and_fetch`` writes the window's keys after the committed prefix and
    returns prefix ⊕ window; ``commit(n)`` then keeps the first n window
    positions. Uncommitted positions are overwritten by the next window, so the
    active block is recomputed every step while the prefix is computed once.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.offset = 0
        self.keys = None
        self.values = None
        self._window = 0

    def update_and_fetch(self, k, v):
        B, H, L, D = k.shape
        end = self.offset + L
        if end > self.capacity:
            raise ValueError(f"KV cache capacity {self.capacity} exceeded ({end})")
        if self.keys is None:
            self.keys = mx.zeros((B, H, self.capacity, D), dtype=k.dtype)
            self.values = mx.zeros((B, H, self.capacity, v.shape[-1]), dtype=v.dtype)
        self.keys[..., self.offset : end, :] = k
        self.values[..., self.offset : end, :] = v
        self._window = L
        return self.keys[..., :end, :], self.values[..., :end, :]

    def commit(self, n: int) -> None:
        if n > self._window:
            raise ValueError(f"cannot commit {n} of a {self._window}-position window")
        self.offset += n
        self._window = 0

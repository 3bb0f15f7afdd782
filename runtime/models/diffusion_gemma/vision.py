"""The Gemma 4 vision tower and DiffusionGemma's multimodal embedder in MLX
(transformers' ``modeling_gemma4.py: Gemma4VisionModel``; parameter names equal the checkpoint's).

    x = input_proj(2 (pixels - 0.5)) + PE[0][x_pos] + PE[1][y_pos]
    N x (norm sandwich: bidirectional attention with 2-D RoPE, gelu-tanh MLP)
    pool k x k patch blocks (mean), * sqrt(hidden) and standardize in float32
    embed_vision: Linear(RMS(h)) into the text hidden size

Padding patches never enter: the processor pads every image to max_patches,
but padded keys are masked out and padded rows are zeroed before pooling, so
running the real patches only gives the same features for less work. One
image per forward (images differ in patch count).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...platform.errors import ConfigError
from .layers import RMSNorm, geglu, rms_norm


@dataclass
class VisionArgs:
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_embedding_size: int = 10240
    use_clipped_linears: bool = False
    standardize: bool = False
    rope_theta: float = 100.0
    hidden_activation: str = "gelu_pytorch_tanh"
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, vision: dict, where: str = "config.json vision_config") -> "VisionArgs":
        from ..base import ConfigReader

        r = ConfigReader(vision, where)
        rope = r.dict("rope_parameters", {}) or {}
        rope_type = rope.get("rope_type", "axial")
        if rope_type not in ("axial", "default"):  # "default" is read as "axial" (transformers' Gemma4VisionConfig)
            raise ConfigError(f"{where}: unsupported vision rope_type {rope_type!r}")
        heads = r.int("num_attention_heads", 12, minimum=1)
        args = cls(
            hidden_size=r.int("hidden_size", 768, minimum=1),
            intermediate_size=r.int("intermediate_size", 3072, minimum=1),
            num_hidden_layers=r.int("num_hidden_layers", 16, minimum=1),
            num_attention_heads=heads,
            num_key_value_heads=r.int("num_key_value_heads", heads, minimum=1),
            head_dim=r.int("head_dim", 64, minimum=4),
            rms_norm_eps=r.float("rms_norm_eps", 1e-6, positive=True),
            patch_size=r.int("patch_size", 16, minimum=1),
            pooling_kernel_size=r.int("pooling_kernel_size", 3, minimum=1),
            position_embedding_size=r.int("position_embedding_size", 10240, minimum=1),
            use_clipped_linears=bool(vision.get("use_clipped_linears", False)),
            standardize=bool(vision.get("standardize", False)),
            rope_theta=float(rope.get("rope_theta", 100.0)),
            hidden_activation=r.str("hidden_activation", "gelu_pytorch_tanh"),
        )
        if args.head_dim % 4:
            raise ConfigError(f"{where}: head_dim {args.head_dim} must be a multiple of 4 (2-D RoPE)")
        if heads % args.num_key_value_heads:
            raise ConfigError(f"{where}: num_attention_heads {heads} is not a multiple of "
                              f"num_key_value_heads {args.num_key_value_heads}")
        if args.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ConfigError(f"{where}: unsupported hidden_activation {args.hidden_activation!r}")
        return args


class ClippableLinear(nn.Module):
    """``linear`` with optional input/output clamps (use_clipped_linears)."""

    def __init__(self, args: VisionArgs, dims_in: int, dims_out: int):
        super().__init__()
        self.linear = nn.Linear(dims_in, dims_out, bias=False)
        self.clipped = args.use_clipped_linears
        if self.clipped:
            self.input_min, self.input_max = mx.array(-math.inf), mx.array(math.inf)
            self.output_min, self.output_max = mx.array(-math.inf), mx.array(math.inf)

    def __call__(self, x: mx.array) -> mx.array:
        if not self.clipped:
            return self.linear(x)
        x = mx.clip(x, self["input_min"].astype(x.dtype), self["input_max"].astype(x.dtype))
        y = self.linear(x)
        return mx.clip(y, self["output_min"].astype(y.dtype), self["output_max"].astype(y.dtype))


def axial_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x [S, heads, d]: the first half rotated by the x angles, the second by y,
    each with rotate_half inside its half. cos/sin: [S, 1, d]."""
    d = x.shape[-1]
    q = d // 4
    parts = []
    for i in range(2):
        xi = x[..., i * 2 * q : (i + 1) * 2 * q]
        rotated = mx.concatenate([-xi[..., q:], xi[..., :q]], axis=-1)
        ci, si = cos[..., i * 2 * q : (i + 1) * 2 * q], sin[..., i * 2 * q : (i + 1) * 2 * q]
        parts.append(xi * ci + rotated * si)
    return mx.concatenate(parts, axis=-1)


class VisionAttention(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        H, d = args.hidden_size, args.head_dim
        self.heads, self.kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, d
        self.eps = args.rms_norm_eps
        self.q_proj = ClippableLinear(args, H, self.heads * d)
        self.k_proj = ClippableLinear(args, H, self.kv_heads * d)
        self.v_proj = ClippableLinear(args, H, self.kv_heads * d)
        self.o_proj = ClippableLinear(args, self.heads * d, H)
        self.q_norm = RMSNorm(d, self.eps)
        self.k_norm = RMSNorm(d, self.eps)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        S, d = x.shape[0], self.head_dim
        q = axial_rope(self.q_norm(self.q_proj(x).reshape(S, self.heads, d)), cos, sin)
        k = axial_rope(self.k_norm(self.k_proj(x).reshape(S, self.kv_heads, d)), cos, sin)
        v = rms_norm(self.v_proj(x).reshape(S, self.kv_heads, d), None, self.eps)
        q, k, v = (t.transpose(1, 0, 2)[None] for t in (q, k, v))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0)  # bidirectional
        return self.o_proj(out[0].transpose(1, 0, 2).reshape(S, -1))


class VisionMLP(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        H, I = args.hidden_size, args.intermediate_size
        self.gate_proj = ClippableLinear(args, H, I)
        self.up_proj = ClippableLinear(args, H, I)
        self.down_proj = ClippableLinear(args, I, H)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x)))


class VisionLayer(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = VisionAttention(args)
        self.mlp = VisionMLP(args)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.pre_feedforward_layernorm = RMSNorm(H, eps)
        self.post_feedforward_layernorm = RMSNorm(H, eps)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class VisionEncoder(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.layers = [VisionLayer(args) for _ in range(args.num_hidden_layers)]


class PatchEmbedder(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.input_proj = nn.Linear(3 * args.patch_size**2, args.hidden_size, bias=False)
        self.position_embedding_table = mx.zeros((2, args.position_embedding_size, args.hidden_size))

    def __call__(self, pixels: mx.array, positions: mx.array) -> mx.array:
        x = (2 * (pixels.astype(mx.float32) - 0.5)).astype(self["position_embedding_table"].dtype)
        table = self["position_embedding_table"]
        pe = table[0][positions[:, 0]] + table[1][positions[:, 1]]
        return self.input_proj(x) + pe


class VisionModel(nn.Module):
    """The tower: real patches of one image -> its soft tokens [n, hidden] (model dtype)."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        self.patch_embedder = PatchEmbedder(args)
        self.encoder = VisionEncoder(args)
        if args.standardize:
            self.std_bias = mx.zeros((args.hidden_size,))
            self.std_scale = mx.ones((args.hidden_size,))
        d = args.head_dim
        spatial = d // 2
        self._inv_freq = mx.array(
            (1.0 / (np.float32(args.rope_theta) ** (np.arange(0, spatial, 2, dtype=np.float32) / np.float32(spatial))))
            .astype(np.float32)
        )

    def rope_tables(self, positions: mx.array, dtype) -> tuple[mx.array, mx.array]:
        """cos/sin [S, 1, d] laid out x, x, y, y (each d/4 wide), float32 -> dtype."""
        angles = positions.astype(mx.float32)[..., None] * self._inv_freq  # [S, 2, d/4]
        ax, ay = angles[:, 0], angles[:, 1]
        full = mx.concatenate([ax, ax, ay, ay], axis=-1)[:, None, :]
        return mx.cos(full).astype(dtype), mx.sin(full).astype(dtype)

    def __call__(self, pixels: mx.array, positions: np.ndarray) -> mx.array:
        """pixels [P, 3 p^2] and positions [P, 2] (x, y) of the real patches."""
        k = self.args.pooling_kernel_size
        pos = mx.array(positions.astype(np.int32))
        h = self.patch_embedder(pixels, pos)
        cos, sin = self.rope_tables(pos, h.dtype)
        for layer in self.encoder.layers:
            h = layer(h, cos, sin)
        # Pool k x k blocks by position: slot = x//k + (W/k) (y//k), in float32.
        width = int(positions[:, 0].max()) + 1
        slots = positions[:, 0] // k + (width // k) * (positions[:, 1] // k)
        used, inverse = np.unique(slots, return_inverse=True)
        pooled = mx.zeros((len(used), h.shape[-1]), dtype=mx.float32)
        pooled = pooled.at[mx.array(inverse.astype(np.int32))].add(h.astype(mx.float32))
        # The mean is rounded to the model dtype before the float32 scale (as transformers does).
        pooled = (pooled / float(k * k)).astype(h.dtype).astype(mx.float32)
        pooled = pooled * np.float32(math.sqrt(self.args.hidden_size))
        if self.args.standardize:
            pooled = (pooled - self["std_bias"].astype(mx.float32)) * self["std_scale"].astype(mx.float32)
        return pooled.astype(h.dtype)


class MultimodalEmbedder(nn.Module):
    """embed_vision: weightless RMS norm, then a projection into the text hidden size."""

    def __init__(self, vision_hidden: int, text_hidden: int, eps: float):
        super().__init__()
        self.embedding_projection = nn.Linear(vision_hidden, text_hidden, bias=False)
        self.eps = eps

    def __call__(self, h: mx.array) -> mx.array:
        return self.embedding_projection(rms_norm(h, None, self.eps))

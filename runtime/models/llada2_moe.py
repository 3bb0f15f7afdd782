"""LLaDA2.0 / 2.1 MoE (``llada2_moe``) for MLX.

The whole family on the MLX side: the config, the HF->MLX weight plan used by
dlm-convert (per-expert tensors stacked into the switch layout), the classes of
the mixed quantization recipe, ``sanitize`` for mlx-community layouts, and the
MLX modules.  Reference: ../shared/reference/llada2_moe.md (§1-§3, §9).

Converted names are the hub names, except the routed experts, which are stacked
as ``model.layers.{i}.mlp.switch_mlp.{gate,up,down}_proj.weight`` [E, out, in]
(the mlx-lm layout; mlx-vlm adds a ``language_model.`` prefix).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from ..errors import ConfigError, WeightError
from ..weights import TensorPlan
from .llada2_moe_layers import CommittedKVCache, SwitchGLU

DEFAULT_EOS_ID = 156892  # <|endoftext|>; 2.0 configs carry no eos_token_id
DEFAULT_MASK_ID = 156895

# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int = 0
    first_k_dense_replace: int = 0
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.5
    rms_norm_eps: float = 1e-5
    use_qk_norm: bool = True
    use_qkv_bias: bool = False
    use_bias: bool = True
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 16384
    pad_token_id: int = DEFAULT_EOS_ID
    eos_token_ids: list[int] = field(default_factory=lambda: [DEFAULT_EOS_ID])
    mask_token_id: int = DEFAULT_MASK_ID
    model_type: str = "llada2_moe"

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> "ModelArgs":
        if config.get("model_type") != "llada2_moe":
            raise ConfigError(f"{where}: model_type {config.get('model_type')!r} is not llada2_moe")
        cfg = dict(config)
        if isinstance(cfg.get("text_config"), dict):  # mlx-vlm writes a nested text config
            cfg.update({k: v for k, v in cfg["text_config"].items() if k not in cfg})

        def need(key: str) -> Any:
            if cfg.get(key) is None:
                raise ConfigError(f"{where}: llada2_moe config is missing required key {key!r}")
            return cfg[key]

        def ints(key: str, default: int) -> int:
            value = cfg.get(key)
            return default if value is None else int(value)

        heads = int(need("num_attention_heads"))
        kv_heads = cfg.get("num_key_value_heads")
        if not kv_heads or int(kv_heads) <= 0:
            # The hub class default is 0, which divides by zero: say so instead.
            raise ConfigError(
                f"{where}: num_key_value_heads must be a positive integer (got {kv_heads!r})"
            )
        hidden = int(need("hidden_size"))
        first_dense = ints("first_k_dense_replace", 0)
        n_layers = int(need("num_hidden_layers"))
        eos = cfg.get("eos_token_id")
        if eos is None:
            eos = cfg.get("pad_token_id", DEFAULT_EOS_ID)
        eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        args = cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads),
            head_dim=ints("head_dim", hidden // heads),
            intermediate_size=int(need("intermediate_size")) if first_dense else ints("intermediate_size", 0),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            num_experts=int(need("num_experts")),
            num_experts_per_tok=int(need("num_experts_per_tok")),
            num_shared_experts=ints("num_shared_experts", 0),
            first_k_dense_replace=first_dense,
            n_group=ints("n_group", 8),
            topk_group=ints("topk_group", 4),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            partial_rotary_factor=float(cfg.get("partial_rotary_factor", 0.5)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            use_qk_norm=bool(cfg.get("use_qk_norm", True)),
            use_qkv_bias=bool(cfg.get("use_qkv_bias", False)),
            use_bias=bool(cfg.get("use_bias", True)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=ints("max_position_embeddings", 16384),
            pad_token_id=ints("pad_token_id", DEFAULT_EOS_ID),
            eos_token_ids=eos_ids,
            mask_token_id=ints("mask_token_id", DEFAULT_MASK_ID),
        )
        args._validate(where, cfg)
        return args

    def _validate(self, where: str, cfg: dict) -> None:
        def bad(msg: str):
            raise ConfigError(f"{where}: {msg}")

        if self.num_attention_heads % self.num_key_value_heads:
            bad(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.num_experts % self.n_group:
            bad(f"num_experts={self.num_experts} is not divisible by n_group={self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            bad(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
        if self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
            bad(f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts of "
                f"{self.topk_group} selected groups")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            bad(f"partial_rotary_factor={self.partial_rotary_factor} gives an invalid rotary "
                f"dimension {self.rotary_dim} for head_dim={self.head_dim}")
        scaling = cfg.get("rope_scaling") or {}
        kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        if kind != "default":
            bad(f"rope_scaling type {kind!r} is not supported (LLaDA-2 uses default RoPE)")
        if cfg.get("hidden_act", "silu") != "silu":
            bad(f"hidden_act {cfg.get('hidden_act')!r} is not supported (expected 'silu')")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            bad(f"first_k_dense_replace={self.first_k_dense_replace} is out of range")


# ---------------------------------------------------------------------------
# HF -> MLX weight plan (dlm-convert) and quantization classes (dlm.quantize)
# ---------------------------------------------------------------------------

_PROJS = ("gate_proj", "up_proj", "down_proj")
_IGNORED = re.compile(r"(rotary_emb|inv_freq)")


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor of a hub checkpoint (experts per expert) with its shape."""
    H, D = args.hidden_size, args.head_dim
    hq, hkv = args.num_attention_heads, args.num_key_value_heads
    shapes: dict[str, tuple[int, ...]] = {
        "model.word_embeddings.weight": (args.vocab_size, H),
        "model.norm.weight": (H,),
    }
    if not args.tie_word_embeddings:
        shapes["lm_head.weight"] = (args.vocab_size, H)

    def swiglu(prefix: str, inter: int):
        shapes[prefix + "gate_proj.weight"] = (inter, H)
        shapes[prefix + "up_proj.weight"] = (inter, H)
        shapes[prefix + "down_proj.weight"] = (H, inter)

    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        shapes[p + "attention.query_key_value.weight"] = ((hq + 2 * hkv) * D, H)
        if args.use_qkv_bias:
            shapes[p + "attention.query_key_value.bias"] = ((hq + 2 * hkv) * D,)
        if args.use_qk_norm:
            shapes[p + "attention.query_layernorm.weight"] = (D,)
            shapes[p + "attention.key_layernorm.weight"] = (D,)
        shapes[p + "attention.dense.weight"] = (H, hq * D)
        if args.use_bias:
            shapes[p + "attention.dense.bias"] = (H,)
        if not args.is_moe_layer(i):
            swiglu(p + "mlp.", args.intermediate_size)
            continue
        shapes[p + "mlp.gate.weight"] = (args.num_experts, H)
        shapes[p + "mlp.gate.expert_bias"] = (args.num_experts,)
        for e in range(args.num_experts):
            swiglu(f"{p}mlp.experts.{e}.", args.moe_intermediate_size)
        if args.num_shared_experts:
            swiglu(p + "mlp.shared_experts.", args.moe_intermediate_size * args.num_shared_experts)
    return shapes


def _stack(arrays):
    return mx.stack(list(arrays))


def plan_weights(
    args: ModelArgs, source: dict[str, tuple[tuple[int, ...], str]], text_only: bool = True
) -> list[TensorPlan]:
    """Map a hub llada2_moe checkpoint to MLX tensors.

    ``source`` maps each checkpoint tensor to (shape, dtype). Accepts the
    published per-expert layout and the dFactory/VeOmni merged layout
    (``mlp.experts.{proj}`` already [E, out, in]). Raises WeightError naming
    the first missing, mis-shaped or unexpected tensor.
    """
    expected = expected_shapes(args)
    used: set[str] = set()

    def check(name: str, want: tuple[int, ...]) -> None:
        if name not in source:
            raise WeightError(f"checkpoint is missing tensor {name} (expected shape {list(want)})")
        got = tuple(source[name][0])
        if got != tuple(want):
            raise WeightError(f"tensor {name} has shape {list(got)} but the config implies {list(want)}")
        used.add(name)

    plans: list[TensorPlan] = []
    expert = re.compile(r"^(model\.layers\.\d+\.mlp\.)experts\.(\d+)\.(\w+_proj)\.weight$")
    stacked: dict[tuple[str, str], list[str]] = {}
    for name, want in expected.items():
        m = expert.match(name)
        if m:
            stacked.setdefault((m.group(1), m.group(3)), []).append(name)
            continue
        check(name, want)
        plans.append(TensorPlan(name, (name,), keep_float32=name.endswith("expert_bias")))
    for (prefix, proj), names in stacked.items():
        merged = f"{prefix}experts.{proj}"
        out = f"{prefix}switch_mlp.{proj}.weight"
        if merged in source and names[0] not in source:
            check(merged, (len(names),) + expected[names[0]])
            plans.append(TensorPlan(out, (merged,)))
            continue
        for n in names:
            check(n, expected[n])
        plans.append(TensorPlan(out, tuple(names), combine=_stack))
    for name in source:
        if name in used or _IGNORED.search(name):
            continue
        if name == "lm_head.weight" and args.tie_word_embeddings:
            continue
        raise WeightError(f"unexpected tensor {name} in a llada2_moe checkpoint")
    return plans


def output_config(config: dict, text_only: bool = True) -> dict:
    """config.json next to the converted weights: the hub config, minus the
    remote-code hooks (the converted folder ships no modeling code)."""
    return {k: v for k, v in config.items() if k not in ("auto_map", "_name_or_path")}


_HIGH = re.compile(
    r"(^model\.word_embeddings$|^lm_head$|\.attention\.(query_key_value|dense)$"
    r"|^model\.layers\.\d+\.mlp\.(gate|up|down)_proj$)"
)
_LOW = re.compile(r"\.mlp\.(switch_mlp|shared_experts)\.(gate|up|down)_proj$")


def quant_class(path: str) -> str | None:
    """Mixed recipe: attention, embeddings, head and dense FFN layers "high"
    (8-bit); routed and shared experts "low" (--q-bits); the router gate, its
    expert_bias and every norm None (never quantized)."""
    if _HIGH.search(path):
        return "high"
    if _LOW.search(path):
        return "low"
    return None


# ---------------------------------------------------------------------------
# mlx-community layouts (runtime)
# ---------------------------------------------------------------------------


def _dequantize_gate(weights: dict, prefix: str) -> None:
    """mlx-lm quantizes the gate; dlm keeps it float. Infer (group, bits) from shapes."""
    w, scales = weights.pop(prefix + "weight"), weights.pop(prefix + "scales")
    biases = weights.pop(prefix + "biases", None)
    for group in (64, 32, 128):
        in_dims = scales.shape[-1] * group
        bits, rem = divmod(w.shape[-1] * 32, in_dims)
        if not rem and bits in (2, 3, 4, 5, 6, 8):
            weights[prefix + "weight"] = mx.dequantize(w, scales, biases, group, bits).astype(mx.float32)
            return
    raise WeightError(f"cannot infer the quantization of {prefix}weight {list(w.shape)}")


def sanitize(weights: dict) -> dict:
    """Accept mlx-community layouts: mlx-vlm (``language_model.`` prefix,
    ``switch_mlp``), mlx-lm (``switch_mlp``, possibly a quantized gate or a
    bailing-style ``gate.gate_proj``), per-expert or merged experts; drop rotary
    buffers; keep expert_bias in float32."""
    out: dict = {}
    for k, v in weights.items():
        if _IGNORED.search(k):
            continue
        if k.startswith("language_model."):
            k = k[len("language_model."):]
        k = k.replace(".mlp.gate.gate_proj.", ".mlp.gate.")
        m = re.match(r"^(model\.layers\.\d+\.mlp\.)experts\.(\w+_proj)$", k)
        if m:  # merged [E, out, in]
            k = f"{m.group(1)}switch_mlp.{m.group(2)}.weight"
        out[k] = v
    expert = re.compile(r"^(model\.layers\.\d+\.mlp\.)experts\.(\d+)\.(\w+_proj)\.(weight|scales|biases)$")
    groups: dict[tuple[str, str, str], dict[int, Any]] = {}
    for k in [k for k in out if expert.match(k)]:
        m = expert.match(k)
        groups.setdefault((m.group(1), m.group(3), m.group(4)), {})[int(m.group(2))] = out.pop(k)
    for (prefix, proj, kind), per in groups.items():
        if sorted(per) != list(range(len(per))):
            raise WeightError(f"{prefix}experts.*.{proj}.{kind}: experts are not numbered 0..{len(per) - 1}")
        out[f"{prefix}switch_mlp.{proj}.{kind}"] = mx.stack([per[e] for e in range(len(per))])
    for k in [k for k in out if k.endswith(".mlp.gate.scales")]:
        _dequantize_gate(out, k[: -len("scales")])
    for k in [k for k in out if k.endswith("expert_bias")]:
        out[k] = out[k].astype(mx.float32)
    return out


# ---------------------------------------------------------------------------
# MLX modules (§3)
# ---------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Normalise in float32, cast back, then multiply the weight in the model dtype."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x):
        return self.weight * mx.fast.rms_norm(x, None, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.hq, self.hkv, self.d = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.query_key_value = nn.Linear(
            args.hidden_size, (self.hq + 2 * self.hkv) * self.d, bias=args.use_qkv_bias
        )
        self.dense = nn.Linear(self.hq * self.d, args.hidden_size, bias=args.use_bias)
        self.use_qk_norm = args.use_qk_norm
        if args.use_qk_norm:
            self.query_layernorm = RMSNorm(self.d, args.rms_norm_eps)
            self.key_layernorm = RMSNorm(self.d, args.rms_norm_eps)
        self.rotary_dim, self.theta = args.rotary_dim, args.rope_theta
        self.scale = self.d ** -0.5

    def __call__(self, x, offset: int, mask, cache: Optional[CommittedKVCache]):
        B, L, _ = x.shape
        qkv = self.query_key_value(x).reshape(B, L, self.hq + 2 * self.hkv, self.d)
        q, k, v = mx.split(qkv, [self.hq, self.hq + self.hkv], axis=2)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        if self.use_qk_norm:  # before RoPE
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q = mx.fast.rope(q, self.rotary_dim, traditional=False, base=self.theta, scale=1.0, offset=offset)
        k = mx.fast.rope(k, self.rotary_dim, traditional=False, base=self.theta, scale=1.0, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.dense(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    """Sigmoid router, expert_bias for selection only, group-limited top-k (§3.6).
    Raw arrays, not a Linear: the router is never quantized."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.weight = mx.zeros((args.num_experts, args.hidden_size))
        self.expert_bias = mx.zeros((args.num_experts,), dtype=mx.float32)
        self.k, self.n_group, self.topk_group = args.num_experts_per_tok, args.n_group, args.topk_group
        self.scaling = args.routed_scaling_factor

    def __call__(self, x):
        s = mx.sigmoid(x.astype(mx.float32) @ self.weight.astype(mx.float32).T)
        b = s + self.expert_bias.astype(mx.float32)
        if self.topk_group < self.n_group:
            T, E = b.shape
            grouped = b.reshape(T, self.n_group, E // self.n_group)
            top2 = mx.topk(grouped, min(2, E // self.n_group), axis=-1).sum(-1)
            dropped = mx.argpartition(top2, kth=self.n_group - self.topk_group - 1, axis=-1)
            dropped = dropped[:, : self.n_group - self.topk_group]
            group_ok = mx.put_along_axis(
                mx.ones((T, self.n_group), dtype=mx.bool_), dropped, mx.array(False), axis=-1
            )
            keep = mx.broadcast_to(group_ok[..., None], grouped.shape).reshape(T, E)
            b = mx.where(keep, b, -mx.inf)
        idx = mx.argsort(-b, axis=-1)[:, : self.k]  # descending, as the reference sums
        w = mx.take_along_axis(s, idx, axis=-1)
        if self.k > 1:
            w = w / (w.sum(-1, keepdims=True) + 1e-20)
        return mx.stop_gradient(idx), w * self.scaling


class SparseMoe(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = Gate(args)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts)
        if args.num_shared_experts:
            self.shared_experts = MLP(args.hidden_size, args.moe_intermediate_size * args.num_shared_experts)

    def __call__(self, x):
        shape = x.shape
        t = x.reshape(-1, shape[-1])
        idx, w = self.gate(t)
        y = self.switch_mlp(t, idx).astype(mx.float32)  # [T, k, H]
        y = (y * w[..., None]).sum(1).astype(x.dtype).reshape(shape)
        if "shared_experts" in self:
            y = y + self.shared_experts(x)
        return y


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attention = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if args.is_moe_layer(index):
            self.mlp = SparseMoe(args)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size)

    def __call__(self, h, offset, mask, cache):
        h = h + self.attention(self.input_layernorm(h), offset, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LLaDA2Backbone(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.word_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = LLaDA2Backbone(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self, capacity: int) -> list[CommittedKVCache]:
        return [CommittedKVCache(capacity) for _ in self.model.layers]

    def __call__(self, inputs, cache=None, mask=None, last: Optional[int] = None):
        """float32 logits of ``inputs`` [B, L] (the last ``last`` positions only).

        ``mask``: None (bidirectional), or a boolean/additive array over
        [L, cached + L]. Positions start at the cache offset.
        """
        h = self.model.word_embeddings(inputs)
        offset = cache[0].offset if cache else 0
        for i, layer in enumerate(self.model.layers):
            h = layer(h, offset, mask, cache[i] if cache else None)
        if last is not None:
            h = h[:, -last:]
        h = self.model.norm(h)
        if self.args.tie_word_embeddings:
            return self.model.word_embeddings.as_linear(h).astype(mx.float32)
        return self.lm_head(h).astype(mx.float32)

    @staticmethod
    def sanitize(weights: dict) -> dict:
        return sanitize(weights)


def block_causal_mask(start: int, length: int, prefix: int, block_length: int):
    """Boolean [length, prefix + length] mask for a window at absolute positions
    [start, start + length) over keys [start - prefix, start + length):
    query i sees key j iff block(j) <= block(i). None when that is everything."""
    if start % block_length == 0 and length <= block_length:
        return None
    q = mx.arange(start, start + length) // block_length
    k = mx.arange(start - prefix, start + length) // block_length
    return k[None, :] <= q[:, None]

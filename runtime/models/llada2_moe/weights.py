"""LLaDA-2 weight map, both directions.

Converted names are the hub names, except the routed experts, which are stacked
as ``model.layers.{i}.mlp.switch_mlp.{gate,up,down}_proj.weight`` [E, out, in]
(the mlx-lm layout; mlx-vlm adds a ``language_model.`` prefix).

* ``plan_weights``: hub checkpoint -> MLX tensors (dlm-convert);
* ``sanitize``: mlx-community layouts -> the MLX module tree (load time);
* ``to_hf``: MLX tensors -> hub names, stacked experts split per expert (dlm-verify);
* ``quant_class``: the mixed recipe's classes (dlm.quantize).
"""

from __future__ import annotations

import re
from typing import Any

import mlx.core as mx

from ...platform.errors import WeightError
from ..plan import TensorPlan
from .config import ModelArgs

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


_SWITCH = re.compile(r"^(model\.layers\.\d+\.mlp\.)switch_mlp\.(\w+_proj)\.weight$")


def to_hf(mlx_weights) -> dict:
    """MLX names -> hub names: the stacked switch experts split per expert."""
    out = {}
    for name, value in mlx_weights.items():
        if name.startswith("language_model."):
            name = name[len("language_model."):]
        m = _SWITCH.match(name)
        if m:
            for e in range(value.shape[0]):
                out[f"{m.group(1)}experts.{e}.{m.group(2)}.weight"] = value[e]
        else:
            out[name] = value
    return out


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


# Load time: mlx-community layouts.

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


def sanitize(weights: dict, args=None) -> dict:
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

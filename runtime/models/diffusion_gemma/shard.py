"""DiffusionGemma over the ranks of an ``mlx.launch`` job: ``shard(model, world)``
(``FAMILY.shard``) keeps this rank's share of the loaded weights and attaches
the forward that puts the shares together (parallel.py).

* Routed experts: expert parallel, ``world.span(num_experts)`` per rank; the
  router replicated.
* Attention: tensor parallel by KV head (each rank its KV heads' query heads;
  o_proj split by input columns) in the layers whose KV heads divide over the
  ranks; the others (DiffusionGemma's full-attention layers have 2 KV heads,
  the tiny test models' 1) replicated whole, with no collective. A quantized
  o_proj splits only at its groups, else that layer's attention is replicated
  too.
* Dense MLP: tensor parallel over the intermediate features (whole quantization
  groups of down_proj), else replicated.
* Vocabulary: the tied embedding / output head by rows, equal widths (the
  last rank's shorter) as ``gather_last`` joins the logits.
* Replicated: norms, routers, layer scalars, the self-conditioning MLP, the
  vision tower.

Every decision reads only the config and the module shapes, which every rank
shares, so every rank decides (and refuses) alike, before anything is sliced.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...platform.distributed import DistributedError, World, span
from ..shard import keep_cols, keep_experts, keep_rows
from .config import SLIDING
from .parallel import LayerShard, VocabShard


@dataclass(frozen=True)
class LayerPlan:
    attention: str  # "" (split), else why it is replicated
    mlp_unit: int  # intermediate features per unit split over the ranks (0: replicated)
    experts: tuple[int, int]


def shard(model, world: World) -> list[str]:
    """Keep this rank's share of ``model`` (see the module docstring); returns the notes."""
    dec = model.model.decoder
    args = model.args
    _check(args, world)
    plans = [_plan_layer(layer, args, world) for layer in dec.layers]
    for layer, plan in zip(dec.layers, plans):
        _shard_layer(layer, plan, world)
    lo, hi = world.vocab_span(args.vocab_size)
    keep_rows(dec.embed_tokens, lo, hi)
    if hasattr(dec.embed_tokens, "num_embeddings"):
        dec.embed_tokens.num_embeddings = hi - lo
    dec.vocab_shard = VocabShard(world, lo, hi, args.vocab_size)
    return _notes(model, plans, world)


def _check(args, world: World) -> None:
    """What must split for the model to run over the ranks at all."""
    n = world.size
    if args.num_experts < n:
        raise DistributedError(f"routed experts: {args.num_experts} per layer cannot split over {n} ranks "
                               "(expert parallel needs one expert per rank at least)")
    width = -(-args.vocab_size // n)
    if width * (n - 1) >= args.vocab_size:
        raise DistributedError(f"vocabulary: {args.vocab_size} entries cannot split over {n} ranks in "
                               f"equal widths of {width}")


def _plan_layer(layer, args, world: World) -> LayerPlan:
    return LayerPlan(_attention_split(layer.self_attn, world), _mlp_unit(layer.mlp, world),
                     world.span(args.num_experts))


def _attention_split(attn, world: World) -> str:
    """"" when the layer's attention splits by KV head over the ranks, else why not."""
    n = world.size
    if attn.n_kv % n:
        return f"{attn.n_kv} KV head(s) do not divide over {n} ranks"
    if attn.n_heads % attn.n_kv:
        return f"{attn.n_heads} query heads do not group over {attn.n_kv} KV heads"
    o = attn.o_proj
    if "scales" in o and (attn.head_dim * attn.n_heads // n) % o.group_size:  # a rank's o_proj columns
        return f"o_proj's quantization groups of {o.group_size} do not fall on a rank's heads"
    return ""


def _mlp_unit(mlp, world: World) -> int:
    """Intermediate features per unit of the dense MLP's split (whole groups of a
    quantized down_proj), 0 when fewer units than ranks."""
    down = mlp.down_proj
    unit = down.group_size if "scales" in down else 1
    inter = mlp.gate_proj["weight"].shape[0]
    return unit if inter % unit == 0 and inter // unit >= world.size else 0


def _shard_layer(layer, plan: LayerPlan, world: World) -> None:
    if not plan.attention:
        _split_attention(layer.self_attn, world)
    if plan.mlp_unit:
        inter = layer.mlp.gate_proj["weight"].shape[0]
        lo, hi = (i * plan.mlp_unit for i in world.span(inter // plan.mlp_unit))
        keep_rows(layer.mlp.gate_proj, lo, hi)
        keep_rows(layer.mlp.up_proj, lo, hi)
        keep_cols(layer.mlp.down_proj, lo, hi, keep_bias=world.primary)
    lo, hi = plan.experts
    keep_experts(layer.experts.gate_up_proj, lo, hi)
    keep_experts(layer.experts.down_proj, lo, hi)
    layer.parallel = LayerShard(world, not plan.attention, bool(plan.mlp_unit), plan.experts)


def _split_attention(attn, world: World) -> None:
    """This rank's KV heads and the query heads that read them (consecutive
    groups of n_heads / n_kv, as scaled_dot_product_attention pairs them)."""
    lo, hi = world.span(attn.n_kv)
    d, group = attn.head_dim, attn.n_heads // attn.n_kv
    keep_rows(attn.q_proj, lo * group * d, hi * group * d)
    keep_rows(attn.k_proj, lo * d, hi * d)
    if attn.is_sliding:  # full layers read V = K (no v_proj)
        keep_rows(attn.v_proj, lo * d, hi * d)
    keep_cols(attn.o_proj, lo * group * d, hi * group * d, keep_bias=world.primary)
    attn.n_heads, attn.n_kv = (hi - lo) * group, hi - lo


# -- what the loader reports ------------------------------------------------------


def _sizes(n: int, world: World) -> str:
    return "+".join(str(hi - lo) for lo, hi in (span(n, world.size, r) for r in range(world.size)))


def _layers(indices: list[int]) -> str:
    """[0, 1, 2, 4] -> "layers 0-2, 4"; [5] -> "layer 5"."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    text = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
    return f"layer {text}" if len(indices) == 1 else f"layers {text}"


def _notes(model, plans: list[LayerPlan], world: World) -> list[str]:
    args, n = model.args, world.size
    split = [i for i, p in enumerate(plans) if not p.attention]
    notes = [f"routed experts: expert parallel, {args.num_experts} per layer as {_sizes(args.num_experts, world)} "
             "over the ranks (routers replicated)"]
    if split:
        kinds = sorted({"sliding" if args.layer_types[i] == SLIDING else "full" for i in split})
        notes.append(f"attention: tensor parallel by KV head in {_layers(split)} ({'/'.join(kinds)})")
    for reason in dict.fromkeys(p.attention for p in plans if p.attention):  # in layer order
        where = [i for i, p in enumerate(plans) if p.attention == reason]
        notes.append(f"attention replicated in {_layers(where)}: {reason}")
    if all(p.mlp_unit for p in plans):
        notes.append(f"dense MLP: tensor parallel, {args.intermediate_size} intermediate features split over the "
                     "ranks")
    else:
        notes.append(f"dense MLP replicated: {args.intermediate_size} intermediate features (in whole quantization "
                     f"groups) do not split over {n} ranks")
    width = -(-args.vocab_size // n)
    notes.append(f"vocabulary: tied embedding / output head and self-conditioning product split by rows, "
                 f"{width} per rank of {args.vocab_size}; logits gathered on every rank before the softcap")
    notes.append("replicated: norms, routers, layer scalars, the self-conditioning MLP"
                 + (", the vision tower" if model.has_vision else ""))
    sums = 1 + len(plans) + len(split)
    notes.append(f"collectives per denoising forward: {sums} all_sum (1 for the embeddings, 1 per layer for "
                 f"attention where split, 1 per layer for the MLP and experts) and 1 all_gather (the logits)")
    return notes

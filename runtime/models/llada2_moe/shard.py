"""LLaDA-2 over the ranks of an ``mlx.launch`` job: what each rank keeps of the
loaded model (runtime/models/shard.py slices it), and where model.py adds the
collectives.

* routed experts: expert parallel, ``span(num_experts)`` per rank; the router
  (``gate``) is replicated and every rank routes every token, so each rank runs
  its own experts' slots (``local_routes``) and the layer sums over the ranks;
* attention: tensor parallel by heads when both the query and the KV heads
  divide the ranks (fused ``query_key_value`` rows per head, ``dense`` columns,
  one sum); otherwise replicated, and the notes say so;
* dense MLPs (the first layers) and the shared experts: tensor parallel over
  the intermediate features (whole quantization groups); a MoE layer's shared
  and routed partials share one sum;
* the output head and the embedding table: split over the vocabulary (logits
  gathered, lookups summed), unless tied.

Per forward: one sum per attention, one per MLP/MoE layer, one for the
embedding, one gather for the head. The layer pieces run eagerly (not through
mx.compile), so the collectives are counted per call.
"""

from __future__ import annotations

import mlx.nn as nn

from ...platform.distributed import DistributedError, World, span
from ..shard import keep_cols, keep_experts, keep_row_ranges, keep_rows
from .model import MLP, SparseMoe


def _unit(module: nn.Module) -> int:
    """The input features a column split must keep together: a quantization group."""
    return module.group_size if "scales" in module else 1


def _attention(attn, w: World) -> str:
    hq, hkv, d = attn.hq, attn.hkv, attn.d
    unit = _unit(attn.dense)
    if hq % w.size or hkv % w.size or (hq // w.size * d) % unit:
        return f"attention replicated ({hq} query / {hkv} KV heads over {w.size} ranks)"
    qlo, qhi = w.span(hq)
    klo, khi = w.span(hkv)
    keep_row_ranges(attn.query_key_value, [(qlo * d, qhi * d), ((hq + klo) * d, (hq + khi) * d),
                                 ((hq + hkv + klo) * d, (hq + hkv + khi) * d)])
    keep_cols(attn.dense, qlo * d, qhi * d, keep_bias=w.primary)
    attn.hq, attn.hkv, attn.world = qhi - qlo, khi - klo, w
    return f"attention heads split ({hq // w.size} query / {hkv // w.size} KV heads per rank)"


def _mlp(mlp: MLP, w: World) -> bool:
    """Intermediate features split in whole quantization groups, ``down`` summed over
    the ranks; False (left whole) where they do not give every rank a group."""
    inter, unit = mlp.gate_proj["weight"].shape[0], _unit(mlp.down_proj)
    if inter % unit or inter // unit < w.size:
        return False
    lo, hi = (unit * i for i in w.span(inter // unit))
    keep_rows(mlp.gate_proj, lo, hi)
    keep_rows(mlp.up_proj, lo, hi)
    keep_cols(mlp.down_proj, lo, hi, keep_bias=w.primary)
    return True


def _experts(moe: SparseMoe, w: World) -> str:
    E = moe.switch_mlp.gate_proj["weight"].shape[0]
    if E < w.size:
        raise DistributedError(f"{E} experts do not split over {w.size} ranks (expert parallel needs one each)")
    lo, hi = w.span(E)
    for p in moe.switch_mlp.projections:
        keep_experts(p, lo, hi)
    moe.experts_held, moe.world = (lo, hi), w
    if "shared_experts" not in moe:
        return "no shared experts"
    if _mlp(moe.shared_experts, w):
        return "shared experts split over their features"
    moe.shared_here = w.primary  # whole on every rank: rank 0 alone adds it before the sum
    return "shared experts replicated (their features do not split)"


def _vocabulary(model, w: World) -> str:
    """Head and embedding rows ``vocab_span(V)``: ceil(V / N) per rank, the last one's fewer."""
    if model.args.tie_word_embeddings:
        return "vocabulary replicated (tied head)"
    V = model.args.vocab_size
    lo, hi = w.vocab_span(V)
    for module in (model.lm_head, model.model.word_embeddings):
        keep_rows(module, lo, hi)
    model.vocab_held, model.world = (lo, hi), w
    return f"vocabulary split ({-(-V // w.size)} of {V} rows of the head and the embedding per rank)"


def shard(model, w: World) -> list[str]:
    """Keep this rank's share of ``model`` (loaded, not evaluated); the notes say what
    is split and what replicated."""
    notes = {_attention(layer.attention, w) for layer in model.layers}
    for layer in model.layers:
        if isinstance(layer.mlp, SparseMoe):
            notes.add(_experts(layer.mlp, w))
        elif _mlp(layer.mlp, w):
            layer.mlp.world = w
            notes.add("dense MLPs split over their features")
        else:
            notes.add("dense MLPs replicated (their features do not split)")
    E = model.args.num_experts
    lo, hi = span(E, w.size, w.rank)
    notes = sorted(notes) + [f"experts split ({hi - lo} of {E} on rank {w.rank}); router replicated",
                             _vocabulary(model, w)]
    model.compile = False  # eager layers: every collective is issued (and counted) per call
    return notes

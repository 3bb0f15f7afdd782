"""DiffusionGemma's forward over the ranks of a sharded run (shard.py keeps each
rank's share of the weights and attaches these to the modules).

Every rank runs the same forward on the same inputs; the collectives put the
ranks' partial products together:

* per layer: o_proj's products where the attention heads are split (one
  ``all_sum``), then the dense MLP's and the routed experts' partial outputs in
  ONE ``all_sum`` (stacked: each has its own norm after the sum, so they cannot
  be added first);
* per forward: the embedding lookup and the self-conditioning product of a
  vocabulary-sharded table in one ``all_sum``, the logits with ``gather_last``
  (the softcap and the sampling then see the full vocabulary on every rank).

The collectives run eagerly between the compiled pieces, so each one is issued
(and counted, platform/distributed.py) once per call.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import mlx.core as mx

from ...platform.distributed import World, all_sum, gather_last
from ..shard import local_routes
from .layers import _record


class VocabShard:
    """The tied embedding / output head holding rows [lo, hi) of ``total`` on this rank."""

    def __init__(self, world: World, lo: int, hi: int, total: int):
        self.world, self.lo, self.hi, self.total = world, lo, hi, total

    def lookup(self, dec, ids: mx.array) -> mx.array:
        """This rank's part of the unscaled embeddings: its rows, zeros for other ids
        (the sum over the ranks adds exact zeros: the single-process values)."""
        mine = (ids >= self.lo) & (ids < self.hi)
        rows = dec.embed_tokens(mx.where(mine, ids - self.lo, 0))
        return mx.where(mine[..., None], rows, mx.zeros((), dtype=rows.dtype))

    def product(self, dec, probs: mx.array) -> mx.array:
        """This rank's part of probs @ W_E (unscaled): its vocabulary slice of the probabilities."""
        return dec.probs_product(probs[..., self.lo:self.hi])

    def embed(self, dec, ids: mx.array) -> mx.array:
        return dec.scaled(all_sum(self.lookup(dec, ids), self.world))

    def embed_probs(self, dec, probs: mx.array) -> mx.array:
        return dec.scaled(all_sum(self.product(dec, probs), self.world))

    def inputs_probs(self, dec, canvas: mx.array, probs: mx.array) -> mx.array:
        """The decoder input with self-conditioning: both sums in one all_sum."""
        parts = [self.lookup(dec, canvas), self.product(dec, probs)]
        dtype = parts[0].dtype
        both = all_sum(mx.stack([p.astype(dtype) for p in parts]), self.world)
        return dec.self_conditioning(dec.scaled(both[0]), dec.scaled(both[1]))

    def project(self, dec, h: mx.array) -> mx.array:
        """Logits over the whole vocabulary (model dtype, before the softcap): this
        rank's columns, gathered in rank order."""
        return gather_last(dec.local_logits(h), self.world, self.total)


class Pieces(NamedTuple):
    project: Callable  # (x, offset) -> q, k, v (this rank's heads)
    output: Callable  # attention output -> o_proj's product (a partial where heads are split)
    mix: Callable  # (x, o) -> h, mlp, xe, weights, idx
    routed: Optional[Callable]  # (xe, idx, weights, sequences) -> experts' partial (None: in mix_routed)
    mix_routed: Optional[Callable]  # (x, o) -> h, mlp, experts' partial, idx (one compiled graph)
    combine: Callable  # (h, mlp sum, experts sum, scalar) -> the layer's output


class LayerShard:
    """One decoder layer's share: ``attention`` (heads split: o_proj's products
    summed), ``mlp`` (the dense MLP's intermediate split: its output summed),
    experts [lo, hi) of the routed ones (their outputs summed)."""

    def __init__(self, world: World, attention: bool, mlp: bool, experts: tuple[int, int]):
        self.world, self.attention, self.mlp = world, attention, mlp
        self.lo, self.hi = experts
        self._pieces: dict = {}

    def routed(self, layer, xe: mx.array, idx: mx.array, weights: mx.array, sequences: int) -> mx.array:
        """The routed experts' output from this rank's experts (the other slots weigh 0)."""
        local_idx, local_weights = local_routes(idx, weights, self.lo, self.hi)
        return layer.experts(xe, local_idx, local_weights, sequences)

    def mix(self, layer, x: mx.array, o: mx.array):
        """The residual, the dense MLP's output before its norm, the experts' input and the routing."""
        h = x + layer.post_attention_layernorm(o)
        return (h, *layer.branches(h))

    def combine(self, layer, h: mx.array, mlp: mx.array, experts: mx.array, scalar: mx.array) -> mx.array:
        return layer._combine(h, layer.post_feedforward_layernorm_1(mlp), experts, scalar)

    def pieces(self, layer, compiled: bool) -> Pieces:
        if compiled not in self._pieces:
            self._pieces[compiled] = self._build(layer, compiled)
        return self._pieces[compiled]

    def _build(self, layer, compiled: bool) -> Pieces:
        def mix(x, o):
            return self.mix(layer, x, o)

        def routed(xe, idx, weights, sequences):
            return self.routed(layer, xe, idx, weights, sequences)

        def mix_routed(x, o):
            h, mlp, xe, weights, idx = mix(x, o)
            return h, mlp, routed(xe, idx, weights, x.shape[0]), idx

        def combine(h, mlp, experts, scalar):
            return self.combine(layer, h, mlp, experts, scalar)

        project, output = layer._project, layer.self_attn.output
        if not compiled:
            return Pieces(project, output, mix, routed, None, combine)
        state = layer.state  # the layer's arrays as implicit inputs, as DecoderLayer.compiled
        fused = [mx.compile(fn, inputs=state) for fn in (project, output, mix, mix_routed, combine)]
        if layer.experts.eager:  # the CPU experts read their routing on the host: outside the graph
            return Pieces(fused[0], fused[1], fused[2], routed, None, fused[4])
        return Pieces(fused[0], fused[1], fused[2], None, fused[3], fused[4])

    def __call__(self, layer, x: mx.array, cache, offset, encode: bool, scalar: mx.array,
                 attention_only: bool, compiled: bool, blocks: Optional[mx.array]) -> Optional[mx.array]:
        """DecoderLayer.__call__ on this rank's share (same arguments)."""
        p = self.pieces(layer, compiled)
        q, k, v = p.project(x, offset)
        attn = layer.attention(q, k, v, cache, encode, blocks)
        if attention_only:
            _record(None)
            return None
        o = p.output(attn)
        if self.attention:
            o = all_sum(o, self.world)
        if p.mix_routed is not None:
            h, mlp, experts, idx = p.mix_routed(x, o)
        else:
            h, mlp, xe, weights, idx = p.mix(x, o)
            experts = p.routed(xe, idx, weights, x.shape[0])
        _record(idx)
        mlp, experts = self._sum(mlp, experts)
        return p.combine(h, mlp, experts, scalar)

    def _sum(self, mlp: mx.array, experts: mx.array) -> tuple[mx.array, mx.array]:
        """The experts' partial (and the dense MLP's, where split) summed in one all_sum."""
        if not self.mlp:
            return mlp, all_sum(experts, self.world)
        both = all_sum(mx.stack([mlp.reshape(experts.shape), experts.astype(mlp.dtype)]), self.world)
        return both[0].reshape(mlp.shape), both[1]

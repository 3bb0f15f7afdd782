"""The LLaDA-2 MLX model (the forward pass of inclusionAI/LLaDA2.0-mini's hub
``modeling_llada2_moe.py``): fused QKV with QK-norm before
partial RoPE, a sigmoid group-limited router with ``expert_bias``, routed and
shared experts, dense first layers, and the committed-prefix KV cache of the
block loop.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ...platform.distributed import all_sum, gather_last
from ...platform.errors import GenerationError
from ..base import compile_enabled
from ..cpu.streams import split_positions
from ..rows import as_linear, linear, linear_each, matmul
from ..shard import local_routes
from ..cpu.dequant import per_call, splits, wants
from ..switch import SwitchLinear, SwitchMLP, dense
from ..taps import layer_input
from .config import ModelArgs
from .options import BLOCK_LENGTH
from .weights import sanitize


def _linear(module, x):
    """``rows.linear``; a quantized module on the CPU backend has its rows split
    over the CPU streams (cpu/streams.py: its kernel is single-threaded)."""
    if splits(module):
        return split_positions(lambda rows: linear(module, rows), x)
    return linear(module, x)


class SwitchGLU(SwitchMLP):
    """Routed experts: ``down(silu(gate(x)) * up(x))`` for each (token, slot)
    (switch.SwitchMLP chooses the kernel): x [T, H], indices [T, k] -> [T, k, H]."""

    def __init__(self, hidden: int, inter: int, num_experts: int):
        super().__init__()
        self.gate_proj = SwitchLinear(hidden, inter, num_experts)
        self.up_proj = SwitchLinear(hidden, inter, num_experts)
        self.down_proj = SwitchLinear(inter, hidden, num_experts)

    @property
    def inputs(self) -> list:
        return [self.gate_proj, self.up_proj]

    def activate(self, gate, up):
        return nn.silu(gate) * up

    def weighted(self, x, indices, weights):
        """The routed experts' weighted sum, ``x`` [S, n, H] (S sequences of n
        positions), indices/weights [S*n, k] -> float32 [S, n, H], through all
        the experts at once (small experts on the CPU: cpu/experts.dense): each
        token times every expert's gate and up weights, the chosen ones kept,
        and their activations, scaled by the routing weights, through one down
        product. Every product runs per sequence (rows.matmul)."""
        S, n, H = x.shape
        E, inter, _ = self.gate_proj["weight"].shape
        T = indices.shape[0]

        def all_experts(layer):
            y = matmul(x, layer["weight"].reshape(E * inter, H).T).reshape(T, E, inter)
            return mx.take_along_axis(y, indices[..., None], axis=1)

        h = nn.silu(all_experts(self.gate_proj)) * all_experts(self.up_proj)  # [T, k, inter]
        h = (h.astype(mx.float32) * weights[..., None]).astype(x.dtype)
        # Added, not put: under expert parallelism a token's foreign slots share local expert 0 (weight 0).
        spread = mx.zeros((T, E, inter), dtype=h.dtype).at[mx.arange(T)[:, None], indices].add(h)
        down = self.down_proj["weight"].transpose(0, 2, 1).reshape(E * inter, H)
        return matmul(spread.reshape(S, n, E * inter), down).astype(mx.float32)


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

    def adopt(self, other: "CommittedKVCache", n: int) -> None:
        """Take ``other``'s first ``n`` committed positions (a kept chat prefix)."""
        B, H, _, D = other.keys.shape
        if self.keys is None:
            self.keys = mx.zeros((B, H, self.capacity, D), dtype=other.keys.dtype)
            self.values = mx.zeros((B, H, self.capacity, other.values.shape[-1]), dtype=other.values.dtype)
        self.keys[..., :n, :] = other.keys[..., :n, :]
        self.values[..., :n, :] = other.values[..., :n, :]
        self.offset, self._window = n, 0

    def segment(self, n: int) -> tuple[mx.array, mx.array]:
        """Copies of the last ``n`` committed positions' K/V (a prefix cache keeps them)."""
        a, b = self.offset - n, self.offset
        return mx.contiguous(self.keys[..., a:b, :]), mx.contiguous(self.values[..., a:b, :])

    def restore(self, parts: list[tuple[mx.array, mx.array]], offset: int) -> None:
        """The first ``offset`` committed positions, from the ``segment``s that made them, in order."""
        keys, values = parts[0]
        B, H, _, D = keys.shape
        self.keys = mx.zeros((B, H, self.capacity, D), dtype=keys.dtype)
        self.values = mx.zeros((B, H, self.capacity, values.shape[-1]), dtype=values.dtype)
        at = 0
        for k, v in parts:
            self.keys[..., at : at + k.shape[2], :] = k
            self.values[..., at : at + v.shape[2], :] = v
            at += k.shape[2]
        self.offset, self._window = offset, 0

    def commit(self, n: int) -> None:
        if n > self._window:
            raise ValueError(f"cannot commit {n} of a {self._window}-position window")
        self.offset += n
        self._window = 0


class RMSNorm(nn.Module):
    """Normalise in float32, cast back, then multiply the weight in the model dtype."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x):
        return self.weight * mx.fast.rms_norm(x, None, self.eps)


class Attention(nn.Module):
    """Run by the layer in pieces (``project``, ``attend``, ``output``): the first
    and last may be fused with the layer's other fixed-shape work."""

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
        self.world = None  # heads split over these ranks (shard.py): ``dense`` sums over them

    def project(self, x, offset):
        """q, k, v as [B, heads, L, d]: QK-normed, then RoPE'd at positions offset.. (an
        array [B] in a batch: each sequence at its own)."""
        B, L, _ = x.shape
        qkv = _linear(self.query_key_value, x).reshape(B, L, self.hq + 2 * self.hkv, self.d)
        q, k, v = mx.split(qkv, [self.hq, self.hq + self.hkv], axis=2)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        if self.use_qk_norm:  # before RoPE
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q = mx.fast.rope(q, self.rotary_dim, traditional=False, base=self.theta, scale=1.0, offset=offset)
        k = mx.fast.rope(k, self.rotary_dim, traditional=False, base=self.theta, scale=1.0, offset=offset)
        return q, k, v

    def attend(self, q, k, v, mask, cache):
        """The attention output before ``dense``, [B, heads, L, d]. ``cache`` may be a
        list, one per sequence of a batch, with ``mask`` a list alike: each sequence
        attends to its own cache."""
        if isinstance(cache, list):
            return self._attend_each(q, k, v, mask, cache)
        return self._attend(q, k, v, mask, cache)

    def output(self, o):
        B, _, L, _ = o.shape
        y = _linear(self.dense, o.transpose(0, 2, 1, 3).reshape(B, L, -1))
        return y if self.world is None else all_sum(y, self.world)

    def _attend_each(self, q, k, v, masks: list, caches: list[CommittedKVCache]):
        """A batch's attention, each sequence against its own cache. Sequences
        whose caches hold as many positions have the same block-causal mask (the
        batch's windows and blocks are as long) and attend in one batched call,
        which computes per sequence what it computes alone."""
        groups: dict[int, list[int]] = {}
        for b, c in enumerate(caches):
            groups.setdefault(c.offset, []).append(b)
        out, order = [], []
        for idx in groups.values():
            kv = [caches[b].update_and_fetch(k[b : b + 1], v[b : b + 1]) for b in idx]
            keys, values = (mx.concatenate(t) if len(idx) > 1 else t[0] for t in zip(*kv))
            qs = q if len(groups) == 1 else q[mx.array(idx)]
            out.append(mx.fast.scaled_dot_product_attention(qs, keys, values, scale=self.scale, mask=masks[idx[0]]))
            order.extend(idx)
        if len(groups) == 1:
            return out[0]
        return mx.concatenate(out)[mx.array([order.index(b) for b in range(len(caches))])]

    def _attend(self, q, k, v, mask, cache: Optional[CommittedKVCache]):
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.world = None  # a dense layer's features split over these ranks (shard.py)

    def partial(self, x):
        """This rank's share of the output (all of it on one process)."""
        return _linear(self.down_proj, nn.silu(_linear(self.gate_proj, x)) * _linear(self.up_proj, x))

    def __call__(self, x):
        y = self.partial(x)
        return y if self.world is None else all_sum(y, self.world)


class Gate(nn.Module):
    """Sigmoid router, expert_bias for selection only; group-limited top-k (as the
    hub ``modeling_llada2_moe.py: LLaDA2MoeSparseMoeBlock`` of LLaDA2.0/2.1 routes)
    or, on LLaDA2.2 (``expert_capacity`` > 0), block routing: each token picks its
    top-k from the pool of its block of ``block_size`` tokens (docs/llada2.md).
    Raw arrays, not a Linear: the router is never quantized."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.weight = mx.zeros((args.num_experts, args.hidden_size))
        self.expert_bias = mx.zeros((args.num_experts,), dtype=mx.float32)
        self.k, self.n_group, self.topk_group = args.num_experts_per_tok, args.n_group, args.topk_group
        self.capacity, self.block_size = args.expert_capacity, args.block_size
        self.scaling = args.routed_scaling_factor

    def __call__(self, x, sequences: int = 1):
        """x [T, H] (``sequences`` equal-length sequences' rows, in order)."""
        x32 = x.astype(mx.float32).reshape(sequences, -1, x.shape[-1])
        s = mx.sigmoid(matmul(x32, self.weight.astype(mx.float32).T).reshape(x.shape[0], -1))
        b = s + self.expert_bias.astype(mx.float32)
        if self.capacity:
            b = self._pooled(b, sequences)
        elif self.topk_group < self.n_group:
            b = self._group_limited(b)
        idx = _top(b, self.k)  # descending, as the reference sums
        w = mx.take_along_axis(s, idx, axis=-1)
        if self.k > 1:
            w = w / (w.sum(-1, keepdims=True) + 1e-20)
        return mx.stop_gradient(idx), w * self.scaling

    def _group_limited(self, b):
        T, E = b.shape
        grouped = b.reshape(T, self.n_group, E // self.n_group)
        top2 = mx.topk(grouped, min(2, E // self.n_group), axis=-1).sum(-1)
        dropped = mx.argpartition(top2, kth=self.n_group - self.topk_group - 1, axis=-1)
        dropped = dropped[:, : self.n_group - self.topk_group]
        group_ok = mx.put_along_axis(
            mx.ones((T, self.n_group), dtype=mx.bool_), dropped, mx.array(False), axis=-1
        )
        keep = mx.broadcast_to(group_ok[..., None], grouped.shape).reshape(T, E)
        return mx.where(keep, b, -mx.inf)

    def _pooled(self, b, sequences: int):
        """Block routing: the experts outside each block's pool (its top
        ``expert_capacity`` by the max over the block's tokens) set to -inf.
        Blocks are per sequence; every forward starts on a block boundary."""
        T, E = b.shape
        n = T // sequences
        if n % self.block_size:
            raise GenerationError(f"LLaDA2.2 block routing needs whole blocks of block_size={self.block_size} "
                                  f"tokens; a forward of {n} tokens per sequence is not")
        groups = b.reshape(sequences, n // self.block_size, self.block_size, E)
        pool = _top(groups.max(axis=2), self.capacity)  # [S, G, capacity]
        inside = mx.put_along_axis(mx.zeros((*pool.shape[:2], E), dtype=mx.bool_), pool, mx.array(True), axis=-1)
        inside = mx.broadcast_to(inside[:, :, None], groups.shape).reshape(T, E)
        return mx.where(inside, b, -mx.inf)


def _top(scores, k: int):
    """Indices of the k largest along the last axis, largest first; exact ties
    go to the lower index (a stable sort of the negated scores)."""
    return mx.argsort(-scores, axis=-1)[..., :k]


class SparseMoe(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = Gate(args)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts)
        if args.num_shared_experts:
            self.shared_experts = MLP(args.hidden_size, args.moe_intermediate_size * args.num_shared_experts)
        # Expert parallel (shard.py): this rank holds experts [lo, hi) and sums the layer over the
        # ranks; shared experts left whole are added by one rank only.
        self.world, self.experts_held, self.shared_here = None, None, True

    @property
    def eager(self) -> bool:
        """CPU backend: large float experts (grouped, with host reads) and quantized
        ones (split over the CPU streams) run outside mx.compile."""
        return self.switch_mlp.eager

    def route(self, x):
        """``x`` [S, n, H] -> its rows [S*n, H], their experts and routing weights [S*n, k]."""
        t = x.reshape(-1, x.shape[-1])
        idx, w = self.gate(t, x.shape[0])
        return t, idx, w

    def routed(self, x, t, idx, w):
        """The routed experts' weighted sum of ``route``'s rows, float32."""
        S, sw = x.shape[0], self.switch_mlp
        if self.experts_held is not None:
            idx, w = local_routes(idx, w, *self.experts_held)
        if dense(t.shape[0] // S, *sw.projections):
            return sw.weighted(x, idx, w)
        return (sw(t, idx, S).astype(mx.float32) * w[..., None]).sum(1)  # [T, k, H] summed

    def combine(self, x, y):
        """The routed sum ``y`` in ``x``'s dtype, plus the shared experts (over the
        ranks: both partials in one sum)."""
        y = y.astype(x.dtype).reshape(x.shape)
        if "shared_experts" in self and self.shared_here:
            y = y + self.shared_experts.partial(x)
        return y if self.world is None else all_sum(y, self.world)

    def __call__(self, x):
        return self.combine(x, self.routed(x, *self.route(x)))


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
        self._compiled = None

    def _project(self, h, offset):
        return self.attention.project(self.input_layernorm(h), offset)

    def _finish(self, h, o):
        h = h + self.attention.output(o)
        return h + self.mlp(self.post_attention_layernorm(h))

    def _mix(self, h, o):
        """A MoE layer up to its routed experts: the residual, the MLP input, its routing."""
        h = h + self.attention.output(o)
        x = self.post_attention_layernorm(h)
        return (h, x, *self.mlp.route(x))

    def _combine(self, h, x, y):
        return h + self.mlp.combine(x, y)

    def fusable(self) -> bool:
        """Whether the layer's pieces may run inside mx.compile: not where a
        quantized linear runs split over the CPU streams or dequantized per call
        (cpu/streams.py, cpu/dequant.py: those run eagerly)."""
        return not any(splits(m) or per_call(m) for _, m in self.named_modules()
                       if isinstance(m, (nn.Linear, nn.QuantizedLinear)))

    def compiled(self):
        """The fixed-shape pieces fused with mx.compile, traced once per window
        shape (a block, or a finished block and the next): (project, finish), or
        (project, (mix, combine)) around eager experts; None where the layer
        runs eagerly. Attention and its cache writes stay eager."""
        if self._compiled is None:
            pieces = False
            if self.fusable():
                state = self.state  # the module's arrays as implicit inputs
                eager = isinstance(self.mlp, SparseMoe) and self.mlp.eager
                rest = ((mx.compile(self._mix, inputs=state), mx.compile(self._combine, inputs=state)) if eager
                        else mx.compile(self._finish, inputs=state))
                pieces = (mx.compile(self._project, inputs=state), rest)
            object.__setattr__(self, "_compiled", pieces)
        return self._compiled or None

    def __call__(self, h, offset, mask, cache, compiled: bool = False):
        """``compiled``: the fused pieces where the layer allows them (``offset``
        must then be an mx.array)."""
        pieces = self.compiled() if compiled else None
        if pieces is None:
            return self._finish(h, self.attention.attend(*self._project(h, offset), mask, cache))
        project, finish = pieces
        o = self.attention.attend(*project(h, offset), mask, cache)
        if isinstance(finish, tuple):  # compiled around eager experts
            mix, combine = finish
            h, x, t, idx, w = mix(h, o)
            return combine(h, x, self.mlp.routed(x, t, idx, w))
        return finish(h, o)


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
        self.compile = compile_enabled()
        # The vocabulary split over these ranks (shard.py): rows [lo, hi) of the head and the embedding.
        self.world, self.vocab_held = None, None

    def embed(self, inputs):
        """The token embeddings; a vocabulary-split table looks up its own rows and sums."""
        table = self.model.word_embeddings
        if self.vocab_held is None:
            return table(inputs)
        lo, hi = self.vocab_held
        mine = (inputs >= lo) & (inputs < hi)
        h = table(mx.where(mine, inputs - lo, 0)) * mine[..., None]
        return all_sum(h, self.world)

    @property
    def layers(self):
        return self.model.layers

    @property
    def dtype(self) -> mx.Dtype:
        """The activation dtype: the embedding's (its scales' when quantized)."""
        emb = self.model.word_embeddings
        return (emb["scales"] if "scales" in emb else emb["weight"]).dtype

    def product_rows(self) -> dict:
        """Rows per product of a denoising forward (the CPU weight layout, layout.py):
        a default block's positions, and its token copies per routed expert (over
        the block's pool under LLaDA2.2's block routing)."""
        a = self.args
        experts = a.expert_capacity or a.num_experts
        return {"linear": BLOCK_LENGTH, "experts": BLOCK_LENGTH * a.num_experts_per_tok / experts}

    def make_cache(self, capacity: int) -> list[CommittedKVCache]:
        return [CommittedKVCache(capacity) for _ in self.model.layers]

    def __call__(self, inputs, cache=None, mask=None, last: Optional[int] = None,
                 collect: Optional[list] = None, compiled: bool = False, rows: Optional[mx.array] = None):
        """float32 logits of ``inputs`` [B, L] (the last ``last`` positions only;
        of those, only ``rows``, an index array, when given: the head runs on them alone).

        ``mask``: None (bidirectional), or a boolean/additive array over
        [L, cached + L]. Positions start at the cache offset. ``collect``: a
        list that gets each layer's output (dlm-verify's per-layer diagnostic).
        ``compiled``: the layers' fixed-shape pieces run fused (``self.compile``
        permitting): for the denoising windows, whose two shapes repeat every
        step (a prompt's prefill stays eager: each new length would trace anew).
        """
        compiled = compiled and self.compile and collect is None
        h = self.embed(inputs)
        offset = cache[0].offset if cache else 0
        if compiled:
            offset = mx.array(offset, dtype=mx.int32)
        for i, layer in enumerate(self.model.layers):
            h = layer(layer_input(collect, h), offset, mask, cache[i] if cache else None, compiled)
            if collect is not None:
                collect.append(h)
        if last is not None:
            h = h[:, -last:]
        if rows is not None:
            h = h[:, rows]
        return self.head(self.model.norm(h))

    @property
    def head_module(self):
        """The output projection: the embedding when tied, else ``lm_head``."""
        return self.model.word_embeddings if self.args.tie_word_embeddings else self.lm_head

    def head(self, h):
        """float32 logits of normed hidden states; a quantized head on the CPU
        backend has its rows split over the CPU streams (cpu/streams.py)."""
        tied = self.args.tie_word_embeddings
        module = self.head_module

        def project(rows):
            return as_linear(module, rows) if tied else linear(module, rows)

        out = split_positions(project, h) if splits(module) else project(h)
        return self._gathered(out.astype(mx.float32))

    def _gathered(self, logits):
        """A vocabulary-split head's logits, joined over the ranks in vocabulary order."""
        return logits if self.vocab_held is None else gather_last(logits, self.world, self.args.vocab_size)

    def heads(self, hs: list[mx.array]) -> list[mx.array]:
        """``head`` of each of ``hs`` (a batch's sequences, each with its own
        rows), each as alone; a head dequantized per call dequantizes each
        vocabulary slice once for all of them that take that path."""
        module = self.head_module
        shared = [i for i, h in enumerate(hs) if wants(module, h)]
        out = [None if i in shared else self.head(h) for i, h in enumerate(hs)]
        for i, y in zip(shared, linear_each(module, [hs[i] for i in shared])):
            out[i] = self._gathered(y.astype(mx.float32))
        return out

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

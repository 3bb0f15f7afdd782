"""DiffusionGemma MLX layers: norms, RoPE, the prefix cache, attention, the
dense MLP, the router, the routed experts and the decoder layer.

Parameter names equal the converted tensor names (mlx-community layout), so a
converted directory loads with ``Model.load_weights`` as it is.  Equations and
dtype flow follow transformers 5.24's ``modeling_diffusion_gemma.py``:

* RMSNorm multiplies by ``w`` (not ``1 + w``), computed in float32, one cast.
* Attention scale is 1.0; full-attention layers have K = V (raw k_proj output,
  taken before k_norm) with their own head_dim / kv heads.
* Full layers use "proportional" RoPE (frequencies over the whole head_dim,
  the rest pass through); sliding layers plain RoPE.
* The router sees the raw residual; experts see pre_feedforward_layernorm_2.
* Decoder sliding layers see exactly the cached last ``sliding_window - 1``
  prefix positions plus the canvas, with no mask.
* Logits: tied embedding head in the model dtype, then float32 softcap.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...platform.errors import ConfigError
from ..rows import linear
from ..switch import SwitchLinear, SwitchMLP
from .config import SLIDING, ModelArgs


# ---------------------------------------------------------------------------
# Elementwise helpers
# ---------------------------------------------------------------------------


def rms_norm(x: mx.array, weight: Optional[mx.array], eps: float) -> mx.array:
    """RMS_w(x) in float32 with one cast back (transformers' ``DiffusionGemmaRMSNorm``: w, not 1 + w)."""
    if x.dtype == mx.float32:
        return mx.fast.rms_norm(x, weight, eps)
    x32 = x.astype(mx.float32)
    y = x32 * mx.rsqrt(mx.mean(mx.square(x32), axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(mx.float32)
    return y.astype(x.dtype)


@mx.compile
def _gelu_tanh_f32(x: mx.array) -> mx.array:
    return 0.5 * x * (1.0 + mx.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def geglu(gate: mx.array, up: mx.array) -> mx.array:
    # torch evaluates gelu of half types in float32 and rounds once.
    act = _gelu_tanh_f32(gate.astype(mx.float32)).astype(gate.dtype)
    return act * up


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self["weight"], self.eps)


def make_rope_freqs(head_dim: int, params: dict, where: str) -> mx.array:
    """Periods (1 / inv_freq) for mx.fast.rope over the whole head_dim.

    "default": inv_freq_i = theta^(-2i/d'), d' = head_dim * partial_rotary_factor.
    "proportional": the first int(p * head_dim // 2) pairs rotate with exponent
    over the FULL head_dim; the remaining pairs get inv_freq 0 (period inf), so
    dims (i, i + head_dim/2) for those i pass through unchanged.
    """
    rope_type = params.get("rope_type", "default")
    theta = np.float32(params["rope_theta"])
    factor = np.float32(params.get("factor", 1.0) or 1.0)
    partial = float(params.get("partial_rotary_factor", 1.0) or 1.0)
    if rope_type == "default":
        dim = int(head_dim * partial)
        if dim != head_dim:
            raise ConfigError(f"{where}: default RoPE with partial_rotary_factor {partial} is not supported")
        inv = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    elif rope_type == "proportional":
        n_rot = int(partial * head_dim // 2)
        rot = 1.0 / (theta ** (np.arange(0, 2 * n_rot, 2, dtype=np.float32) / np.float32(head_dim)))
        inv = np.concatenate([rot, np.zeros(head_dim // 2 - n_rot, dtype=np.float32)]) / factor
    else:
        raise ConfigError(f"{where}: unsupported rope_type {rope_type!r}")
    with np.errstate(divide="ignore"):
        periods = (np.float32(1.0) / inv.astype(np.float32)).astype(np.float32)
    return mx.array(periods)


# ---------------------------------------------------------------------------
# Prefix KV cache (written by the encoder, read by the decoder)
# ---------------------------------------------------------------------------


class PrefixCache:
    """Encoder K/V of one layer, [B, kv_heads, T, head_dim].

    Full layers keep every position; sliding layers keep the last
    ``sliding_window - 1`` (as transformers' DynamicSlidingWindowLayer does), which
    is exactly what the decoder must see. ``offset`` counts all positions seen.
    """

    def __init__(self, keep: Optional[int] = None):
        self.keep = keep
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.offset = 0

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def update(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append; return the old entries plus the new ones (what the encoder chunk attends to)."""
        if self.keys is not None:
            keys = mx.concatenate([self.keys, keys], axis=2)
            values = mx.concatenate([self.values, values], axis=2)
        self.offset += keys.shape[2] - self.length
        if self.keep is not None and keys.shape[2] > self.keep:
            self.keys, self.values = keys[:, :, -self.keep :], values[:, :, -self.keep :]
        else:
            self.keys, self.values = keys, values
        return keys, values

    def can_rewind(self, n: int) -> bool:
        """Whether the cache still holds what a window ending at position ``n`` sees."""
        first = self.offset - self.length  # the oldest position kept
        need = 0 if self.keep is None else max(0, n - self.keep)
        return n <= self.offset and first <= need

    def rewind(self, n: int) -> None:
        """Back to the first ``n`` positions (a kept chat prefix); see can_rewind."""
        first = self.offset - self.length
        start = 0 if self.keep is None else max(0, n - self.keep) - first
        if self.keys is not None:
            self.keys = self.keys[:, :, start : n - first]
            self.values = self.values[:, :, start : n - first]
        self.offset = n

    def segment(self, n: int) -> tuple[mx.array, mx.array]:
        """Copies of the K/V a prefix cache keeps of the last ``n`` positions (a
        sliding layer: at most its window, all a later position can see)."""
        kept = min(n, self.length)
        return mx.contiguous(self.keys[:, :, -kept:]), mx.contiguous(self.values[:, :, -kept:])

    def restore(self, parts: list[tuple[mx.array, mx.array]], offset: int) -> None:
        """The state after ``offset`` positions, from the ``segment``s that made them, in order."""
        if self.keep is not None:  # only the window's positions: the last segments suffice
            have, take = 0, []
            for part in reversed(parts):
                take.insert(0, part)
                have += part[0].shape[2]
                if have >= self.keep:
                    break
            parts = take
        keys = parts[0][0] if len(parts) == 1 else mx.concatenate([k for k, _ in parts], axis=2)
        values = parts[0][1] if len(parts) == 1 else mx.concatenate([v for _, v in parts], axis=2)
        if self.keep is not None and keys.shape[2] > self.keep:
            keys, values = keys[:, :, -self.keep:], values[:, :, -self.keep:]
        self.keys, self.values, self.offset = keys, values, offset

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]


# ---------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        H, nh = args.hidden_size, args.num_attention_heads
        self.head_dim = d = args.layer_head_dims[index]
        self.n_heads, self.n_kv = nh, args.layer_kv_heads[index]
        self.is_sliding = args.layer_types[index] == SLIDING
        self.window = args.sliding_window
        self.eps = args.rms_norm_eps
        self.q_proj = nn.Linear(H, nh * d, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv * d, bias=False)
        if self.is_sliding:  # full layers: V = K (no v_proj), hard-wired in the reference
            self.v_proj = nn.Linear(H, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, H, bias=False)
        self.q_norm = RMSNorm(d, self.eps)
        self.k_norm = RMSNorm(d, self.eps)
        layer_type = args.layer_types[index]
        self._freqs = make_rope_freqs(d, args.rope_parameters[layer_type], f"rope_parameters.{layer_type}")

    def _rope(self, x: mx.array, offset: int) -> mx.array:
        return mx.fast.rope(
            x, self.head_dim, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._freqs
        )

    def _encoder_mask(self, n_prev: int, S: int, blocks: Optional[mx.array] = None):
        # Queries sit at positions n_prev..n_prev+S-1 of the visible key run.
        # ``blocks`` (the chunk's image block ids, -1 for text): positions of one image
        # block see each other in full and sliding layers alike (transformers'
        # ``create_masks_for_generate`` with ``block_sequence_ids``);
        # a chunk never splits a block, so the cached keys are never in one.
        windowed = self.is_sliding and n_prev + S > self.window
        if blocks is None and not windowed:
            return "causal" if S > 1 else None
        q = mx.arange(n_prev, n_prev + S)[:, None]
        k = mx.arange(n_prev + S)[None, :]
        mask = k <= q
        if windowed:
            mask = mask & (k > q - self.window)
        if blocks is not None:
            keys = mx.concatenate([mx.full((n_prev,), -1, dtype=blocks.dtype), blocks]) if n_prev else blocks
            mask = mask | ((blocks[:, None] == keys[None, :]) & (blocks[:, None] >= 0))
        return mask

    def project(self, x: mx.array, offset) -> tuple[mx.array, mx.array, mx.array]:
        """q, k, v as [B, heads, S, d]: normed, RoPE'd at positions offset.. (v: weightless norm)."""
        B, S, _ = x.shape
        d = self.head_dim
        q = self.q_norm(linear(self.q_proj, x).reshape(B, S, self.n_heads, d)).transpose(0, 2, 1, 3)
        k_raw = linear(self.k_proj, x).reshape(B, S, self.n_kv, d)
        v_raw = linear(self.v_proj, x).reshape(B, S, self.n_kv, d) if self.is_sliding else k_raw
        k = self.k_norm(k_raw).transpose(0, 2, 1, 3)
        v = rms_norm(v_raw, None, self.eps).transpose(0, 2, 1, 3)
        return self._rope(q, offset), self._rope(k, offset), v

    def attend(self, q: mx.array, k: mx.array, v: mx.array, cache: PrefixCache, encode: bool,
               blocks: Optional[mx.array] = None) -> mx.array:
        """Attention output before o_proj, [B, heads, S, d] (see ``output``)."""
        S = q.shape[2]
        if encode:
            n_prev = cache.length
            keys, values = cache.update(k, v)
            mask = self._encoder_mask(n_prev, S, blocks)
        else:  # the decoder reads the cache, never writes it; no mask at all
            keys, values, mask = k, v, None
            if cache.keys is not None:
                keys = mx.concatenate([cache.keys, k], axis=2)
                values = mx.concatenate([cache.values, v], axis=2)
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=1.0, mask=mask)

    def attend_stacked(self, q: mx.array, k: mx.array, v: mx.array, caches: list[PrefixCache]) -> mx.array:
        """The decoder's ``attend`` for a batch whose caches hold as many positions."""
        return self.attend(q, k, v, _Stacked(caches), False)

    def attend_appending(self, q: mx.array, k: mx.array, v: mx.array, caches: list[PrefixCache]) -> mx.array:
        """The encoder's ``attend`` for a batch whose caches hold as many
        positions: each sequence appends its keys to its own cache, then all
        attend in one call under their shared causal mask."""
        held = caches[0].length
        fetched = [c.update(k[b : b + 1], v[b : b + 1]) for b, c in enumerate(caches)]
        keys, values = (mx.concatenate(t) if len(t) > 1 else t[0] for t in zip(*fetched))
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=1.0,
                                                    mask=self._encoder_mask(held, q.shape[2]))

    def output(self, attn: mx.array) -> mx.array:
        B, _, S, _ = attn.shape
        return linear(self.o_proj, attn.transpose(0, 2, 1, 3).reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return linear(self.down_proj, geglu(linear(self.gate_proj, x), linear(self.up_proj, x)))


class Router(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        H = args.hidden_size
        self.proj = nn.Linear(H, args.num_experts, bias=False)
        self.scale = mx.ones((H,))
        self.per_expert_scale = mx.ones((args.num_experts,))
        self.top_k = args.top_k_experts
        self.eps = args.rms_norm_eps
        self.root = H**-0.5

    def __call__(self, r: mx.array) -> tuple[mx.array, mx.array]:
        z = rms_norm(r, None, self.eps) * self["scale"].astype(r.dtype) * self.root
        probs = mx.softmax(linear(self.proj, z).astype(mx.float32), axis=-1)
        k = self.top_k
        idx = mx.argpartition(-probs, kth=k - 1, axis=-1)[..., :k]
        w = mx.take_along_axis(probs, idx, axis=-1)
        w = w / w.sum(axis=-1, keepdims=True)
        # per_expert_scale multiplies the renormalised weights (float32).
        return w * self["per_expert_scale"][idx].astype(mx.float32), idx


class Experts(SwitchMLP):
    """The routed experts: one fused gate_up projection and a gelu-tanh GEGLU
    (switch.SwitchMLP chooses the kernel); returns the weighted sum."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        H, M, E = args.hidden_size, args.moe_intermediate_size, args.num_experts
        self.inter = M
        self.gate_up_proj = SwitchLinear(H, 2 * M, E)  # gate rows [:M], up rows [M:]
        self.down_proj = SwitchLinear(M, H, E)

    @property
    def inputs(self) -> list:
        return [self.gate_up_proj]

    def activate(self, gate_up: mx.array) -> mx.array:
        return geglu(gate_up[..., : self.inter], gate_up[..., self.inter :])

    def __call__(self, x: mx.array, idx: mx.array, weights: mx.array, sequences: int = 1) -> mx.array:
        """The routing ``weights``' sum of each token's experts (``dispatch``)."""
        y = self.dispatch(x, idx, sequences)
        # Weighted sum in float32, one cast (transformers' grouped_mm path).
        return (y.astype(mx.float32) * weights[..., None]).sum(axis=1).astype(x.dtype)


# dlm-verify's routing records (``record_routes``): each layer call appends its
# top-k expert ids (None where the layer routes nothing) to every open record.
_records: list[list] = []


def _record(idx: Optional[mx.array]) -> None:
    for record in _records:
        record.append(idx)


@contextlib.contextmanager
def record_routes():
    """Collect every layer call's routed expert ids [positions, k], in call order
    (dlm-verify compares them with the reference's router, and makes the
    reference follow them). Records nest. A layer whose experts are fused in
    one compiled graph runs its two halves uncompiled meanwhile, so the ids
    can leave it."""
    record: list = []
    _records.append(record)
    try:
        yield record
    finally:
        _records.remove(record)


NORMS = (
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
    "post_feedforward_layernorm", "pre_feedforward_layernorm_2",
    "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
)


class DecoderLayer(nn.Module):
    """One text layer; the encoder runs the same weights with its own layer_scalar."""

    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, index)
        self.mlp = MLP(H, args.intermediate_size)
        self.router = Router(args)
        self.experts = Experts(args)
        for name in NORMS:
            setattr(self, name, RMSNorm(H, eps))
        self.layer_scalar = mx.ones((1,))
        self.index = index
        self._compiled = None
        self.parallel = None  # a sharded run: this rank's share's forward (parallel.LayerShard)

    def _project(self, x: mx.array, offset) -> tuple[mx.array, mx.array, mx.array]:
        return self.self_attn.project(self.input_layernorm(x), offset)

    def _mix(self, x: mx.array, attn: mx.array):
        """Everything before the routed experts: the residual h, the dense MLP
        branch, the experts' input and the routing."""
        h = x + self.post_attention_layernorm(self.self_attn.output(attn))
        mlp, xe, weights, idx = self.branches(h)
        return h, self.post_feedforward_layernorm_1(mlp), xe, weights, idx

    def branches(self, h: mx.array):
        """From the residual h: the dense MLP's output (before its norm), the
        experts' input and the routing."""
        mlp = self.mlp(self.pre_feedforward_layernorm(h))
        flat = h.reshape(-1, h.shape[-1])
        weights, idx = self.router(h)  # routed on the raw residual (per sequence: rows.linear)
        weights, idx = weights.reshape(-1, weights.shape[-1]), idx.reshape(-1, idx.shape[-1])
        return mlp, self.pre_feedforward_layernorm_2(flat), weights, idx

    def _combine(self, h: mx.array, m1: mx.array, m2: mx.array, scalar: mx.array) -> mx.array:
        m2 = self.post_feedforward_layernorm_2(m2.reshape(h.shape))
        out = h + self.post_feedforward_layernorm(m1 + m2)
        return out * scalar.astype(out.dtype)

    def _finish(self, x: mx.array, attn: mx.array, scalar: mx.array) -> mx.array:
        h, m1, xe, weights, idx = self._mix(x, attn)
        return self._combine(h, m1, self.experts(xe, idx, weights, x.shape[0]), scalar)

    def compiled(self):
        """The fixed-shape pieces fused with mx.compile: the denoiser calls them with
        the same shapes every step, so each traces once per canvas length. The cache
        concat + attention stay eager (their shapes grow), and so do CPU float
        experts (grouped ones read per-expert counts on the host): (project,
        finish) or, with eager experts, (project, (mix, combine))."""
        if self._compiled is None:
            state = self.state  # the module's arrays (weights, RoPE periods) as implicit inputs
            if self.experts.eager:
                rest = (mx.compile(self._mix, inputs=state), mx.compile(self._combine, inputs=state))
            else:
                rest = mx.compile(self._finish, inputs=state)
            object.__setattr__(self, "_compiled", (mx.compile(self._project, inputs=state), rest))
        return self._compiled

    def __call__(
        self, x: mx.array, cache: PrefixCache, offset: int, encode: bool,
        layer_scalar: Optional[mx.array] = None, attention_only: bool = False,
        compiled: bool = False, blocks: Optional[mx.array] = None,
    ) -> Optional[mx.array]:
        """One layer (``compiled``: fused pieces; ``offset`` must then be an mx.array).
        ``attention_only`` (last encoder layer) only writes the cache
        and returns None: nothing downstream reads that layer's output.
        ``blocks``: the encoder chunk's image block ids (bidirectional blocks).
        ``cache`` may be a list, one cache per sequence of a batch (``offset``:
        their offsets, [B]): each sequence attends to its own prefix (and, in
        the encoder, appends to it)."""
        scalar = self["layer_scalar"] if layer_scalar is None else layer_scalar
        if self.parallel is not None:
            return self.parallel(self, x, cache, offset, encode, scalar, attention_only, compiled, blocks)
        project, finish = self.compiled() if compiled else (self._project, self._finish)
        q, k, v = project(x, offset)
        attn = self.attention(q, k, v, cache, encode, blocks)
        if attention_only:
            _record(None)
            return None
        if _records and not isinstance(finish, tuple):
            finish = (self._mix, self._combine)
        if isinstance(finish, tuple):  # compiled around eager experts
            mix, combine = finish
            h, m1, xe, weights, idx = mix(x, attn)
            _record(idx)
            return combine(h, m1, self.experts(xe, idx, weights, x.shape[0]), scalar)
        return finish(x, attn, scalar)

    def attention(self, q: mx.array, k: mx.array, v: mx.array, cache, encode: bool,
                  blocks: Optional[mx.array] = None) -> mx.array:
        """The attention output before o_proj, against one prefix cache or a batch's list of them."""
        if isinstance(cache, list):
            return self._attend_each(q, k, v, cache, encode)
        return self.self_attn.attend(q, k, v, cache, encode, blocks)

    def _attend_each(self, q: mx.array, k: mx.array, v: mx.array, caches: list[PrefixCache],
                     encode: bool) -> mx.array:
        """Attention of a batch, each sequence against its own prefix cache (the
        encoder appends to it first). Sequences whose caches hold as many
        positions (sliding layers past their window, all alike) attend in one
        batched call: per sequence it computes what it computes alone (batched
        matmuls and softmax run per sequence)."""
        groups: dict[int, list[int]] = {}
        for b, c in enumerate(caches):
            groups.setdefault(c.length, []).append(b)
        attend = self.self_attn.attend_appending if encode else self.self_attn.attend_stacked
        if len(groups) == 1:
            return attend(q, k, v, caches)
        out, order = [], []
        for idx in groups.values():
            sel = mx.array(idx)
            out.append(attend(q[sel], k[sel], v[sel], [caches[b] for b in idx]))
            order.extend(idx)
        inverse = mx.array([order.index(b) for b in range(len(caches))])
        return mx.concatenate(out)[inverse]


class _Stacked:
    """Prefix caches holding the same number of positions, as one batch (read only)."""

    def __init__(self, caches: list[PrefixCache]):
        first = caches[0]
        if first.keys is None or len(caches) == 1:
            self.keys, self.values = first.keys, first.values
        else:
            self.keys = mx.concatenate([c.keys for c in caches])
            self.values = mx.concatenate([c.values for c in caches])


class SelfConditioning(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.pre_norm = RMSNorm(H, eps)
        self.gate_proj = nn.Linear(H, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, H, bias=False)
        self.eps = eps

    def __call__(self, embeds: mx.array, soft: Optional[mx.array]) -> mx.array:
        if soft is None:  # first step: RMS(0) = 0 and MLP(0) = 0 exactly
            return rms_norm(embeds, None, self.eps)
        n = self.pre_norm(soft)
        signal = linear(self.down_proj, geglu(linear(self.gate_proj, n), linear(self.up_proj, n)))
        return rms_norm(embeds + signal, None, self.eps)  # post_norm has no weight

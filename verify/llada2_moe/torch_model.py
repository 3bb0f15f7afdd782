"""Independent PyTorch reference model for LLaDA2.0/2.1/2.2 MoE (``llada2_moe``).

Written from the forward pass of inclusionAI/LLaDA2.0-mini's hub
``modeling_llada2_moe.py`` (``LLaDA2MoeModel``), which is not imported here.
Its ``generate()`` is in ``torch_generate``. Module and parameter names equal
the hub checkpoint names, so a hub ``state_dict`` loads with ``strict=True``.

LLaDA2.2 block routing (``expert_capacity`` > 0) follows ``LLaDA2MoeGate`` of
the hub ``modeling_llada2_moe.py`` of inclusionAI/LLaDA2.2-flash. That file was
not readable here, so the gate is written from docs/llada2.md's description
(pseudocode (a) and "dlm's rules"), not from the hub code.

Dtype flow follows that hub code in bf16: RMSNorm statistics in float32 with
the weight multiply in the model dtype, router in float32, expert combine accumulated in
float32 with one cast, logits cast to float32.

Its config and forward pass deliberately repeat what
dlm.runtime.models.llada2_moe implements, written apart from it: a reference
that shared code with what it checks could not disagree with it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

EOS_ID = 156892
MASK_ID = 156895


@dataclass
class RefConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int = 0
    first_k_dense_replace: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.5
    rms_norm_eps: float = 1e-5
    use_qk_norm: bool = True
    use_qkv_bias: bool = False
    use_bias: bool = True
    expert_capacity: int = 0  # > 0: LLaDA2.2 block routing (n_group/topk_group ignored)
    block_size: int = 32  # routing group length of block routing

    @classmethod
    def from_dict(cls, cfg: dict) -> "RefConfig":
        heads = int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads", 0))
        if kv <= 0:
            raise ValueError("config: num_key_value_heads must be a positive integer")
        capacity = int(cfg.get("expert_capacity") or 0)
        k, experts = int(cfg["num_experts_per_tok"]), int(cfg["num_experts"])
        if capacity and not k <= capacity <= experts:
            raise ValueError(f"config: expert_capacity {capacity} must lie in [num_experts_per_tok {k}, "
                             f"num_experts {experts}]")
        block_size = int(cfg.get("block_size") or 32)
        if block_size <= 0:
            raise ValueError(f"config: block_size must be a positive integer, got {block_size}")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            num_experts=experts,
            num_experts_per_tok=k,
            num_shared_experts=int(cfg.get("num_shared_experts") or 0),
            first_k_dense_replace=int(cfg.get("first_k_dense_replace", 0)),
            n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            partial_rotary_factor=float(cfg.get("partial_rotary_factor", 0.5)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            use_qk_norm=bool(cfg.get("use_qk_norm", True)),
            use_qkv_bias=bool(cfg.get("use_qkv_bias", False)),
            use_bias=bool(cfg.get("use_bias", True)),
            expert_capacity=capacity,
            block_size=block_size,
        )


# ---------------------------------------------------------------------------
# Forward pass (hub ``modeling_llada2_moe.py``: LLaDA2MoeModel)
# ---------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(h.dtype)  # cast back before the weight multiply


def _rotate_half(u: torch.Tensor) -> torch.Tensor:
    half = u.shape[-1] // 2
    return torch.cat((-u[..., half:], u[..., :half]), dim=-1)


def rope_cos_sin(positions: torch.Tensor, rot_dim: int, theta: float, dtype) -> tuple:
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    rot = rot * cos + _rotate_half(rot) * sin
    return torch.cat((rot, rest), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: RefConfig):
        super().__init__()
        self.cfg = cfg
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.query_key_value = nn.Linear(cfg.hidden_size, (hq + 2 * hkv) * d, bias=cfg.use_qkv_bias)
        self.dense = nn.Linear(hq * d, cfg.hidden_size, bias=cfg.use_bias)
        if cfg.use_qk_norm:
            self.query_layernorm = RMSNorm(d, cfg.rms_norm_eps)
            self.key_layernorm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, a, cos, sin, mask):
        cfg = self.cfg
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        B, L, _ = a.shape
        qkv = self.query_key_value(a).view(B, L, hq + 2 * hkv, d)
        q, k, v = (t.transpose(1, 2) for t in qkv.split([hq, hkv, hkv], dim=2))
        if cfg.use_qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        g = hq // hkv
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False, scale=1 / math.sqrt(d))
        return self.dense(o.transpose(1, 2).reshape(B, L, hq * d))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, m):
        return self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))


class Gate(nn.Module):
    """Sigmoid router with expert_bias: group-limited top-k (hub 2.0
    ``LLaDA2MoeSparseMoeBlock``), or LLaDA2.2 block routing when
    ``expert_capacity`` > 0 (``forward(t, sequences)``: ``t`` holds
    ``sequences`` sequences of equal length, one after the other)."""

    def __init__(self, cfg: RefConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))

    def forward(self, t: torch.Tensor, sequences: int = 1):
        cfg = self.cfg
        s = torch.sigmoid(F.linear(t.float(), self.weight.float()))
        b = s + self.expert_bias  # routing scores only; fp32 sum
        if cfg.expert_capacity > 0:
            idx = self._block_topk(b, sequences)
        else:
            idx = self._group_limited_topk(b)
        w = s.gather(1, idx)
        if cfg.num_experts_per_tok > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * cfg.routed_scaling_factor

    def _group_limited_topk(self, b: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        T, E = b.shape[0], cfg.num_experts
        per_group = E // cfg.n_group
        gs = b.view(T, cfg.n_group, per_group).topk(min(2, per_group), dim=-1).values.sum(-1)
        chosen = gs.topk(cfg.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(gs, dtype=torch.bool).scatter(1, chosen, True)
        keep = keep.unsqueeze(-1).expand(T, cfg.n_group, per_group).reshape(T, E)
        b = b.masked_fill(~keep, float("-inf"))
        return b.topk(cfg.num_experts_per_tok, dim=-1, sorted=True).indices

    def _block_topk(self, b: torch.Tensor, sequences: int) -> torch.Tensor:
        """Pool = the top-``expert_capacity`` experts of each group of
        ``block_size`` tokens by the max over its tokens of ``b``; each token
        then takes its top-k by ``b`` inside its group's pool
        (docs/llada2.md, pseudocode (a))."""
        cfg = self.cfg
        T, E, bs = b.shape[0], cfg.num_experts, cfg.block_size
        per_seq = T // sequences
        if per_seq * sequences != T or per_seq % bs:
            raise ValueError(f"block routing: {per_seq} tokens per sequence is not a whole number of "
                             f"block_size {bs} groups")
        groups = b.view(sequences, per_seq // bs, bs, E)
        pool = _stable_topk(groups.max(dim=2).values, cfg.expert_capacity)  # [S, G, capacity]
        keep = torch.zeros(sequences, per_seq // bs, E, dtype=torch.bool).scatter(-1, pool, True)
        keep = keep[:, :, None, :].expand(sequences, per_seq // bs, bs, E).reshape(T, E)
        return _stable_topk(b.masked_fill(~keep, float("-inf")), cfg.num_experts_per_tok)


def _stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last axis, largest first; exact
    ties go to the lower index (torch.topk leaves tie order unspecified)."""
    return torch.sort(-scores, dim=-1, stable=True).indices[..., :k]


class SparseMoe(nn.Module):
    def __init__(self, cfg: RefConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = Gate(cfg)
        self.experts = nn.ModuleList(
            SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts)
        )
        if cfg.num_shared_experts:
            self.shared_experts = SwiGLU(
                cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts
            )

    def forward(self, m):
        shape = m.shape
        t = m.reshape(-1, shape[-1])
        idx, w = self.gate(t, sequences=shape[0] if m.dim() == 3 else 1)  # routing groups stay per sequence
        parts = torch.zeros(t.shape[0], idx.shape[1], t.shape[1], dtype=torch.float32)
        for e in idx.unique().tolist():
            rows, slots = (idx == e).nonzero(as_tuple=True)
            out = self.experts[e](t[rows]).float()
            parts[rows, slots] = out * w[rows, slots, None]
        y = parts.sum(1).to(m.dtype).reshape(shape)  # fp32 accumulate in idx order, one cast
        if self.cfg.num_shared_experts:
            y = y + self.shared_experts(m)
        return y


class DecoderLayer(nn.Module):
    def __init__(self, cfg: RefConfig, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if index < cfg.first_k_dense_replace:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        else:
            self.mlp = SparseMoe(cfg)

    def forward(self, h, cos, sin, mask):
        h = h + self.attention(self.input_layernorm(h), cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, cfg: RefConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LLaDA2Reference(nn.Module):
    """``logits = model(input_ids, attention_mask=None | 4-D additive, position_ids=None)``."""

    def __init__(self, cfg: RefConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def dtype(self):
        return self.lm_head.weight.dtype

    @torch.no_grad()
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        cfg = self.cfg
        B, L = input_ids.shape
        h = self.model.word_embeddings(input_ids)
        dt = h.dtype
        if position_ids is None:
            position_ids = torch.arange(L)
        position_ids = position_ids.reshape(-1)[:L]
        rot = int(cfg.head_dim * cfg.partial_rotary_factor)
        cos, sin = rope_cos_sin(position_ids, rot, cfg.rope_theta, dt)
        mask = self._mask(attention_mask, L, dt)
        for layer in self.model.layers:
            h = layer(h, cos, sin, mask)
        return self.lm_head(self.model.norm(h)).float()

    @staticmethod
    def _mask(attention_mask, L, dt):
        """The hub model's SDPA-path mask semantics (transformers 4.x
        ``_prepare_4d_causal_attention_mask_for_sdpa``)."""
        if attention_mask is None:
            return None
        if attention_mask.dim() == 4:
            return attention_mask.to(dt)  # {0, -inf}: exact in any float dtype
        if attention_mask.dim() == 2:
            if bool((attention_mask != 0).all()):
                return None
            # The 4.x helper is causal-only: any padding makes the model causal.
            keep = torch.ones(L, L, dtype=torch.bool).tril()[None, None]
            keep = keep & (attention_mask[:, None, None, :] != 0)
            return torch.zeros(keep.shape, dtype=dt).masked_fill(~keep, float("-inf"))
        raise ValueError(f"attention_mask must be 2-D or 4-D, got {attention_mask.dim()}-D")


def block_causal_mask(length: int, block_length: int, dtype=torch.float32) -> torch.Tensor:
    """[1, 1, L, L] additive: 0 where ⌊j/bl⌋ ≤ ⌊i/bl⌋, −inf elsewhere."""
    blocks = torch.arange(length) // block_length
    keep = blocks[None, :] <= blocks[:, None]
    return torch.zeros(length, length, dtype=dtype).masked_fill(~keep, float("-inf"))[None, None]


def empty_reference(cfg: RefConfig, dtype=torch.float32) -> LLaDA2Reference:
    """The reference with uninitialised storage in ``dtype`` (every floating
    parameter and buffer, as ``.to(dtype)`` leaves them): built on the meta
    device, so no weight initialisation runs and nothing is allocated twice.
    Every tensor must then be written (``fill``, ``load_reference``)."""
    with torch.device("meta"):
        model = LLaDA2Reference(cfg)
    return model.to(dtype).to_empty(device="cpu").eval()


class Mismatch(ValueError):
    """Checkpoint tensors that do not match the module the config builds."""


def fill(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], where: str = "the weights") -> None:
    """Copy ``(name, tensor)`` pairs into ``model``'s parameters and persistent
    buffers one at a time, each cast to its target's dtype (``copy_``); every
    target must be written (a tied one under any of its names). ``Mismatch``
    on an unknown name, a wrong shape or a target left unwritten."""
    targets = model.state_dict(keep_vars=True)
    written: set[int] = set()
    with torch.no_grad():
        for name, value in tensors:
            dst = _target(targets, name, tuple(value.shape), where)
            dst.copy_(value)
            written.add(id(dst))
    _check_written(targets, written, where)


def _target(targets: dict, name: str, shape: tuple, where: str) -> torch.Tensor:
    dst = targets.get(name)
    if dst is None:
        raise Mismatch(f"{where}: tensor {name} has no counterpart in the reference")
    if tuple(dst.shape) != tuple(shape):
        raise Mismatch(f"{where}: tensor {name} has shape {list(shape)}; the reference expects {list(dst.shape)}")
    return dst


def _check_written(targets: dict, written: set[int], where: str) -> None:
    missing = [n for n, t in targets.items() if id(t) not in written]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise Mismatch(f"{where}: no tensor {missing[0]}{more}")


# safetensors dtype names (the format's header) -> torch dtypes.
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
    **{k: getattr(torch, v) for k, v in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"))
       if hasattr(torch, v)},
}


def safetensors_index(files: Iterable[Path]) -> dict[str, tuple]:
    """``{name: (file, torch dtype, shape, byte offset, nbytes)}`` from the
    headers of ``files`` (no tensor data read). ValueError on a malformed
    header or a name in two files."""
    index: dict[str, tuple] = {}
    for f in files:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if n <= 0 or 8 + n > size:
                raise ValueError(f"{f}: not a safetensors file (header length {n})")
            try:
                header = json.loads(fh.read(n))
            except ValueError as exc:
                raise ValueError(f"{f}: unreadable safetensors header ({exc})") from None
        header.pop("__metadata__", None)
        for name, info in header.items():
            dtype = _ST_DTYPES.get(info.get("dtype"))
            if dtype is None:
                raise ValueError(f"{f}: tensor {name} has dtype {info.get('dtype')!r}, which the reference "
                                 "cannot read")
            shape = tuple(int(d) for d in info["shape"])
            start, end = (int(x) for x in info["data_offsets"])
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if end - start != nbytes or start < 0 or 8 + n + end > size:
                raise ValueError(f"{f}: tensor {name} has data offsets {[start, end]} that do not fit its "
                                 f"shape {list(shape)} ({info['dtype']}) and the file")
            if name in index:
                raise ValueError(f"tensor {name} is in both {index[name][0].name} and {f.name}")
            index[name] = (f, dtype, shape, 8 + n + start, nbytes)
    return index


def _read_into(fh, offset: int, dst: torch.Tensor) -> None:
    """Read ``dst``'s bytes (contiguous, CPU) from ``fh`` at ``offset``."""
    view = memoryview(dst.detach().reshape(-1).view(torch.uint8).numpy())
    fh.seek(offset)
    done = 0
    while done < len(view):  # one read(2) returns at most ~2 GB on some systems
        got = fh.readinto(view[done:])
        if not got:
            raise ValueError(f"{fh.name}: truncated at byte {offset + done}")
        done += got


def load_reference(path: str | Path, dtype=torch.float32) -> LLaDA2Reference:
    """Load a hub-layout checkpoint directory (safetensors only).

    Flat in memory: the module is built without initialising weights
    (``empty_reference``) and each tensor is read from its file (plain reads,
    no mapping, so no file pages stay resident) straight into its parameter,
    or into one temporary tensor cast from when the dtypes differ: the peak is
    the reference in ``dtype`` plus the largest tensor. The values are those
    of a ``load_state_dict`` of the whole file into a float32 model followed
    by ``.to(dtype)``, bit for bit. A tied head (``tie_word_embeddings``
    without ``lm_head.weight``) is the embedding's parameter. ``Mismatch``
    where the checkpoint does not match its config, ValueError where a file is
    not valid safetensors."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    index = {k: v for k, v in safetensors_index(files).items() if "rotary_emb" not in k}
    model = empty_reference(RefConfig.from_dict(cfg), dtype)
    if cfg.get("tie_word_embeddings") and "lm_head.weight" not in index:
        model.lm_head.weight = model.model.word_embeddings.weight
    targets = model.state_dict(keep_vars=True)
    by_file: dict[Path, list] = {}
    for name, (f, src_dtype, shape, offset, _) in index.items():
        by_file.setdefault(f, []).append((offset, name, src_dtype, _target(targets, name, shape, str(f))))
    _check_written(targets, {id(e[3]) for entries in by_file.values() for e in entries}, str(path))
    with torch.no_grad():
        for f, entries in by_file.items():
            with open(f, "rb", buffering=0) as fh:
                for offset, _, src_dtype, dst in sorted(entries, key=lambda e: (e[0], e[1])):  # file order
                    if dst.dtype == src_dtype and dst.is_contiguous():
                        _read_into(fh, offset, dst)
                    else:
                        tmp = torch.empty(dst.shape, dtype=src_dtype)
                        _read_into(fh, offset, tmp)
                        dst.copy_(tmp)
                        del tmp
    return model

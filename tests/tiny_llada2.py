"""Tiny LLaDA2.0 MoE checkpoints in the hub layout, built locally.

The weights come from dlm's independent PyTorch reference
(dlm.verify.llada2_moe.torch_model), whose module tree has the hub names; the
tokenizer is character-level with LLaDA's special tokens at scaled-down ids
(eos/pad ``<|endoftext|>`` 252 ↔ 156892, ``<|mask|>`` 255 ↔ 156895) and a
LLaDA2-style chat template (``<role>HUMAN</role>…<|role_end|>``).
"""

from __future__ import annotations

import json
from pathlib import Path

EOS_ID = 252
ROLE_END_ID = 253
MASK_ID = 255
SPECIAL_TOKENS = {
    248: "<unk>", 249: "<|startoftext|>", 250: "<role>", 251: "</role>",
    EOS_ID: "<|endoftext|>", ROLE_END_ID: "<|role_end|>", 254: "<|arithmetic_start|>",
    MASK_ID: "<|mask|>",
}
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- set role = {'user': 'HUMAN', 'assistant': 'ASSISTANT', 'system': 'SYSTEM'}"
    ".get(m['role'], m['role'] | upper) -%}"
    "<role>{{ role }}</role>{{ m['content'] }}<|role_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<role>ASSISTANT</role>{%- endif -%}"
)
CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;!?+-*/=()[]{}<>'\"\n_#@%&|"

BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=64,
    first_k_dense_replace=1, num_experts=16, num_experts_per_tok=4, num_shared_experts=1,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, rope_theta=600000.0,
    partial_rotary_factor=0.5, rms_norm_eps=1e-6,
)
# Several geometries: group-limited routing, >1 dense layer, no groups / top-1 /
# no shared expert, head_dim != hidden/heads with a quarter rotary.
GEOMETRIES = {
    "base": BASE,
    "dense2": dict(
        BASE, num_hidden_layers=4, first_k_dense_replace=2, num_key_value_heads=1,
        num_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, num_shared_experts=2,
    ),
    "flat": dict(
        BASE, num_hidden_layers=2, first_k_dense_replace=0, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.25, num_experts=8,
        num_experts_per_tok=1, n_group=1, topk_group=1, num_shared_experts=0,
    ),
}


def hub_config(geometry: str = "base", **overrides) -> dict:
    """config.json as the hub ships it (plus mask_token_id for the tiny ids)."""
    cfg = dict(
        architectures=["LLaDA2MoeModelLM"], model_type="llada2_moe",
        hidden_act="silu", use_qk_norm=True, use_qkv_bias=False, use_bias=False,
        norm_head=False, norm_softmax=False, tie_word_embeddings=False,
        score_function="sigmoid", norm_topk_prob=True, moe_router_enable_expert_bias=True,
        router_dtype="fp32", rope_scaling=None, rotary_dim=None, max_position_embeddings=4096,
        sliding_window=4096, use_sliding_window=False, max_window_layers=28,
        attention_dropout=0.0, embedding_dropout=0.0, output_dropout=0.0,
        initializer_range=0.02, use_cache=False, output_router_logits=False,
        pad_token_id=EOS_ID, mask_token_id=MASK_ID, dtype="float32",
    )
    cfg.update(GEOMETRIES[geometry])
    cfg.update(overrides)
    # Informational in the hub config (the hub code derives it from the partial factor).
    cfg.setdefault("rotary_dim", None)
    if "rotary_dim" not in overrides:
        cfg["rotary_dim"] = int(cfg["head_dim"] * cfg["partial_rotary_factor"])
    return cfg


def build_tokenizer(vocab_size: int, out_dir: str | Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in SPECIAL_TOKENS.items()}
    free = (i for i in range(vocab_size) if i not in SPECIAL_TOKENS)
    for ch in CHARS:
        vocab[ch] = next(free)
    for i in free:
        vocab[f"<unused{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        unk_token="<unk>", mask_token="<|mask|>",
        additional_special_tokens=[
            t for i, t in sorted(SPECIAL_TOKENS.items()) if t not in ("<unk>", "<|endoftext|>", "<|mask|>")
        ],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def build_model(geometry: str = "base", seed: int = 1234, **overrides):
    """(reference model in float32, hub config dict) with re-drawn parameters."""
    import torch

    from dlm.verify.llada2_moe.torch_model import LLaDA2Reference, RefConfig

    cfg = hub_config(geometry, **overrides)
    model = LLaDA2Reference(RefConfig.from_dict(cfg)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.2 * (torch.rand(p.shape, generator=gen) - 0.5))
            elif name.endswith("expert_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif name.endswith("gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif name == "lm_head.weight":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.9)
            elif name == "model.word_embeddings.weight":
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.25)
    return model, cfg


def build_llada2(
    out_dir: str | Path,
    geometry: str = "base",
    *,
    seed: int = 1234,
    dtype: str = "float32",
    layout: str = "hub",
    shards: int = 1,
    generation_config: dict | None = None,
    **overrides,
):
    """Write a tiny llada2_moe checkpoint; returns the float32 reference model.

    layout="hub": per-expert tensors (the published layout);
    layout="merged": dFactory/VeOmni stacked experts ``mlp.experts.{gate,up,down}_proj`` [E, out, in].
    """
    import torch
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, cfg = build_model(geometry, seed, **overrides)
    cfg["dtype"] = dtype
    state = {k: v.detach().to(getattr(torch, dtype)).contiguous() for k, v in model.state_dict().items()}
    if layout == "merged":
        for i in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]):
            p = f"model.layers.{i}.mlp.experts."
            for proj in ("gate_proj", "up_proj", "down_proj"):
                keys = [f"{p}{e}.{proj}.weight" for e in range(cfg["num_experts"])]
                state[p + proj] = torch.stack([state.pop(k) for k in keys])
    elif layout != "hub":
        raise ValueError(f"unknown layout {layout!r}")
    names = list(state)
    if shards == 1:
        save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map, per = {}, -(-len(names) // shards)
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: state[k] for k in names[s * per : (s + 1) * per]}
            save_file(part, str(out_dir / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in part})
        total = sum(v.numel() * v.element_size() for v in state.values())
        (out_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    gc = generation_config if generation_config is not None else {
        "eos_token_id": EOS_ID, "pad_token_id": EOS_ID,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(gc, indent=2))
    build_tokenizer(cfg["vocab_size"], out_dir)
    return model


# A stand-in for the hub's remote code, written the way the 2.0 hub files are
# (4.x-only imports, a non-persistent rotary buffer that _init_weights skips, a
# list _tied_weights_keys), so that dlm-verify --trust-remote-code has to run it
# through its transformers-5 compatibility shims. ``test_logit_offset`` in the
# config shifts its logits so a test can tell which reference ran.
_REMOTE_CONFIG = '''
from transformers import PretrainedConfig


class LLaDA2MoeConfig(PretrainedConfig):
    model_type = "llada2_moe"

    def __init__(self, num_key_value_heads=0, head_dim=None, partial_rotary_factor=0.5,
                 rope_theta=10000.0, test_logit_offset=0.0, **kwargs):
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.partial_rotary_factor = partial_rotary_factor
        self.rope_theta = rope_theta
        self.test_logit_offset = test_logit_offset
        super().__init__(**kwargs)
'''
_REMOTE_MODEL = '''
import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_attn_mask_utils import _prepare_4d_causal_attention_mask_for_sdpa
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.utils.import_utils import is_torch_fx_available

from dlm.verify.llada2_moe.torch_model import Backbone, RefConfig

from .configuration_llada2_moe import LLaDA2MoeConfig

assert not is_torch_fx_available() or True


class LLaDA2MoeRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS["default"](config, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions, dtype):
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class LLaDA2MoeModelLM(PreTrainedModel):
    config_class = LLaDA2MoeConfig
    base_model_prefix = "model"
    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config):
        super().__init__(config)
        self.model = Backbone(RefConfig.from_dict(config.to_dict()))
        self.model.rotary_emb = LLaDA2MoeRotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(0.0, 0.02)

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        h = self.model.word_embeddings(input_ids)
        mask = _prepare_4d_causal_attention_mask_for_sdpa(attention_mask, input_ids.shape, h, 0)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1])
        cos, sin = self.model.rotary_emb(position_ids.reshape(-1), h.dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin, mask)
        logits = self.lm_head(self.model.norm(h)).float() + self.config.test_logit_offset
        return CausalLMOutputWithPast(logits=logits)
'''


def write_remote_code(out_dir: str | Path, logit_offset: float = 0.0) -> None:
    """Ship hub-style modeling code with a tiny checkpoint (auto_map in config.json)."""
    out_dir = Path(out_dir)
    (out_dir / "configuration_llada2_moe.py").write_text(_REMOTE_CONFIG)
    (out_dir / "modeling_llada2_moe.py").write_text(_REMOTE_MODEL)
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["auto_map"] = {
        "AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
        "AutoModel": "modeling_llada2_moe.LLaDA2MoeModelLM",
        "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM",
    }
    cfg["test_logit_offset"] = logit_offset
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))

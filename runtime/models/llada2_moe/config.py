"""LLaDA2.0 / 2.1 / 2.2 MoE (``llada2_moe``) config: ``ModelArgs`` from the hub
config.json, and the config dlm-convert writes.
Fields as in the hub ``configuration_llada2_moe.py`` and config.json of
inclusionAI/LLaDA2.0-mini (and LLaDA2.1-mini, the same architecture); LLaDA2.2
(inclusionAI/LLaDA2.2-mini, -flash) adds ``expert_capacity`` and ``block_size``
(block routing) and the DELETE/SPLIT ids of its Levenshtein decoding (docs/llada2.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...platform.errors import ConfigError
from ..base import METADATA_KEYS, BaseModelArgs, ConfigKeys, ConfigReader, check_config_keys

DEFAULT_EOS_ID = 156892  # <|endoftext|>; 2.0 configs carry no eos_token_id
DEFAULT_MASK_ID = 156895
# LLaDA2.2's edit tokens: base-vocabulary ids, the hub generate() defaults
# (inclusionAI/LLaDA2.2-flash declares them in config.json; docs/llada2.md).
DEFAULT_DELETE_ID = 156930
DEFAULT_SPLIT_ID = 156931

# The keys of the llada2_moe config.json dlm understands: those of
# inclusionAI/LLaDA2.0-mini's and LLaDA2.1-mini's config.json (and dlm's own
# mask_token_id / eos_token_id), and LLaDA2.2's additions. Any other key is
# refused at dlm-convert and at load.
_READ = frozenset({  # what from_config reads: the computation dlm implements
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
    "num_shared_experts", "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor",
    "rope_theta", "partial_rotary_factor", "rope_scaling", "rms_norm_eps", "use_qk_norm", "use_qkv_bias",
    "use_bias", "tie_word_embeddings", "hidden_act", "max_position_embeddings", "pad_token_id",
    "eos_token_id", "mask_token_id",
    "expert_capacity", "block_size", "delete_token_id", "split_token_id",  # LLaDA2.2
})
_HARMLESS = METADATA_KEYS | {
    "rotary_dim",  # informational: the hub code derives the rotary width from partial_rotary_factor
    "attention_dropout", "embedding_dropout", "output_dropout",  # training only
    "initializer_range", "output_router_logits",  # training only
    # Passed to the attention function, which ignores them on the SDPA/eager paths
    # the hub code runs (and use_sliding_window is false, below).
    "sliding_window", "max_window_layers",
    "bos_token_id",  # a tokenizer id; generation never starts from it
}
# Keys the LLaDA2.0/2.1 hub modeling code ignores (it hard-codes their released
# value), so dlm implements that value only: another one would mean a model
# dlm (and the hub code) does not run as its author meant.
_FIXED = {
    "score_function": ("sigmoid",), "norm_topk_prob": (True,), "moe_router_enable_expert_bias": (True,),
    "router_dtype": ("fp32",), "norm_head": (False,), "norm_softmax": (False,),
    "use_sliding_window": (False,),
}
_TEXT_KEYS = ConfigKeys(read=_READ, harmless=_HARMLESS, fixed=_FIXED)
# The hub form is flat; mlx-vlm nests the same keys under text_config, and
# writes an empty vision_config even for a text-only model (LLaDA-2 has no
# vision tower: only the empty one is neutral).
CONFIG_KEYS = {"llada2_moe": ConfigKeys(read=_READ, harmless=_HARMLESS,
                                        fixed={**_FIXED, "vision_config": ({}, None)},
                                        nested={"text_config": _TEXT_KEYS})}


@dataclass(kw_only=True)
class ModelArgs(BaseModelArgs):
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
    # LLaDA2.2: block routing (expert_capacity > 0) and its Levenshtein decoding.
    expert_capacity: int = 0
    block_size: int = 32
    delete_token_id: int = DEFAULT_DELETE_ID
    split_token_id: int = DEFAULT_SPLIT_ID
    model_type: str = "llada2_moe"
    config_keys = CONFIG_KEYS

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def block_routing(self) -> bool:
        """LLaDA2.2: experts pooled per block of ``block_size`` tokens, and Levenshtein decoding."""
        return self.expert_capacity > 0

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> "ModelArgs":
        if config.get("model_type") != "llada2_moe":
            raise ConfigError(f"{where}: model_type {config.get('model_type')!r} is not llada2_moe")
        check_config_keys(config, cls.config_keys["llada2_moe"], where)
        cfg = dict(config)
        if isinstance(cfg.get("text_config"), dict):  # mlx-vlm writes a nested text config
            cfg.update({k: v for k, v in cfg["text_config"].items() if k not in cfg})

        r = ConfigReader(cfg, where, "llada2_moe config")
        heads = r.int("num_attention_heads", minimum=1)
        kv_heads = cfg.get("num_key_value_heads")
        if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads <= 0:
            # The hub class default is 0, which divides by zero: say so instead.
            raise ConfigError(
                f"{where}: num_key_value_heads must be a positive integer (got {kv_heads!r})"
            )
        hidden = r.int("hidden_size", minimum=1)
        first_dense = r.int("first_k_dense_replace", 0, minimum=0)
        vocab = r.int("vocab_size", minimum=1)
        eos_key = "eos_token_id" if cfg.get("eos_token_id") is not None else "pad_token_id"
        args = cls(
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=r.int("num_hidden_layers", minimum=1),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=r.int("head_dim", hidden // heads, minimum=1),
            intermediate_size=(r.int("intermediate_size", minimum=1) if first_dense
                               else r.int("intermediate_size", 0, minimum=0)),
            moe_intermediate_size=r.int("moe_intermediate_size", minimum=1),
            num_experts=r.int("num_experts", minimum=1),
            num_experts_per_tok=r.int("num_experts_per_tok", minimum=1),
            num_shared_experts=r.int("num_shared_experts", 0, minimum=0),
            first_k_dense_replace=first_dense,
            n_group=r.int("n_group", 8, minimum=1),
            topk_group=r.int("topk_group", 4, minimum=1),
            routed_scaling_factor=r.float("routed_scaling_factor", 2.5),
            rope_theta=r.float("rope_theta", 10000.0, positive=True),
            partial_rotary_factor=r.float("partial_rotary_factor", 0.5, positive=True),
            rms_norm_eps=r.float("rms_norm_eps", 1e-5, positive=True),
            use_qk_norm=r.bool("use_qk_norm", True),
            use_qkv_bias=r.bool("use_qkv_bias", False),
            use_bias=r.bool("use_bias", True),
            tie_word_embeddings=r.bool("tie_word_embeddings", False),
            max_position_embeddings=r.int("max_position_embeddings", 16384, minimum=2),
            pad_token_id=r.int("pad_token_id", DEFAULT_EOS_ID, minimum=0),
            eos_token_ids=r.token_ids(eos_key, [DEFAULT_EOS_ID]),
            mask_token_id=r.int("mask_token_id", DEFAULT_MASK_ID, minimum=0),
            expert_capacity=r.int("expert_capacity", 0, minimum=0),
            block_size=r.int("block_size", 32, minimum=1),
            delete_token_id=r.int("delete_token_id", DEFAULT_DELETE_ID, minimum=0),
            split_token_id=r.int("split_token_id", DEFAULT_SPLIT_ID, minimum=0),
        )
        args._validate(where, cfg)
        return args

    def _validate(self, where: str, cfg: dict) -> None:
        def bad(msg: str):
            raise ConfigError(f"{where}: {msg}")

        if self.num_attention_heads % self.num_key_value_heads:
            bad(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.block_routing:
            self._validate_v22(bad)
        elif self.num_experts % self.n_group:
            bad(f"num_experts={self.num_experts} is not divisible by n_group={self.n_group}")
        elif not 1 <= self.topk_group <= self.n_group:
            bad(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
        elif self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
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

    def _validate_v22(self, bad) -> None:
        """LLaDA2.2: the pool holds at least a token's top-k; the edit ids are distinct vocabulary ids.
        (n_group / topk_group stay in its config, unused: its gate has no group step.)"""
        if not self.num_experts_per_tok <= self.expert_capacity <= self.num_experts:
            bad(f"expert_capacity={self.expert_capacity} must be in [num_experts_per_tok="
                f"{self.num_experts_per_tok}, num_experts={self.num_experts}]")
        ids = {"mask_token_id": self.mask_token_id, "delete_token_id": self.delete_token_id,
               "split_token_id": self.split_token_id}
        for name, value in ids.items():
            if value >= self.vocab_size:
                bad(f"{name}={value} is outside the vocabulary (vocab_size={self.vocab_size})")
        if len(set(ids.values())) < 3:
            bad(f"mask_token_id, delete_token_id and split_token_id must differ (got {sorted(ids.values())})")



def output_config(config: dict, text_only: bool = True) -> dict:
    """config.json next to the converted weights: the hub config, minus the
    remote-code hooks (the converted folder ships no modeling code)."""
    return {k: v for k, v in config.items() if k not in ("auto_map", "_name_or_path")}

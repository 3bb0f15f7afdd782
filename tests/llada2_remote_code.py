"""A stand-in for LLaDA2.0's hub remote code, for the --trust-remote-code tests.

Written the way the 2.0 hub files are (4.x-only imports, a non-persistent rotary
buffer that _init_weights skips, a list _tied_weights_keys), so that
dlm-verify --trust-remote-code has to run it through its transformers-5
compatibility shims. The modeling file's ``LOGIT_OFFSET`` shifts its logits so a
test can tell which reference ran (written into the code, not config.json: dlm
refuses a config key it does not implement).
"""

from __future__ import annotations

import json
from pathlib import Path

_LLADA2_REMOTE_CONFIG = '''
from transformers import PretrainedConfig


class LLaDA2MoeConfig(PretrainedConfig):
    model_type = "llada2_moe"

    def __init__(self, num_key_value_heads=0, head_dim=None, partial_rotary_factor=0.5,
                 rope_theta=10000.0, **kwargs):
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.partial_rotary_factor = partial_rotary_factor
        self.rope_theta = rope_theta
        super().__init__(**kwargs)
'''
_LLADA2_REMOTE_MODEL = '''
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
        logits = self.lm_head(self.model.norm(h)).float() + LOGIT_OFFSET
        return CausalLMOutputWithPast(logits=logits)
'''


def write_llada2_remote_code(out_dir: str | Path, logit_offset: float = 0.0) -> None:
    """Ship hub-style modeling code with a tiny checkpoint (auto_map in config.json)."""
    out_dir = Path(out_dir)
    (out_dir / "configuration_llada2_moe.py").write_text(_LLADA2_REMOTE_CONFIG)
    (out_dir / "modeling_llada2_moe.py").write_text(f"LOGIT_OFFSET = {float(logit_offset)!r}\n"
                                                    + _LLADA2_REMOTE_MODEL)
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["auto_map"] = {
        "AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
        "AutoModel": "modeling_llada2_moe.LLaDA2MoeModelLM",
        "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM",
    }
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))

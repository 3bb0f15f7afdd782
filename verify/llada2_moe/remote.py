"""A llada2_moe checkpoint's own modeling code as the parity reference (only
with ``--trust-remote-code``).

The LLaDA2.0 hub files were written for transformers 4.x and do not import or
load correctly under 5.x (checked with transformers 5.24); the fixes below
restore the 4.x behaviour without touching the numerics:

* P1 ``transformers.modeling_attn_mask_utils`` is gone: provide the two mask
  helpers with their 4.x semantics (``_prepare_4d_causal_attention_mask`` and
  ``_for_sdpa``: None/2-D/4-D paths, a 2-D mask with a 0 turns causal);
* P2 ``is_torch_fx_available`` is gone: False (it only gates an FX wrap);
* P3 ``ROPE_INIT_FUNCTIONS["default"]`` is gone: default RoPE with the
  partial rotary factor;
* P5 ``_tied_weights_keys`` must be a dict in 5.x;
* P6 5.x materialises non-persistent buffers only through ``_init_weights``,
  which the hub code does not extend to its rotary module: ``inv_freq`` is
  recomputed after loading;
* P4 (a bf16 mask with fp32 activations) cannot happen: masks are passed in
  the model dtype.

Only the forward pass comes from the checkpoint; dlm-verify runs its own
``generate`` (torch_model) around it, since the 2.0 hub ``generate`` samples
even at temperature 0.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

from dlm.runtime.platform.errors import DlmError

from ..noise import expected_config_messages


def _mask_utils():
    import torch

    def _causal(attention_mask, input_shape, inputs_embeds, past_key_values_length):
        B, L = input_shape[0], input_shape[-1]
        S = L + past_key_values_length
        dtype = inputs_embeds.dtype
        keep = torch.ones(L, S, dtype=torch.bool).tril(diagonal=past_key_values_length)[None, None]
        keep = keep.expand(B, 1, L, S)
        if attention_mask is not None:
            keep = keep & (attention_mask[:, None, None, :S] != 0)
        return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)

    def prepare_eager(attention_mask, input_shape, inputs_embeds, past_key_values_length, sliding_window=None):
        if attention_mask is not None and attention_mask.dim() == 4:
            # 4.x eager: a 4-D mask means 1 = keep, 0 = drop.
            inverted = 1.0 - attention_mask.to(inputs_embeds.dtype)
            return inverted.masked_fill(inverted.bool(), torch.finfo(inputs_embeds.dtype).min)
        return _causal(attention_mask, input_shape, inputs_embeds, past_key_values_length)

    def prepare_sdpa(attention_mask, input_shape, inputs_embeds, past_key_values_length, sliding_window=None):
        if attention_mask is None:
            return None  # SDPA with is_causal=False: bidirectional
        if attention_mask.dim() == 4:
            return attention_mask  # an additive bias, unchanged
        if bool((attention_mask != 0).all()):
            return None
        return _causal(attention_mask, input_shape, inputs_embeds, past_key_values_length)

    module = types.ModuleType("transformers.modeling_attn_mask_utils")
    module._prepare_4d_causal_attention_mask = prepare_eager
    module._prepare_4d_causal_attention_mask_for_sdpa = prepare_sdpa
    module.__doc__ = "dlm compatibility shim (transformers 4.x modeling_attn_mask_utils semantics)"
    return module


def _inv_freq(head_dim: int, partial_rotary_factor: float, base: float):
    """Default-RoPE frequencies of the rotated part, as the hub rotary __init__ builds them."""
    import torch

    dim = int(head_dim * partial_rotary_factor)
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _default_rope(config=None, device=None, seq_len=None, **kwargs):
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = _inv_freq(head_dim, getattr(config, "partial_rotary_factor", 1.0),
                         float(getattr(config, "rope_theta", 10000.0)))
    return inv_freq.to(device), 1.0


def install_shims() -> None:
    """P1-P3: make the 4.x names the hub files import exist (no-op where they do)."""
    import transformers
    import transformers.utils.import_utils as import_utils
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    try:
        import transformers.modeling_attn_mask_utils  # noqa: F401
    except ImportError:
        module = _mask_utils()
        sys.modules[module.__name__] = module
        transformers.modeling_attn_mask_utils = module
    if not hasattr(import_utils, "is_torch_fx_available"):
        import_utils.is_torch_fx_available = lambda: False
    if not hasattr(transformers.utils, "is_torch_fx_available"):
        transformers.utils.is_torch_fx_available = import_utils.is_torch_fx_available
    ROPE_INIT_FUNCTIONS.setdefault("default", _default_rope)


def _fix_rotary(model, config: dict) -> None:
    """P6: recompute every rotary inv_freq buffer as the module's __init__ does."""
    import torch

    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    inv_freq = _inv_freq(head_dim, float(config.get("partial_rotary_factor", 0.5)),
                         float(config.get("rope_theta", 10000.0)))
    for _, module in model.named_modules():
        for name in ("inv_freq", "original_inv_freq"):
            buf = getattr(module, name, None)
            if isinstance(buf, torch.Tensor) and buf.shape == inv_freq.shape:
                setattr(module, name, inv_freq.clone())


class RemoteModel:
    """The hub model behind torch_model's calling convention:
    ``model(ids, mask=None | 4-D additive, position_ids=None) -> float32 logits``."""

    def __init__(self, model):
        self.model = model

    @property
    def dtype(self):
        return next(self.model.parameters()).dtype

    def __call__(self, input_ids, attention_mask=None, position_ids=None):
        import torch

        L = input_ids.shape[1]
        if attention_mask is None:  # a zero bias: bidirectional (2.1's forward takes only 4-D masks)
            attention_mask = torch.zeros(1, 1, L, L)
        if position_ids is None:
            position_ids = torch.arange(L)
        with torch.no_grad():
            out = self.model(input_ids=input_ids, attention_mask=attention_mask.to(self.dtype),
                             position_ids=position_ids.reshape(1, -1)[:, :L])
        logits = out.logits if hasattr(out, "logits") else out[0]
        return logits.float()


def load_remote(path, torch_dtype, config: dict, stream: bool = False) -> RemoteModel:
    """Build the checkpoint's own ``AutoModelForCausalLM`` (trust_remote_code);
    ``config``: its config.json, already read. ``stream``: only its skeleton,
    every parameter on the meta device (``dlm.verify.streaming`` loads them)."""
    from transformers import AutoConfig
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    path = Path(path)
    ref = (config.get("auto_map") or {}).get("AutoModelForCausalLM")
    if not ref:
        raise DlmError(f"{path / 'config.json'}: auto_map has no AutoModelForCausalLM entry")
    install_shims()
    try:
        cls = get_class_from_dynamic_module(ref, str(path))
        if isinstance(getattr(cls, "_tied_weights_keys", None), list):  # P5
            cls._tied_weights_keys = {"lm_head.weight": "model.word_embeddings.weight"}
        with expected_config_messages():  # the checkpoint's own rope_scaling key
            hf_config = AutoConfig.from_pretrained(str(path), trust_remote_code=True)
        if stream:
            from ..streaming import empty_parameters

            with empty_parameters():
                model = cls(hf_config)
            model = model.to(torch_dtype)
        else:
            model = cls.from_pretrained(str(path), config=hf_config, dtype=torch_dtype, use_safetensors=True)
    except Exception as exc:
        raise DlmError(f"cannot run the modeling code shipped with {path}: {type(exc).__name__}: {exc}") from None
    _fix_rotary(model, config)
    return RemoteModel(model.eval())

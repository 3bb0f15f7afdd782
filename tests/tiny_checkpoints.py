"""Tiny checkpoints in the exact Hub layout, built locally (tests never download).

DiffusionGemma checkpoints come from transformers' own classes (so they are the
real reference); the tokenizer is a small character-level tokenizer with the
Gemma 4 special-token ids and a Gemma-4-style chat template.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# Gemma 4 special-token ids that dlm relies on (reference §4.10).
SPECIAL_TOKENS = {
    0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>",
    48: "<|tool_call>", 49: "<tool_call|>", 50: "<|tool_response>", 52: '<|"|>',
    98: "<|think|>", 100: "<|channel>", 101: "<channel|>", 105: "<|turn>", 106: "<turn|>",
}
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set msgs = messages %}"
    "{% if enable_thinking is defined and enable_thinking %}<|turn>system\n<|think|>"
    "{% if msgs and msgs[0]['role'] == 'system' %}{{ msgs[0]['content'] }}{% set msgs = msgs[1:] %}{% endif %}"
    "<turn|>\n"
    "{% elif msgs and msgs[0]['role'] == 'system' %}<|turn>system\n{{ msgs[0]['content'] }}<turn|>\n"
    "{% set msgs = msgs[1:] %}{% endif %}"
    "{% for m in msgs %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)
CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;!?+-*/=()[]{}<>'\"\n_#@%&|"


def build_tokenizer(vocab_size: int, out_dir: str | Path) -> None:
    """Write tokenizer.json / tokenizer_config.json / chat_template.jinja."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {tok: i for i, tok in SPECIAL_TOKENS.items()}
    free = (i for i in range(vocab_size) if i not in SPECIAL_TOKENS)
    for ch in CHARS:
        vocab[ch] = next(free)
    for i in free:  # fill the rest so every id decodes to something
        vocab[f"<unused{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=[t for i, t in sorted(SPECIAL_TOKENS.items()) if i > 3],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.add_bos_token = False
    fast.save_pretrained(str(out_dir))


TINY_TEXT = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
    num_global_key_value_heads=1, sliding_window=16, num_experts=4, top_k_experts=2,
    moe_intermediate_size=32, use_bidirectional_attention="vision", eos_token_id=[1, 106],
    max_position_embeddings=4096,
)
TINY_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
    position_embedding_size=64,
)
GENERATION = {
    "confidence_threshold": 0.005, "eos_token_id": [1, 106, 50], "max_denoising_steps": 48,
    "max_new_tokens": 256, "pad_token_id": 0,
    "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
    "stability_threshold": 1, "t_max": 0.8, "t_min": 0.4,
}


def build_diffusion_gemma(
    out_dir: str | Path,
    *,
    form: str = "hub",
    vision: bool = False,
    seed: int = 0,
    canvas_length: int = 8,
    text_overrides: dict | None = None,
    dtype: str = "float32",
):
    """Build a tiny random DiffusionGemma in the hub layout; returns the torch model.

    form="hub" writes the released flat keys (global_head_dim,
    num_global_key_value_heads); form="resaved" keeps what save_pretrained
    writes (per_layer_config). Unit parameters (norms, router scales,
    layer scalars) are perturbed so that bugs which swap them show.
    """
    import torch
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    out_dir = Path(out_dir)
    text = dict(TINY_TEXT, **(text_overrides or {}))
    vis = dict(TINY_VISION, num_hidden_layers=2 if vision else 1, standardize=vision)
    config = DiffusionGemmaConfig(
        text_config=text, vision_config=vis, canvas_length=canvas_length,
        image_token_id=500, boi_token_id=501, eoi_token_id=502, eos_token_id=[1, 106],
    )
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "router.scale", "per_expert_scale", "std_scale")):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif name.endswith("std_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.rand(b.shape, generator=gen) + 0.5)
            elif name.endswith(("std_bias", "std_scale")):
                b.copy_(torch.rand(b.shape, generator=gen) + 0.5)
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(out_dir))
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if form == "hub":
        tc = cfg["text_config"]
        tc.pop("per_layer_config", None)
        tc["global_head_dim"] = text["global_head_dim"]
        tc["num_global_key_value_heads"] = text["num_global_key_value_heads"]
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (out_dir / "generation_config.json").write_text(json.dumps(GENERATION, indent=2))
    build_tokenizer(text["vocab_size"], out_dir)
    return model


def install_in_hf_cache(src_dir: str | Path, cache_dir: str | Path, repo_id: str,
                        revision: str = "0" * 40) -> Path:
    """Lay a local checkpoint out as huggingface_hub's cache does (hub/models--org--name)."""
    src_dir, cache_dir = Path(src_dir), Path(cache_dir)
    repo = cache_dir / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True, exist_ok=True)
    for f in src_dir.iterdir():
        if f.is_file():
            shutil.copy2(f, snap / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snap

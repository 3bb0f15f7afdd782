"""Tiny checkpoints and tokenizers in the exact Hub layout, built locally (tests never download).

The one place that builds what the tests run on, for every family:

* DiffusionGemma checkpoints come from transformers' own classes (so they are
  the real reference), with a character-level tokenizer carrying the Gemma 4
  special-token ids and a Gemma-4-style chat template;
* LLaDA2.0 MoE checkpoints come from dlm's independent PyTorch reference
  (dlm.verify.llada2_moe.torch_model), whose module tree has the hub names, with
  a character-level tokenizer carrying LLaDA's special tokens at scaled-down ids
  (eos/pad ``<|endoftext|>`` 252 <-> 156892, ``<|mask|>`` 255 <-> 156895) and a
  LLaDA2-style chat template (``<role>HUMAN</role>...<|role_end|>``), optionally
  with hub-style remote code;
* ``FAMILY_KITS``: one entry per registered family, which the family
  conformance suite (tests/test_family_conformance.py) runs on;
* what tests derive from them: a copy in the Hugging Face cache layout, a
  resharded copy, a dlm-convert output, a dequantized float twin of a quantized
  output, a dlm-verify reference bundle; and reading their tensors back.

The tokenizers are tests/builders_tokenizers.py's (re-exported here); the demo
training scripts (demo/train_*.py) build theirs with the same functions, so the
bundled demo checkpoints share these vocabularies.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# The tokenizers live in tests/builders_tokenizers.py; importers keep using these names from here.
from tests.builders_tokenizers import (  # noqa: F401
    CHARS,
    DG_CHAT_TEMPLATE,
    DG_IMAGE_NAMES,
    DG_IMAGE_TOKENS,
    DG_SPECIAL_TOKENS,
    LLADA2_CHAT_TEMPLATE,
    LLADA2_EOS_ID,
    LLADA2_MASK_ID,
    LLADA2_ROLE_END_ID,
    LLADA2_SPECIAL_TOKENS,
    _build_char_tokenizer,
    build_diffusion_gemma_tokenizer,
    build_llada2_tokenizer,
)


def _save_shards(tensors: dict, out_dir: Path, shards: int = 1) -> None:
    """Write torch tensors as save_pretrained does: one model.safetensors, or
    ``shards`` files (in the order of ``tensors``) and an index."""
    from safetensors.torch import save_file

    if shards == 1:
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map, per = {}, -(-len(names) // shards)
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[s * per : (s + 1) * per]}
        save_file(part, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )


# ---------------------------------------------------------------------------
# DiffusionGemma
# ---------------------------------------------------------------------------

DG_TEXT = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
    num_global_key_value_heads=1, sliding_window=16, num_experts=4, top_k_experts=2,
    moe_intermediate_size=32, use_bidirectional_attention="vision", eos_token_id=[1, 106],
    max_position_embeddings=4096,
)
DG_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
    position_embedding_size=64,
)
# The processor files a Gemma 4 repo has (processor_config.json, as
# Gemma4Processor.save_pretrained writes it), scaled to the tiny tower:
# 70 soft tokens x pooling 2^2 = 280 patches of 4 x 4 pixels.
DG_IMAGE_PROCESSOR = {
    "do_convert_rgb": True, "do_normalize": False, "do_rescale": True, "do_resize": True,
    "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0],
    "image_processor_type": "Gemma4ImageProcessor", "max_soft_tokens": 70, "patch_size": 4,
    "pooling_kernel_size": 2, "resample": 3, "rescale_factor": 1 / 255,
}
DG_PROCESSOR_CONFIG = {
    "audio_ms_per_token": 40, "audio_seq_length": 750, "image_processor": DG_IMAGE_PROCESSOR,
    "image_seq_length": 70, "processor_class": "Gemma4Processor",
}
DG_GENERATION = {
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
    text = dict(DG_TEXT, **(text_overrides or {}))
    vis = dict(DG_VISION, num_hidden_layers=2 if vision else 1, standardize=vision)
    if vision:  # position table wide enough for the widest image (280 patches, 2 rows)
        vis["position_embedding_size"] = 160
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
    (out_dir / "generation_config.json").write_text(json.dumps(DG_GENERATION, indent=2))
    build_diffusion_gemma_tokenizer(text["vocab_size"], out_dir)
    if vision:
        (out_dir / "processor_config.json").write_text(json.dumps(DG_PROCESSOR_CONFIG, indent=2))
    return model


def load_diffusion_gemma_hf(hf_dir, dtype: str = "float32"):
    """A DiffusionGemma checkpoint loaded by transformers (eval, one torch thread): the reference."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.set_num_threads(1)
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(hf_dir), dtype=getattr(torch, dtype))
    return model.eval()


# ---------------------------------------------------------------------------
# LLaDA2.0 MoE
# ---------------------------------------------------------------------------

_LLADA2_BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=64,
    first_k_dense_replace=1, num_experts=16, num_experts_per_tok=4, num_shared_experts=1,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, rope_theta=600000.0,
    partial_rotary_factor=0.5, rms_norm_eps=1e-6,
)
# Several geometries: group-limited routing, >1 dense layer, no groups / top-1 /
# no shared expert, head_dim != hidden/heads with a quarter rotary.
LLADA2_GEOMETRIES = {
    "base": _LLADA2_BASE,
    "dense2": dict(
        _LLADA2_BASE, num_hidden_layers=4, first_k_dense_replace=2, num_key_value_heads=1,
        num_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, num_shared_experts=2,
    ),
    "flat": dict(
        _LLADA2_BASE, num_hidden_layers=2, first_k_dense_replace=0, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.25, num_experts=8,
        num_experts_per_tok=1, n_group=1, topk_group=1, num_shared_experts=0,
    ),
}
# LLaDA2.2: block routing with a pool of 6 of the 16 experts per group of 8
# tokens (so the pool matters for top-4), DELETE/SPLIT ids in the tiny
# vocabulary; n_group/topk_group stay, unused, as in the released configs.
# Kept apart from LLADA2_GEOMETRIES, which the 2.0/2.1 suites run over with
# token counts that are not whole routing groups.
LLADA22_GEOMETRIES = {
    "v22": dict(
        _LLADA2_BASE, expert_capacity=6, block_size=8, delete_token_id=246, split_token_id=247,
    ),
}


def llada2_hub_config(geometry: str = "base", **overrides) -> dict:
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
        pad_token_id=LLADA2_EOS_ID, mask_token_id=LLADA2_MASK_ID, dtype="float32",
    )
    cfg.update({**LLADA2_GEOMETRIES, **LLADA22_GEOMETRIES}[geometry])
    cfg.update(overrides)
    # Informational in the hub config (the hub code derives it from the partial factor).
    cfg.setdefault("rotary_dim", None)
    if "rotary_dim" not in overrides:
        cfg["rotary_dim"] = int(cfg["head_dim"] * cfg["partial_rotary_factor"])
    return cfg


def build_llada2_model(geometry: str = "base", seed: int = 1234, **overrides):
    """(reference model in float32, hub config dict) with re-drawn parameters."""
    import torch

    from dlm.verify.llada2_moe.torch_model import LLaDA2Reference, RefConfig

    cfg = llada2_hub_config(geometry, **overrides)
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
    adjust: Callable | None = None,
    **overrides,
):
    """Write a tiny llada2_moe checkpoint; returns the float32 reference model.

    layout="hub": per-expert tensors (the published layout);
    layout="merged": dFactory/VeOmni stacked experts ``mlp.experts.{gate,up,down}_proj`` [E, out, in].
    ``adjust(model)`` may edit the drawn parameters in place before they are written.
    """
    import torch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, cfg = build_llada2_model(geometry, seed, **overrides)
    if adjust is not None:
        adjust(model)
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
    _save_shards(state, out_dir, shards)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    gc = generation_config if generation_config is not None else {
        "eos_token_id": LLADA2_EOS_ID, "pad_token_id": LLADA2_EOS_ID,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(gc, indent=2))
    build_llada2_tokenizer(cfg["vocab_size"], out_dir)
    return model


# LLaDA2.2 Levenshtein decoding on the tiny "v22" model: the prompts (one of 19
# tokens: two prompt-only blocks, then a partial block) and the greedy settings
# under which the reference's trace holds DELETE and SPLIT writes.
LLADA22_DELETE_ID, LLADA22_SPLIT_ID = 246, 247
LLADA22_EDIT_PROMPTS = ([10, 20, 30], list(range(40, 59)), [100, 101, 102, 103, 104, 105])
LLADA22_EDIT_SETTINGS = dict(
    block_length=8, steps=8, threshold=0.5, editing_threshold=0.0, max_post_steps=4, suppress_mask=True,
    gen_length=16, eos_id=[LLADA2_EOS_ID, LLADA2_ROLE_END_ID], mask_id=LLADA2_MASK_ID,
    delete_id=LLADA22_DELETE_ID, split_id=LLADA22_SPLIT_ID,
)
# Scale of the DELETE and SPLIT lm_head rows: at 1 the random model never
# predicts them; at 3 every edit prompt's trace writes both (found by trial).
LLADA22_EDIT_ROW_SCALE = 3.0


def _boost_edit_rows(model) -> None:
    """Make DELETE and SPLIT the argmax at some positions: their random lm_head rows, scaled up."""
    import torch

    with torch.no_grad():
        for tok in (LLADA22_DELETE_ID, LLADA22_SPLIT_ID):
            model.lm_head.weight[tok] *= LLADA22_EDIT_ROW_SCALE


def build_llada22(out_dir: str | Path, **kw):
    """A tiny LLaDA2.2 checkpoint (geometry "v22": block routing, DELETE 246 /
    SPLIT 247) whose greedy Levenshtein decoding of ``LLADA22_EDIT_PROMPTS``
    under ``LLADA22_EDIT_SETTINGS`` writes DELETE and SPLIT; returns the
    float32 reference model. End ids: eos 252 and <|role_end|> 253."""
    kw.setdefault("generation_config", {"eos_token_id": [LLADA2_EOS_ID, LLADA2_ROLE_END_ID],
                                        "pad_token_id": LLADA2_EOS_ID})
    return build_llada2(out_dir, "v22", adjust=_boost_edit_rows, **kw)


# ---------------------------------------------------------------------------
# Derived checkpoints: hub cache, copies, reshards, conversions, float twins
# ---------------------------------------------------------------------------


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


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of a checkpoint directory that a test may break."""
    shutil.copytree(src, dst)
    return dst


def reshard(src: Path, dst: Path, n_shards: int) -> Path:
    """Split a one-file checkpoint into n shards (names sorted) with an index, as save_pretrained does."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = source_tensors(src)
    _save_shards({n: tensors[n].contiguous() for n in sorted(tensors)}, Path(dst), n_shards)
    return dst


def convert_dir(src, out, **options) -> Path:
    """dlm-convert ``src`` into ``out`` (ConvertOptions keywords: dtype, quantize, q_bits, q_mode, recipe, ...)."""
    from dlm.convert.pipeline import ConvertOptions, convert

    convert(ConvertOptions(source=str(src), output=str(out), progress=False, **options), echo=lambda _: None)
    return Path(out)


def dequantized_twin(src_dir, out_dir) -> Path:
    """A float copy of a quantized MLX dir with every quantized tensor dequantized."""
    import mlx.core as mx

    src_dir, out_dir = Path(src_dir), Path(out_dir)
    shutil.copytree(src_dir, out_dir)
    config = json.loads((src_dir / "config.json").read_text())
    q = config.pop("quantization")
    config.pop("quantization_config", None)
    weights = mx.load(str(src_dir / "model.safetensors"))
    out = {}
    for name, value in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base is not None and f"{base}.scales" in weights:
            o = q.get(base) if isinstance(q.get(base), dict) else {}
            mode = o.get("mode", q.get("mode", "affine")) if o else q.get("mode", "affine")
            value = mx.dequantize(value, weights[f"{base}.scales"], weights.get(f"{base}.biases"),
                                  group_size=o.get("group_size", q.get("group_size")),
                                  bits=o.get("bits", q.get("bits")), mode=mode)
            scales_dtype = weights[f"{base}.scales"].dtype
            if mx.issubdtype(scales_dtype, mx.floating):
                value = value.astype(scales_dtype)
        out[name] = value
    for f in out_dir.glob("*.safetensors"):
        f.unlink()
    mx.save_safetensors(str(out_dir / "model.safetensors"), out, metadata={"format": "mlx"})
    index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in sorted(out)}}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out_dir


# ---------------------------------------------------------------------------
# dlm-verify on tiny checkpoints
# ---------------------------------------------------------------------------

# Drift thresholds are meant for real checkpoints; a random tiny model is
# chaotic (near-uniform logits, routing flips), so they are informational here.
TINY_DRIFT = {"drift": {"kl_mean": None, "top1": None, "commit_match": None, "steps_ratio": None}}
FAST_VERIFY = dict(logits_prompts=None, canvases=2, steps=8, stream_prompts=1, progress=False)


def verify_options(**kw):
    """dlm-verify Options for a tiny checkpoint: few canvases and steps, drift informational."""
    from dlm.verify.suite import Options

    return Options(**{**FAST_VERIFY, "thresholds": TINY_DRIFT, **kw})


def record_bundle(reference: Path, out: Path, **kw) -> Path:
    """Record a dlm-verify reference bundle of ``reference`` into ``out``."""
    from dlm.verify import bundle as B
    from dlm.verify.suite import Options, record

    data = record(str(reference), Options(reference=str(reference), **{**FAST_VERIFY, **kw}))
    return B.save(data, out)


# ---------------------------------------------------------------------------
# Reading checkpoints back
# ---------------------------------------------------------------------------


def source_tensors(directory: Path) -> dict:
    """Every tensor of an HF checkpoint as a torch tensor (safetensors' own loader, not dlm's)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def load_output(directory: Path) -> dict[str, mx.array]:
    """All tensors of a converted model, through its index (as MLX loaders do)."""
    import mlx.core as mx

    index = json.loads((Path(directory) / "model.safetensors.index.json").read_text())
    out: dict[str, mx.array] = {}
    for f in sorted(set(index["weight_map"].values())):
        out.update(mx.load(str(Path(directory) / f)))
    assert set(out) == set(index["weight_map"]), "index and shards disagree"
    return out


def bits_of(t) -> np.ndarray:
    """Raw bits of a torch float tensor, for bit-identity checks."""
    import torch

    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype]
    return t.contiguous().view(view).numpy()


def mx_bits(a: mx.array) -> np.ndarray:
    """Raw bits of an MLX float array, for bit-identity checks."""
    import mlx.core as mx
    import numpy as np

    view = {mx.float32: mx.int32, mx.bfloat16: mx.int16, mx.float16: mx.int16}[a.dtype]
    return np.array(a.view(view))


def leftovers(parent: Path, out: Path) -> list[str]:
    """Anything a failed conversion left next to (or at) ``out``."""
    return [p.name for p in Path(parent).iterdir()
            if p.name == out.name or p.name.startswith(f".{out.name}.dlm-")]


# -- family kits: what the conformance suite (test_family_conformance.py) needs -----


@dataclass(frozen=True)
class FamilyKit:
    build: Callable[[Path], object]  # a tiny float32 checkpoint in the hub layout
    config_forms: Callable[[dict], dict[str, dict]]  # that config in every on-disk form the family reads
    form_dependent_fields: tuple[str, ...] = ()  # ModelArgs fields that legitimately differ between forms
    q_group_size: int = 32  # a group size the tiny geometry divides
    not_converted: tuple[str, ...] = ()  # name prefixes a text-only conversion leaves out on purpose
    # Option name -> where the family's generation Settings keep its value (dotted attribute path).
    settings_fields: dict = field(default_factory=dict)


def diffusion_gemma_config_forms(config: dict) -> dict[str, dict]:
    """Hub form (flat global_head_dim keys), the save_pretrained form
    (per_layer_config) and the bare text config (``diffusion_gemma_text``)."""
    hub = copy.deepcopy(config)
    resaved = copy.deepcopy(config)
    text = resaved["text_config"]
    head_dim, kv_heads = text.pop("global_head_dim"), text.pop("num_global_key_value_heads")
    text["per_layer_config"] = {str(i): {"head_dim": head_dim, "num_key_value_heads": kv_heads}
                                for i, kind in enumerate(text["layer_types"]) if kind == "full_attention"}
    flat = dict(copy.deepcopy(config["text_config"]), model_type="diffusion_gemma_text",
                canvas_length=config["canvas_length"], eos_token_id=config["eos_token_id"])
    return {"hub": hub, "resaved": resaved, "text": flat}


def llada2_config_forms(config: dict) -> dict[str, dict]:
    """The hub config and mlx-vlm's nested form (everything under text_config)."""
    nested = {"model_type": "llada2_moe",
              "text_config": {k: v for k, v in config.items() if k != "model_type"}}
    return {"hub": copy.deepcopy(config), "mlx-vlm": nested}


FAMILY_KITS = {
    "diffusion_gemma": FamilyKit(
        build=lambda out: build_diffusion_gemma(out, form="hub"),
        config_forms=diffusion_gemma_config_forms,
        # The text form has no vision tower and no image token ids.
        form_dependent_fields=("model_type", "vision_config", "image_token_id", "boi_token_id",
                               "eoi_token_id"),
        not_converted=("model.encoder.vision_tower.", "model.encoder.embed_vision."),
        settings_fields={"max_tokens": "max_tokens", "max_denoising_steps": "denoise.steps",
                         "diffusion_sampler": "denoise.sampler", "diffusion_threshold": "denoise.threshold",
                         "diffusion_min_canvas_length": "min_canvas", "temp": "denoise.temperature",
                         "skip_special_tokens": "skip_special_tokens", "prefill_step_size": "prefill_step_size"},
    ),
    "llada2_moe": FamilyKit(
        build=lambda out: build_llada2(out),
        config_forms=llada2_config_forms,
        settings_fields={"max_tokens": "max_tokens", "max_denoising_steps": "steps", "temp": "temperature",
                         "block_length": "block_length", "threshold": "threshold",
                         "max_post_steps": "max_post_steps", "max_steps_per_block": "max_steps_per_block",
                         "skip_special_tokens": "skip_special_tokens", "prefill_step_size": "prefill_step_size"},
    ),
}


def mutate(good: Path, out: Path, edit) -> Path:
    """Copy a conversion and rewrite its safetensors through ``edit(tensors)`` (mutation tests)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(good, out)
    for f in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(f))
        edit(tensors)
        save_file(tensors, str(f), metadata={"format": "mlx"})
    return out


# A dlm-verify run in a process where torch cannot be imported (bundle comparisons).
NO_TORCH_VERIFY = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is not installed here")
sys.meta_path.insert(0, Block())
from dlm.verify.cli import main
main()
"""

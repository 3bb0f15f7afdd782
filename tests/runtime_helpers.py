"""Helpers for the runtime tests: turn a tiny HF DiffusionGemma checkpoint into an
MLX directory (the converter's layout) and run the transformers reference.

``mlx_dir_from_hf`` is a minimal stand-in for dlm-convert built on the family's
own weight plan (plan_weights + output_config), so the runtime tests do not
depend on the converter; quantization uses nn.quantize with the family's
quant_class recipe (high = 8-bit, low = ``bits``) and writes per-module
overrides like mlx-vlm / dlm-convert do.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from dlm.runtime.models import diffusion_gemma as dg

SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "special_tokens_map.json", "generation_config.json")


def mlx_dir_from_hf(hf_dir, out_dir, *, dtype: str | None = None, bits: int | None = None,
                    mode: str = "affine", group_size: int | None = None, mixed: bool = True) -> Path:
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((hf_dir / "config.json").read_text())
    args = dg.ModelArgs.from_config(config)
    source = mx.load(str(hf_dir / "model.safetensors"))
    meta = {k: (tuple(v.shape), str(v.dtype)) for k, v in source.items()}
    weights = {}
    for plan in dg.plan_weights(args, meta, text_only=True):
        arrays = [source[s] for s in plan.sources]
        weights[plan.name] = arrays[0] if plan.combine is None else plan.combine(arrays)
    if dtype is not None:
        target = getattr(mx, dtype)
        weights = {k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v
                   for k, v in weights.items()}
    out_config = dg.output_config(config, text_only=True)
    if bits is not None:
        model = dg.Model(args)
        model.load_weights(list(weights.items()))
        q = {"group_size": group_size, "bits": bits, "mode": mode}
        q = {k: v for k, v in q.items() if v is not None}

        def predicate(path, module):
            if not hasattr(module, "to_quantized"):
                return False
            kind = dg.quant_class(path)
            if kind is None:
                return False
            if kind == "high" and mixed:
                q[path] = {"group_size": 64 if _divides(module, 64) else 32, "bits": 8, "mode": "affine"}
                return dict(q[path])
            return True

        nn.quantize(model, group_size=group_size, bits=bits, mode=mode, class_predicate=predicate)
        weights = dict(tree_flatten(model.parameters()))
        out_config["quantization"] = q
        out_config["quantization_config"] = dict(q)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    index = {"metadata": {"total_size": int(sum(v.nbytes for v in weights.values()))},
             "weight_map": {k: "model.safetensors" for k in sorted(weights)}}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out_dir / "config.json").write_text(json.dumps(out_config, indent=2, sort_keys=True))
    for name in SIDE_FILES:
        if (hf_dir / name).exists():
            shutil.copy2(hf_dir / name, out_dir / name)
    return out_dir


def _divides(module, group: int) -> bool:
    w = module["weight"]
    return w.shape[-1] % group == 0


def dequantized_twin(src_dir, out_dir) -> Path:
    """A float copy of a quantized MLX dir with every quantized tensor dequantized."""
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
# transformers reference (torch)
# ---------------------------------------------------------------------------


def load_hf(hf_dir, dtype: str = "float32"):
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.set_num_threads(1)
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(hf_dir), dtype=getattr(torch, dtype))
    return model.eval()


def hf_logits(model, prompt: list[int], canvases: list[list[int]], sc_logits=None):
    """Prefill ``prompt``; encode all but the last of ``canvases`` as commits at their
    positions; return the decoder logits of the last canvas (numpy [L, V])."""
    import torch
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config.get_text_config(decoder=True))
        ids = torch.tensor([prompt])
        pos = torch.arange(len(prompt))[None]
        model.model.encoder(input_ids=ids, cache=cache, position_ids=pos)
        cur = len(prompt)
        for c in canvases[:-1]:
            pos = torch.arange(cur, cur + len(c))[None]
            model.model.encoder(input_ids=torch.tensor([c]), cache=cache, position_ids=pos)
            cur += len(c)
        last = canvases[-1]
        sc = None if sc_logits is None else torch.tensor(np.asarray(sc_logits))[None]
        out = model(decoder_input_ids=torch.tensor([last]), cache=cache, self_conditioning_logits=sc,
                    decoder_position_ids=torch.arange(cur, cur + len(last))[None])
        return out.logits[0].float().numpy()

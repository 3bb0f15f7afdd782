"""Helpers for the runtime tests (not a test module): convert tiny checkpoints
with dlm-convert, make dequantized float twins of quantized MLX directories,
and run the transformers reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np


def convert_dir(src, out, **options) -> Path:
    """dlm-convert ``src`` into ``out`` (ConvertOptions keywords: dtype, quantize, q_bits, q_mode, recipe)."""
    from dlm.convert.pipeline import ConvertOptions, convert

    convert(ConvertOptions(source=str(src), output=str(out), progress=False, **options), echo=lambda _: None)
    return Path(out)


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

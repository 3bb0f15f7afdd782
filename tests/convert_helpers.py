"""Shared helpers for the dlm-convert tests (not a test module)."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
# The mixed recipe, stated independently of dlm.quantize / quant_class.
HIGH = re.compile(r"(embed_tokens|\.self_attn\.[qkvo]_proj|\.mlp\.(gate|up|down)_proj|\.router\.proj)$")
LOW = re.compile(r"(\.experts\.(gate_up|down)_proj|self_conditioning\.(gate|up|down)_proj)$")


def source_tensors(directory: Path) -> dict:
    """Every tensor of an HF checkpoint as a torch tensor (safetensors' own loader, not dlm's)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def expected_mlx_names(src_names, keep_vision: bool) -> set[str]:
    """The mlx-community layout, from the reference §2.5 recipe."""
    out = set()
    for n in src_names:
        if n == "lm_head.weight":
            continue
        if n.startswith("model.encoder.language_model."):
            if n.endswith(".layer_scalar"):
                out.add(n)
            continue
        if n.startswith(VISION_PREFIXES):
            if keep_vision:
                out.add(n)
            continue
        if n.endswith(("experts.gate_up_proj", "experts.down_proj")):
            n += ".weight"
        out.add(n)
    return out


def hf_name(mlx_name: str) -> str:
    """Source name of an unquantized output tensor (fused experts lose the .weight MLX adds)."""
    if ".experts." in mlx_name and mlx_name.endswith(".weight"):
        return mlx_name[: -len(".weight")]
    return mlx_name


def load_output(directory: Path) -> dict[str, mx.array]:
    """All tensors of a converted model, through its index (as MLX loaders do)."""
    index = json.loads((Path(directory) / "model.safetensors.index.json").read_text())
    out: dict[str, mx.array] = {}
    for f in sorted(set(index["weight_map"].values())):
        out.update(mx.load(str(Path(directory) / f)))
    assert set(out) == set(index["weight_map"]), "index and shards disagree"
    return out


def to_numpy32(t) -> np.ndarray:
    return t.float().numpy()


def bits_of(t) -> np.ndarray:
    """Raw bits of a torch float tensor, for bit-identity checks."""
    import torch

    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype]
    return t.contiguous().view(view).numpy()


def mx_bits(a: mx.array) -> np.ndarray:
    view = {mx.float32: mx.int32, mx.bfloat16: mx.int16, mx.float16: mx.int16}[a.dtype]
    return np.array(a.view(view))


def quant_error_bound(w: np.ndarray, group_size: int, bits: int, mode: str, eps: float = 0.0) -> np.ndarray:
    """Per-element bound on |w - dequant(quant(w))| for one quantization format.

    affine: one quantization step, (max - min) / (2^bits - 1), per group.
    fp formats: a fraction of the group's largest magnitude (e2m1: 1/4, e4m3: 1/8 -- loose
    bounds that still catch a transposed or misplaced tensor).  ``eps``: relative precision
    of the dtype the scales, biases and dequantized values are stored in (bf16: 2^-8).
    """
    g = w.reshape(-1, w.shape[-1] // group_size, group_size)
    if mode == "affine":
        step = (g.max(-1) - g.min(-1)) / (2**bits - 1)
    else:
        step = np.abs(g).max(-1) * (0.25 if bits == 4 else 0.125)
    step = step + eps * 3 * np.abs(g).max(-1)  # rounding of scale, bias and the result
    return np.broadcast_to(step[..., None], g.shape).reshape(w.shape) + 1e-6


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def reshard(src: Path, dst: Path, n_shards: int) -> Path:
    """Split a one-file checkpoint into n shards with an index, as save_pretrained does."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = source_tensors(src)
    names = sorted(tensors)
    per = math.ceil(len(names) / n_shards)
    weight_map = {}
    for i in range(n_shards):
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i * per:(i + 1) * per]}
        save_file(part, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )
    return dst


def leftovers(parent: Path, out: Path) -> list[str]:
    """Anything a failed conversion left next to (or at) ``out``."""
    return [p.name for p in Path(parent).iterdir()
            if p.name == out.name or p.name.startswith(f".{out.name}.dlm-")]

"""Benchmark DiffusionGemma image prefill, dlm vs mlx-vlm 0.7.10 (not a test).

Image prefill = the vision tower (+ embed_vision) on one image, then the
encoder prefill of a chat prompt holding that image into the prefix cache.
Both tools run on the same converted checkpoint (dlm-convert output, which
mlx-vlm loads as it is), the same image and the same prompt text, in one
process on the same MLX (and BLAS); each tool preprocesses the image with its
own processor, outside the timings, and the script checks that both give the
same prompt ids and soft-token count (and reports the features' and the
full-attention K/V's max abs difference). Timed, per tool:

  vision      the vision tower + embed_vision on the image, evaluated
              dlm:     Model.encode_image(pixel_values, position_ids)
              mlx-vlm: model.model.encoder.get_image_features(pixel_values)
  prefill     the prompt's encoder prefill alone, the image's features computed
              beforehand (dlm: passed to Model.prefill; mlx-vlm: its encoder's
              get_image_features answers them, the rest of its call unchanged)
  full        vision + the prompt's encoder prefill, the cache evaluated
              dlm:     encode_image, then Model.prefill(ids, cache, 2048,
                       features, image_blocks(ids)) (what dlm's generate does)
              mlx-vlm: model.diffusion_prefill_cache(ids, pixel_values=...,
                       mm_token_type_ids=..., chunk_prefill=False) (what its
                       stream_diffusion_generate does: no chunking with images)
  preprocess  each tool's image processor + prompt expansion (informational)

One warm-up per tool and operation, then ``--repeats`` rounds, tools
alternating first; medians with [min-max]. Ratios are mlx-vlm time / dlm time
(> 1: dlm faster). "peak" is MLX's peak memory during the warm-up full call
above what was allocated before it (transient memory: activations, masks).
On the CPU backend dlm computes in float32 by default, so it dequantizes every
quantized weight at load (q4v8's vision linears too: its q4 rows compute like
f32); mlx-vlm runs the quantized kernels. The vision tower stays float32 in the
checkpoint unless converted with quantize_vision (q4v8).

Run from the repository root, as a module (it shares code with tests/):

    .venv/bin/python -m scripts.bench.images                     # tiny + small, f32 + q4
    .venv/bin/python -m scripts.bench.images --sizes tiny --dtypes f32 --repeats 3 --json out.json

Sizes: "tiny" is the test suite's vision checkpoint (tests/builders.py
build_diffusion_gemma(vision=True): tower hidden 32, 2 layers, patch 4,
pooling 2, at most 70 soft tokens); "small" has a bigger tower at the release's
patch 16 / pooling 3 / 280 soft tokens / position table 10240 (hidden 256,
4 layers) and scripts.bench.runtime's small text model; processor_config.json is
written to match each tower. mlx-vlm must be importable from ``--peer``
(default .peer/: ``pip install --no-deps --target .peer mlx-vlm==0.7.10
requests certifi charset-normalizer idna urllib3 pillow``); without it, or
where it cannot run a case, only dlm is timed and the reason is printed.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import sys
import traceback
from pathlib import Path

from dlm.runtime.platform import blas  # importing dlm.runtime loads the optimized BLAS before anything imports MLX
from scripts.bench import harness

harness.offline()

PROMPT = "Describe this image."
SMALL_TEXT = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128,
    num_global_key_value_heads=1, sliding_window=64, num_experts=16, top_k_experts=4,
    moe_intermediate_size=128,
)
# The released tower's patching (patch 16, pooling 3, 280 soft tokens, position
# table 10240), narrower and shallower.
SMALL_VISION = dict(
    hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, head_dim=64, patch_size=16, pooling_kernel_size=3,
    position_embedding_size=10240,
)
RELEASE_PROCESSOR = dict(patch_size=16, pooling_kernel_size=3, max_soft_tokens=280)
SIZES = {
    "tiny": dict(canvas=8, text={}, vision=None, processor=None),  # tests/builders.py as it is
    "small": dict(canvas=32, text=SMALL_TEXT, vision=SMALL_VISION, processor=RELEASE_PROCESSOR),
}
OPS = ("vision", "prefill", "full")  # timed per tool and round, in this order
DTYPES = {
    "f32": {},
    "q4": dict(quantize=True, q_bits=4),
    # also the tower's linears at 8-bit (dlm-convert --quantize-vision); not in the default set
    "q4v8": dict(quantize=True, q_bits=4, quantize_vision=True),
}


# ---------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------


def build_vision_checkpoint(out_dir, *, canvas_length: int = 8, text_overrides: dict | None = None,
                            vision_overrides: dict | None = None, processor_overrides: dict | None = None,
                            seed: int = 0) -> Path:
    """A random multimodal DiffusionGemma in the hub layout, as
    tests/builders.py build_diffusion_gemma(vision=True) writes it (transformers'
    own classes, perturbed unit parameters, the Gemma-4-style character
    tokenizer with image tokens 500-502, generation_config.json), with the
    vision tower's geometry overridable and processor_config.json written to
    match it (patch size, pooling, soft-token budget)."""
    import torch
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    from tests.builders import (DG_GENERATION, DG_IMAGE_PROCESSOR, DG_PROCESSOR_CONFIG, DG_TEXT, DG_VISION,
                                build_diffusion_gemma_tokenizer)

    out_dir = Path(out_dir)
    text = {**DG_TEXT, **(text_overrides or {})}
    vision = {**DG_VISION, "num_hidden_layers": 2, "standardize": True, "position_embedding_size": 160,
              **(vision_overrides or {})}
    image_processor = {**DG_IMAGE_PROCESSOR, **(processor_overrides or {})}
    for key in ("patch_size", "pooling_kernel_size"):
        if image_processor[key] != vision[key]:
            raise ValueError(f"processor {key} {image_processor[key]} != vision tower's {vision[key]}")
    # The widest image the processor makes is max_soft_tokens x pooling patches across.
    widest = image_processor["max_soft_tokens"] * image_processor["pooling_kernel_size"]
    if widest > vision["position_embedding_size"]:
        raise ValueError(f"position_embedding_size {vision['position_embedding_size']} < the widest image "
                         f"({widest} patches)")
    if text["vocab_size"] <= 502:
        raise ValueError("the vocabulary must hold the image tokens 500-502")
    config = DiffusionGemmaConfig(
        text_config=text, vision_config=vision, canvas_length=canvas_length,
        image_token_id=500, boi_token_id=501, eoi_token_id=502, eos_token_id=[1, 106],
    )
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # unit parameters off 1 / 0, so that swapped ones would show
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
    model.save_pretrained(str(out_dir))
    del model
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    tc = cfg["text_config"]  # the released flat keys (what mlx-vlm reads)
    tc.pop("per_layer_config", None)
    tc["global_head_dim"] = text["global_head_dim"]
    tc["num_global_key_value_heads"] = text["num_global_key_value_heads"]
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (out_dir / "generation_config.json").write_text(json.dumps(DG_GENERATION, indent=2))
    build_diffusion_gemma_tokenizer(text["vocab_size"], out_dir)
    processor = dict(DG_PROCESSOR_CONFIG, image_processor=image_processor,
                     image_seq_length=image_processor["max_soft_tokens"])
    (out_dir / "processor_config.json").write_text(json.dumps(processor, indent=2))
    return out_dir


def build(work: Path, size: str, dtype: str) -> Path:
    from tests.builders import build_diffusion_gemma, convert_dir

    spec = SIZES[size]
    hf = work / f"img-{size}-hf"
    if not (hf / "config.json").exists():
        if spec["vision"] is None:
            build_diffusion_gemma(hf, form="hub", vision=True, canvas_length=spec["canvas"],
                                  text_overrides=spec["text"])
        else:
            build_vision_checkpoint(hf, canvas_length=spec["canvas"], text_overrides=spec["text"],
                                    vision_overrides=spec["vision"], processor_overrides=spec["processor"])
    out = work / f"img-{size}-{dtype}"
    if not (out / "config.json").exists():
        convert_dir(hf, out, **DTYPES[dtype])
    return out


def picture(width: int, height: int, seed: int = 0):
    """A deterministic noise image (the content does not change the work)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8))


# ---------------------------------------------------------------------------
# The two tools
# ---------------------------------------------------------------------------


class Dlm:
    name = "dlm"

    def __init__(self, loaded):
        self.loaded, self.model = loaded, loaded.model

    def prepare(self, image):
        from dlm.runtime import api

        self.inputs = api.encode_inputs(self.loaded, PROMPT, images=[image])
        self.ids = list(self.inputs.ids)
        self.soft_tokens = self.inputs.images[0].soft_tokens

    def vision(self):
        import mlx.core as mx

        img = self.inputs.images[0]
        features = self.model.encode_image(img.pixel_values, img.position_ids)
        mx.eval(features)
        return features

    def full(self, features=None):
        import mlx.core as mx

        from dlm.runtime.models.diffusion_gemma.model import image_blocks

        features = self.vision() if features is None else features
        cache = self.model.make_cache()
        blocks = image_blocks(self.ids, self.loaded.args.image_token_id)
        self.model.prefill(self.ids, cache, 2048, features, blocks)
        mx.eval([c.state for c in cache])
        return cache

    def keep_features(self):
        self.features = self.vision()

    def prefill(self):
        """The text prefill alone: ``full`` with the features computed beforehand."""
        return self.full(self.features)

    def kv(self, cache, layer: int):
        return cache[layer].keys, cache[layer].values


class MlxVlm:
    name = "mlx-vlm"

    def __init__(self, model, processor, text: str):
        self.model, self.processor, self.text = model, processor, text

    def prepare(self, image):
        import mlx.core as mx

        batch = self.processor(text=self.text, images=[image])
        self.input_ids = mx.array(batch["input_ids"])
        self.pixel_values = batch["pixel_values"]
        if not isinstance(self.pixel_values, mx.array):
            self.pixel_values = mx.array(self.pixel_values)
        mm = batch.get("mm_token_type_ids")
        self.mm = None if mm is None else mx.array(mm)
        self.ids = self.input_ids[0].tolist()
        image_id = self.model.config.image_token_id
        self.soft_tokens = sum(1 for t in self.ids if t == image_id)

    def vision(self):
        import mlx.core as mx

        self.raw_features = self.model.model.encoder.get_image_features(self.pixel_values)
        mx.eval(self.raw_features)
        features = self.raw_features
        return features[0] if features.ndim == 3 else features

    def full(self):
        import mlx.core as mx

        cache = self.model.diffusion_prefill_cache(
            self.input_ids, attention_mask=None, cache=self.model.make_cache(),
            pixel_values=self.pixel_values, mm_token_type_ids=self.mm,
            prefill_step_size=2048, chunk_prefill=False,
        )
        mx.eval([c.state for c in cache])
        return cache

    def keep_features(self):
        self.vision()
        self.features = self.raw_features  # as get_image_features returns them

    def prefill(self):
        """The text prefill alone: ``full`` with get_image_features answering the
        features computed beforehand (an instance attribute over the method, removed after)."""
        encoder = self.model.model.encoder
        encoder.get_image_features = lambda pixel_values: self.features
        try:
            return self.full()
        finally:
            del encoder.get_image_features

    def kv(self, cache, layer: int):
        keys, values = cache[layer].state
        return keys, values


def timed(fn):
    """``(seconds, result)`` of ``fn()`` (each tool evaluates its own results)."""
    return harness.timed(fn, evaluate=False)


def peak_of(fn) -> float:
    """MB of MLX memory fn allocates on top of what is live before it (its peak)."""
    return harness.peak_bytes(fn) / 2**20


def checks(tools) -> dict:
    """Same prompt ids and soft tokens; features and full-attention K/V differences."""
    import mlx.core as mx

    dlm_tool, vlm = tools["dlm"], tools["mlx-vlm"]
    out = {"prompt_tokens": [len(dlm_tool.ids), len(vlm.ids)],
           "soft_tokens": [dlm_tool.soft_tokens, vlm.soft_tokens],
           "same_ids": dlm_tool.ids == vlm.ids}
    a, b = dlm_tool.vision(), vlm.vision()
    if a.shape == b.shape:
        out["feature_max_abs_diff"] = float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())
        out["feature_abs_max"] = float(mx.abs(a).max())
    else:
        out["feature_shapes"] = [list(a.shape), list(b.shape)]
    if out["same_ids"]:
        ca, cb = dlm_tool.full(), vlm.full()
        args = dlm_tool.loaded.args
        diff = scale = 0.0
        for i, kind in enumerate(args.layer_types):
            if kind != "full_attention":
                continue  # sliding layers: mlx-vlm keeps a rotating buffer
            for x, y in zip(dlm_tool.kv(ca, i), vlm.kv(cb, i)):
                if x.shape != y.shape:
                    out["kv_shapes"] = [list(x.shape), list(y.shape)]
                    return out
                diff = max(diff, float(mx.abs(x.astype(mx.float32) - y.astype(mx.float32)).max()))
                scale = max(scale, float(mx.abs(x).max()))
        out["full_attention_kv_max_abs_diff"], out["full_attention_kv_abs_max"] = diff, scale
    return out


def run_case(size, dtype, path, image, repeats, vlm_load, compute_dtype):
    import mlx.core as mx

    from dlm.runtime import api

    loaded = api.load(path, compute_dtype=compute_dtype)
    tools = {"dlm": Dlm(loaded)}
    row = {"size": size, "dtype": dtype, "dlm_compute_dtype": str(loaded.model.dtype),
           "vision": {k: loaded.args.vision_config.get(k) for k in
                      ("hidden_size", "num_hidden_layers", "patch_size", "pooling_kernel_size")}}
    errors = {}
    if vlm_load is None:
        errors["mlx-vlm"] = "mlx-vlm not importable"
    else:
        try:
            vmodel, vproc = vlm_load(str(path))
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
            text = loaded.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            tools["mlx-vlm"] = MlxVlm(vmodel, vproc, text)
        except Exception as exc:  # pragma: no cover - depends on the peer
            errors["mlx-vlm"] = f"load: {type(exc).__name__}: {exc}".splitlines()[0]
    prep = {name: [] for name in tools}
    for name, tool in list(tools.items()):
        try:
            t, _ = timed(lambda tool=tool: tool.prepare(image))
            prep[name].append(t)
            tool.full()  # warm-up (vision inside)
            tool.vision()
            tool.keep_features()
            tool.prefill()
        except Exception as exc:
            if name == "dlm":
                raise
            errors[name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            traceback.print_exc(limit=3, file=sys.stderr)
            del tools[name]
    if "mlx-vlm" in tools:
        row["check"] = checks(tools)
    row["peak_mb"] = {name: peak_of(tool.full) for name, tool in tools.items()}

    def one_round(tool) -> tuple[float, dict]:  # the seconds of its preprocessing, then of each op
        t, _ = timed(lambda: tool.prepare(image))
        return t, {op: timed(getattr(tool, op))[0] for op in OPS}

    rounds = harness.interleave({name: functools.partial(one_round, tool) for name, tool in tools.items()}, repeats,
                                alternate=True, run=harness.returned)  # the tools alternate going first
    runs = {name: {op: [ops[op] for _, ops in samples] for op in OPS} for name, samples in rounds.items()}
    for name, samples in rounds.items():
        prep[name] += [t for t, _ in samples]
    for name in tools:
        row[name] = {**{op: harness.spread(runs[name][op], "ms") for op in OPS},
                     "preprocess": harness.spread(prep[name], "ms"),
                     "prompt_tokens": len(tools[name].ids), "soft_tokens": tools[name].soft_tokens}
    if "mlx-vlm" in tools:
        row["ratio"] = {op: row["mlx-vlm"][op]["median_ms"] / row["dlm"][op]["median_ms"] for op in OPS}
    if errors:
        row["errors"] = errors
    del tools, loaded
    mx.clear_cache()
    return row


def fmt(m, op) -> str:
    v = m[op]
    return f"{v['median_ms']:.2f} [{v['range_ms'][0]:.2f}-{v['range_ms'][1]:.2f}]"


def table(results) -> str:
    head = ("| model | soft / prompt tokens | dlm vision ms | mlx-vlm vision ms | ratio | dlm prefill ms "
            "| mlx-vlm prefill ms | ratio | dlm vision+prefill ms | mlx-vlm vision+prefill ms | ratio "
            "| peak MB dlm / mlx-vlm | check |")
    lines = [head, "|---" * head.count(" | ") + "|---|"]
    for row in results:
        d, v = row["dlm"], row.get("mlx-vlm")
        tower = row["vision"]
        model = f"{row['size']} {row['dtype']} (tower {tower['hidden_size']}x{tower['num_hidden_layers']})"
        tokens = f"{d['soft_tokens']} / {d['prompt_tokens']}"
        if v is None:
            why = row.get("errors", {}).get("mlx-vlm", "?")
            lines.append(f"| {model} | {tokens} | {fmt(d, 'vision')} | n/a | n/a | {fmt(d, 'prefill')} | n/a | n/a "
                         f"| {fmt(d, 'full')} | n/a | n/a | {row['peak_mb']['dlm']:.1f} / n/a | mlx-vlm: {why} |")
            continue
        c = row["check"]
        same = "same ids" if c["same_ids"] else (f"ids differ: prompt tokens {c['prompt_tokens']}, "
                                                 f"soft tokens {c['soft_tokens']}")
        if "feature_max_abs_diff" in c:
            same += f"; features diff {c['feature_max_abs_diff']:.1e}"
        if "full_attention_kv_max_abs_diff" in c:
            same += f"; K/V diff {c['full_attention_kv_max_abs_diff']:.1e}"
        cells = " | ".join(f"{fmt(d, op)} | {fmt(v, op)} | {row['ratio'][op]:.2f}x" for op in OPS)
        lines.append(f"| {model} | {tokens} | {cells} "
                     f"| {row['peak_mb']['dlm']:.1f} / {row['peak_mb']['mlx-vlm']:.1f} | {same} |")
    return "\n".join(lines)


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=list(SIZES))
    ap.add_argument("--dtypes", nargs="+", default=["f32", "q4"], choices=list(DTYPES))
    ap.add_argument("--image-size", default="896x896", help="WxH of the (noise) image")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--compute-dtype", default=None, help="dlm's compute dtype (api.load; default auto)")
    harness.add_options(ap, "work", "peer", "json")
    a = ap.parse_args()

    import mlx.core as mx

    vlm_load, vlm_version = harness.load_mlx_vlm(a.peer)

    width, height = (int(x) for x in a.image_size.lower().split("x"))
    image = picture(width, height)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for size in a.sizes:
        for dtype in a.dtypes:
            row = run_case(size, dtype, build(work, size, dtype), image, a.repeats, vlm_load, a.compute_dtype)
            results.append(row)
            d, v = row["dlm"], row.get("mlx-vlm")
            line = f"{size:5s} {dtype:4s} soft {d['soft_tokens']} prompt {d['prompt_tokens']}"
            for name in ("dlm", "mlx-vlm") if v is not None else ("dlm",):
                line += f" | {name} " + " ".join(f"{op} {fmt(row[name], op)}" for op in OPS) + " ms"
            if v is not None:
                line += " | mlx-vlm/dlm " + " ".join(f"{op} {row['ratio'][op]:.2f}x" for op in OPS)
                line += f" | {row['check']}"
            for name, why in row.get("errors", {}).items():
                line += f" | {name} not run: {why}"
            print(line, flush=True)

    meta = {"command": harness.command(), "mlx": mx.__version__, "mlx_vlm": vlm_version, "blas": blas.STATUS,
            "device": str(mx.default_device()), "machine": platform.machine(), "cpus": os.cpu_count(),
            "image": [width, height], "repeats": a.repeats, "prompt": PROMPT}
    print()
    print(table(results))
    print()
    harness.finish(meta, results, a.json)


if __name__ == "__main__":
    main()

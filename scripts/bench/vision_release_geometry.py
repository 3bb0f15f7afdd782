"""DiffusionGemma's vision tower at the released scale, dlm vs transformers (not a test).

The released google/diffusiongemma-26B-A4B-it vision tower geometry (its
config.json ``vision_config``: hidden 1152, intermediate 4304, 27 layers, 16 heads
(kv 16), head_dim 72, patch 16, pooling 3, position table 10240, standardize,
rope theta 100) with random weights, embed_vision 1152 -> 2816 (the released
text hidden size), under a 1-layer text model that only keeps the checkpoint
small (the text part is not run). The checkpoint is built with transformers'
own DiffusionGemma classes (scripts/bench/images.py build_vision_checkpoint,
processor_config.json at the released patch 16 / pooling 3 / 280 soft tokens),
converted with dlm-convert (float32) and loaded with dlm.runtime.api.load.

Each image goes through dlm's processor once (transformers' own Gemma 4 Pillow
processor: 896x896 -> 768x768, 2304 patches, 256 soft tokens; 1920x1080 ->
2376 patches, 264 soft tokens), then, float32 on the CPU, through

    dlm:          loaded.model.encode_image(pixel_values, position_ids)   (real patches only)
    transformers: model.model.encoder.get_image_features(pixel_values, image_position_ids).pooler_output
                  (the padded 2520 patches, padding masked, as transformers runs them)

and the two [soft tokens, 2816] outputs are compared: max abs diff, that over
the reference's max abs (must be < 1e-4), the relative Frobenius error, the
cosine of the flattened outputs and the lowest per-token cosine. Reported too:
the wall time of each call (``--repeats`` rounds, the two alternating first;
median and range), dlm's MLX memory (weights after load; peak of one
encode_image above them, mx.get_peak_memory) and the process's peak RSS.

Run from the repository root, as a module:

    .venv/bin/python -m scripts.bench.vision_release_geometry
    .venv/bin/python -m scripts.bench.vision_release_geometry --repeats 2 --json out.json

Needs about 4.6 GB of disk under --work (the float32 checkpoint and its
conversion, kept for later runs) and about 7 GB of memory (both towers, 2.3 GB
each in float32, loaded at once).
"""

from __future__ import annotations

import functools
import os
import platform
import resource
import sys
import time
from pathlib import Path

from dlm.runtime.platform import blas  # importing dlm.runtime loads the optimized BLAS before anything imports MLX
from scripts.bench import harness

harness.offline()

RELEASE_VISION = dict(
    hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
    num_key_value_heads=16, head_dim=72, patch_size=16, pooling_kernel_size=3,
    position_embedding_size=10240, standardize=True, use_clipped_linears=False,
    rope_parameters={"rope_theta": 100.0, "rope_type": "default"},
)
# Only the hidden size matters (embed_vision's output); the rest is as small as the family allows.
TEXT = dict(hidden_size=2816, num_hidden_layers=1, intermediate_size=64, moe_intermediate_size=32,
            num_experts=4, top_k_experts=2)
IMAGES = {"896x896": (896, 896), "1920x1080": (1920, 1080)}
EXPECTED = {"896x896": (2304, 256), "1920x1080": (2376, 264)}  # (patches, soft tokens)
TOLERANCE = 1e-4  # max abs diff / reference max abs


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def build(work: Path) -> tuple[Path, Path, dict]:
    from scripts.bench.images import RELEASE_PROCESSOR, build_vision_checkpoint
    from tests.builders import convert_dir

    hf, out, took = work / "vision-release-hf", work / "vision-release-f32", {}
    if not (hf / "config.json").exists():
        start = time.perf_counter()
        build_vision_checkpoint(hf, canvas_length=8, text_overrides=TEXT, vision_overrides=RELEASE_VISION,
                                processor_overrides=RELEASE_PROCESSOR)
        took["build_s"] = time.perf_counter() - start
    if not (out / "config.json").exists():
        start = time.perf_counter()
        convert_dir(hf, out)
        took["convert_s"] = time.perf_counter() - start
    return hf, out, took


def compare(got, want) -> dict:
    import numpy as np

    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64).reshape(got.shape)
    diff = float(np.abs(got - want).max())
    scale = float(np.abs(want).max())
    cos = float((got * want).sum() / (np.linalg.norm(got) * np.linalg.norm(want)))
    per_token = (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
    return {"shape": list(got.shape), "max_abs_diff": diff, "ref_abs_max": scale, "rel_max_abs_diff": diff / scale,
            "rel_fro": float(np.linalg.norm(got - want) / np.linalg.norm(want)), "cosine": cos,
            "min_token_cosine": float(per_token.min()), "ok": diff / scale < TOLERANCE}


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--images", nargs="+", default=list(IMAGES), choices=list(IMAGES))
    harness.add_options(ap, "work", "json")
    a = ap.parse_args()

    import mlx.core as mx
    import numpy as np
    import torch
    from mlx.utils import tree_flatten
    from transformers import DiffusionGemmaForBlockDiffusion

    from dlm.runtime import api
    from scripts.bench.images import picture

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    hf, mlx_dir, took = build(work)
    print(f"checkpoint {hf} -> {mlx_dir} {took}", flush=True)

    loaded = api.load(mlx_dir)
    weights_gb = mx.get_active_memory() / 2**30
    vision = loaded.args.vision_config
    geometry = {k: vision.get(k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                            "num_attention_heads", "num_key_value_heads", "head_dim", "patch_size",
                                            "pooling_kernel_size", "position_embedding_size", "standardize")}
    encoder = loaded.model.model.encoder
    tower = sum(v.size for part in (encoder.vision_tower, encoder.embed_vision)
                for _, v in tree_flatten(part.parameters()))
    print(f"dlm: compute dtype {loaded.model.dtype}, tower + embed_vision {tower / 1e6:.1f} M parameters, "
          f"MLX active after load {weights_gb:.2f} GiB; geometry {geometry}", flush=True)
    processor = api.image_processor(loaded)
    inputs = {}
    for name in a.images:
        [img] = processor.preprocess([picture(*IMAGES[name], seed=1)])
        patches = int((img.position_ids >= 0).all(-1).sum())
        inputs[name] = img
        print(f"image {name}: {patches} patches of {len(img.position_ids)} (padded), {img.soft_tokens} soft "
              f"tokens (expected {EXPECTED[name]})", flush=True)

    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(str(hf), dtype=torch.float32).eval()
    print(f"transformers loaded; torch threads {torch.get_num_threads()}; peak RSS {rss_gb():.2f} GiB", flush=True)

    def run_dlm(img):
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        start = time.perf_counter()
        out = loaded.model.encode_image(img.pixel_values, img.position_ids)
        mx.eval(out)
        took = time.perf_counter() - start
        return took, np.array(out), (mx.get_peak_memory() - before) / 2**30

    def run_torch(img):
        pv = torch.from_numpy(img.pixel_values[None])
        pi = torch.from_numpy(img.position_ids[None]).long()
        start = time.perf_counter()
        with torch.no_grad():
            out = ref.model.encoder.get_image_features(pv, pi, return_dict=True).pooler_output
        return time.perf_counter() - start, out.float().numpy()

    results = []
    for name in a.images:
        img = inputs[name]
        peaks, outs = [], {}

        def one(tool, r, name=name, img=img, peaks=peaks, outs=outs) -> float:
            if tool == "dlm":
                t, outs["dlm"], peak = run_dlm(img)
                peaks.append(peak)
            else:
                t, outs["transformers"] = run_torch(img)
            print(f"  {name} round {r + 1} {tool}: {t:.2f} s", flush=True)
            return t

        # The two alternate going first.
        times = harness.interleave({tool: functools.partial(one, tool) for tool in ("dlm", "transformers")},
                                   a.repeats, alternate=True, run=lambda fn, r: fn(r))
        row = {"image": name, "patches": int((img.position_ids >= 0).all(-1).sum()),
               "soft_tokens": img.soft_tokens, "dlm": harness.spread(times["dlm"]),
               "transformers": harness.spread(times["transformers"]), "dlm_peak_gib": max(peaks),
               **compare(outs["dlm"], outs["transformers"])}
        row["speedup"] = row["transformers"]["median_s"] / row["dlm"]["median_s"]
        results.append(row)
        print(f"{name}: {row['soft_tokens']} soft tokens, max abs diff {row['max_abs_diff']:.3e} "
              f"(ref max {row['ref_abs_max']:.3f}, rel {row['rel_max_abs_diff']:.2e}), 1 - cosine "
              f"{1 - row['cosine']:.1e}, 1 - min token cosine {1 - row['min_token_cosine']:.1e}, "
              f"dlm {row['dlm']['median_s']:.2f} s, "
              f"transformers {row['transformers']['median_s']:.2f} s, dlm peak above weights "
              f"{row['dlm_peak_gib']:.2f} GiB -> {'OK' if row['ok'] else 'FAIL'}", flush=True)

    meta = {"command": harness.command(), "mlx": mx.__version__, "torch": torch.__version__, "blas": blas.STATUS,
            "device": str(mx.default_device()), "machine": platform.machine(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "geometry": geometry, "tower_params": tower,
            "dlm_weights_gib": weights_gb, "peak_rss_gib": rss_gb(), "repeats": a.repeats, **took}
    print()
    print("| image | patches / soft tokens | max abs diff | rel. to ref max | 1 - cosine | 1 - min token cosine "
          "| dlm s | transformers s | dlm peak GiB (weights + encode) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in results:
        print(f"| {row['image']} | {row['patches']} / {row['soft_tokens']} | {row['max_abs_diff']:.2e} "
              f"| {row['rel_max_abs_diff']:.2e} | {1 - row['cosine']:.1e} | {1 - row['min_token_cosine']:.1e} "
              f"| {row['dlm']['median_s']:.2f} [{row['dlm']['range_s'][0]:.2f}-{row['dlm']['range_s'][1]:.2f}] "
              f"| {row['transformers']['median_s']:.2f} [{row['transformers']['range_s'][0]:.2f}-"
              f"{row['transformers']['range_s'][1]:.2f}] | {weights_gb:.2f} + {row['dlm_peak_gib']:.2f} |")
    print()
    harness.finish(meta, results, a.json)
    if not all(row["ok"] for row in results):
        sys.exit(1)


if __name__ == "__main__":
    main()

"""The image rows of the parity suite, for families whose verify adapter has
the image hooks (``dlm.verify.protocol``) and models with a vision tower.

On the built-in images (``dlm.verify.images``):

* ``image.features.<image>``: the vision tower + projection vs the original
  weights' (max |Δ|, cosine per soft token);
* ``image.logits.p<i>``: logits of fixed forward passes on prompt ``i`` with
  its images (the ``logits`` check's metrics and thresholds);
* ``image.implementation.features`` / ``image.implementation.logits``: the
  same against the reference holding the MLX model's (dequantized) weights;
* ``image.drift``: quantization drift on the image prompts;
* ``image.stream``: the deterministic debug-canvas commit stream of the
  one-image prompt (the ``commit_stream`` check).

No row is made, and a note says why, when the MLX model has no vision tower
(a text-only conversion) or the reference or bundle has no image cases.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from . import checks as C
from . import weights as W
from .images import ImageSet, image_prompts
from .progress import tqdm
from .protocol import has_image_hooks
from .store import ArrayStore, subset

NO_IMAGES = "no image checks: "


def record_images(adapter, ref_path: Path, config: dict, generation_config: dict, options
                  ) -> tuple[Optional[ImageSet], str]:
    """The image part of a recording: (ImageSet, "") or (None, why none)."""
    if not has_image_hooks(adapter):
        return None, ""
    if not options.images:
        return None, "disabled (--no-images)"
    why = adapter.image_support(ref_path, config)
    if why:
        return None, f"the reference {why}"
    images, prompts = image_prompts(ref_path, config, options.trust_remote_code)
    found = ImageSet(images, prompts)
    found.cases = adapter.image_logit_cases(config, [found.inputs(i) for i in range(len(prompts))],
                                            generation_config)
    # The one-image prompt gets a commit stream (none with --stream-prompts 0).
    found.stream_prompts = [0] if prompts and options.stream_prompts != 0 else []
    return found, ""


def mlx_takes_images(adapter, mlx_config: dict, options) -> tuple[bool, str]:
    """Whether the image rows apply to the MLX model, and else the note to show
    ("" for a family without images)."""
    if not has_image_hooks(adapter):
        return False, ""
    if not adapter.has_vision(mlx_config):
        return False, NO_IMAGES + "the MLX model has no vision tower (a text-only conversion)"
    if not options.images:
        return False, NO_IMAGES + "disabled (--no-images)"
    return True, ""


def usable(adapter, mlx_config: dict, bundle, options) -> tuple[Optional[ImageSet], str]:
    """The bundle's ImageSet when the MLX model can be checked on it, else
    (None, the note to show; "" for a family without images)."""
    ok, note = mlx_takes_images(adapter, mlx_config, options)
    if not ok:
        return None, note
    if bundle.images is None:
        return None, NO_IMAGES + (bundle.image_note or "the bundle was recorded without image cases")
    return bundle.images, ""


def run_reference(adapter, ref, images: ImageSet, settings: dict, run, progress: bool, label: str,
                  logits=None) -> None:
    """Fill a ReferenceRun's image fields (features, image logits, image streams);
    ``logits(case, done)``: the reference's logits of one case (default:
    ``adapter.reference_logits``)."""
    logits = logits or (lambda case, done: adapter.reference_logits(ref, case, done))
    for name, image in tqdm(list(images.images.items()), f"{label}: image features", progress):
        run.features[name] = adapter.reference_image_features(ref, image)
    for case in tqdm(images.cases, f"{label}: image logits", progress):
        run.image_logits[case.name] = logits(case, run.image_logits)
    for i in tqdm(images.stream_prompts, f"{label}: image commit streams", progress):
        run.image_streams.append(adapter.reference_commit_stream(ref, images.inputs(i), settings))


@dataclass
class MlxImages:
    features: dict = field(default_factory=dict)
    logits: dict = field(default_factory=ArrayStore)  # on disk, read case by case
    streams: list = field(default_factory=list)


def run_mlx(adapter, loaded, images: ImageSet, settings: dict, progress: bool, logits=None) -> MlxImages:
    """``logits(case)``: the MLX logits of one case (default: ``adapter.mlx_logits``)."""
    logits = logits or (lambda case: adapter.mlx_logits(loaded, case))
    out = MlxImages()
    for name, image in tqdm(list(images.images.items()), "MLX: image features", progress):
        out.features[name] = adapter.mlx_image_features(loaded, image)
    for case in tqdm(images.cases, "MLX: image logits", progress):
        out.logits[case.name] = logits(case)
    for i in tqdm(images.stream_prompts, "MLX: image commit streams", progress):
        out.streams.append(adapter.mlx_commit_stream(loaded, images.inputs(i), settings))
    return out


def vision_precision(adapter, mlx_dir: Path, config: dict, loaded, compute: str) -> W.Precision:
    """The vision encoder's own precision (what the feature rows are judged by),
    relabelled to the compute dtype as the suite does for the whole model."""
    vis = W.precision(mlx_dir, config, select=adapter.is_vision_weight)
    if not loaded.upcast and not vis.quantized and compute != vis.compute_dtype:
        vis = W.Precision(compute, compute, None, None)
    return vis


def _subset(d, names: list[str]):
    return subset(d, names)


def _image_title(name: str, image) -> str:
    w, h = image.size
    return f"Image features vs the original weights: {name} ({w}×{h}, {image.soft_tokens} soft tokens)"


def rows(bundle, images: ImageSet, mlx: MlxImages, matched, matched_note: str, prec: W.Precision,
         vs_original: W.Precision, vision: W.Precision, compute: str, thr: dict) -> list[C.CheckResult]:
    """The image rows (see the module docstring). ``prec`` / ``vs_original``:
    the model's precision as the text rows use it; ``vision``: the vision
    encoder's stored precision; ``compute``: the MLX compute dtype."""
    original = bundle.original
    ref_dtype = original.meta.get("dtype", "float32")
    vis_original = vision
    if ref_dtype != "float32" and vision.compute_dtype == "float32":
        vis_original = W.Precision(vision.label, ref_dtype, vision.bits, vision.mode)
    note = f"reference in {ref_dtype}"
    out = []
    for name, image in images.images.items():
        out.append(C.check_features(f"image.features.{name}", _subset(original.features, [name]),
                                    mlx.features, vis_original, thr, note, _image_title(name, image)))
    for i, prompt in enumerate(images.prompts):
        names = [c.name for c in images.cases if images.prompt_index(c) == i]
        what = f"{len(prompt.images)} image{'s' if len(prompt.images) != 1 else ''}: {', '.join(prompt.images)}"
        out.append(C.check_logits(f"image.logits.p{i}", _subset(original.image_logits, names), mlx.logits,
                                  vs_original, thr, note, kind="logits",
                                  label=f"Logits with images vs the original weights: prompt {i} ({what})"))
    impl_features = "Image features, implementation parity (same weights)"
    impl_logits = "Logits with images, implementation parity (same weights)"
    if matched is not None and matched.image_logits:
        same = W.Precision(compute, compute, None, None)  # same weights: judged by the compute dtype
        out.append(C.check_features("image.implementation.features", matched.features, mlx.features, same, thr,
                                    matched_note, impl_features))
        out.append(C.check_logits("image.implementation.logits", matched.image_logits, mlx.logits, prec, thr,
                                  matched_note, kind="implementation", label=impl_logits))
    else:
        why = matched_note if matched is None else "the same-weights run in the bundle has no image cases"
        out.append(C.skipped("image.implementation.features", why, "features", impl_features))
        out.append(C.skipped("image.implementation.logits", why, "implementation", impl_logits))
    out.append(C.check_drift(original.image_logits, mlx.logits, original.image_streams, mlx.streams, prec, thr,
                             name="image.drift", label="Quantization drift with images"))
    stream = "Commit streams with images (deterministic generation)"
    if matched is not None and matched.image_streams:
        out.append(C.check_commit_stream(matched.image_streams, mlx.streams, prec, thr,
                                         note="vs the reference with the MLX weights",
                                         original=original.image_streams, name="image.stream", label=stream))
    elif not prec.quantized:
        out.append(C.check_commit_stream(original.image_streams, mlx.streams, vs_original, thr,
                                         note="vs the original reference", name="image.stream", label=stream))
    else:
        out.append(C.skipped("image.stream", "quantized model without the same-weights reference",
                             "commit_stream", stream))
    return out


def summary(images: Optional[ImageSet]) -> dict:
    """What the report says about the image cases ({} without images)."""
    if images is None:
        return {}
    return {"images": images.describe(), "prompts": len(images.prompts), "cases": len(images.cases),
            "stream_prompts": len(images.stream_prompts)}

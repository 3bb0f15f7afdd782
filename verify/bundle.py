"""Recorded reference results: record once (with torch and the original
weights), compare anywhere (numpy + MLX only).

A bundle is a directory:

* ``bundle.json``: format/version, family and model_type, the reference (source,
  revision, dtype, library versions), the config and generation config it was
  recorded from, the prompts (token ids), the logit cases (name, prompt index,
  meta), the commit-stream settings and, per stream, its committed tokens,
  steps per canvas and finish reason; optionally a ``matched`` section (the
  reference run with a converted model's own dequantized weights, keyed by that
  model's weight fingerprint); for a reference that takes images, an
  ``images`` section (the built-in images' names, sizes and soft tokens, the
  image prompts as ids + image names, the image logit cases, which image
  prompts have commit streams) or an ``image_note`` saying why there is none.
* ``arrays.safetensors``: case inputs (``case/<name>/<key>``), reference logits
  (``logits/<name>``), per-step stream traces (``stream/<i>/<block>/<field>``),
  and the same under ``matched/`` for a matched run. float32 / int32 / int64.
  Images: the processed pixels (``image/<name>/pixel_values``,
  ``image/<name>/position_ids``: exactly what both vision towers see), image
  case inputs (``image_case/<name>/<key>``) and, per run, vision features
  (``features/<name>``), image logits (``image_logits/<name>``) and image
  stream traces (``image_stream/<i>/<block>/<field>``). Per-layer hidden
  states of the diagnostic cases: ``hidden/<case>/<stack>/<layer>`` (listed
  per run under ``hidden``; a bundle without them still loads).

Written to a temporary sibling directory and renamed at the end, so a failed
record leaves nothing half-written.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping
from typing import Optional

import numpy as np

from dlm.runtime.platform.errors import ConfigError, DlmError

from dlm.runtime.generation.inputs import ImageInput

from .images import ImagePrompt, ImageSet
from .protocol import BlockTrace, CommitStream, LogitCase
from .report import umask_mode
from .store import SafetensorsArrays, View, write_safetensors

FORMAT = "dlm-verify-bundle"
VERSION = 1


@dataclass
class ReferenceRun:
    """Everything one reference produced: logits per case and commit streams."""

    logits: dict[str, np.ndarray] = field(default_factory=dict)
    streams: list[CommitStream] = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # source, revision, dtype, versions, fingerprint
    # Image rows: vision features per image, logits per image case, image commit streams.
    features: dict[str, np.ndarray] = field(default_factory=dict)
    image_logits: dict[str, np.ndarray] = field(default_factory=dict)
    image_streams: list[CommitStream] = field(default_factory=list)
    # Per-layer diagnostic: {case: {stack: [float32 [positions, hidden] per layer]}}.
    hidden: dict[str, dict[str, list]] = field(default_factory=dict)


@dataclass
class Bundle:
    family: str
    model_type: str
    config: dict
    generation_config: dict
    prompts: list[list[int]]
    cases: list[LogitCase]
    settings: dict  # commit-stream settings
    stream_prompts: list[int]  # indices into prompts that have commit streams
    original: ReferenceRun
    matched: Optional[ReferenceRun] = None
    path: Optional[Path] = None
    images: Optional[ImageSet] = None  # None: no image rows (image_note says why)
    image_note: str = ""


def _stream_to_json(stream: CommitStream) -> dict:
    return {
        "finish_reason": stream.finish_reason,
        "blocks": [{"tokens": b.tokens, "steps": b.steps} for b in stream.blocks],
    }


def _put_streams(arrays: dict, prefix: str, streams: list[CommitStream]) -> list[dict]:
    for i, stream in enumerate(streams):
        for b, block in enumerate(stream.blocks):
            base = f"{prefix}/{i}/{b}/"
            arrays[base + "step_argmax"] = np.ascontiguousarray(block.step_argmax, np.int32)
            arrays[base + "topk_ids"] = np.ascontiguousarray(block.topk_ids, np.int32)
            arrays[base + "topk_logits"] = np.ascontiguousarray(block.topk_logits, np.float32)
            if block.step_scores is not None:
                arrays[base + "step_scores"] = np.ascontiguousarray(block.step_scores, np.float32)
                arrays[base + "step_accept"] = np.ascontiguousarray(block.step_accept, np.uint8)
    return [_stream_to_json(s) for s in streams]


def _put_run(arrays: dict, prefix: str, run: ReferenceRun) -> dict:
    for name in run.logits:  # read one at a time when written (logits may be on disk)
        arrays[f"{prefix}logits/{name}"] = _Deferred(run.logits, name)
    doc = {"meta": run.meta, "streams": _put_streams(arrays, f"{prefix}stream", run.streams),
           "cases": sorted(run.logits)}
    if run.features or run.image_logits or run.image_streams:
        for name, value in run.features.items():
            arrays[f"{prefix}features/{name}"] = np.ascontiguousarray(value, np.float32)
        for name in run.image_logits:
            arrays[f"{prefix}image_logits/{name}"] = _Deferred(run.image_logits, name)
        doc["features"] = sorted(run.features)
        doc["image_cases"] = sorted(run.image_logits)
        doc["image_streams"] = _put_streams(arrays, f"{prefix}image_stream", run.image_streams)
    if run.hidden:
        doc["hidden"] = {}
        for case, stacks in run.hidden.items():
            doc["hidden"][case] = {}
            for stack, layers in stacks.items():
                doc["hidden"][case][stack] = [i for i, v in enumerate(layers) if v is not None]
                for i, value in enumerate(layers):
                    if value is not None:
                        arrays[f"{prefix}hidden/{case}/{stack}/{i}"] = np.ascontiguousarray(value, np.float32)
    return doc


def _array(arrays, key: str) -> np.ndarray:
    if key not in arrays:
        raise ConfigError(f"bundle is missing array {key}")
    return arrays[key]


def _lazy(arrays, prefix: str, names: list[str]) -> View:
    """Logits by case name, read from the bundle when a check needs them."""
    keys = {name: prefix + name for name in names}
    missing = [k for k in keys.values() if k not in arrays]
    if missing:
        raise ConfigError(f"bundle is missing array {missing[0]}")
    return View(arrays, keys)


class _Deferred:
    """An array to write later: ``source[name]`` as float32."""

    def __init__(self, source, name: str):
        self.source, self.name = source, name


class _Arrays(Mapping):
    """The bundle's arrays for write_safetensors, deferred ones read when written."""

    def __init__(self, arrays: dict):
        self.arrays = arrays

    def __getitem__(self, key):
        v = self.arrays[key]
        return np.asarray(v.source[v.name], np.float32) if isinstance(v, _Deferred) else v

    def __iter__(self):
        return iter(self.arrays)

    def __len__(self):
        return len(self.arrays)

    def meta(self, key) -> tuple:
        v = self.arrays[key]
        if isinstance(v, _Deferred):
            src = v.source
            shape = src.meta(v.name)[0] if hasattr(src, "meta") else np.shape(src[v.name])
            return tuple(shape), np.dtype(np.float32)
        return tuple(v.shape), v.dtype


def _get_streams(arrays: dict, prefix: str, data: list, prompts: list, stream_prompts: list[int]
                 ) -> list[CommitStream]:
    streams = []
    for i, s in enumerate(data):
        blocks = []
        for b, blk in enumerate(s["blocks"]):
            base = f"{prefix}/{i}/{b}/"
            blocks.append(BlockTrace(
                tokens=list(blk["tokens"]), steps=int(blk["steps"]),
                step_argmax=_array(arrays, base + "step_argmax"), topk_ids=_array(arrays, base + "topk_ids"),
                topk_logits=_array(arrays, base + "topk_logits"),
                # (optional: bundles recorded before these, or by a family without them)
                step_scores=arrays[base + "step_scores"] if base + "step_scores" in arrays else None,
                step_accept=(np.asarray(arrays[base + "step_accept"]).astype(bool)
                             if base + "step_accept" in arrays else None),
            ))
        streams.append(CommitStream(list(prompts[stream_prompts[i]]), blocks, s.get("finish_reason")))
    return streams


def _get_run(arrays: dict, prefix: str, data: dict, prompts: list[list[int]],
             stream_prompts: list[int], images: Optional[ImageSet] = None) -> ReferenceRun:
    run = ReferenceRun(meta=data.get("meta", {}))
    run.logits = _lazy(arrays, f"{prefix}logits/", data.get("cases", []))
    run.streams = _get_streams(arrays, f"{prefix}stream", data.get("streams", []), prompts, stream_prompts)
    for case, stacks in (data.get("hidden") or {}).items():
        run.hidden[case] = {}
        for stack, present in stacks.items():
            layers = [None] * (max(present) + 1 if present else 0)
            for i in present:
                layers[i] = _array(arrays, f"{prefix}hidden/{case}/{stack}/{i}")
            run.hidden[case][stack] = layers
    if images is not None:
        for name in data.get("features", []):
            run.features[name] = _array(arrays, f"{prefix}features/{name}")
        run.image_logits = _lazy(arrays, f"{prefix}image_logits/", data.get("image_cases", []))
        run.image_streams = _get_streams(arrays, f"{prefix}image_stream", data.get("image_streams", []),
                                         [p.ids for p in images.prompts], images.stream_prompts)
    return run


def _put_images(arrays: dict, images: ImageSet) -> dict:
    for name, image in images.images.items():
        arrays[f"image/{name}/pixel_values"] = np.ascontiguousarray(image.pixel_values, np.float32)
        arrays[f"image/{name}/position_ids"] = np.ascontiguousarray(image.position_ids, np.int32)
    cases = []
    for case in images.cases:
        for key, value in case.arrays.items():
            arrays[f"image_case/{case.name}/{key}"] = np.ascontiguousarray(value)
        cases.append({"name": case.name, "prompt": images.prompt_index(case), "meta": case.meta,
                      "arrays": sorted(case.arrays)})
    return {
        "images": images.describe(),
        "prompts": [{"ids": p.ids, "images": p.images} for p in images.prompts],
        "cases": cases, "stream_prompts": images.stream_prompts,
    }


def _get_images(arrays: dict, doc: dict) -> ImageSet:
    images = {}
    for item in doc.get("images", []):
        name = item["name"]
        images[name] = ImageInput(
            pixel_values=_array(arrays, f"image/{name}/pixel_values"),
            position_ids=_array(arrays, f"image/{name}/position_ids"),
            soft_tokens=int(item["soft_tokens"]), size=tuple(item.get("size", (0, 0))),
        )
    prompts = []
    for p in doc.get("prompts", []):
        unknown = [n for n in p["images"] if n not in images]
        if unknown:
            raise ConfigError(f"bundle image prompt names image {unknown[0]!r}, which the bundle lacks")
        prompts.append(ImagePrompt(list(map(int, p["ids"])), list(p["images"])))
    out = ImageSet(images, prompts, stream_prompts=list(doc.get("stream_prompts", [])))
    for c in doc.get("cases", []):
        arr = {key: _array(arrays, f"image_case/{c['name']}/{key}") for key in c.get("arrays", [])}
        p = prompts[c["prompt"]]
        out.cases.append(LogitCase(c["name"], list(p.ids), arr, c.get("meta", {}), [images[n] for n in p.images]))
    return out


def save(bundle: Bundle, out: Path) -> Path:
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not (out / "bundle.json").exists():
        raise DlmError(f"{out}: exists and is not a dlm-verify bundle; choose another -o")
    arrays: dict[str, np.ndarray] = {}
    cases = []
    index = {tuple(p): i for i, p in enumerate(bundle.prompts)}
    for case in bundle.cases:
        for key, value in case.arrays.items():
            arrays[f"case/{case.name}/{key}"] = np.ascontiguousarray(value)
        cases.append({"name": case.name, "prompt": index[tuple(case.prompt_ids)], "meta": case.meta,
                      "arrays": sorted(case.arrays)})
    doc = {
        "format": FORMAT, "version": VERSION, "family": bundle.family, "model_type": bundle.model_type,
        "config": bundle.config, "generation_config": bundle.generation_config,
        "prompts": bundle.prompts, "cases": cases, "settings": bundle.settings,
        "stream_prompts": bundle.stream_prompts,
        "original": _put_run(arrays, "", bundle.original),
    }
    if bundle.matched is not None:
        doc["matched"] = _put_run(arrays, "matched/", bundle.matched)
    if bundle.images is not None:
        doc["images"] = _put_images(arrays, bundle.images)
    if bundle.image_note:
        doc["image_note"] = bundle.image_note
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(umask_mode(directory=True))  # mkdtemp is owner-only; bundles are shared
    try:
        write_safetensors(tmp / "arrays.safetensors", _Arrays(arrays))
        (tmp / "bundle.json").write_text(json.dumps(doc, indent=1, default=_json_default))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    bundle.path = out
    return out


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def load(path: Path) -> Bundle:
    path = Path(path)
    doc_path = path / "bundle.json"
    if not doc_path.exists():
        raise ConfigError(f"{path}: not a dlm-verify bundle (no bundle.json)")
    try:
        doc = json.loads(doc_path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{doc_path}: invalid JSON ({exc})") from None
    if doc.get("format") != FORMAT:
        raise ConfigError(f"{doc_path}: not a dlm-verify bundle")
    if doc.get("version") != VERSION:
        raise ConfigError(f"{doc_path}: bundle version {doc.get('version')} (this dlm reads {VERSION})")
    arrays = SafetensorsArrays(path / "arrays.safetensors")  # read by name, on access
    prompts = [list(map(int, p)) for p in doc["prompts"]]
    cases = []
    for c in doc["cases"]:
        arr = {}
        for key in c.get("arrays", []):
            full = f"case/{c['name']}/{key}"
            if full not in arrays:
                raise ConfigError(f"bundle is missing array {full}")
            arr[key] = arrays[full]
        cases.append(LogitCase(c["name"], prompts[c["prompt"]], arr, c.get("meta", {})))
    stream_prompts = list(doc.get("stream_prompts", []))
    images = _get_images(arrays, doc["images"]) if "images" in doc else None
    original = _get_run(arrays, "", doc["original"], prompts, stream_prompts, images)
    matched = None
    if "matched" in doc:
        matched = _get_run(arrays, "matched/", doc["matched"], prompts, stream_prompts, images)
    return Bundle(
        family=doc["family"], model_type=doc["model_type"], config=doc["config"],
        generation_config=doc.get("generation_config", {}), prompts=prompts, cases=cases,
        settings=doc["settings"], stream_prompts=stream_prompts, original=original, matched=matched,
        path=path, images=images, image_note=str(doc.get("image_note", "")),
    )

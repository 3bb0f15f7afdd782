"""The parity suite: run the references and the MLX model, then the checks.

``record(...)`` runs the PyTorch reference (original weights, optionally also
a converted model's own weights) and returns a Bundle; ``run_parity(...)``
compares a converted MLX directory with a live reference or a recorded
bundle and returns a Report. Both are family-agnostic: the family's verify
adapter (``dlm.verify.protocol``) does the model-specific work; the image
rows (models with a vision tower) are ``dlm.verify.image_suite``'s.

Each reference runs whole in memory or layer by layer (``dlm.verify.streaming``:
``--stream-layers``, by default when a whole-model run would take over half
the memory budget: the reference and, for the same-weights reference, the
dequantized weights beside it, ``streaming.whole_parts``); a streamed run gets
a smaller default commit-stream budget. Phases do not overlap: the original
reference runs before the MLX model loads, and the MLX model is released
(``_release``) before the same-weights reference loads. The same-weights reference dequantizes the MLX weights
as the loaded model holds them (float32 scales where the runtime upcast). The first
logits case (and the first image case) also yields per-layer hidden states of
both frameworks (``dlm.verify.layers``), and every reference records per-phase
timings in its run's meta (saved in bundles).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from dlm.runtime.checkpoint import read_json
from dlm.runtime.platform.errors import ConfigError, DlmError
from dlm.runtime.registry import family_for_config

from . import bundle as B
from . import local as LOC
from . import memory as M
from . import parity_report as X
from . import passes as P
from . import routes as R
from . import streaming as S
from .budget import STREAMED_BUDGET, WHOLE_BUDGET
from .store import ArrayStore
from . import weights as W
from . import image_suite as I
from .noise import loading_bars
from .progress import tqdm as _tqdm
from .protocol import adapter_for, check_adapter
from .compat import check_compatible, generation_config_differences, text_config
from .report import Report
from .source import recorded_source, resolve_reference


@dataclass
class Options:
    reference: Optional[str] = None  # repo id or directory; default: config.json's dlm.source
    revision: Optional[str] = None
    reference_dtype: str = "float32"
    prompts_file: Optional[str] = None
    builtin_prompts: bool = True
    long_prompt: bool = True  # a built-in prompt longer than the sliding window
    bundle: Optional[str] = None
    # Budget (dlm.verify.budget); AUTO: the mode's default, smaller for a
    # layer-streamed reference (every forward reads every layer from disk).
    logits_prompts: Union[int, None, str] = "auto"  # prompts that get logits cases (None: all)
    canvases: Union[int, str] = "auto"  # canvases per commit stream
    steps: Union[int, None, str] = "auto"  # max denoising steps per canvas (None: generation_config)
    stream_prompts: Union[int, None, str] = "auto"  # prompts that get commit streams (None: all)
    stream_layers: Optional[bool] = None  # layer-streamed references (None: when too big to hold)
    implementation: bool = True  # run check 2 (same weights)
    local: bool = True  # its layer-local row (dlm.verify.local)
    local_original: bool = True  # also record it with the original weights (reused for an unquantized model)
    images: bool = True  # image rows (a family with image hooks, a model with a vision tower)
    trust_remote_code: bool = False
    thresholds: dict = field(default_factory=dict)
    progress: bool = True
    trace_dir: Optional[str] = None  # --trace-dir: HTML pages of diverging commit streams


def _adapter(config: dict, where: str):
    family = family_for_config(config, where)
    try:
        adapter = adapter_for(family)
    except ImportError as exc:
        raise DlmError(f"dlm-verify has no reference for the {family.name} family ({exc})") from None
    check_adapter(adapter)
    return family, adapter


def _versions() -> dict:
    out = {}
    for name in ("torch", "transformers", "mlx"):
        try:
            from importlib.metadata import version

            out[name] = version(name)
        except Exception:
            pass
    return out


AUTO = "auto"


def _budget(options: Options, streamed: bool) -> dict:
    """The suite's budget (dlm.verify.budget): what the user set, else the mode's default."""
    default = STREAMED_BUDGET if streamed else WHOLE_BUDGET
    return {k: default[k] if getattr(options, k) == AUTO else getattr(options, k) for k in default}


def _waves(adapter, cases) -> list[list]:
    """The cases in waves whose members need nothing of each other (the
    adapter's ``case_waves``; default: one wave)."""
    waves = getattr(adapter, "case_waves", None)
    return waves(cases) if callable(waves) else [list(cases)]


def _forwards(streams) -> int:
    """Denoising forward passes of commit streams (one per traced step)."""
    return int(sum(b.steps for s in streams for b in s.blocks))


def _run_reference(adapter, ref, cases, prompts, stream_idx, settings, progress, label,
                   images=None, layer_cases=(), routes: Optional[R.RouteLog] = None,
                   local: bool = False) -> B.ReferenceRun:
    """The reference's logits, commit streams and image passes; with ``routes``
    (MLX's routing), routed as MLX routed (dlm.verify.routes); with ``local``,
    the layer-local record of the diagnostic cases (its own routing)."""
    forced = R.Forced()
    with P.routing(adapter, "force_reference_routes", ref, routes, forced):
        run = _reference_passes(adapter, ref, cases, prompts, stream_idx, settings, progress, label, images,
                                layer_cases)
    if routes is not None and forced.forced + forced.unforced:
        run.meta["routing"] = forced.summary()
    if local and layer_cases:
        with M.phase(f"{label}: layer-local"):
            LOC.record_reference(adapter, ref, run, P.cases_by_name(cases, images), layer_cases, progress, label)
    if getattr(ref, "streamer", None) is not None:
        run.meta["streaming"] = ref.streamer.stats()
        ref.streamer.close()
    return run


def _reference_passes(adapter, ref, cases, prompts, stream_idx, settings, progress, label, images,
                      layer_cases) -> B.ReferenceRun:
    # Logits on disk, one case read at a time (268 MB a case at the released size).
    run = B.ReferenceRun(logits=ArrayStore(), image_logits=ArrayStore())
    timings: dict = {}
    if getattr(ref, "streamer", None) is not None:
        ref.streamer.label, ref.streamer.bar.enabled = label, progress
    t = time.perf_counter()
    streamer = getattr(ref, "streamer", None)
    with M.phase(f"{label}: logits"):
        if streamer is None:
            for case in _tqdm(cases, f"{label}: logits", progress):
                run.logits[case.name] = P.reference_logits(adapter, ref, case, run.logits, run.hidden, layer_cases)
        else:  # layer-streamed: independent cases share each layer read (dlm.verify.lockstep)
            loads = streamer.layer_loads
            for wave in _tqdm(_waves(adapter, cases), f"{label}: logits (cases run together)", progress):
                jobs = [functools.partial(P.reference_logits, adapter, ref, case, run.logits, run.hidden,
                                          layer_cases) for case in wave]
                for case, logits in zip(wave, streamer.lockstep(jobs)):
                    run.logits[case.name] = logits
            timings["logits_layer_loads"] = streamer.layer_loads - loads
    timings["logits"] = time.perf_counter() - t
    t = time.perf_counter()
    with M.phase(f"{label}: commit streams"):
        for i in _tqdm(stream_idx, f"{label}: commit streams", progress):
            with R.job(f"stream:{i}"):
                run.streams.append(adapter.reference_commit_stream(ref, prompts[i], settings))
    timings["streams"] = time.perf_counter() - t
    timings["stream_forwards"] = _forwards(run.streams)
    if images is not None:
        t = time.perf_counter()

        def logits(case, done):
            return P.reference_logits(adapter, ref, case, done, run.hidden, layer_cases)

        I.run_reference(adapter, ref, images, settings, run, progress, label, logits=logits)
        timings["images"] = time.perf_counter() - t
        timings["image_stream_forwards"] = _forwards(run.image_streams)
    run.meta["timings"] = _rounded(timings)
    return run


def _rounded(timings: dict) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in timings.items()}


def _stream_indices(n_prompts: int, stream_prompts: Optional[int]) -> list[int]:
    k = n_prompts if stream_prompts is None else max(0, min(stream_prompts, n_prompts))
    return list(range(k))


def record(reference: str, options: Options, mlx_dir: Optional[Path] = None,
           expect_family: Optional[str] = None) -> B.Bundle:
    """Run the PyTorch reference on the suite's cases and streams; each run's
    meta gets the peak resident memory of its phases (``rss_gb``)."""
    with M.monitoring() as monitor:
        bundle = _record(reference, options, mlx_dir, expect_family)
        rss = monitor.summary()
    for run, label in ((bundle.original, "reference:"), (bundle.matched, "reference (MLX weights):")):
        if run is not None:
            run.meta["rss_gb"] = {k: v for k, v in rss.items() if k.startswith(label)}
    return bundle


def _record(reference: str, options: Options, mlx_dir: Optional[Path], expect_family: Optional[str]) -> B.Bundle:
    import torch  # noqa: F401  (clear ImportError before any work)

    from .prompts import suite_prompts

    ref_path = resolve_reference(reference, options.revision)
    config = read_json(ref_path / "config.json", "reference config")
    family, adapter = _adapter(config, str(ref_path / "config.json"))
    if expect_family and family.name != expect_family:
        raise ConfigError(f"reference {reference} is a {family.name} model; the converted model is {expect_family}")
    t = time.perf_counter()
    parts = S.whole_parts(S.CheckpointSource(ref_path), options.reference_dtype)
    need = sum(parts.values())
    streamed, why = S.decide(options.stream_layers, parts)
    with loading_bars(options.progress):
        ref = adapter.load_reference(ref_path, dtype=options.reference_dtype,
                                     trust_remote_code=options.trust_remote_code, stream=streamed)
    load_s = time.perf_counter() - t
    generation_config = getattr(ref, "generation_config", None) or {}
    window = _sliding_window(config)
    budget = _budget(options, streamed)
    prompts = suite_prompts(ref_path, options.prompts_file, builtin=options.builtin_prompts,
                            long_prompt_tokens=window if options.long_prompt else None,
                            trust_remote_code=options.trust_remote_code)[:budget["logits_prompts"]]
    cases = adapter.logit_cases(config, prompts, generation_config)
    settings = adapter.stream_settings(config, generation_config, blocks=budget["canvases"], steps=budget["steps"])
    stream_idx = _stream_indices(len(prompts), budget["stream_prompts"])
    budgeted = Options(**{**options.__dict__, **budget})
    images, image_note = I.record_images(adapter, ref_path, config, generation_config, budgeted)
    original = _run_reference(adapter, ref, cases, prompts, stream_idx, settings, options.progress, "reference",
                              images, P.layer_cases(adapter, cases, images),
                              local=options.local and options.local_original)
    original.meta["timings"]["load"] = round(load_s, 3)
    local = Path(reference).expanduser().is_dir()
    original.meta.update(source=str(ref_path.resolve()) if local else reference,
                         revision=options.revision, path=str(ref_path),
                         dtype=options.reference_dtype, versions=_versions(),
                         mode="streamed" if streamed else "whole", mode_reason=why,
                         bytes=need)
    del ref
    bundle = B.Bundle(
        family=family.name, model_type=str(config.get("model_type")), config=config,
        generation_config=generation_config, prompts=prompts, cases=cases, settings=settings,
        stream_prompts=stream_idx, original=original, images=images, image_note=image_note,
    )
    if mlx_dir is not None:
        bundle.matched = _matched_run(Path(mlx_dir), bundle, family, adapter, options)
    return bundle


def _sliding_window(config: dict) -> Optional[int]:
    text = text_config(config)
    if text.get("use_sliding_window") is False:  # LLaDA-2 carries the key but never uses it
        return None
    value = text.get("sliding_window")
    return int(value) if value else None


def _bundle_layer_cases(adapter, bundle: B.Bundle, images) -> list[str]:
    """The cases the bundle's reference captured hidden states for (older
    bundles: the suite's choice)."""
    return ([c for c in bundle.original.hidden if not c.startswith(LOC.PREFIX)]
            or P.layer_cases(adapter, bundle.cases, images))


def _mlx_bytes(loaded) -> int:
    """Bytes of the loaded MLX model's parameters, as the runtime holds them
    (float32 where it upcast or dequantized at load); 0 once released."""
    from mlx.utils import tree_flatten

    if loaded is None or loaded.model is None:
        return 0
    seen: dict[int, int] = {}
    for _, p in tree_flatten(loaded.model.parameters()):
        seen[id(p)] = int(p.nbytes)
    return sum(seen.values())


def _release(loaded) -> None:
    """Drop the MLX model's weights (its outputs are already taken): at the
    released scale the MLX model and a reference do not fit side by side."""
    import gc

    import mlx.core as mx

    loaded.model = None
    gc.collect()
    mx.clear_cache()
    M.trim()


def _matched_run(mlx_dir: Path, bundle: B.Bundle, family, adapter, options: Options,
                 loaded=None, routes: Optional[R.RouteLog] = None) -> B.ReferenceRun:
    """The reference with exactly the converted model's (dequantized) weights,
    in float32: what is left against MLX is its compute precision, and bugs.

    ``loaded``: the MLX model of this comparison (``LoadedModel``), if loaded:
    its weights are dequantized as it holds them (float32 scales where the
    runtime upcast them), and, while its model is still held, it counts
    towards the memory of a whole-model run (``run_parity`` releases it
    first). Without it (``record --mlx``), in the stored precision."""
    config = read_json(mlx_dir / "config.json", "config")
    dtype = "float32"
    t = time.perf_counter()
    upcast = bool(getattr(loaded, "upcast", False))
    dequantized = W.dequantized_weights(mlx_dir, config, upcast=upcast)
    source = S.MlxSource(dequantized, family.weights.to_hf)
    held = _mlx_bytes(loaded) if loaded is not None else 0
    parts = S.whole_parts(source, dtype, mlx_bytes=held)
    need = sum(parts.values())
    streamed, why = S.decide(options.stream_layers, parts, held=held)
    with loading_bars(options.progress):
        if streamed:
            ref = adapter.load_reference(mlx_dir, dtype=dtype, weights=source,
                                         trust_remote_code=options.trust_remote_code, stream=True)
        else:
            weights = family.weights.to_hf(dequantized)
            ref = adapter.load_reference(mlx_dir, dtype=dtype, weights=weights,
                                         trust_remote_code=options.trust_remote_code)
            del weights
    load_s = time.perf_counter() - t
    images, _ = I.usable(adapter, config, bundle, options)
    run = _run_reference(adapter, ref, bundle.cases, bundle.prompts, bundle.stream_prompts,
                         bundle.settings, options.progress, "reference (MLX weights)", images,
                         _bundle_layer_cases(adapter, bundle, images), routes=routes, local=options.local)
    run.meta["timings"]["load"] = round(load_s, 3)
    run.meta.update(dtype=dtype, fingerprint=W.fingerprint(mlx_dir), versions=_versions(),
                    mode="streamed" if streamed else "whole", mode_reason=why, bytes=need,
                    scales_dtype=dequantized.scales_dtype)
    return run


def _same_as_original(mlx_dir: Path, config: dict, family, bundle: B.Bundle, prec: W.Precision,
                      upcast: bool) -> str:
    """A note when the same-weights reference would be the original one over
    again: an unquantized conversion whose every tensor, as float32, equals
    the checkpoint's under the same name, bit for bit, and a float32 original
    reference (compared one tensor at a time); "" otherwise."""
    meta = bundle.original.meta
    path = Path(meta.get("path") or "")
    if prec.quantized or meta.get("dtype") != "float32" or not (path / "config.json").is_file():
        return ""
    import numpy as np

    mlx = S.MlxSource(W.dequantized_weights(mlx_dir, config, upcast=upcast), family.weights.to_hf)
    checkpoint = S.CheckpointSource(path)
    names = list(mlx.keys())
    if not names or any(n not in checkpoint for n in names):
        return ""
    for group in mlx.groups():  # each converted tensor read once (a stack of experts at a time)
        ours, theirs = mlx.read(group), checkpoint.read(group)
        for name in group:
            if tuple(ours[name].shape) != tuple(theirs[name].shape):
                return ""
            if not np.array_equal(ours[name].float().numpy(), theirs[name].float().numpy()):
                return ""
        del ours, theirs
    return (f"the MLX weights are the checkpoint's, bit for bit ({len(names)} tensors compared): the "
            "original-weights reference is the same-weights reference (not run twice)")


def _scales_mismatch(matched: B.ReferenceRun, mlx_dir: Path, config: dict, upcast: bool) -> str:
    """A note when a bundle's same-weights reference dequantized with scales in
    another dtype than the loaded MLX model holds (bundles without the record:
    their stored dtype), else ""."""
    want = W.dequantized_weights(mlx_dir, config, upcast=upcast).scales_dtype
    got = matched.meta.get("scales_dtype", W.dequantized_weights(mlx_dir, config).scales_dtype)
    if got == want:
        return ""
    return (f"; but dequantized with {got} scales, where the MLX model holds {want} ones "
            "(run without --bundle for exactly its weights)")


def run_parity(mlx_dir, options: Options) -> Report:
    """Compare a converted MLX directory with its PyTorch reference; the
    report's timings include each phase's peak resident memory (``rss_gb``)."""
    with M.monitoring() as monitor:
        report = _run_parity(mlx_dir, options)
        report.timings["rss_gb"] = monitor.summary()
    return report


def _run_parity(mlx_dir, options: Options) -> Report:
    """The steps of a comparison, in order; each phase's timings and notes go
    into the report in the order they happen."""
    start = time.perf_counter()
    mlx_dir = Path(mlx_dir).expanduser()
    if not (mlx_dir / "config.json").exists():
        raise ConfigError(_not_a_conversion(mlx_dir))
    config = read_json(mlx_dir / "config.json", "config")
    family, adapter = _adapter(config, str(mlx_dir / "config.json"))
    run = X.Parity(mlx_dir=mlx_dir, config=config, family=family, adapter=adapter, options=options)
    run.bundle, run.reference = _original_reference(run)
    _run_mlx(run)
    _same_weights_reference(run)
    _layer_local(run)
    return X.checks_and_report(run, start)


def _not_a_conversion(mlx_dir: Path) -> str:
    """Why ``--parity`` cannot take this path (it has no config.json)."""
    text = str(mlx_dir)
    if not mlx_dir.exists() and not text.startswith((".", "/", "~")) and text.count("/") == 1:
        return (f"{text}: no such directory. dlm-verify --parity takes a converted MLX directory; a Hub "
                f"checkpoint is what it converts from: dlm-convert {text} -o MLX_DIR, then "
                "dlm-verify --parity MLX_DIR")
    return f"{mlx_dir}: not a converted model directory (no config.json)"


def _original_reference(run: X.Parity) -> tuple[B.Bundle, dict]:
    """The original-weights reference: a recorded bundle, or a live run of the
    checkpoint the conversion names (or --reference); checked to fit the model."""
    options, config, mlx_dir = run.options, run.config, run.mlx_dir
    t = time.perf_counter()
    if options.bundle:
        bundle = B.load(Path(options.bundle))
        if options.prompts_file:
            run.notes.append("--prompts ignored: the bundle's prompts are used")
        reference = dict(bundle.original.meta, bundle=str(bundle.path))
        run.timings["reference"] = {"bundle": round(time.perf_counter() - t, 3),
                                    "recorded": bundle.original.meta.get("timings", {})}
    else:
        source, revision = options.reference, options.revision
        if not source:
            source, recorded_rev = recorded_source(config)
            revision = revision or recorded_rev
        if not source and not isinstance(config.get("dlm"), dict):
            raise ConfigError(
                f"{mlx_dir} is not a dlm-convert conversion (its config.json has no \"dlm\" block): "
                f"dlm-verify --parity checks a converted MLX directory against the checkpoint it was converted "
                f"from. Convert it first (dlm-convert {mlx_dir} -o MLX_DIR), then run dlm-verify --parity MLX_DIR "
                f"(its reference defaults to {mlx_dir}); to check MLX running this checkpoint as it is, "
                f"pass --reference {mlx_dir}"
            )
        if not source:
            raise ConfigError(
                f"{mlx_dir / 'config.json'} records no source (\"dlm\": {{\"source\": ...}}); "
                "pass --reference HF_REPO_OR_DIR or --bundle"
            )
        # A text-only conversion cannot use image cases: do not record them.
        # The original run's layer-local record serves only an unquantized model (_same_as_original).
        live = Options(**{**options.__dict__, "reference": source, "revision": revision,
                          "images": I.mlx_takes_images(run.adapter, config, options)[0],
                          "local_original": not W.precision(mlx_dir, config).quantized})
        bundle = record(source, live, expect_family=run.family.name)
        reference = dict(bundle.original.meta)
        run.timings["reference"] = bundle.original.meta.get("timings", {})
    what = f"bundle {options.bundle}" if options.bundle else f"reference {reference.get('source')}"
    if bundle.family != run.family.name:
        raise ConfigError(f"{what} is a {bundle.family} model; {mlx_dir} is {run.family.name}")
    check_compatible(bundle, config, str(mlx_dir / "config.json"))
    return bundle, reference


def _run_mlx(run: X.Parity) -> None:
    """Load the MLX model, take its logits, commit streams and image passes
    (recording its routing for the same-weights reference), then release it."""
    from dlm.runtime import loader

    options, adapter, bundle, mlx_dir = run.options, run.adapter, run.bundle, run.mlx_dir
    mlx_t: dict = {}
    t = time.perf_counter()
    # Prompts are token ids: no tokenizer needed (nor transformers, on a torch-less machine).
    loaded = loader.load(mlx_dir, trust_remote_code=options.trust_remote_code, tokenizer=False)
    prec = W.precision(mlx_dir, run.config)
    mlx_t["load"] = time.perf_counter() - t
    compute = adapter.compute_dtype(loaded) if hasattr(adapter, "compute_dtype") else prec.compute_dtype
    if loaded.upcast:
        # Half-precision weights upcast for the CPU backend: the stored precision
        # still sets what the original-weights comparison may lose.
        run.notes.append(f"MLX computed in float32: the {prec.compute_dtype} weights were upcast at load for the "
                         "CPU backend (--compute-dtype native keeps them)")
    elif compute != prec.compute_dtype:
        prec = W.Precision(prec.label if prec.quantized else compute, compute, prec.bits, prec.mode)
    run.loaded, run.prec, run.compute = loaded, prec, compute
    differ = generation_config_differences(bundle.settings, loaded.generation_config)
    if differ:
        run.notes.append("the MLX generation_config.json differs from the reference's ("
                         + ", ".join(differ) + "): commit streams may diverge for that reason")
    images, image_note = I.usable(adapter, run.config, bundle, options)
    if image_note:
        run.notes.append(image_note)
    run.images = images
    run.layer_cases = layer_cases = _bundle_layer_cases(adapter, bundle, images)
    hidden = run.mlx_hidden
    routes = R.RouteLog() if options.implementation else None  # what the same-weights reference follows
    with P.routing(adapter, "record_mlx_routes", loaded, routes):
        t = time.perf_counter()
        with M.phase("MLX: logits"):
            for case in _tqdm(bundle.cases, "MLX: logits", options.progress):
                run.mlx_logits[case.name] = P.mlx_logits(adapter, loaded, case, hidden, layer_cases)
        mlx_t["logits"] = time.perf_counter() - t
        t = time.perf_counter()
        with M.phase("MLX: commit streams"):
            for i in _tqdm(bundle.stream_prompts, "MLX: commit streams", options.progress):
                with R.job(f"stream:{i}"):
                    run.mlx_streams.append(adapter.mlx_commit_stream(loaded, bundle.prompts[i], bundle.settings))
        mlx_t["streams"] = time.perf_counter() - t
        mlx_t["stream_forwards"] = _forwards(run.mlx_streams)
        if images:
            t = time.perf_counter()
            run.mlx_images = I.run_mlx(adapter, loaded, images, bundle.settings, options.progress,
                                       logits=lambda case: P.mlx_logits(adapter, loaded, case, hidden, layer_cases))
            mlx_t["images"] = time.perf_counter() - t
    run.routes = routes if routes else None  # nothing recorded: a family without routing hooks
    run.timings["mlx"] = _rounded(mlx_t)
    _release(loaded)  # everything below needs only its outputs (and loaded.upcast)


def _same_weights_reference(run: X.Parity) -> None:
    """The reference with the MLX model's own weights (check 2): recorded in
    the bundle for these weights, the original one where the weights are the
    checkpoint's bit for bit, else a run of its own."""
    t = time.perf_counter()
    options, bundle, mlx_dir, upcast = run.options, run.bundle, run.mlx_dir, run.loaded.upcast
    matched, matched_note = None, ""
    if options.implementation:
        fp = W.fingerprint(mlx_dir)
        if bundle.matched is not None and bundle.matched.meta.get("fingerprint") == fp:
            matched, matched_note = bundle.matched, "recorded in the bundle for these exact weights"
            matched_note += _scales_mismatch(matched, mlx_dir, run.config, upcast)
        else:
            try:
                import torch  # noqa: F401
            except ImportError:
                matched_note = "needs torch (or a bundle recorded with --mlx for these weights)"
            else:
                same = _same_as_original(mlx_dir, run.config, run.family, bundle, run.prec, upcast)
                if same:
                    matched, matched_note = bundle.original, same
                else:
                    matched = _matched_run(mlx_dir, bundle, run.family, run.adapter, options, loaded=run.loaded,
                                           routes=run.routes)
                    matched_note = f"reference run with the MLX weights in {matched.meta['dtype']}"
                    if matched.meta.get("mode") == "streamed":
                        matched_note += ", layer-streamed"
    else:
        matched_note = "disabled (--no-implementation)"
    run.matched, run.matched_note = matched, matched_note
    reused = run.reused
    run.timings["implementation"] = (
        dict(matched.meta.get("timings", {}), total=round(time.perf_counter() - t, 3))
        if matched is not None and not reused
        else {"total": round(time.perf_counter() - t, 3),
              **({"reused": "the original-weights reference"} if reused else {})})


def _layer_local(run: X.Parity) -> None:
    """The layer-local row (dlm.verify.local): the MLX model loaded again and
    fed the same-weights reference's recorded layer inputs."""
    from dlm.runtime import loader

    options = run.options
    if run.matched is None or not options.local or not LOC.recorded(run.matched):
        return
    t = time.perf_counter()
    loaded = loader.load(run.mlx_dir, trust_remote_code=options.trust_remote_code, tokenizer=False)
    with M.phase("MLX: layer-local"):
        run.local_row = LOC.run_and_check(run.adapter, loaded, P.cases_by_name(run.bundle.cases, run.images),
                                          run.matched, W.Precision(run.compute, run.compute, None, None),
                                          options.thresholds, options.progress)
    _release(loaded)
    run.timings["mlx"]["layer_local"] = round(time.perf_counter() - t, 3)

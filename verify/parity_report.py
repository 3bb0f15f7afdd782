"""The checks and the report of ``dlm.verify.suite.run_parity``: what the
comparison's steps produced (``Parity``) judged row by row — logits, the
same-weights implementation, drift, commit streams, images, per-layer
agreement — and assembled into a ``Report``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from . import bundle as B
from . import checks as C
from . import image_suite as I
from . import layers as L
from . import routes as R
from . import weights as W
from .report import Report
from .store import ArrayStore


@dataclass
class Parity:
    """One comparison as its steps fill it in (dlm.verify.suite._run_parity)."""

    mlx_dir: Path
    config: dict
    family: Any
    adapter: Any
    options: Any  # dlm.verify.suite.Options
    timings: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    # the original-weights reference
    bundle: Optional[B.Bundle] = None
    reference: dict = field(default_factory=dict)
    # the MLX side (its model released once its outputs are taken)
    loaded: Any = None
    prec: Optional[W.Precision] = None
    compute: str = ""
    images: Any = None  # the usable image cases (dlm.verify.images.ImageSet), if any
    layer_cases: list = field(default_factory=list)
    mlx_hidden: dict = field(default_factory=dict)
    mlx_logits: ArrayStore = field(default_factory=ArrayStore)
    mlx_streams: list = field(default_factory=list)
    mlx_images: Any = None
    routes: Optional[R.RouteLog] = None
    # the same-weights reference and its layer-local row
    matched: Optional[B.ReferenceRun] = None
    matched_note: str = ""
    local_row: Optional[C.CheckResult] = None

    @property
    def reused(self) -> bool:
        """The same-weights reference is the original one (not run twice)."""
        return self.matched is self.bundle.original


def checks_and_report(run: Parity, start: float) -> Report:
    """Every row, the per-layer agreement and the report (``start``: when the
    comparison began, for the total time)."""
    t = time.perf_counter()
    ref_dtype = run.bundle.original.meta.get("dtype", "float32")
    prec = run.prec
    # A half-precision reference cannot hold a float32 model to float32 bounds.
    vs_original = prec
    if ref_dtype != "float32" and prec.compute_dtype == "float32":
        vs_original = W.Precision(prec.label, ref_dtype, prec.bits, prec.mode)
    results = _logits_rows(run, vs_original, ref_dtype)
    results += _stream_rows(run, vs_original)
    if run.images is not None:
        vision = I.vision_precision(run.adapter, run.mlx_dir, run.config, run.loaded, run.compute)
        results += I.rows(run.bundle, run.images, run.mlx_images, run.matched, run.matched_note, prec,
                          vs_original, vision, run.compute, run.options.thresholds)
    layers = _layer_agreement(run, vs_original, ref_dtype)
    run.timings["checks"] = round(time.perf_counter() - t, 3)
    run.timings["total"] = round(time.perf_counter() - start, 3)
    return _report(run, results, layers)


def _logits_rows(run: Parity, vs_original: W.Precision, ref_dtype: str) -> list[C.CheckResult]:
    """Check 1 (vs the original weights), check 2 (vs the same weights, with
    the routing it was forced to follow) and the layer-local row."""
    bundle, matched, thr = run.bundle, run.matched, run.options.thresholds
    results = [C.check_logits("logits", bundle.original.logits, run.mlx_logits, vs_original, thr,
                              note=f"reference in {ref_dtype}")]
    if matched is not None:
        results.append(C.check_logits("implementation", matched.logits, run.mlx_logits, run.prec, thr,
                                      note=run.matched_note))
        if matched.meta.get("routing") and not run.reused:
            R.judge(results[-1], matched.meta["routing"], run.prec, thr)
            run.notes.append(R.describe(matched.meta["routing"]))
    else:
        results.append(C.skipped("implementation", run.matched_note))
    if run.local_row is not None:
        results.append(run.local_row)
    elif run.options.local and matched is not None and run.layer_cases:
        results.append(C.skipped("implementation_layers", "the same-weights reference has no layer-local "
                                 "record (a bundle recorded before it)"))
    return results


def _stream_rows(run: Parity, vs_original: W.Precision) -> list[C.CheckResult]:
    """Drift (quantized vs original) and the commit-stream row, with a
    side-by-side page per diverging stream under --trace-dir."""
    bundle, matched, prec, thr = run.bundle, run.matched, run.prec, run.options.thresholds
    td = time.perf_counter()
    results = [C.check_drift(bundle.original.logits, run.mlx_logits, bundle.original.streams,
                             run.mlx_streams, prec, thr)]
    run.timings["drift"] = round(time.perf_counter() - td, 3)
    if matched is not None:
        results.append(C.check_commit_stream(matched.streams, run.mlx_streams, prec, thr,
                                             note="vs the reference with the MLX weights",
                                             original=bundle.original.streams))
    elif not prec.quantized:
        results.append(C.check_commit_stream(bundle.original.streams, run.mlx_streams, vs_original, thr,
                                             note="vs the original reference"))
    else:
        results.append(C.skipped("commit_stream", "quantized model without the same-weights reference"))
    if run.options.trace_dir:  # a side-by-side page per diverging commit stream (trace_view.py)
        from .trace_view import write_divergences

        compared = matched.streams if matched is not None else None if prec.quantized else bundle.original.streams
        run.notes += write_divergences(run.options.trace_dir, run.mlx_dir, run.family, compared, run.mlx_streams,
                                       "PyTorch reference" + (" (MLX weights)" if matched is not None else ""))
    return results


def _layer_agreement(run: Parity, vs_original: W.Precision, ref_dtype: str) -> dict:
    """Per-layer hidden-state agreement (dlm.verify.layers) against each
    reference that captured it."""
    layers = {}
    matched, thr = run.matched, run.options.thresholds
    if matched is not None and matched.hidden:
        same = W.Precision(run.compute, run.compute, None, None)  # same weights: judged by the compute dtype
        layers["implementation"] = L.agreement(matched.hidden, run.mlx_hidden, same, thr,
                                               "vs the reference with the MLX weights")
    if run.bundle.original.hidden:
        layers["original"] = L.agreement(run.bundle.original.hidden, run.mlx_hidden, vs_original, thr,
                                         f"vs the original weights (reference in {ref_dtype})")
    return layers


def _backend() -> dict:
    """Where the MLX side ran and how its float32 products were computed
    (dlm.runtime.platform.precision: TF32 on a GPU would blur float32 parity)."""
    from dlm.runtime.platform import backend, precision

    return {"device": backend.device_name(), "float32_matmul": precision.describe()}


def _report(run: Parity, results: list[C.CheckResult], layers: dict) -> Report:
    bundle, matched = run.bundle, run.matched
    modes = {"reference": bundle.original.meta.get("mode", "whole"),
             "reference_reason": bundle.original.meta.get("mode_reason", "")}
    if matched is not None and not run.reused:
        modes.update(implementation=matched.meta.get("mode", "whole"),
                     implementation_reason=matched.meta.get("mode_reason", ""))
    return Report(
        model=str(run.mlx_dir), family=run.family.name, precision=dict(run.prec.to_dict(), mlx_compute_dtype=run.compute, **_backend()),
        reference=run.reference, checks=results,
        settings=dict(bundle.settings, stream_prompts=len(bundle.stream_prompts)),
        prompts=len(bundle.prompts), cases=len(bundle.cases), timings=run.timings, notes=run.notes,
        images=I.summary(run.images), layers=layers, streaming=modes,
    )

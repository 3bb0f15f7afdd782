"""The parity checks: numbers, thresholds and a verdict each.

Generic over families: inputs are per-case logits, commit streams and (image
rows) vision features. A row's ``kind`` names its threshold table and how it
is shown (``image.logits.p0`` is a ``logits`` row); its ``name`` is unique.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from . import metrics as M
from .protocol import CommitStream
from .thresholds import evaluate, thresholds_for
from .weights import Precision

TITLES = {
    "logits": "Logits vs the original weights",
    "implementation": "Implementation parity (same weights)",
    "implementation_layers": "Implementation, layer by layer (fed the reference's input)",
    "drift": "Quantization drift",
    "commit_stream": "Commit streams (deterministic generation)",
    "features": "Image features vs the original weights",
}


@dataclass
class CheckResult:
    name: str
    status: str  # "pass" | "fail" | "skip"
    metrics: dict = field(default_factory=dict)
    thresholds: dict = field(default_factory=dict)  # metric -> [op, value]
    precision_class: str = ""
    failures: list[str] = field(default_factory=list)
    note: str = ""
    details: dict = field(default_factory=dict)
    kind: str = ""  # threshold table and display (default: name)
    label: str = ""  # title (default: the kind's)

    def __post_init__(self):
        self.kind = self.kind or self.name

    @property
    def title(self) -> str:
        return self.label or TITLES.get(self.kind, self.name)

    @property
    def passed(self) -> bool:
        return self.status != "fail"

    def to_dict(self) -> dict:
        return dict(
            name=self.name, kind=self.kind, title=self.title, status=self.status, passed=self.passed,
            metrics=self.metrics, thresholds=self.thresholds, precision_class=self.precision_class,
            failures=self.failures, note=self.note, details=self.details,
        )


def skipped(name: str, note: str, kind: str = "", label: str = "") -> CheckResult:
    return CheckResult(name, "skip", note=note, kind=kind, label=label)


def _verdict(name: str, metrics: dict, prec: Precision, overrides: dict | None, note: str = "",
             details: dict | None = None, kind: str = "", label: str = "") -> CheckResult:
    kind = kind or name
    cls, bounds, _ = thresholds_for(kind, prec.label, prec.compute_dtype, prec.bits, overrides)
    ok, failures = evaluate(metrics, bounds)
    return CheckResult(
        name, "pass" if ok else "fail", metrics, {k: [op, v] for k, (op, v) in bounds.items()},
        cls, failures, note, details or {}, kind, label,
    )


def _tolerance(name: str, prec: Precision, overrides: dict | None) -> float:
    return thresholds_for(name, prec.label, prec.compute_dtype, prec.bits, overrides)[2]


def _per_case(ref: dict[str, np.ndarray], mlx: dict[str, np.ndarray], tol: float) -> dict[str, dict]:
    missing = sorted(set(ref) - set(mlx))
    if missing:
        raise ValueError(f"no MLX logits for case {missing[0]}")
    return {name: M.logits_metrics(ref[name], mlx[name], tol) for name in ref}


def check_logits(name: str, ref: dict[str, np.ndarray], mlx: dict[str, np.ndarray], prec: Precision,
                 overrides: dict | None = None, note: str = "", kind: str = "", label: str = "") -> CheckResult:
    """``logits`` (vs original) and ``implementation`` (vs same weights); ``kind``
    (default ``name``) is one of the two for the image rows."""
    kind = kind or name
    tol = _tolerance(kind, prec, overrides)
    per_case = _per_case(ref, mlx, tol)
    if not per_case:
        return skipped(name, "no logit cases", kind, label)
    worst = max(per_case, key=lambda k: (per_case[k]["max_abs"], -per_case[k]["top1"]))
    details = {"cases": per_case, "worst_case": worst, "tie_tolerance": tol}
    return _verdict(name, M.aggregate(per_case), prec, overrides, note, details, kind, label)


def check_features(name: str, ref: dict[str, np.ndarray], mlx: dict[str, np.ndarray], prec: Precision,
                   overrides: dict | None = None, note: str = "", label: str = "") -> CheckResult:
    """Vision features per image (``features`` thresholds): the worst image decides."""
    missing = sorted(set(ref) - set(mlx))
    if missing:
        raise ValueError(f"no MLX features for image {missing[0]}")
    per_image = {n: M.features_metrics(ref[n], mlx[n]) for n in ref}
    if not per_image:
        return skipped(name, "no images", "features", label)
    worst = max(per_image, key=lambda k: (per_image[k]["max_abs"], -per_image[k]["cosine_min"]))
    details = {"images": per_image, "worst_image": worst}
    return _verdict(name, M.aggregate_features(per_image), prec, overrides, note, details, "features", label)


def _stream_rows(ref: list[CommitStream], mlx: list[CommitStream], tol: float) -> list[dict]:
    rows = []
    for i, (r, m) in enumerate(zip(ref, mlx)):
        row = M.stream_metrics(r, m)
        div = M.first_divergence(r, m)
        row["prompt"] = i
        row["divergence"] = div.to_dict() if div else None
        row["divergence_text"] = div.describe() if div else None
        row["near_tie"] = bool(div and div.near_tie(tol))
        row["stop_decision"] = bool(div and div.stop_decision)
        accept = M.acceptance_tie(r, m, div, tol) if div and not row["near_tie"] else None
        row["acceptance"] = accept
        row["acceptance_tie"] = bool(accept and accept["tied"])
        row["step_gaps"] = M.step_gaps(r, m, div) if div else []
        if len(row["step_gaps"]) > 1:
            row["divergence_text"] += "; top-1 logit gap by step " + " → ".join(f"{g:.2g}" for g in row["step_gaps"])
        if accept:
            row["divergence_text"] += (
                f"; step {accept['step'] + 1} kept different positions ({accept['flipped']}: "
                f"{accept['positions']}), " + ("a near-tie of their scores in both frameworks" if accept["tied"]
                                               else "not a near-tie"))
        rows.append(row)
    return rows


def check_commit_stream(ref: list[CommitStream], mlx: list[CommitStream], prec: Precision,
                        overrides: dict | None = None, note: str = "",
                        original: Optional[list[CommitStream]] = None, name: str = "commit_stream",
                        label: str = "") -> CheckResult:
    if not ref or not mlx:
        return skipped(name, "no commit streams", "commit_stream", label)
    tol = _tolerance("commit_stream", prec, overrides)
    rows = _stream_rows(ref, mlx, tol)
    metrics = dict(
        identical_fraction=float(np.mean([r["identical"] for r in rows])),
        steps_match_fraction=float(np.mean([r["same_steps"] for r in rows])),
        # identical tokens, or a first divergence the precision explains: a
        # near-tie (both candidates within the tie tolerance in both
        # frameworks), an acceptance near-tie (an earlier step kept positions
        # whose scores tie with ones it did not keep, in both frameworks) or
        # a stop decision taken one step apart
        explained_fraction=float(np.mean([r["identical"] or r["near_tie"] or r["acceptance_tie"]
                                          or r["stop_decision"] for r in rows])),
        token_match=float(np.mean([r["token_match"] for r in rows])),
        prompts=len(rows),
        tokens=int(sum(r["reference_tokens"] for r in rows)),
    )
    details: dict = {"prompts": rows, "tie_tolerance": tol}
    if original is not None and original is not ref:
        orig = [M.stream_metrics(o, m) for o, m in zip(original, mlx)]
        metrics["vs_original_token_match"] = float(np.mean([o["token_match"] for o in orig]))
    first = next((r for r in rows if r["divergence"]), None)
    if first:
        details["first_divergence"] = f"prompt {first['prompt']}: {first['divergence_text']}"
    return _verdict(name, metrics, prec, overrides, note, details, "commit_stream", label)


def check_drift(orig_logits: dict, mlx_logits: dict, orig_streams: list[CommitStream],
                mlx_streams: list[CommitStream], prec: Precision,
                overrides: dict | None = None, name: str = "drift", label: str = "") -> CheckResult:
    if not prec.quantized:
        return skipped(name, f"not quantized ({prec.label})", "drift", label)
    per_case = _per_case(orig_logits, mlx_logits, _tolerance("drift", prec, overrides))
    agg = M.aggregate(per_case)
    rows = [M.stream_metrics(o, m) for o, m in zip(orig_streams, mlx_streams)]
    ref_steps = float(np.mean([r["reference_steps_mean"] for r in rows])) if rows else 0.0
    mlx_steps = float(np.mean([r["mlx_steps_mean"] for r in rows])) if rows else 0.0
    metrics = dict(
        kl_mean=agg.get("kl_mean"),
        kl_max=agg.get("kl_max"),
        top1=agg.get("top1"),
        top1_tol=agg.get("top1_tol"),
        commit_match=float(np.mean([r["token_match"] for r in rows])) if rows else None,
        reference_steps_per_canvas=ref_steps,
        mlx_steps_per_canvas=mlx_steps,
        steps_delta=mlx_steps - ref_steps,
        steps_ratio=(mlx_steps / ref_steps) if ref_steps else None,
    )
    details = {"streams": [{k: r[k] for k in ("token_match", "reference_steps", "mlx_steps")} for r in rows]}
    return _verdict(name, metrics, prec, overrides, "", details, "drift", label)

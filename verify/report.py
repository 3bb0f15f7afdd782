"""Parity results as JSON, a terminal table and a model-card section."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .checks import CheckResult
from .layers import describe as describe_layers

LAYER_TITLES = {"implementation": "same weights", "original": "original weights"}

# Metrics shown per check kind (in order); thresholded metrics are always shown.
SHOWN = {
    "features": ("max_abs", "mean_abs", "cosine_min", "rel_err"),
    "logits": ("max_abs", "mean_abs", "top1", "top1_tol", "kl_mean", "entropy_diff_max"),
    "implementation": ("max_abs", "mean_abs", "top1", "top1_tol", "kl_mean", "entropy_diff_max"),
    "implementation_layers": ("cosine_min", "rel_max", "max_abs", "stages", "excused", "routing_flips"),
    "drift": ("kl_mean", "top1", "top1_tol", "commit_match", "reference_steps_per_canvas", "mlx_steps_per_canvas",
              "steps_ratio"),
    "commit_stream": ("identical_fraction", "steps_match_fraction", "explained_fraction", "token_match", "tokens",
                      "vs_original_token_match"),
}
LABELS = {
    "max_abs": "max|Δ|", "mean_abs": "mean|Δ|", "top1": "top-1", "top1_tol": "top-1~", "kl_mean": "KL", "kl_max": "KLmax",
    "entropy_diff_max": "max|ΔH|", "entropy_diff_mean": "mean|ΔH|", "commit_match": "commits",
    "reference_steps_per_canvas": "steps ref", "mlx_steps_per_canvas": "steps mlx",
    "steps_ratio": "steps×", "identical_fraction": "identical", "explained_fraction": "identical~", "steps_match_fraction": "same steps", "token_match": "tokens",
    "tokens": "n", "vs_original_token_match": "vs orig", "cosine_min": "cos min", "cosine_mean": "cos mean",
    "rel_err": "rel|Δ|", "rel_max": "rel max|Δ|", "excused": "near-ties", "routing_flips": "flips",
}


def fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if math.isinf(x) or math.isnan(x):
            return str(x)
        if x == 0:
            return "0"
        if abs(x) < 1e-3 or abs(x) >= 1e4:
            return f"{x:.1e}"
        if 0.99 <= x < 1:  # cosines and agreement close to 1: show the nines
            short = f"{x:.6g}"
            return "1.000" if short == "1" else short
        return f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"
    return str(x)


@dataclass
class Report:
    model: str
    family: str
    precision: dict
    reference: dict
    checks: list[CheckResult]
    settings: dict = field(default_factory=dict)
    prompts: int = 0
    cases: int = 0
    timings: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    images: dict = field(default_factory=dict)  # image cases (image_suite.summary); {} without
    # Per-layer hidden-state agreement (dlm.verify.layers.agreement), by
    # comparison: "implementation" (same weights) and "original".
    layers: dict = field(default_factory=dict)
    # How each reference ran: "whole" or "streamed" (layer by layer), and why.
    streaming: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def check(self, name: str) -> CheckResult:
        return next(c for c in self.checks if c.name == name)

    def to_dict(self) -> dict:
        return dict(
            passed=self.passed, model=self.model, family=self.family, precision=self.precision,
            reference=self.reference, prompts=self.prompts, cases=self.cases, settings=self.settings,
            checks={c.name: c.to_dict() for c in self.checks}, images=self.images, timings=self.timings,
            layers=self.layers, streaming=self.streaming, notes=self.notes,
            created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        )

    def write_json(self, path) -> None:
        """Atomically (temporary sibling, then rename), with the usual umask mode
        (mkstemp alone would leave it owner-only)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_dict(), f, indent=2, default=_default)
                f.write("\n")
            os.chmod(tmp, umask_mode(directory=False))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def images_text(self) -> str:
        """One line on the image cases ("" without)."""
        if not self.images:
            return ""
        shown = ", ".join(f"{i['name']} {i['size'][0]}×{i['size'][1]} ({i['soft_tokens']} soft tokens)"
                          for i in self.images.get("images", []))
        n = self.images.get("stream_prompts", 0)
        return (f"{len(self.images.get('images', []))} built-in images ({shown}) in "
                f"{self.images.get('prompts', 0)} image prompts, {self.images.get('cases', 0)} image logit cases"
                f"{f', commit streams for {n} of them' if n else ''}")

    def settings_text(self) -> str:
        """The commit-stream settings (family-specific keys), scalars only."""
        items = [f"{k}={v}" for k, v in self.settings.items()
                 if k != "stream_prompts" and isinstance(v, (int, float, str, bool))]
        return ", ".join(items)

    # -- terminal -----------------------------------------------------------

    def _numbers(self, c: CheckResult) -> str:
        keys = list(SHOWN.get(c.kind, ()))
        keys += [k for k in c.thresholds if k not in keys and c.thresholds[k][1] is not None]
        parts = [f"{LABELS.get(k, k)} {fmt(c.metrics.get(k))}" for k in keys if k in c.metrics]
        return "  ".join(parts)

    def _bounds(self, c: CheckResult) -> str:
        parts = [f"{LABELS.get(k, k)}{'≤' if op == '<=' else '≥'}{fmt(v)}"
                 for k, (op, v) in c.thresholds.items() if v is not None]
        return " ".join(parts) or "-"

    def table(self) -> str:
        prec = self.precision
        ref = self.reference
        src = ref.get("source") or ref.get("bundle") or "?"
        lines = [
            f"dlm-verify --parity {self.model}",
            f"  family {self.family}, precision {prec.get('label')} ({self.compute_text()}); "
            f"MLX {prec.get('device', '?')} backend, float32 matmuls {prec.get('float32_matmul', '?')}; "
            f"reference {src} ({ref.get('dtype', '?')})"
            + (f", bundle {ref['bundle']}" if ref.get("bundle") and ref.get("source") else ""),
            f"  {self.prompts} prompts, {self.cases} logit cases; commit streams for "
            f"{self.settings.get('stream_prompts', 0)} prompts ({self.settings_text()})",
        ]
        if self.images:
            lines.append(f"  images: {self.images_text()}")
        lines.append("")
        rows = [("check", "verdict", "numbers", "threshold")]
        for c in self.checks:
            verdict = {"pass": "PASS", "fail": "FAIL", "skip": "skip"}[c.status]
            numbers = self._numbers(c) if c.status != "skip" else c.note
            rows.append((f"{c.name}: {c.title}", verdict, numbers, self._bounds(c) if c.status != "skip" else ""))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        for r in rows:
            lines.append(f"  {r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}".rstrip())
        for c in self.checks:
            for failure in c.failures:
                lines.append(f"  ✗ {c.name}: {failure}")
            if c.status == "fail" and c.kind in ("logits", "implementation"):
                worst = c.details.get("worst_case")
                if worst:
                    m = c.details["cases"][worst]
                    lines.append(f"    worst case {worst}: max|Δ| {fmt(m['max_abs'])}, top-1 {fmt(m['top1'])}")
            if c.status == "fail" and c.kind == "features" and len(c.details.get("images", {})) > 1:
                worst = c.details.get("worst_image")
                if worst:
                    m = c.details["images"][worst]
                    lines.append(f"    worst image {worst}: max|Δ| {fmt(m['max_abs'])}, "
                                 f"cos min {fmt(m['cosine_min'])}")
            div = c.details.get("first_divergence") if c.kind == "commit_stream" else None
            if div:
                lines.append(f"  first divergence: {div}")
        for name, summary in self.layers.items():
            lines.append(f"  layers ({LAYER_TITLES.get(name, name)}): {describe_layers(summary)}")
        lines += [f"  {line}" for line in self.mode_lines()]
        timing = self.timings_text()
        if timing:
            lines.append(f"  timings: {timing}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        n = len(self.checks)
        n_pass = sum(c.status == "pass" for c in self.checks)
        n_skip = sum(c.status == "skip" for c in self.checks)
        lines.append("")
        lines.append(
            f"RESULT: {'PASS' if self.passed else 'FAIL'} ({n_pass} passed, {n - n_pass - n_skip} failed, "
            f"{n_skip} skipped)"
        )
        return "\n".join(lines)

    def mode_lines(self) -> list[str]:
        """How the references ran (whole or layer-streamed), one line each."""
        out = []
        for key, title in (("reference", "reference"), ("implementation", "same-weights reference")):
            mode = self.streaming.get(key)
            if not mode:
                continue
            why = self.streaming.get(f"{key}_reason")
            word = "layer by layer (streamed from disk)" if mode == "streamed" else "whole in memory"
            out.append(f"{title}: ran {word}" + (f": {why}" if why else ""))
        return out

    def timings_text(self) -> str:
        """Seconds per phase (load, logits, streams, images) of each part."""
        parts = []
        for key in ("reference", "mlx", "implementation"):
            t = self.timings.get(key)
            if isinstance(t, dict):
                t = t.get("recorded", t) if "bundle" in t else t
                phases = [f"{p} {t[p]:.1f} s" for p in ("load", "logits", "streams", "images")
                          if isinstance(t.get(p), (int, float))]
                n = t.get("stream_forwards")
                if n and t.get("streams"):
                    phases.append(f"{t['streams'] / n:.2f} s/forward over {n}")
                if phases:
                    parts.append(f"{key} (" + ", ".join(phases) + ")")
        if isinstance(self.timings.get("total"), (int, float)):
            parts.append(f"total {self.timings['total']:.1f} s")
        rss = self.timings.get("rss_gb") or {}
        if rss:  # the phase that set the run's peak resident memory
            top = max(rss, key=lambda k: rss[k]["peak"])
            parts.append(f"peak RSS {rss[top]['peak']:.2f} GB ({top})")
        return "; ".join(parts)

    def layers_markdown(self) -> list[str]:
        """The per-layer hidden-state section of the card ([] without)."""
        if not self.layers:
            return []
        lines = ["Per-layer hidden states (informational: which layer diverges first):", ""]
        for name, summary in self.layers.items():
            lines.append(f"* {LAYER_TITLES.get(name, name)}: {describe_layers(summary)}")
        lines.append("")
        summary = self.layers.get("implementation") or next(iter(self.layers.values()))
        for case, c in summary.get("cases", {}).items():
            stacks = list(c["stacks"])
            n = max((len(r) for r in c["stacks"].values()), default=0)
            if not n:
                continue
            title = LAYER_TITLES.get(next(k for k, v in self.layers.items() if v is summary), "")
            lines.append(f"Case `{case}` ({title}): cosine min / max|Δ| per layer")
            lines.append("")
            lines.append("| layer | " + " | ".join(stacks) + " |")
            lines.append("|---|" + "---|" * len(stacks))
            for i in range(n):
                cells = []
                for stack in stacks:
                    row = next((r for r in c["stacks"][stack] if r["layer"] == i), None)
                    cells.append(f"{fmt(row['cosine_min'])} / {fmt(row['max_abs'])}" if row else "-")
                lines.append(f"| {i} | " + " | ".join(cells) + " |")
            lines.append("")
        return lines

    def compute_text(self) -> str:
        """What MLX computed in: the stored dtype, unless the runtime upcast it
        (half-precision weights on the CPU backend compute in float32)."""
        prec = self.precision
        stored = prec.get("compute_dtype")
        ran = prec.get("mlx_compute_dtype") or stored  # reports written before dlm recorded it
        if ran == stored:
            return f"computes in {stored}"
        return f"stored in {stored}, MLX computed in {ran}"

    def _backend_text(self) -> str:
        prec = self.precision
        if "device" not in prec:  # a report written before dlm recorded it
            return ""
        ran = prec.get("mlx_compute_dtype") or prec.get("compute_dtype")
        matmuls = f", float32 matmuls {prec['float32_matmul']}" if ran == "float32" else ""
        return f" on MLX's {prec['device']} backend{matmuls}"

    # -- model card ---------------------------------------------------------

    def card_markdown(self) -> str:
        ref = self.reference
        versions = ref.get("versions") or {}
        vtext = ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))
        src = ref.get("source") or "?"
        date = _dt.date.today().isoformat()
        lines = [
            f"**dlm-verify {'passed' if self.passed else 'FAILED'}** on {date}: this "
            f"{self.precision.get('label')} model ({self.compute_text().replace('computes in', 'computing in')}"
            f"{self._backend_text()}) against "
            f"the PyTorch reference `{src}` in {ref.get('dtype', '?')}" + (f" ({vtext})" if vtext else "") + ".",
            "",
            f"{self.prompts} prompts, {self.cases} fixed logit cases; commit streams of the deterministic "
            f"generation for {self.settings.get('stream_prompts', 0)} prompts ({self.settings_text()}).",
            "",
        ]
        if self.images:
            lines += [f"Images: {self.images_text()}; the image rows run the vision tower and prompts "
                      "holding its features.", ""]
        lines += [
            "| check | verdict | measured | threshold |",
            "|---|---|---|---|",
        ]
        for c in self.checks:
            verdict = {"pass": "pass", "fail": "**FAIL**", "skip": "skipped"}[c.status]
            measured = self._numbers(c) if c.status != "skip" else c.note
            bounds = self._bounds(c) if c.status != "skip" else ""
            cells = [f"{c.title} (`{c.name}`)", verdict, measured, bounds]
            lines.append("| " + " | ".join(x.replace("|", "\\|") for x in cells) + " |")
        lines.append("")
        lines += self.layers_markdown()
        for line in self.mode_lines():
            lines += [line + ".", ""]
        lines.append(
            f"Reproduce: `dlm-verify --parity <this model> --reference {src} --reference-dtype "
            f"{ref.get('dtype', 'float32')}`."
        )
        return "\n".join(lines)


def _default(x):
    try:
        import numpy as np

        if isinstance(x, np.integer):
            return int(x)
        if isinstance(x, np.floating):
            return float(x)
        if isinstance(x, np.ndarray):
            return x.tolist()
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def umask_mode(directory: bool) -> int:
    """The mode a plain open()/mkdir() would give under the current umask."""
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if directory else 0o666) & ~mask

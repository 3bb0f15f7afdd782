"""Per-precision pass/fail thresholds of the parity checks.

A threshold is ``(metric, op, value)``: the check passes when every metric
satisfies its bound; ``value=None`` makes a metric informational (reported,
never failing). The defaults are meant for real checkpoints:

* ``logits`` (converted model vs the original weights): tight in float32
  (f32 kernels agree to ~1e-5 on a ±30 softcapped scale), loose for
  half precision and quantized models, whose error is mostly rounding. There
  they are judged on KL, near-tie top-1 and entropy: abs logit differences
  scale with a model's logit range and are reported only.
* ``implementation`` (the float32 reference run with exactly the weights the
  MLX model holds): keyed by the MLX compute dtype, not by the bit width, so
  a 4-bit model with float32 scales is held to float32 tolerances.
* ``implementation_layers`` (dlm.verify.local: every MLX layer fed the
  same-weights reference's input, so errors cannot compound): the worst
  layer's cosine and max |Δ| relative to the reference's largest entry,
  keyed by the compute dtype. It is what proves an implementation on a deep
  random checkpoint, where the end-to-end rows are chaotic for any float32
  implementation (the reference's own float32 against float64 included).
* ``drift`` (quantized vs original): KL / top-1 like llama.cpp's KLD
  statistics (Q4_K_M: mean KLD ~0.03-0.06, same-top ~86-98%), the share of
  committed tokens that match and the growth of denoising steps per canvas
  (quantized logits make the entropy-bound sampler run longer: mlx-vlm PR #1359,
  "Fix quantized Diffusion Gemma sampler speed").
* ``commit_stream`` (debug-canvas generation vs the reference with the same
  weights): identical tokens and steps per canvas where the compute dtype is
  float32; in half precision each stream must be identical or first diverge
  at a near-tie or at a stop decision.
* ``features`` (image rows: the vision tower + its projection, per soft
  token): max |Δ| where the vision weights are float32; cosine per soft token
  otherwise, as the logits checks judge half precision on relative numbers.
  Keyed by the vision encoder's own precision (dlm-convert keeps it in float
  unless --quantize-vision); the same-weights row by the compute dtype.
  The image logits, drift and stream rows use the tables of ``logits``,
  ``implementation``, ``drift`` and ``commit_stream``.

Tiny random test models are chaotic (1e-4 relative weight noise moves logits
by ~0.5), so their drift numbers are not meaningful: pass ``--thresholds``
with a JSON file to loosen or silence metrics, e.g.
``{"drift": {"kl_mean": null, "top1": null}}`` (``"tie_tolerance"`` sets a
check's near-tie logit gap).

Top-1 agreement is gated up to near-ties (``top1_tol``): a flipped argmax
whose two candidates are closer than the tie tolerance under the reference is
what rounding does, not a bug; the exact ``top1`` is reported alongside.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from dlm.runtime.platform.errors import ConfigError

Bound = tuple[str, object]  # (op, value)

_F32 = {"max_abs": ("<=", 1e-3), "top1": (">=", None), "top1_tol": (">=", 0.999), "kl_mean": ("<=", 1e-6),
        "entropy_diff_max": ("<=", 1e-3)}
_HALF = {"max_abs": ("<=", None), "mean_abs": ("<=", None), "top1": (">=", None), "top1_tol": (">=", 0.98),
         "kl_mean": ("<=", 0.02), "entropy_diff_mean": ("<=", 0.1)}
_Q8 = {"max_abs": ("<=", None), "mean_abs": ("<=", None), "top1": (">=", None), "top1_tol": (">=", 0.98),
       "kl_mean": ("<=", 0.05), "entropy_diff_mean": ("<=", 0.2)}
_Q4 = {"max_abs": ("<=", None), "mean_abs": ("<=", None), "top1": (">=", None), "top1_tol": (">=", 0.95),
       "kl_mean": ("<=", 0.25), "entropy_diff_mean": ("<=", 0.5)}

DEFAULTS: dict[str, dict[str, dict[str, Bound]]] = {
    # check -> precision class -> metric -> bound
    "logits": {"float32": _F32, "half": _HALF, "q8": _Q8, "q4": _Q4},
    "implementation": {
        "float32": _F32,
        "half": {"max_abs": ("<=", None), "mean_abs": ("<=", 0.1), "top1": (">=", None),
                 "top1_tol": (">=", 0.98), "kl_mean": ("<=", 0.01), "entropy_diff_mean": ("<=", 0.05)},
    },
    "drift": {
        "q8": {"kl_mean": ("<=", 0.02), "top1": (">=", 0.95), "commit_match": (">=", 0.8),
               "steps_ratio": ("<=", 1.25)},
        "q4": {"kl_mean": ("<=", 0.1), "top1": (">=", 0.85), "commit_match": (">=", 0.5),
               "steps_ratio": ("<=", 1.5)},
    },
    "features": {
        "float32": {"max_abs": ("<=", 1e-4), "cosine_min": (">=", 0.9999), "mean_abs": ("<=", None)},
        "half": {"max_abs": ("<=", None), "mean_abs": ("<=", None), "cosine_min": (">=", 0.99)},
        "q8": {"max_abs": ("<=", None), "mean_abs": ("<=", None), "cosine_min": (">=", 0.99)},
        "q4": {"max_abs": ("<=", None), "mean_abs": ("<=", None), "cosine_min": (">=", 0.95)},
    },
    # Per-layer hidden states (informational, dlm.verify.layers): the cosine
    # under which a layer is named as where agreement first drops.
    "layers": {
        "float32": {"cosine_min": (">=", 0.9999)},
        "half": {"cosine_min": (">=", 0.99)},
        "q8": {"cosine_min": (">=", 0.99)},
        "q4": {"cosine_min": (">=", 0.95)},
    },
    # Layer-local (dlm.verify.local): each MLX layer on the reference's own input,
    # so one layer's rounding only (float32: ~1e-6 relative at the released size).
    "implementation_layers": {
        "float32": {"cosine_min": (">=", 0.99999), "rel_max": ("<=", 1e-4), "max_abs": ("<=", None)},
        "half": {"cosine_min": (">=", 0.999), "rel_max": ("<=", None), "max_abs": ("<=", None)},
    },
    # MoE routing of the same-weights reference (dlm.verify.routes): the largest
    # margin by which the reference's own top-k led an expert MLX chose instead,
    # as a router-logit gap (log-probabilities); a flip within it is rounding.
    "routing": {"float32": {"margin_max": ("<=", 1e-3)}, "half": {"margin_max": ("<=", 0.25)}},
    "commit_stream": {
        "float32": {"identical_fraction": (">=", 1.0), "steps_match_fraction": (">=", 1.0)},
        "half": {"explained_fraction": (">=", 1.0), "token_match": (">=", None),
                 "steps_match_fraction": (">=", None)},
    },
}

# Logit gap (on the ±30 softcapped scale) under which two candidates count as
# tied: top1_tol accepts such flips, and a commit stream may first diverge there.
TIE_TOLERANCE = {"float32": 1e-3, "half": 0.25, "q8": 0.5, "q4": 1.0}


def precision_class(check: str, label: str, compute_dtype: str, bits: int | None) -> str:
    """Which column of DEFAULTS applies to a model."""
    if check in ("implementation", "implementation_layers", "commit_stream", "routing") or bits is None:
        return "float32" if compute_dtype == "float32" else "half"
    return "q8" if bits >= 8 else "q4"


def thresholds_for(check: str, label: str, compute_dtype: str, bits: int | None,
                   overrides: dict | None = None) -> tuple[str, dict[str, Bound], float]:
    """(precision class, {metric: (op, value)}, tie tolerance) of a check."""
    cls = precision_class(check, label, compute_dtype, bits)
    table = copy.deepcopy(DEFAULTS[check].get(cls, {}))
    tol = TIE_TOLERANCE[cls]
    for metric, value in ((overrides or {}).get(check) or {}).items():
        if metric == "tie_tolerance":
            tol = float(value)
            continue
        op = table.get(metric, ("<=", None))[0]
        if isinstance(value, (list, tuple)) and len(value) == 2:
            op, value = value
        table[metric] = (op, value)
    return cls, table, tol


def load_overrides(path: str | Path | None) -> dict:
    if not path:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read thresholds ({exc})") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ConfigError(f"{path}: expected {{check: {{metric: value | [op, value] | null}}}}")
    unknown = sorted(set(data) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"{path}: unknown check(s) {unknown}; known: {sorted(DEFAULTS)}")
    return data


def evaluate(metrics: dict, bounds: dict[str, Bound]) -> tuple[bool, list[str]]:
    """(passed, failures) of metrics against bounds; missing metrics fail."""
    failures = []
    for metric, (op, value) in bounds.items():
        if value is None:
            continue
        got = metrics.get(metric)
        if got is None:
            failures.append(f"{metric} missing")
            continue
        ok = got <= value if op == "<=" else got >= value if op == ">=" else got == value
        if not ok:
            failures.append(f"{metric} {_num(got)} (want {op} {_num(value)})")
    return not failures, failures


def _num(x) -> str:
    if isinstance(x, float):
        if 0.99 <= x < 1:  # cosines and agreement close to 1: show the nines
            return f"{x:.6g}"
        return f"{x:.3g}"
    return str(x)

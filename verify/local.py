"""Layer-local implementation check: every MLX layer on the reference's own input.

The end-to-end comparisons (logits, and the per-layer diagnostic of
dlm.verify.layers) run each framework on its own hidden states, so a layer's
rounding error is the next layer's input error. On a deep random checkpoint
that grows about 2× a layer: at the released DiffusionGemma geometry
transformers' own float32 against float64 ends at top-1 0.08
(``scripts/bench/probe_rounding.py``), so no float32 implementation passes an
end-to-end check there. This check removes the compounding:

* the same-weights reference runs the diagnostic cases (``layers.py``'s
  ``layer_cases``) once more with its own routing, recording each layer's
  input and output, its router probabilities and its logits (``reference_pass``;
  stored as the run's ``hidden`` case ``local:<case>``, so bundles keep it);
* the MLX model runs the same cases with each layer handed the reference's
  input (a ``Feed`` as the layer loop's ``collect``, dlm.runtime.models.taps),
  so its encoder cache too is built from the reference's hidden states
  (``mlx_pass``);
* ``check`` compares per layer: each layer's output, the first layer's input
  (MLX's own embeddings and, DiffusionGemma's decoder, self-conditioning) and
  the logits (the last layer and the head). A position where MLX's local
  routing differs from the reference's (a near-tie: the reference's
  router-logit gap within ``thresholds.DEFAULTS["routing"]``) is left out of
  that layer's numbers and counted; a flip at a clear margin fails the row.

The row (``implementation_layers``) is judged by the compute dtype
(``thresholds.DEFAULTS["implementation_layers"]``).
"""

from __future__ import annotations

import collections
import time
from typing import Optional

import numpy as np

from dlm.runtime.platform.errors import DlmError

from . import layers as L
from .checks import CheckResult
from .thresholds import evaluate, thresholds_for

PREFIX = "local:"  # a run's hidden case holding a layer-local record
INPUTS = ":inputs"  # suffix of a stack's layer inputs
LOGITS = "logits"  # the record's logits, one [positions, vocab] entry
EMBED = "embed"  # MLX's own input of a stack's first layer


class Feed(list):
    """A layer loop's ``collect`` list (each layer's output, in call order) that
    also hands each layer the reference's input for the same positions:
    ``inputs`` holds one float32 [positions, hidden] per layer, each consumed
    in call order (a prefill in chunks takes consecutive rows). ``own`` keeps
    what MLX itself computed as the first layer's input, per call."""

    def __init__(self, stack: str, inputs: list):
        super().__init__()
        self.stack, self.inputs = stack, inputs
        self.own: list = []
        self._calls = 0
        self._rows = [0] * len(inputs)

    def feed(self, h):
        import mlx.core as mx

        i = self._calls % len(self.inputs)
        self._calls += 1
        if i == 0:
            self.own.append(h)
        ref, start, n = self.inputs[i], self._rows[i], h.shape[-2]
        if ref is None or h.shape[0] != 1 or start + n > ref.shape[0] or ref.shape[-1] != h.shape[-1]:
            have = "none" if ref is None else f"{ref.shape[0] - start} rows of width {ref.shape[-1]} left"
            raise DlmError(f"layer-local check: {self.stack} layer {i} takes {list(h.shape)} but the "
                           f"reference recorded {have}")
        self._rows[i] = start + n
        return mx.array(ref[start:start + n])[None].astype(h.dtype)

    def first_input(self) -> Optional[np.ndarray]:
        return np.concatenate([L._numpy(h) for h in self.own], axis=0) if self.own else None


def reference_pass(adapter, ref, case, done) -> dict:
    """One case on the reference, routed its own way: ``{stack: outputs,
    stack + INPUTS: inputs, stack + ROUTES: router probabilities, LOGITS: [logits]}``."""
    if getattr(ref, "prefilled", None) is not None:
        ref.prefilled = None  # a prompt's shared prefill (streamed DiffusionGemma) would skip the encoder
    stacks = adapter.reference_layers(ref)
    routers = getattr(adapter, "reference_routers", None)
    hooked = dict(stacks, **(routers(ref) if callable(routers) else {}))
    with L.capture(hooked) as outs, L.capture(stacks, inputs=True) as ins:
        logits = adapter.reference_logits(ref, case, done)
    record = L.result(outs, hooked)
    record.update({name + INPUTS: layers for name, layers in L.result(ins, stacks).items()})
    record[LOGITS] = [np.asarray(logits, np.float32)]
    return record


def record_reference(adapter, ref, run, cases: dict, layer_cases, progress: bool = True,
                     label: str = "reference") -> None:
    """``reference_pass`` of each diagnostic case into ``run.hidden`` (``PREFIX`` + name)."""
    from .progress import tqdm

    t = time.perf_counter()
    done = collections.ChainMap(run.logits, run.image_logits)
    for name in tqdm(layer_cases, f"{label}: layer-local cases", progress):
        run.hidden[PREFIX + name] = reference_pass(adapter, ref, cases[name], done)
    run.meta.setdefault("timings", {})["layer_local"] = round(time.perf_counter() - t, 3)


def recorded(run) -> list[str]:
    """The case names of ``run``'s layer-local records."""
    return [c[len(PREFIX):] for c in (run.hidden if run is not None else {}) if c.startswith(PREFIX)]


def mlx_pass(adapter, loaded, case, record: dict) -> dict:
    """``case`` on the MLX model, each layer fed the reference's input from
    ``record``: ``{stack: outputs, stack + ROUTES: expert ids, stack + EMBED:
    [first-layer input], LOGITS: [logits]}``."""
    stacks = [k[: -len(INPUTS)] for k in record if k.endswith(INPUTS)]
    feeds = {s: Feed(s, record[s + INPUTS]) for s in stacks}
    out: dict = {}
    logits = adapter.mlx_logits(loaded, case, collect=out, feed=feeds)
    for s, feed in feeds.items():
        out[s + EMBED] = [feed.first_input()]
    out[LOGITS] = [np.asarray(logits, np.float32)]
    return out


def _flips(record: dict, mlx: dict, stack: str, i: int) -> list[dict]:
    probs = record.get(stack + L.ROUTES) or []
    ids = mlx.get(stack + L.ROUTES) or []
    if i >= len(probs) or i >= len(ids) or probs[i] is None or ids[i] is None:
        return []
    return L.route_flips(probs[i], ids[i])


def _stage(name: str, ref, got, skip: set, bound: Optional[float]) -> Optional[dict]:
    if ref is None or got is None:
        return None
    keep = np.ones(ref.shape[0], bool)
    keep[sorted(p for p in skip if p < keep.size)] = False
    if not keep.any():
        return None
    row = dict(stage=name, **L.layer_metrics(ref[keep], got[keep], bound), excused=int((~keep).sum()))
    if row.get("position_min") is not None:  # back to the stage's own positions
        row["position_min"] = int(np.flatnonzero(keep)[row["position_min"]])
    return row


def compare_case(record: dict, mlx: dict, margin: Optional[float], bound: Optional[float]) -> dict:
    """Per stage (each stack's first-layer input, each layer, the logits) of one
    case: the metrics without the near-tie positions; the flips at a clear margin."""
    rows, gaps, clear = [], [], []
    last_flips: set = set()
    stacks = [k[: -len(INPUTS)] for k in record if k.endswith(INPUTS)]
    for s in stacks:
        first = (record.get(s + INPUTS) or [None])[0]
        row = _stage(f"{s} input", first, (mlx.get(s + EMBED) or [None])[0], set(), bound)
        if row:
            rows.append(row)
        for i, (ref, got) in enumerate(zip(record.get(s) or [], mlx.get(s) or [])):
            fl = _flips(record, mlx, s, i)
            gaps += [f["gap"] for f in fl]
            clear += [dict(stack=s, layer=i, **f) for f in fl if margin is not None and f["gap"] > margin]
            skip = {f["position"] for f in fl}
            last_flips = skip
            row = _stage(f"{s} {i}", ref, got, skip, bound)
            if row:
                rows.append(dict(row, stack=s, layer=i, routing_flips=len(fl),
                                 routing_gap_max=max((f["gap"] for f in fl), default=0.0)))
    # The logits follow the last layer: its near-tie positions are left out there too.
    row = _stage(LOGITS, record[LOGITS][0], mlx[LOGITS][0], last_flips, bound)
    if row:
        rows.append(row)
    return dict(stages=rows, routing_flips=len(gaps), routing_gap_max=max(gaps, default=0.0), clear_flips=clear)


def check(record_run, mlx: dict, prec, overrides: Optional[dict] = None, note: str = "") -> CheckResult:
    """The ``implementation_layers`` row: ``mlx`` ({case: mlx_pass output}) vs
    ``record_run``'s layer-local records, judged by the worst stage."""
    cls, bounds, _ = thresholds_for("implementation_layers", prec.label, prec.compute_dtype, prec.bits, overrides)
    _, routing, _ = thresholds_for("routing", prec.label, prec.compute_dtype, prec.bits, overrides)
    margin = routing.get("margin_max", ("<=", None))[1]
    bound = bounds.get("cosine_min", (">=", None))[1]
    cases = {name: compare_case(record_run.hidden[PREFIX + name], out, margin, bound) for name, out in mlx.items()}
    stages = [dict(case=name, **row) for name, c in cases.items() for row in c["stages"]]
    if not stages:
        return CheckResult("implementation_layers", "skip", note="no layer-local stages compared")
    worst_cos = min(stages, key=lambda r: r["cosine_min"])
    worst_rel = max(stages, key=lambda r: r["rel_max"])
    metrics = dict(cosine_min=worst_cos["cosine_min"], rel_max=worst_rel["rel_max"],
                   max_abs=max(r["max_abs"] for r in stages), stages=len(stages),
                   excused=sum(r["excused"] for r in stages if r["stage"] != LOGITS),
                   routing_flips=sum(c["routing_flips"] for c in cases.values()),
                   routing_margin_max=max((c["routing_gap_max"] for c in cases.values()), default=0.0))
    ok, failures = evaluate(metrics, bounds)
    for name, c in cases.items():
        for f in c["clear_flips"][:3]:
            failures.append(f"{name} {f['stack']} layer {f['layer']} position {f['position']}: expert "
                            f"{','.join(map(str, f['mlx_only']))} over the reference's "
                            f"{','.join(map(str, f['reference_only']))} at a router-logit margin {f['gap']:.3g}")
    where = (f"worst: {worst_cos['case']} {worst_cos['stage']} cos min {worst_cos['cosine_min']:.9g}, "
             f"{worst_rel['case']} {worst_rel['stage']} rel max|Δ| {worst_rel['rel_max']:.3g}")
    return CheckResult("implementation_layers", "fail" if failures else "pass", metrics,
                       {k: [op, v] for k, (op, v) in bounds.items()}, cls, failures,
                       "; ".join(x for x in (note, where) if x), dict(cases=cases, worst=worst_cos))


def run_and_check(adapter, loaded, cases: dict, record_run, prec, overrides: Optional[dict] = None,
                  progress: bool = True) -> CheckResult:
    """``mlx_pass`` of each case ``record_run`` recorded, then ``check``."""
    from .progress import tqdm

    names = [n for n in recorded(record_run) if n in cases]  # not the image cases of a run without images
    if not names:
        return CheckResult("implementation_layers", "skip", note="no layer-local record of this run's cases")
    mlx = {n: mlx_pass(adapter, loaded, cases[n], record_run.hidden[PREFIX + n])
           for n in tqdm(names, "MLX: layer-local cases", progress)}
    return check(record_run, mlx, prec, overrides, "each MLX layer on the reference's input (MLX weights)")

"""Per-layer hidden-state agreement: which layer diverges first.

For one logits case (and the first image case), the output of every layer of
the reference's stacks (``adapter.reference_layers``: DiffusionGemma's encoder
and decoder, LLaDA-2's layers) is captured with forward hooks while the
reference computes that case's logits, and the MLX model reports the same
through ``mlx_logits(..., collect=...)``. Per layer: max and mean |Δ|, the
cosine between the two hidden vectors at each position (min and mean) and
max |Δ| relative to the reference's largest entry.

The diagnostic is informational, not a verdict: the logits and implementation
rows already gate the model, and a hidden state can move more than the
logits feel (an MoE token whose top-k experts are near-tied switches expert
under rounding: a large local change at one layer that the next layers damp).
Its job is to localise: ``first_divergence`` names the first layer, in
computation order, whose cosine drops below the precision's bound
(``thresholds.DEFAULTS["layers"]``, overridable with ``--thresholds``).

Routing (MoE families whose adapter has ``reference_routers``): the stacks
named ``<stack>:routes`` hold, per layer, the reference router's float32
probabilities [positions, experts] and MLX's routed expert ids [positions, k].
``routing`` counts the positions whose top-k sets differ and, for the first
such flip, the reference's own margin for the expert MLX took instead (a
router-logit gap): a flip at a margin the size of the cross-framework rounding is a near-tie,
which no implementation avoids and which random weights then amplify.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Optional

import numpy as np

from .thresholds import thresholds_for
from .weights import Precision

ROUTES = ":routes"  # suffix of a stack's routing record (module docstring)


def per_layer(outputs: Optional[list], n_layers: int) -> list:
    """Layer outputs collected over several calls (each call appends one per
    layer, in order; None where a layer's output is not computed) as one
    float32 [positions, hidden] array per layer (the calls concatenated)."""
    if not outputs:
        return []
    if len(outputs) % n_layers:
        raise ValueError(f"{len(outputs)} layer outputs do not split into calls of {n_layers} layers")
    layers: list[list] = [[] for _ in range(n_layers)]
    for k, out in enumerate(outputs):
        if out is not None:
            layers[k % n_layers].append(_numpy(out))
    return [np.concatenate(parts, axis=0) if parts else None for parts in layers]


def _numpy(x) -> np.ndarray:
    try:
        import mlx.core as mx

        if isinstance(x, mx.array):
            x = np.array(x.astype(mx.float32))
    except ImportError:  # pragma: no cover
        pass
    if hasattr(x, "detach"):  # torch
        import torch

        x = x.detach().to(torch.float32).numpy()
    x = np.asarray(x, np.float32)
    return x.reshape(-1, x.shape[-1]).copy()  # batch 1: [positions, hidden]


@contextlib.contextmanager
def capture(stacks: dict, inputs: bool = False):
    """Record every call of the torch layer modules in ``stacks`` (``{name:
    [modules]}``); yields ``{name: [per-call outputs in call order]}``, turned
    into per-layer arrays by ``result``. ``inputs``: each call's input hidden
    state instead (dlm.verify.local)."""
    calls: dict[str, list] = {name: [] for name in stacks}
    hooks = []
    # Only this thread's calls: lockstep passes (dlm.verify.lockstep) run the
    # same modules in other threads at the same time.
    owner = threading.get_ident()
    for name, layers in stacks.items():
        for i, layer in enumerate(layers):
            def hook(module, args, output, name=name, i=i):
                if threading.get_ident() != owner:
                    return
                out = output[0] if isinstance(output, (tuple, list)) else output
                calls[name].append((i, _numpy(out)))

            def pre_hook(module, args, kwargs, name=name, i=i):
                if threading.get_ident() == owner:
                    calls[name].append((i, _numpy(args[0] if args else kwargs["hidden_states"])))
            hooks.append(layer.register_forward_pre_hook(pre_hook, with_kwargs=True) if inputs
                         else layer.register_forward_hook(hook))
    try:
        yield calls
    finally:
        for h in hooks:
            h.remove()


def result(calls: dict, stacks: dict) -> dict:
    """``{stack: [float32 [positions, hidden] per layer]}`` from ``capture``'s record."""
    out = {}
    for name, record in calls.items():
        layers: list[list] = [[] for _ in stacks[name]]
        for i, value in record:
            layers[i].append(value)
        out[name] = [np.concatenate(parts, axis=0) if parts else None for parts in layers]
    return out


def layer_metrics(ref: np.ndarray, mlx: np.ndarray, bound: Optional[float] = None) -> dict:
    """Max/mean |Δ|, the per-position cosine's min and mean, max |Δ| relative to the
    reference's largest entry; with ``bound``, how many positions fall below it (a
    few of many: a per-token event such as an MoE near-tie, see the module docstring)."""
    a = np.asarray(ref, np.float64)
    b = np.asarray(mlx, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"hidden states of shape {list(b.shape)} vs the reference's {list(a.shape)}")
    d = np.abs(a - b)
    na, nb = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
    dot = (a * b).sum(-1)
    both = (na > 0) & (nb > 0)
    cos = np.where(both, dot / np.where(both, na * nb, 1.0), np.where((na == 0) & (nb == 0), 1.0, 0.0))
    scale = float(np.abs(a).max()) or 1.0
    row = dict(max_abs=float(d.max()), mean_abs=float(d.mean()), cosine_min=float(cos.min()),
               cosine_mean=float(cos.mean()), rel_max=float(d.max()) / scale)
    if bound is not None:
        row.update(positions=int(cos.size), positions_below=int((cos < bound).sum()),
                   position_min=int(cos.argmin()))
    return row


def agreement(ref: dict, mlx: dict, prec: Precision, overrides: Optional[dict] = None,
              note: str = "") -> dict:
    """Per case, stack and layer metrics of ``ref`` vs ``mlx`` (``{case: {stack:
    [arrays]}}``), and the first layer (cases, then stacks, in order) whose
    cosine drops below the bound."""
    cls, bounds, _ = thresholds_for("layers", prec.label, prec.compute_dtype, prec.bits, overrides)
    bound = bounds.get("cosine_min", (">=", None))[1]
    cases, first = {}, None
    for case, stacks in ref.items():
        if case not in mlx:
            continue
        rows, case_first = {}, None
        for stack, layers in stacks.items():
            if stack.endswith(ROUTES):
                continue
            theirs = mlx[case].get(stack) or []
            rows[stack] = []
            for i, (r, m) in enumerate(zip(layers, theirs)):
                if r is None or m is None:
                    continue
                row = dict(layer=i, **layer_metrics(r, m, bound))
                rows[stack].append(row)
                if case_first is None and bound is not None and row["cosine_min"] < bound:
                    case_first = dict(stack=stack, layer=i, cosine_min=row["cosine_min"], max_abs=row["max_abs"],
                                      positions=row["positions"], positions_below=row["positions_below"],
                                      position=row["position_min"])
        cases[case] = dict(stacks=rows, first_divergence=case_first)
        if first is None and case_first is not None:
            first = dict(case=case, **case_first)
    worst = None
    for case, c in cases.items():
        for stack, rows in c["stacks"].items():
            for row in rows:
                if worst is None or row["cosine_min"] < worst["cosine_min"]:
                    worst = dict(case=case, stack=stack, layer=row["layer"], cosine_min=row["cosine_min"],
                                 max_abs=row["max_abs"])
    return dict(precision_class=cls, threshold={"cosine_min": bound}, cases=cases, first_divergence=first,
                worst=worst, note=note, routing=routing(ref, mlx))


def route_flips(probs: np.ndarray, ids: np.ndarray) -> list[dict]:
    """Positions where MLX's top-k expert set (``ids`` [P, k]) differs from the
    reference's (the k largest of ``probs`` [P, E]): the experts each side
    alone chose, and the reference's margins as router-logit gaps (log
    probabilities: scale-free, whatever the number of experts): ``gap``
    between its k-th expert and the best one MLX chose instead, ``margin``
    between its k-th and (k+1)-th."""
    p = np.asarray(probs, np.float64)
    ids = np.asarray(ids).astype(np.int64)
    k = ids.shape[-1]
    order = np.argsort(-p, axis=-1, kind="stable")
    ref_sets = np.sort(order[:, :k], axis=-1)
    flips = []
    for pos in np.flatnonzero((ref_sets != np.sort(ids, axis=-1)).any(axis=-1)):
        ours, theirs = set(ref_sets[pos].tolist()), set(ids[pos].tolist())
        only_mlx, only_ref = sorted(theirs - ours), sorted(ours - theirs)
        logp = np.log(np.maximum(p[pos], 1e-300))
        kth = logp[order[pos, k - 1]]
        flips.append(dict(position=int(pos), mlx_only=only_mlx, reference_only=only_ref,
                          margin=float(kth - logp[order[pos, k]]),
                          gap=float(kth - max(logp[e] for e in only_mlx))))
    return flips


def routing(ref: dict, mlx: dict) -> Optional[dict]:
    """Per case, stack and layer, the routing flips (``route_flips``); the first
    flip in computation order; None when no routing was recorded."""
    cases, first, total, routed = {}, None, 0, 0
    for case, stacks in ref.items():
        rows = {}
        for stack, layers in stacks.items():
            theirs = (mlx.get(case) or {}).get(stack) or []
            if not stack.endswith(ROUTES) or not theirs:
                continue
            name = stack[: -len(ROUTES)]
            rows[name] = []
            for i, (p, ids) in enumerate(zip(layers, theirs)):
                if p is None or ids is None:
                    continue
                if p.shape[0] != ids.shape[0]:
                    raise ValueError(f"{case} {name} layer {i}: {ids.shape[0]} routed positions vs the "
                                     f"reference's {p.shape[0]}")
                flips = route_flips(p, ids)
                rows[name].append(dict(layer=i, positions=int(p.shape[0]), flips=flips))
                total += len(flips)
                routed += int(p.shape[0])
                if first is None and flips:
                    first = dict(case=case, stack=name, layer=i, **flips[0])
        if rows:
            cases[case] = rows
    if not cases:
        return None
    return dict(cases=cases, flips=total, routed=routed, first_flip=first)


def _cos(x: float) -> str:
    """A cosine, with the distance from 1 shown when it is close."""
    return f"1-{1 - x:.1e}" if 0.9999 <= x < 1 else f"{x:.6g}"


def describe_routing(summary: dict) -> str:
    """The routing clause of ``describe`` ("" when none was recorded)."""
    routes = summary.get("routing")
    if not routes:
        return ""
    first = routes["first_flip"]
    if first is None:
        return f"; routing: all {routes['routed']} token routings agree"
    text = (f"; routing: {routes['flips']} of {routes['routed']} token routings differ, first {first['case']} "
            f"{first['stack']} layer {first['layer']} position {first['position']} (expert "
            f"{','.join(map(str, first['mlx_only']))} for {','.join(map(str, first['reference_only']))}: "
            f"the reference's margin {first['gap']:.2g})")
    div = summary.get("first_divergence")
    if div and all(div.get(k) == first[k] for k in ("case", "stack", "layer", "position")):
        text += ", where the hidden states first diverge"
    return text


def describe(summary: dict) -> str:
    """One line: where agreement first drops, or that every layer agrees."""
    if not summary or not summary.get("cases"):
        return "no hidden states"
    return _describe_hidden(summary) + describe_routing(summary)


def _describe_hidden(summary: dict) -> str:
    n = sum(len(rows) for c in summary["cases"].values() for rows in c["stacks"].values())
    bound = summary["threshold"]["cosine_min"]
    first, worst = summary.get("first_divergence"), summary.get("worst")
    if first:
        where = ""
        if first.get("positions"):
            where = f" at {first['positions_below']} of {first['positions']} positions"
        return (f"first below cos {bound}: {first['case']} {first['stack']} layer {first['layer']}{where} "
                f"(cos min {_cos(first['cosine_min'])}, max|Δ| {first['max_abs']:.3g})")
    text = f"all {n} layer outputs agree"
    if bound is not None:
        text += f" (cos ≥ {bound})"
    if worst:
        text += (f"; worst {worst['case']} {worst['stack']} layer {worst['layer']}: cos min "
                 f"{_cos(worst['cosine_min'])}, max|Δ| {worst['max_abs']:.3g}")
    return text

"""One pass of each side, as the suite runs it: a logits case in the reference
or in MLX (named as a routing pass, dlm.verify.routes; the per-layer hidden
states and routing of the diagnostic cases captured, dlm.verify.layers), and
the adapter's optional routing hooks as contexts."""

from __future__ import annotations

import contextlib

from . import layers as L
from . import routes as R


def layer_cases(adapter, cases, images) -> list[str]:
    """The cases whose per-layer hidden states are compared: the first logits
    case and the first image case (none for a family without reference_layers)."""
    if not callable(getattr(adapter, "reference_layers", None)) or not cases:
        return []
    return [cases[0].name] + ([images.cases[0].name] if images is not None and images.cases else [])


def reference_logits(adapter, ref, case, done, hidden: dict, layer_cases):
    with R.job(f"logits:{case.name}"):  # the pass whose routing the same-weights reference follows
        return reference_case(adapter, ref, case, done, hidden, layer_cases)


def reference_case(adapter, ref, case, done, hidden: dict, layer_cases):
    if case.name not in layer_cases:
        return adapter.reference_logits(ref, case, done)
    stacks = adapter.reference_layers(ref)
    routers = getattr(adapter, "reference_routers", None)
    stacks.update(routers(ref) if callable(routers) else {})  # the routing diagnostic's router probabilities
    with L.capture(stacks) as calls:
        out = adapter.reference_logits(ref, case, done)
    hidden[case.name] = L.result(calls, stacks)
    return out


def mlx_logits(adapter, loaded, case, hidden: dict, layer_cases):
    with R.job(f"logits:{case.name}"):
        if case.name not in layer_cases:
            return adapter.mlx_logits(loaded, case)
        collect: dict = {}
        out = adapter.mlx_logits(loaded, case, collect=collect)
        hidden[case.name] = collect
        return out


def routing(adapter, name: str, model, log, *extra):
    """The adapter's routing hook ``name`` (``record_mlx_routes(loaded, log)`` /
    ``force_reference_routes(ref, log, forced)``, dlm.verify.routes) as a
    context; nothing without a ``log`` or for a family without the hook."""
    hook = getattr(adapter, name, None)
    return hook(model, log, *extra) if callable(hook) and log is not None else contextlib.nullcontext()


def cases_by_name(cases, images) -> dict:
    """The logits cases and the image cases (when images run), by name."""
    return {c.name: c for c in list(cases) + (list(images.cases) if images is not None else [])}

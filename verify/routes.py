"""The same-weights reference follows MLX's routing.

An MoE router picks each token's top-k experts: a discrete choice. Where a
token's k-th and (k+1)-th expert score within the two frameworks' rounding
(float32 sums in another order), the two pick different experts; with random
weights one such flip moves the whole model's output (the released
DiffusionGemma geometry: one token of 54 at encoder layer 7, and every logit
after it). No implementation avoids that, so it says nothing about the
implementation. The implementation check therefore runs the reference with
MLX's expert choice at every token routing and its own router weights for
those experts (what a router computes given the choice), and counts the
routings where its own choice differed: a flip is explained only where the
reference's own margin between its k-th expert and the one MLX took (a
router-logit gap) is within the rounding bound (``thresholds.DEFAULTS
["routing"]``: 1e-3 in float32, 0.25 in half precision); a larger one is a
routing bug and fails the check. The rows the reference routes without an
MLX record (image rows; a commit stream's forwards after MLX's stream
stopped) keep its own choice and are counted.

Both sides key each token routing the same way, whatever order or sharing
their passes use:

* encoder rows by a chain hash of every token the encoder has seen through
  that cache up to the row (the encoder is causal; a prompt's shared prefill
  carries its chain on the cache object);
* decoder rows by (pass, the cache's chain, the canvas tokens, the how-many-th
  forward of the pass on that pair, position); a pass is a logits case or a
  commit stream, named by the suite in ``job``.

Rows with images (features, not tokens alone) are not keyed: they keep the
reference's own routing and are counted as unforced.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Optional

import numpy as np

from .layers import route_flips

CHAIN = "_dlm_route_chain"  # the attribute a cache object carries its chain in
_local = threading.local()


@contextlib.contextmanager
def job(name: str):
    """The pass this thread runs (lockstep runs passes in threads)."""
    saved = getattr(_local, "job", None), getattr(_local, "ordinals", None)
    _local.job, _local.ordinals = name, {}
    try:
        yield
    finally:
        _local.job, _local.ordinals = saved


def encoder_keys(cache, tokens: list[int], keyed: bool = True) -> list:
    """Row keys of an encoder call over ``tokens`` appended to ``cache``, extending
    the chain the cache carries. ``keyed=False`` (rows that are not tokens
    alone): None, for these rows and every later one of this cache."""
    chain = list(getattr(cache, CHAIN, None) or [])
    last = chain[-1] if chain else 0
    new = []
    for t in tokens:
        last = hash((last, int(t))) if keyed and last is not None else None
        new.append(last)
    setattr(cache, CHAIN, chain + new)
    return new


def decoder_keys(cache, canvas: list[int]) -> list:
    """Row keys of a decoder forward over ``canvas`` reading ``cache``: the pass,
    the cache's chain (what the encoder has seen), the canvas tokens and how
    often this pass has met that pair before (its later steps), and the
    position. A forward one side makes and the other does not finds no key."""
    name = getattr(_local, "job", None)
    chain = getattr(cache, CHAIN, None) or [0]
    if name is None or chain[-1] is None:
        return [None] * len(canvas)
    seen = (chain[-1], hash(tuple(int(t) for t in canvas)))
    n = _local.ordinals.get(seen, 0)
    _local.ordinals[seen] = n + 1
    return [(name, seen, n, r) for r in range(len(canvas))]


class RouteLog:
    """MLX's routed expert ids by (stack, layer, row key)."""

    def __init__(self):
        self.rows: dict = {}

    def put(self, stack: str, layer: int, keys: list, ids: np.ndarray) -> None:
        for key, row in zip(keys, np.asarray(ids)):
            if key is not None:
                self.rows[(stack, layer, key)] = row.astype(np.int64)

    def get(self, stack: str, layer: int, keys: list) -> list:
        return [None if key is None else self.rows.get((stack, layer, key)) for key in keys]

    def __len__(self) -> int:
        return len(self.rows)


class Forced:
    """What following MLX's routing changed in the reference: rows forced, rows
    left (no MLX record), and the flips (the reference's own top-k differed)."""

    def __init__(self):
        self.forced = self.unforced = 0
        self.flips = 0
        self.first: Optional[dict] = None
        self.largest: Optional[dict] = None
        self._lock = threading.Lock()

    def add(self, stack: str, layer: int, probs: np.ndarray, theirs: list) -> np.ndarray:
        """The forced ids for one router call: MLX's where recorded, the reference's
        own top-k elsewhere; counts the flips (``route_flips``)."""
        p = np.asarray(probs, np.float64)
        k = next((t.shape[0] for t in theirs if t is not None), None)
        if k is None:
            with self._lock:
                self.unforced += len(theirs)
            return None
        own = np.argsort(-p, axis=-1, kind="stable")[:, :k]
        ids = np.stack([own[r] if t is None else t for r, t in enumerate(theirs)])
        have = [r for r, t in enumerate(theirs) if t is not None]
        flips = route_flips(p[have], ids[have])
        with self._lock:
            self.forced += len(have)
            self.unforced += len(theirs) - len(have)
            self.flips += len(flips)
            for f in flips:
                f = dict(stack=stack, layer=layer, job=getattr(_local, "job", None), **f)
                f["position"] = have[f["position"]]
                if self.first is None:
                    self.first = f
                if self.largest is None or f["gap"] > self.largest["gap"]:
                    self.largest = f
        return ids

    def summary(self) -> dict:
        return dict(forced=self.forced, unforced=self.unforced, flips=self.flips, first=self.first,
                    largest=self.largest)


def judge(row, summary: dict, prec, overrides: Optional[dict] = None) -> None:
    """Add the routing to the implementation row (a ``CheckResult``): the flips,
    and the largest margin judged by ``thresholds.DEFAULTS["routing"]``."""
    from .thresholds import evaluate, thresholds_for

    _, bounds, _ = thresholds_for("routing", prec.label, prec.compute_dtype, prec.bits, overrides)
    big = summary.get("largest")
    margin = big["gap"] if big else 0.0
    row.metrics.update(routing_forced=summary["forced"], routing_flips=summary["flips"], routing_margin_max=margin)
    row.details["routing"] = summary
    ok, failures = evaluate({"margin_max": margin}, bounds)
    if not ok:
        row.status = "fail"
        row.failures += [f"routing {f}: {big['stack']} layer {big['layer']} position {big['position']} "
                         f"({big['job']}) took expert {','.join(map(str, big['mlx_only']))} over the reference's "
                         f"{','.join(map(str, big['reference_only']))}" for f in failures]


def describe(summary: Optional[dict]) -> str:
    """One line for the report's notes."""
    if not summary:
        return ""
    text = (f"implementation: the reference followed MLX's routing at {summary['forced']} token routings "
            f"({summary['flips']} differed from its own choice")
    if summary["largest"]:
        text += f", the largest router-logit margin {summary['largest']['gap']:.2g}"
    text += ")"
    if summary["unforced"]:
        text += (f"; {summary['unforced']} kept its own (no MLX record: image rows, or a stream's forwards "
                 "after MLX's stopped)")
    return text

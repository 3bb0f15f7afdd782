"""DiffusionGemma's ``--trace`` summaries (dlm.runtime.trace): what each
denoising step of a canvas did, per position.

``summarise_step`` is called by canvas.py's step builder only when a trace was
asked for; it adds a few lazy per-position arrays to the step's graph (the
accept mask the sampler used, the entropy it already has, the top-1
confidence for the confidence-threshold sampler, the canvas it leaves). The
``CanvasTracer`` is the loop's ``on_summary`` hook: it reads those arrays back
(a host sync per step, while tracing only) and hands the trace small values.
Batched canvases are traced by their first row.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from ...trace import ACCEPTED, KEPT, RENOISED, REVEALED, Trace
from . import sampling as S


def summarise_step(config, t, argmax, proc, entropy, canvas, revealed_in, revealed,
                   stable_confident: Optional[mx.array], all_revealed: Optional[mx.array]) -> dict:
    """The lazy summary of one step: ``revealed_in`` / ``revealed`` the reveal
    mask before and after it (confidence-threshold), ``canvas`` the next input."""
    if config.sampler == S.CONFIDENCE_THRESHOLD:
        accepted = revealed & ~revealed_in
        confidence = mx.exp(proc.max(axis=-1) - mx.logsumexp(proc, axis=-1))
    else:
        accepted = S.entropy_bound_accept(entropy, config.entropy_bound)
        confidence = None
    return dict(t=float(t), argmax=argmax, entropy=entropy, accepted=accepted, kept=revealed_in,
                canvas=canvas, confidence=confidence, stable_confident=stable_confident,
                all_revealed=all_revealed)


def _host(x) -> Optional[np.ndarray]:
    return None if x is None else np.array(x)


class CanvasTracer:
    """Records one canvas into a Trace: call it per step with the summary, then ``finish``."""

    def __init__(self, trace: Trace, index: int, length: int, config):
        self.trace, self.config = trace, config
        self.confidence_sampler = config.sampler == S.CONFIDENCE_THRESHOLD
        offset = sum(c["length"] for c in trace.canvases)
        trace.begin(index, length, offset=offset, sampler=config.sampler, step_budget=config.steps,
                    entropy_bound=config.entropy_bound,
                    threshold=config.threshold if self.confidence_sampler else None,
                    confidence_threshold=config.confidence_threshold,
                    stability_threshold=config.stability_threshold)
        self.last: dict = {}

    def __call__(self, step: int, summary: dict) -> None:
        keys = ("argmax", "entropy", "accepted", "kept", "canvas", "confidence", "stable_confident", "all_revealed")
        mx.eval([summary[k] for k in keys if summary[k] is not None])
        h = {k: _host(summary[k]) for k in keys}
        pred, entropy = h["argmax"][0], h["entropy"][0]
        accepted, kept, canvas = h["accepted"][0], h["kept"][0], h["canvas"][0]
        status = np.where(accepted, REVEALED if self.confidence_sampler else ACCEPTED,
                          np.where(kept, KEPT, RENOISED))
        holds = (accepted | kept) & (canvas != pred)
        held = [(int(p), int(canvas[p])) for p in np.nonzero(holds)[0]]
        t, temp = summary["t"], self.config.temperature
        flags = {k: bool(h[k]) for k in ("stable_confident", "all_revealed") if h[k] is not None}
        self.last = flags
        self.trace.step(
            pred, status, held=held, entropy=entropy,
            confidence=None if h["confidence"] is None else h["confidence"][0],
            schedule=t, temperature=float(t * temp), mean_entropy=float(h["entropy"].mean()), **flags,
        )

    def finish(self, result) -> None:
        if result.cancelled:
            reason = "cancelled"
        elif result.stopped_early:
            reason = "all-revealed" if self.last.get("all_revealed") else "stable-and-confident"
        else:
            reason = "step-budget"
        self.trace.end(reason)

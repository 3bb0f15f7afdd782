"""One DiffusionGemma canvas under a grammar (dlm.runtime.structured.frontier).

The canvas is denoised as canvas.py does (same schedule, samplers, renoising,
self-conditioning, draws), with the frontier's frozen prefix pinned into the
input of every step. Per step the proposal is the step's argmax (what the
reference commits) and the acceptance is the sampler's own: the entropy
bound's accepted positions, or the confidence threshold's revealed ones. When
the unconstrained stop rule fires (stable and confident, or all revealed), the rest of the
canvas is frozen in that step; the last step freezes whatever is left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from ...structured import Frontier, Rows
from .canvas import DenoiseConfig, _build_step


@dataclass
class StructuredCanvas:
    tokens: list[int]  # the frozen tokens, then one stop token when the answer finished here
    steps: int
    cancelled: bool = False


def _pin(canvas: mx.array, frozen: list[int]) -> mx.array:
    if not frozen:
        return canvas
    head = mx.array(frozen, dtype=canvas.dtype)[None]
    return mx.concatenate([head, canvas[:, len(frozen):]], axis=1)


def denoise_structured(decode, draws, length: int, config: DenoiseConfig, frontier: Frontier, stop_id: int,
                       cancel: Optional[Callable[[], bool]] = None,
                       watch: Optional[Callable[[int, list], None]] = None) -> StructuredCanvas:
    """canvas.py's step (``_build_step``: the same schedule, sampler, draws and
    self-conditioning), each step's input with the frozen prefix pinned."""
    shape = (1, length)
    frontier.begin(length)
    canvas, sc_probs = draws.canvas(shape), None
    revealed = mx.zeros(shape, dtype=mx.bool_)
    history, steps, window = [], 0, config.stability_threshold or 0
    for cur_step in range(config.steps, 0, -1):
        if frontier.complete:
            break
        if cancel is not None and cancel():
            return StructuredCanvas([], steps, cancelled=True)
        step = _build_step(decode, draws, config, _pin(canvas, frontier.frozen), sc_probs, revealed, history,
                           cur_step)
        mx.eval(*step.outputs(), step.keep)
        steps += 1
        if window:
            history = (history + [step.argmax])[-window:]
        quota = frontier.quota(1 if step.stop is not None and bool(step.stop.item()) else cur_step)
        frontier.advance(np.array(step.argmax[0]), np.array(step.keep[0]), quota, Rows(step.logits[0]))
        if watch is not None:
            watch(steps - 1, frontier.frozen + np.array(step.argmax[0, len(frontier.frozen):]).tolist())
        canvas, sc_probs, revealed = step.canvas, step.sc_probs, step.revealed
    tokens = list(frontier.frozen) + ([stop_id] if frontier.finished else [])
    return StructuredCanvas(tokens, steps)

"""One DiffusionGemma canvas under a grammar (dlm.runtime.structured.frontier).

The canvas is denoised as canvas.py does (same schedule, samplers, renoising,
self-conditioning, draws), with the frontier's frozen prefix pinned into the
input of every step. Per step the proposal is the step's argmax (what the
reference commits) and the acceptance is the sampler's own: the entropy
bound's accepted positions, or the confidence threshold's revealed ones. When
the unconstrained stop rule fires (stable and confident), the rest of the
canvas is frozen in that step; the last step freezes whatever is left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from ...structured import Frontier, Rows
from . import sampling as S
from .canvas import DenoiseConfig, _confidence_step, _score, _stable_and_confident


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
    shape = (1, length)
    frontier.begin(length)
    canvas = draws.canvas(shape)
    revealed = mx.zeros(shape, dtype=mx.bool_)
    sc_logits, history, steps = None, [], 0
    schedule = config.t_min is not None and config.t_max is not None
    for cur_step in range(config.steps, 0, -1):
        if frontier.complete:
            break
        if cancel is not None and cancel():
            return StructuredCanvas([], steps, cancelled=True)
        canvas = _pin(canvas, frontier.frozen)
        logits = decode(canvas, sc_logits)
        t = S.linear_temperature(cur_step, config.steps, config.t_min, config.t_max) if schedule else 1.0
        proc, argmax, entropy = _score(logits, mx.array(t, dtype=mx.float32))
        sample = draws.sample(proc, config.temperature, argmax)
        noise = draws.canvas(shape)
        if config.sampler == S.CONFIDENCE_THRESHOLD:
            following, revealed = _confidence_step(proc, canvas, revealed, sample, noise, config.threshold)
            keep = revealed
        else:
            keep = S.entropy_bound_accept(entropy, config.entropy_bound)
            following = mx.where(keep, sample, noise)
        stop = None
        if config.stability_threshold is not None and config.confidence_threshold is not None:
            stop = _stable_and_confident(argmax, history, entropy, config)
        if config.stability_threshold:
            history = (history + [argmax])[-config.stability_threshold:]
        sc_logits = proc.astype(config.sc_dtype)
        outputs = [argmax, keep, following, sc_logits] + ([stop] if stop is not None else [])
        mx.eval(*outputs)
        steps += 1
        quota = frontier.quota(1 if stop is not None and bool(stop.item()) else cur_step)
        frontier.advance(np.array(argmax[0]), np.array(keep[0]), quota, Rows(logits[0]))
        if watch is not None:
            watch(steps - 1, frontier.frozen + np.array(argmax[0, len(frontier.frozen):]).tolist())
        canvas = following
    tokens = list(frontier.frozen) + ([stop_id] if frontier.finished else [])
    return StructuredCanvas(tokens, steps)

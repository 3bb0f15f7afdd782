"""One DiffusionGemma canvas under a grammar (dlm.runtime.structured.frontier).

The canvas is denoised by canvas.py's own loop (``Canvas`` with a ``Grammar``:
same schedule, samplers, renoising, self-conditioning, draws), with the
frontier's frozen prefix pinned into the input of every step. Per step the
proposal is the step's argmax (what the reference commits) and the acceptance
is the sampler's own: the entropy bound's accepted positions, or the
confidence threshold's revealed ones. When the unconstrained stop rule fires
(stable and confident, or all revealed), the rest of the canvas is frozen in
that step; the last step freezes whatever is left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from ...generation.progress import Block
from ...structured import Frontier, Rows


@dataclass
class StructuredCanvas:
    tokens: list[int]  # the frozen tokens, then one stop token when the answer finished here
    steps: int
    cancelled: bool = False


class Grammar:
    """The frontier's part in a Canvas: it pins each step's input, advances on
    each step read on the host, and makes the canvas's result."""

    def __init__(self, frontier: Frontier, stop_id: int, watch: Optional[Callable[[int, list], None]] = None):
        self.frontier, self.stop_id, self.watch = frontier, stop_id, watch
        self.scored = 0

    def begin(self, length: int) -> None:
        self.length, self.scored = length, len(self.frontier.records)
        self.frontier.begin(length)

    @property
    def complete(self) -> bool:
        return self.frontier.complete

    def pin(self, canvas: mx.array) -> mx.array:
        """The step's input canvas [1, L] with the frozen prefix in place."""
        frozen = self.frontier.frozen
        if not frozen:
            return canvas
        return mx.concatenate([mx.array(frozen, dtype=canvas.dtype)[None], canvas[:, len(frozen):]], axis=1)

    def advance(self, step, cur_step: int, index: int) -> None:
        """The step (evaluated) moves the frontier: its stop rule ends the canvas's freezing now."""
        frontier = self.frontier
        quota = frontier.quota(1 if step.stop is not None and bool(step.stop.item()) else cur_step)
        frontier.advance(np.array(step.argmax[0]), np.array(step.keep[0]), quota, Rows(step.logits[0]))
        if self.watch is not None:
            self.watch(index, frontier.frozen + np.array(step.argmax[0, len(frontier.frozen):]).tolist())

    def result(self, steps: int, cancelled: bool = False) -> StructuredCanvas:
        if cancelled:
            return StructuredCanvas([], steps, cancelled=True)
        return StructuredCanvas(list(self.frontier.frozen) + ([self.stop_id] if self.frontier.finished else []),
                                steps)

    def block(self, result: StructuredCanvas, steps: int) -> tuple[mx.array, Block]:
        """(the canvas to commit [1, L], the Block) of a finished canvas; ``steps``: the step budget."""
        logprobs = self.frontier.records[self.scored:] if self.frontier.logprobs is not None else None
        committed = mx.array(result.tokens[:self.length], dtype=mx.int32)[None]
        return committed, Block(result.tokens, result.steps, result.steps < steps, logprobs=logprobs)

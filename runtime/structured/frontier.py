"""Structured output on a canvas: a commit frontier that moves left to right.

A diffusion step proposes a token for every position at once, in no order.
A grammar mask is left-to-right. The two meet at the *frontier*: positions
before it are frozen (committed, grammar-checked, never changed again, fed to
every later step as they are); positions after it are the model's draft. Each
step (``advance``):

1. The grammar's forced tokens (a schema's keys, quotes, braces, separators)
   are frozen at once, without the model: the skeleton is pinned into the
   canvas before its first step and wherever a value ends.
2. From the frontier on, the model's proposal is frozen position by position
   while the grammar allows it and the family's own acceptance rule keeps it
   (entropy bound, confidence threshold): the parallel part, many positions
   in one step when the model is sure.
3. A position the rule keeps but the grammar refuses gets the model's best
   allowed token instead (``Rows.choose``: the masked argmax, or the family's
   sampler over the masked distribution); the run stops after such a
   correction, so the next step conditions on it.
4. At least ``quota`` positions are frozen per step (forced ones excluded), so
   a canvas/block completes within its step budget; the last step freezes all.
5. Closing: once the run's token budget left is no more than what closing the
   answer takes from here (simulated on a copy of the grammar state, plus a
   margin of ``CLOSING_MARGIN``), every position takes the allowed token that
   brings the answer nearest its end (end the string, close the innermost
   container or go on to the next required member, start the shortest value;
   the stop token once it is complete; the model's choice where no closer fits),
   so that any model, an untrained one included, finishes inside its budget.

The output ends when the grammar is complete and the model proposes a stop
token at the frontier, or when the grammar takes nothing more. Every frozen
prefix is a prefix of some valid answer, so a finished answer always parses
and validates; a budget that runs out first ends with finish_reason "length".

Trade-off: commits are contiguous from the frontier (the any-order freedom of
the canvas is given up for positions the grammar constrains), while the
forward still denoises the whole canvas in parallel and the draft beyond the
frontier still conditions every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from .grammar import Constraint

Pick = Callable[[mx.array, int], int]  # (masked logits row [V], position) -> token
CLOSING_MARGIN = 2  # tokens of slack before closing starts
CLOSING_WINDOW = 160  # the closing cost is simulated once the budget left is this small


def argmax_pick(row: mx.array, position: int) -> int:
    return int(mx.argmax(row).item())


class Rows:
    """One step's logits [L, V] as the frontier needs them: the best allowed
    token at a position (``pick`` over the masked row) and token log-probabilities.
    ``offset``: canvas position of row 0."""

    def __init__(self, logits: mx.array, pick: Pick = argmax_pick, offset: int = 0):
        self.logits, self.pick, self.offset = logits, pick, offset

    def choose(self, position: int, allowed: np.ndarray) -> int:
        row = self.logits[position - self.offset]
        return self.pick(mx.where(mx.array(allowed), row, -mx.inf), position)

    def logprobs(self, position: int, token: int, allowed: np.ndarray, top: int):
        """(log p(token), [(token, log p)] of the ``top`` most likely allowed
        tokens) under the model's distribution at ``position`` restricted to
        the tokens the grammar allows there (renormalized)."""
        row = self.logits[position - self.offset].astype(mx.float32)
        masked = mx.where(mx.array(allowed), row, -mx.inf)
        logp = masked - mx.logsumexp(masked)
        k = min(top, int(allowed.sum()))
        order = mx.argsort(-logp)[:k] if k > 0 else mx.zeros((0,), dtype=mx.int32)
        values = mx.take(logp, order)
        chosen = logp[token]
        mx.eval(values, order, chosen)
        return float(chosen.item()), [(int(t), float(v)) for t, v in zip(order.tolist(), values.tolist())]


@dataclass
class Advance:
    tokens: list[int] = field(default_factory=list)  # frozen this step, in order
    finished: bool = False  # the answer is complete: the output ends after ``tokens``
    corrected: int = 0  # proposals the grammar replaced


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]


class Frontier:
    """One structured run's frontier over its canvases/blocks (module docstring).
    ``logprobs``: None, or how many alternatives to report per token (0: the
    chosen token's log-probability only). Log-probabilities are the model's,
    renormalized over the tokens the grammar allows at that position (the
    "decision" reading: an enum slot's candidates sum to 1); a forced token's is 0."""

    def __init__(self, constraint: Constraint, logprobs: Optional[int] = None, budget: Optional[int] = None):
        self.constraint = constraint
        self.logprobs = logprobs
        self.budget = budget  # the run's token budget (None: no closing)
        self.produced = 0  # tokens frozen over the whole run
        self._closing = False
        self.finished = False
        self.records: list[TokenLogprob] = []
        self.length = 0
        self.frozen: list[int] = []  # this canvas/block's frozen tokens
        self._unscored: list[tuple] = []  # (record index, position, token, allowed) awaiting this step's logits

    # -- per canvas/block -------------------------------------------------------

    def begin(self, length: int) -> list[int]:
        """A new canvas/block of ``length`` positions: its pinned skeleton (forced tokens)."""
        self.length, self.frozen = length, []
        self._freeze_forced()
        return list(self.frozen)

    @property
    def position(self) -> int:
        return len(self.frozen)

    @property
    def complete(self) -> bool:
        """Nothing is left to decide in this canvas/block."""
        return self.finished or self.position >= self.length

    def quota(self, steps_left: int) -> int:
        left = self.length - self.position
        return left if steps_left <= 1 else -(-left // steps_left)

    def advance(self, proposal: np.ndarray, keep: np.ndarray, quota: int, rows: Rows) -> Advance:
        """Freeze positions from the frontier (module docstring, steps 1-4).
        ``proposal`` / ``keep``: the step's token and acceptance per canvas
        position (the whole canvas; positions before the frontier are ignored)."""
        c, out = self.constraint, Advance()
        start, chosen = self.position, 0
        while not self.complete:
            if self._freeze_forced():
                continue
            if c.done:
                self.finished = True
                break
            i = self.position
            token, need = int(proposal[i]), chosen < quota
            if self.closing:
                allowed = c.mask()
                closer = c.closing(allowed)
                token = closer if closer is not None else rows.choose(i, allowed)
                if token in c.stop_ids:
                    self.finished = True
                    break
                self._freeze(i, token, allowed)
                continue
            if not (bool(keep[i]) or need):
                break
            if c.allows(token):
                allowed = c.mask() if self._wants_mask() else None
            else:
                allowed = c.mask()
                token = rows.choose(i, allowed)
                out.corrected += 1
            chosen += 1
            if token in c.stop_ids:
                self.finished = True
                break
            self._freeze(i, token, allowed)
            if c.done:  # the grammar takes nothing more: the answer is complete
                self.finished = True
                break
            if out.corrected and not (chosen < quota):
                break
        out.tokens, out.finished = self.frozen[start:], self.finished
        self.score(rows)
        return out

    def score(self, rows: Rows) -> None:
        """Log-probabilities of the tokens the model chose since the last step, from ``rows``."""
        if self.logprobs is not None:
            for index, position, token, allowed in self._unscored:
                lp, top = rows.logprobs(position, token, allowed, self.logprobs)
                self.records[index] = TokenLogprob(token, lp, top)
        self._unscored = []

    @property
    def closing(self) -> bool:
        """The budget left is what closing the answer needs: close it (module docstring, 5)."""
        if self._closing or self.budget is None:
            return self._closing
        left = self.budget - self.produced
        if left <= CLOSING_WINDOW:
            self._closing = left <= self.constraint.closing_cost(left) + CLOSING_MARGIN
        return self._closing

    # -- internals ----------------------------------------------------------

    def _wants_mask(self) -> bool:
        return self.logprobs is not None

    def _freeze(self, position: int, token: int, allowed: Optional[np.ndarray]) -> None:
        self.constraint.consume(token)
        self.frozen.append(token)
        self.produced += 1
        if self.logprobs is not None:  # scored from this step's logits (score)
            self._unscored.append((len(self.records), position, token, allowed))
            self.records.append(TokenLogprob(token, 0.0, []))

    def _freeze_forced(self) -> bool:
        """Freeze what the grammar forces; a forced token has log-probability 0 (no choice)."""
        forced = self.constraint.forced(self.length - self.position)
        for token in forced:
            self.frozen.append(token)
            self.produced += 1
            if self.logprobs is not None:
                self.records.append(TokenLogprob(token, 0.0, [(token, 0.0)] if self.logprobs else []))
        return bool(forced)

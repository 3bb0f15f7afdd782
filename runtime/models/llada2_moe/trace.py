"""LLaDA-2's ``--trace`` summaries (dlm.runtime.trace): what each step of a
block did, per position.

The block session makes a ``BlockTracer`` per block only when a trace was
asked for (``Settings.step_trace``); the loop hands it every step's sampled
tokens, their confidence, the reveal/edit masks and the block as it stands,
which it reads back (a host sync per step, while tracing only).

LLaDA2.2's iterations (levenshtein.py) come as host arrays: the block with the
iteration's writes before the DELETE/SPLIT scan, which the page shows with
"deleted" / "inserted" statuses, and the block the scan shifted (``after``).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from ...trace import (DELETED, EDIT_TOKEN_NAMES, EDITED, FIXED, INSERTED, KEPT, MASKED, REVEALED, STATUS_NAMES,
                      Trace)

# LLaDA-2 masks positions where DiffusionGemma re-draws noise.
LLADA_STATUS_NAMES = ["masked"] + STATUS_NAMES[1:]
# LLaDA2.2 adds its edit tokens' codes; 2.0/2.1 pages keep the shorter list (and legend).
LLADA22_STATUS_NAMES = LLADA_STATUS_NAMES + EDIT_TOKEN_NAMES
# The view's names for DELETE and SPLIT: the tokenizer's text for them is some raw special token.
DELETE_LABEL, SPLIT_LABEL = "\u232bDELETE", "\u2380SPLIT"


class BlockTracer:
    """Records one block into a Trace: ``step`` per denoising step, then ``finish``."""

    def __init__(self, session, b: int, start: int, gen_from: int, need: int):
        self.session, self.b, self.start = session, b, start
        self.gen_from, self.need = gen_from, need
        self.trace: Trace = session.s.step_trace
        rules = session.rules
        self.trace.status_names = list(LLADA_STATUS_NAMES if rules is None else LLADA22_STATUS_NAMES)
        s = session.s
        self.trace.begin(b - session.first_block, session.bl, start=start, output_from=gen_from,
                         output_to=need, step_budget=session.steps, editing_threshold=session.editing,
                         threshold=s.threshold, min_threshold=s.min_threshold, **self._levenshtein_info())
        self.last = (0, 0)  # (revealed, edited) of the last step
        self.before: Optional[np.ndarray] = None  # LLaDA2.2: the block as the next iteration finds it
        self.settled = False  # LLaDA2.2: the last iteration left a mask-free block unchanged

    def _levenshtein_info(self) -> dict:
        """LLaDA2.2's block facts for the view (none on 2.0/2.1, whose pages stay as they were)."""
        r = self.session.rules
        if r is None:
            return {}
        self.trace.labels.update({r.delete_id: DELETE_LABEL, r.split_id: SPLIT_LABEL})
        return dict(mask_id=r.mask_id, iteration_cap=r.max_steps_per_block, max_post_steps=r.max_post_steps)

    def step(self, s: int, write, tok, conf, block, edit: Optional[mx.array]) -> None:
        sess = self.session
        arrays = [write, tok, conf, block] + ([edit] if edit is not None else [])
        mx.eval([a for a in arrays if isinstance(a, mx.array)])  # LLaDA2.2's are numpy already
        write, tok, conf, block = (np.array(a) for a in arrays[:4])
        edit = np.array(arrays[4]) if edit is not None else np.zeros_like(write)
        if sess.rules is not None:
            self._levenshtein_step(s, write, tok, conf, block, edit)
            return
        mask = block == sess.s.mask_token_id
        pos = np.arange(len(block))
        status = np.select(
            [pos < self.gen_from, edit, write, mask], [FIXED, EDITED, REVEALED, MASKED], default=KEPT)
        held = [(int(p), int(block[p])) for p in np.nonzero(~mask & (block != tok))[0]]
        revealed, edited = int((write & ~edit).sum()), int(edit.sum())
        self.last = (revealed, edited)
        self.trace.step(tok, status, held=held, confidence=conf, **self._scalars(s))

    def _scalars(self, s: int) -> dict:
        sess = self.session
        return dict(temperature=float(sess.s.temperature),
                    threshold=float(sess.s.step_threshold(min(s, sess.steps - 1), sess.steps)))

    def _levenshtein_step(self, s: int, write, new, conf, after, edit) -> None:
        """One LLaDA2.2 iteration: ``new`` is the block with its writes before the
        DELETE/SPLIT scan (aligned with ``write``, ``edit``, ``conf``), ``after``
        the block the scan shifted. The page shows ``new``, so a deletion and an
        insertion point sit where they were written, and ``after`` beside it.
        Nothing is ``held``: the shown tokens are the block itself (aligned, before
        the scan), and the loop passes no candidate for the positions it left."""
        r = self.session.rules
        before = self._entry(new) if self.before is None else self.before
        replaced = [(int(p), int(before[p])) for p in np.flatnonzero(write & (before != r.mask_id) & (before != new))]
        self.trace.step(new, self._levenshtein_status(write, new, edit), confidence=conf, after=after,
                        replaced=replaced, **self._scalars(s))
        # apply()'s first end test, replayed: the scan gave back the block it found, with no mask in it.
        self.settled = bool(np.array_equal(after, before) and not (before == r.mask_id).any())
        self.before = np.array(after, copy=True)

    def _entry(self, new) -> np.ndarray:
        """The block at its first iteration: its prompt part (never written), masks after."""
        return np.where(np.arange(len(new)) < self.gen_from, new, self.session.rules.mask_id)

    def _levenshtein_status(self, write, new, edit) -> np.ndarray:
        r = self.session.rules
        pos = np.arange(len(new))
        return np.select(
            [pos < self.gen_from, write & (new == r.delete_id), write & (new == r.split_id), edit, write,
             new == r.mask_id],
            [FIXED, DELETED, INSERTED, EDITED, REVEALED, MASKED], default=KEPT)

    def finish(self, block, steps: int, cancelled: bool) -> None:
        sess = self.session
        if cancelled:
            reason = "cancelled"
        elif sess.rules is not None:
            reason = self._levenshtein_reason(steps)
        elif sess.editing is not None:
            reason = "edits-settled" if self.last == (0, 0) else "post-step-budget"
        elif steps >= sess.steps:
            reason = "step-budget"
        else:
            out = np.array(block)[self.gen_from:self.need]
            reason = "eos" if (out == sess.s.mask_token_id).any() else "all-revealed"
        self.trace.end(reason)

    def _levenshtein_reason(self, steps: int) -> str:
        """Which of levenshtein.apply's end tests ended the block; the post-fill budget
        is what is left once the block neither settled nor reached the cap (when the
        budget and the cap end the same iteration, the view names the cap)."""
        if self.settled:
            return "block-settled"
        if steps >= self.session.rules.max_steps_per_block:
            return "iteration-cap"
        return "post-fill-budget"

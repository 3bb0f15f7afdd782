"""LLaDA-2's ``--trace`` summaries (dlm.runtime.trace): what each step of a
block did, per position.

The block session makes a ``BlockTracer`` per block only when a trace was
asked for (``Settings.step_trace``); the loop hands it every step's sampled
tokens, their confidence, the reveal/edit masks and the block as it stands,
which it reads back (a host sync per step, while tracing only).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from ...trace import EDITED, FIXED, KEPT, MASKED, REVEALED, STATUS_NAMES, Trace

# LLaDA-2 masks positions where DiffusionGemma re-draws noise.
LLADA_STATUS_NAMES = ["masked"] + STATUS_NAMES[1:]


class BlockTracer:
    """Records one block into a Trace: ``step`` per denoising step, then ``finish``."""

    def __init__(self, session, b: int, start: int, gen_from: int, need: int):
        self.session, self.b, self.start = session, b, start
        self.gen_from, self.need = gen_from, need
        self.trace: Trace = session.s.step_trace
        self.trace.status_names = list(LLADA_STATUS_NAMES)
        s = session.s
        self.trace.begin(b - session.first_block, session.bl, start=start, output_from=gen_from,
                         output_to=need, step_budget=session.steps, editing_threshold=session.editing,
                         threshold=s.threshold, min_threshold=s.min_threshold)
        self.last = (0, 0)  # (revealed, edited) of the last step

    def step(self, s: int, write, tok, conf, block, edit: Optional[mx.array]) -> None:
        sess = self.session
        arrays = [write, tok, conf, block] + ([edit] if edit is not None else [])
        mx.eval(arrays)
        write, tok, conf, block = (np.array(a) for a in arrays[:4])
        edit = np.array(arrays[4]) if edit is not None else np.zeros_like(write)
        mask = block == sess.s.mask_token_id
        pos = np.arange(len(block))
        status = np.select(
            [pos < self.gen_from, edit, write, mask], [FIXED, EDITED, REVEALED, MASKED], default=KEPT)
        held = [(int(p), int(block[p])) for p in np.nonzero(~mask & (block != tok))[0]]
        revealed, edited = int((write & ~edit).sum()), int(edit.sum())
        self.last = (revealed, edited)
        self.trace.step(
            tok, status, held=held, confidence=conf,
            temperature=float(sess.s.temperature),
            threshold=float(sess.s.step_threshold(min(s, sess.steps - 1), sess.steps)),
        )

    def finish(self, block, steps: int, cancelled: bool) -> None:
        sess = self.session
        if cancelled:
            reason = "cancelled"
        elif sess.editing is not None:
            reason = "edits-settled" if self.last == (0, 0) else "post-step-budget"
        elif steps >= sess.steps:
            reason = "step-budget"
        else:
            out = np.array(block)[self.gen_from:self.need]
            reason = "eos" if (out == sess.s.mask_token_id).any() else "all-revealed"
        self.trace.end(reason)

"""One LLaDA-2 block under a grammar (dlm.runtime.structured.frontier).

The block is denoised as generate.py's 2.0 loop does (same forward, cache,
sampler and uniform stream), with the frontier's frozen prefix revealed in the
block and every other generated position left masked. Per step the proposal
is the sampled token and the acceptance is the confidence threshold (with its
schedule); the step quota becomes the frontier's, so a block is complete after
``steps`` steps as before. LLaDA2.1's token editing is off here: a frozen
position never changes.
"""

from __future__ import annotations

import mlx.core as mx

from ...structured import Rows
from .requests import Sync
from .sampling import sample


def _pin(block: mx.array, at: int, frozen: list[int]) -> mx.array:
    if not frozen:
        return block
    values = mx.array(frozen, dtype=block.dtype)
    return mx.concatenate([block[:at], values, block[at + len(frozen):]])


def denoise_structured(member, b: int, start: int, block: mx.array, gen_from: int, need: int):
    """Block ``b`` at ``start`` as a batch.Member generator step (the same forward
    and sampling as the unconstrained loop, and a ``Sync`` for the step's
    proposal and acceptance): returns (block, steps, cancelled); its output
    positions are [gen_from, need)."""
    session = member.session
    s, frontier = session.s, session.frontier
    frontier.begin(max(need - gen_from, 0))
    steps = 0
    for step in range(session.steps):
        block = _pin(block, gen_from, frontier.frozen)
        if frontier.complete:
            break
        if session.cancel is not None and session.cancel():
            return block, steps, True
        tok, conf, logits, u = yield from member._scored(b, step, start, block)
        keep = conf > s.step_threshold(step, session.steps)
        # The step's one host read (in a batch: one evaluation for every member's).
        proposed = yield Sync(mx.stack([tok, keep.astype(tok.dtype)]), host=True)
        steps += 1

        def pick(row, position, u=u):  # the family's sampler over the allowed tokens
            lo = gen_from + position
            t, _ = sample(row[None], s, None if u is None else u[lo:lo + 1])
            return int(t.item())

        rows = Rows(logits[gen_from:need], pick)
        frontier.advance(proposed[0, gen_from:need], proposed[1, gen_from:need].astype(bool),
                         frontier.quota(session.steps - step), rows)
        if session.watch is not None:
            session.watch(b - session.first_block, step, _pin(block, gen_from, frontier.frozen).tolist())
    block = _pin(block, gen_from, frontier.frozen)
    if frontier.finished:  # the answer ended: the rest of the block is the stop token
        end = gen_from + len(frontier.frozen)
        stop = min(frontier.constraint.stop_ids)
        block = mx.concatenate([block[:end], mx.full((session.bl - end,), stop, dtype=block.dtype)])
    return block, steps, False

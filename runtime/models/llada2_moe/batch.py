"""LLaDA-2 batched blocks: many requests' active blocks through one model forward
(the scheduler is dlm.runtime.batch).

Each request keeps its own BlockSession (generate.py): prompt, committed-KV
cache, uniform stream, settings, block length; its prefill runs alone. A step's
forward is shared: the windows of the requests with the same window length
and block length ([finished block ; active block] on a block's first step, the
active block after) go through one forward with a batch axis
(dlm.runtime.models.rows keeps every matmul per sequence; each sequence
attends to its own cache under its own block-causal mask, at its own
positions), and each request's head runs on its own rows: a 2.0 block's
masked positions (``Forward.rows``), which are all it reveals. The requests'
per-step flags ("is the block final" and the masked positions, the 2.1 edit
counts) are read in one host sync per step.

``Member`` is the one implementation of a block (2.0 denoising, 2.1 editing):
a generator that yields where it needs the model (``Forward``), a 2.0 step's
sampling and reveal (``Reveal``) or a flag on the host (``Sync``). Alone,
BlockSession.next_block runs it with ``run_alone`` (each Forward is the solo
model call, each Reveal a batch of one, each Sync one read); in a batch, the
batch answers every member's Forward with one forward, the Reveals of one kind
(the same settings and block length) with one graph over their rows, and every
member's Sync with one evaluation. It uses the session's own helpers (sampling, reveal,
trace); a structured block (structured.py) is a generator of the same requests, so
structured requests batch with plain ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from ...generation.progress import Block
from ..cpu.streams import VOCAB_MIN_PIECE_BYTES, split_rows
from .levenshtein import decode_block
from .requests import Forward, Sync
from .model import block_causal_mask
from .sampling import on_host, reveal, sample
from .structured import denoise_structured
from .trace import BlockTracer


@dataclass
class Reveal:
    """A 2.0 step after its forward: sample, reveal and test the block
    (``reveal_rows``; blocks of one ``kind`` are answered in one graph)."""

    kind: tuple
    logits: mx.array  # [bl, V] (or [len(rows), V]), before the logit bias
    uniforms: Optional[np.ndarray]  # [bl], this block's own draws
    rows: Optional[np.ndarray]  # the positions ``logits`` belong to; None: all
    block: mx.array
    in_gen: mx.array  # [bl] bool: generated positions
    threshold: float
    quota: int
    need: int  # positions that reach the output


def reveal_rows(session, reqs: list[Reveal]) -> list[tuple]:
    """(tokens, confidences, written, new block, final?, masked) for each
    request: the denoising step of generate.py's 2.0 loop over a batch axis.
    Every row is computed on its own (row-wise sampling, integer rules), so a
    block gets the same values in any batch; ``session`` is any member's (all
    share the kind). A request with ``rows`` has sampled those positions only:
    the others keep their token, with no confidence (they are not masked, so
    nothing reveals them)."""
    s, bl = session.s, session.bl
    compact = any(r.rows is not None for r in reqs)
    logits = mx.concatenate([r.logits for r in reqs]) if compact else mx.stack([r.logits for r in reqs])
    rows = [logits.reshape(-1, logits.shape[-1])]
    if session.needs_uniforms:
        rows.append(mx.array(np.concatenate([r.uniforms if r.rows is None else r.uniforms[r.rows] for r in reqs])))

    # Over the vocabulary: numpy's threads at scale (cpu/vocab.py: decided by one
    # block's size, as alone), else rows split over the CPU streams where the
    # pieces are big enough to pay (MLX's exp runs on one thread).
    host = on_host(bl * logits.shape[-1], s)

    def score(logits, u=None):
        if session.logit_bias is not None:
            logits = logits + session.logit_bias
        return sample(logits, s, u, host)

    scored = score(*rows) if host else split_rows(score, *rows, min_piece_bytes=VOCAB_MIN_PIECE_BYTES)
    block, in_gen = mx.stack([r.block for r in reqs]), mx.stack([r.in_gen for r in reqs])
    if compact:  # back to [n, bl]: the sampled rows at their positions
        at = mx.array(np.concatenate([i * bl + (np.arange(bl) if r.rows is None else r.rows)
                                      for i, r in enumerate(reqs)]).astype(np.int32))
        tok, conf = block.reshape(-1).astype(scored[0].dtype), mx.full((len(reqs) * bl,), -mx.inf)
        tok[at], conf[at] = scored
        tok, conf = tok.reshape(len(reqs), bl), conf.reshape(len(reqs), bl)
    else:
        tok, conf = (a.reshape(len(reqs), bl) for a in scored)
    active = (block == s.mask_token_id) & in_gen
    threshold = mx.array([[r.threshold] for r in reqs], dtype=mx.float32)
    write = reveal(active, conf, threshold, mx.array([[r.quota] for r in reqs]))
    block = mx.where(write, tok.astype(block.dtype), block)
    # Final once no mask is left before the output budget or before a stop token.
    pos = mx.arange(bl)
    masked = (block == s.mask_token_id) & in_gen
    first_mask = mx.min(mx.where(masked, pos, bl), axis=-1)
    done = first_mask >= mx.array([r.need for r in reqs])
    if s.early_stop and session.stop_arr is not None:
        is_stop = (block[..., None] == session.stop_arr).any(-1) & in_gen
        done = done | (mx.min(mx.where(is_stop, pos, bl), axis=-1) < first_mask)
    elif not s.early_stop:
        done = ~masked.any(-1)
    return [(tok[i], conf[i], write[i], block[i], done[i], masked[i]) for i in range(len(reqs))]


class Member:
    """One request in the batch: its session and the block in progress."""

    def __init__(self, session):
        self.session = session
        self.finished: Optional[Block] = None
        self.busy = False
        self.request = None  # what the generator waits for: a Forward or a Sync
        self._gen = None

    def begin(self, remaining: int) -> None:
        self._gen = self._block()
        self.busy, self.finished = True, None
        self.resume(None)

    def resume(self, value) -> None:
        """Send the generator what it waited for; run it to its next request or its end."""
        try:
            self.request = self._gen.send(value)
        except StopIteration as end:
            self.busy, self.request, self._gen = False, None, None
            self.finished = end.value

    # -- one block, as a generator ----------------------------------------------

    def _block(self):
        s = self.session
        b, bl = s.next_index, s.bl
        s.next_index += 1
        start = b * bl
        gen_from = max(s.P - start, 0)  # first generated position in the block
        need = min(s.limit - start, bl)  # positions that reach the output
        block = mx.array(s.x[start : start + bl])
        s.tracer = None if s.s.step_trace is None else BlockTracer(s, b, start, gen_from, need)
        # The hub denoises the whole block, including positions past the
        # budget (they influence the rest); only the stop test uses ``need``.
        frontier = s.frontier
        scored = len(frontier.records) if frontier is not None else 0
        if frontier is not None:  # structured output (structured.py)
            block, steps, cancelled = yield from denoise_structured(self, b, start, block, gen_from, need)
        elif s.rules is not None:  # LLaDA2.2
            block, steps, cancelled = yield from decode_block(self, b, start, block, gen_from)
        elif s.editing is None:
            block, steps, cancelled = yield from self._denoise(b, start, block, gen_from, need)
        else:
            block, steps, cancelled = yield from self._edit(b, start, block, gen_from)
        if s.tracer is not None:
            s.tracer.finish(block, steps, cancelled)
        if cancelled:
            return Block(steps=steps, cancelled=True)
        out = np.array(block)
        s.x[start : start + bl] = out
        if s.cache is not None:
            s.pending = block
        else:
            s.committed = mx.array(s.x[: start + bl])
        logprobs = frontier.records[scored:] if frontier is not None and frontier.logprobs is not None else None
        return Block(out[gen_from:need].tolist(), steps, steps < s.steps, logprobs=logprobs)

    def _step(self, b: int, step: int, start: int, block):
        """One forward + sample: (tokens, confidences)."""
        tok, conf, _, _ = yield from self._scored(b, step, start, block)
        return tok, conf

    def _scored(self, b: int, step: int, start: int, block):
        """One forward + sample: (tokens, confidences, the biased logits, the step's uniforms)."""
        s = self.session
        logits = yield self._window(start, block)
        if s.s.on_step is not None:
            s.s.on_step(b, step, logits)
        if s.logit_bias is not None:
            logits = logits + s.logit_bias
        u = s.uniforms(s.bl) if s.needs_uniforms else None
        tok, conf = sample(logits, s.s, u)
        return tok, conf, logits, u

    def _denoise(self, b: int, start: int, block, gen_from: int, need: int):
        """LLaDA2.0: up to ``steps`` steps, each revealing >= its quota.

        The head and the sampler run on the block's masked positions only (the
        others are never revealed, so their logits are not needed): their
        positions come back with each step's host read. ``on_step`` and
        ``--trace``, which show every position, get the whole block."""
        s = self.session
        in_gen = mx.arange(s.bl) >= gen_from
        rows = None  # every position
        if s.s.on_step is None and s.tracer is None:
            rows = gen_from + np.flatnonzero(s.x[start + gen_from:start + s.bl] == s.s.mask_token_id)
        for step in range(s.steps):
            if s.cancel is not None and s.cancel():
                return block, step, True
            logits = yield self._window(start, block, rows)
            if s.s.on_step is not None:
                s.s.on_step(b, step, logits)
            u = s.uniforms(s.bl) if s.needs_uniforms else None
            threshold = s.s.step_threshold(step, s.steps)
            tok, conf, write, block, done, masked = yield Reveal(self.kind(), logits, u, rows, block, in_gen,
                                                                 threshold, s.quota[step], need)
            s._trace(b, step, start, write, tok, block, conf)
            flags = yield Sync(mx.concatenate([done[None], masked]))  # final?, then the masked positions
            if flags[0]:
                return block, step + 1, False
            if rows is not None:
                rows = np.flatnonzero(flags[1:])
        return block, s.steps, False

    def kind(self) -> tuple:
        """What a Reveal shares with the blocks it is merged with: the block
        length and every setting its graph is built from."""
        s = self.session
        return (s.bl, s.s.mask_token_id, s.s.temperature, s.s.top_k, s.s.top_p, s.s.reference_sampling,
                s.needs_uniforms, s.logit_bias is not None, s.s.early_stop, tuple(sorted(s.stops)))

    def _edit(self, b: int, start: int, block, gen_from: int):
        """LLaDA2.1 draft-and-edit (the LLaDA2.1-mini hub ``generate``; LLaDA2.1 tech
        report, arXiv 2602.08676): mask-to-token reveals as in 2.0 (quota
        fallback), plus token-to-token edits of generated positions whose new
        token has confidence > editing_threshold; after the last mask, editing
        passes until nothing changes (at most max_post_steps)."""
        s = self.session
        mask_id, post, step = s.s.mask_token_id, 0, 0
        editable = mx.arange(s.bl) >= gen_from
        n_active = int((yield Sync(((block == mask_id) & editable).sum())))
        while True:
            if n_active == 0:
                post += 1
            if post > s.s.max_post_steps:
                return block, step, False
            if s.cancel is not None and s.cancel():
                return block, step, True
            active = (block == mask_id) & editable
            tok, conf = yield from self._step(b, step, start, block)
            tok = tok.astype(block.dtype)
            if n_active:
                q = max(s.quota[step] if step < len(s.quota) else 1, 1)
                thr = s.s.step_threshold(min(step, s.steps - 1), s.steps)
                write = reveal(active, conf, thr, q)
            else:
                write = mx.zeros_like(active)
            edit = editable & ~active & (tok != block) & (conf > s.editing)
            write = write | edit
            block = mx.where(write, tok, block)
            s._trace(b, step, start, write, tok, block, conf, edit)
            counts = yield Sync(mx.stack([((block == mask_id) & editable).sum(), edit.sum()]))
            step += 1
            was_active, n_active = n_active, int(counts[0])
            if was_active == 0 and counts[1] == 0:
                return block, step, False

    # -- the model call, split around the (shared) forward -------------------------

    def _window(self, start: int, block, rows: Optional[np.ndarray] = None) -> Forward:
        s = self.session
        if s.cache is None:  # the full recompute (tests): a forward of its own
            ids = mx.concatenate([s.committed[:start], block])
            return Forward(ids, block_causal_mask(0, start + s.bl, 0, s.bl), rows)
        offset = s.cache[0].offset
        ids = block if s.pending is None else mx.concatenate([s.pending, block])
        return Forward(ids, block_causal_mask(offset, ids.shape[0], offset, s.bl), rows)

    def forwarded(self) -> None:
        """After the forward that read the window: the finished block is committed to the cache."""
        s = self.session
        if s.cache is not None and s.pending is not None:
            for c in s.cache:
                c.commit(s.bl)
            s.pending = None
            s._remember()


def run_alone(member: Member, remaining: int) -> Block:
    """A member's block without a batch: every Forward is the solo model call
    (the batch's "alone" case), every Sync one host read."""
    s = member.session
    member.begin(remaining)
    while member.busy:
        request = member.request
        if isinstance(request, Forward):
            logits = s.model(request.ids[None], s.cache, request.mask, last=s.bl, compiled=s.cache is not None,
                             rows=_index(request.rows))
            member.forwarded()
            member.resume(logits[0])
        elif isinstance(request, Reveal):
            member.resume(reveal_rows(s, [request])[0])
        else:
            member.resume(request.read())
    return member.finished


class Batch:
    """The family's part of the scheduler: its members and one step for all."""

    block_name = "block"

    def __init__(self, loaded):
        self.model = loaded.model

    def member(self, session) -> Member:
        return Member(session)

    def step(self, members: list[Member], renew) -> None:
        """One forward of every busy member (and the work and host reads around it).
        A block ends with the step's last host read, so the next one begins with
        the next step's forward (the scheduler's ``renew`` is not needed)."""
        self._settle(members)
        waiting = [m for m in members if isinstance(m.request, Forward)]
        for m, logits in zip(waiting, self._forward(waiting)):
            m.forwarded()
            m.resume(logits)
        self._settle(members)

    def _settle(self, members: list[Member]) -> None:
        """Answer every pending Reveal (one graph per kind) and Sync (one
        evaluation for all), until none is left."""
        while True:
            reveals: dict[tuple, list[Member]] = {}
            for m in members:
                if isinstance(m.request, Reveal):
                    reveals.setdefault(m.request.kind, []).append(m)
            for group in reveals.values():
                for m, out in zip(group, reveal_rows(group[0].session, [m.request for m in group])):
                    m.resume(out)
            if reveals:
                continue
            syncs = [m for m in members if isinstance(m.request, Sync)]
            if not syncs:
                return
            requests = [m.request for m in syncs]
            mx.eval([r.value for r in requests])  # the host sync of the step, for the whole batch
            for m, r in zip(syncs, requests):
                m.resume(r.read())

    def _forward(self, members: list[Member]) -> list[mx.array]:
        """Each member's block logits [bl, V]: one forward per (window, block) length."""
        out: list[Optional[mx.array]] = [None] * len(members)
        groups: dict[tuple, list[int]] = {}
        for i, m in enumerate(members):
            s = m.session
            key = ("alone", i) if s.cache is None else (m.request.ids.shape[0], s.bl)
            groups.setdefault(key, []).append(i)
        for idx in groups.values():
            reqs = [members[i].request for i in idx]
            sessions = [members[i].session for i in idx]
            bl = sessions[0].bl
            if len(idx) == 1:  # alone: exactly the solo call
                s, r = sessions[0], reqs[0]
                logits = self.model(r.ids[None], s.cache, r.mask, last=bl, compiled=s.cache is not None,
                                    rows=_index(r.rows))
            else:
                logits = forward(self.model, mx.stack([r.ids for r in reqs]), [s.cache for s in sessions],
                                 [r.mask for r in reqs], bl, [r.rows for r in reqs])
            for j, i in enumerate(idx):
                out[i] = logits[j]
        return out


def _index(rows: Optional[np.ndarray]) -> Optional[mx.array]:
    return None if rows is None else mx.array(rows.astype(np.int32))


def forward(model, ids: mx.array, caches: list[list], masks: list, last: int,
            rows: Optional[list] = None) -> mx.array:
    """Model.__call__ for B equal-length windows [B, L], each on its own cache
    under its own mask, its layers' pieces compiled as alone: float32 logits
    [B, last, V]; with ``rows`` (one entry per window: its positions, or None),
    a list of each window's logits, its head run on its rows as alone."""
    h = model.embed(ids)
    offsets = mx.array([c[0].offset for c in caches], dtype=mx.int32)
    for i, layer in enumerate(model.model.layers):
        h = layer(h, offsets, masks, [c[i] for c in caches], model.compile)
    h = h[:, -last:]
    if rows is None or all(r is None for r in rows):
        return model.head(model.model.norm(h))
    return [y[0] for y in model.heads([model.model.norm(h[j:j + 1] if r is None else h[j:j + 1, _index(r)])
                                       for j, r in enumerate(rows)])]

"""DiffusionGemma batched canvases: many requests' canvases denoised in one
decoder forward (the scheduler is dlm.runtime.batch).

Each request keeps its own CanvasSession (generate.py): its prompt, prefix
cache, draws, settings and canvas lengths; the prefill and the re-encoding of
each committed canvas run per request, as alone. What is shared is the
decoder forward of a step: the canvases of the requests with the same canvas
length go through one forward with a batch axis (dlm.runtime.models.rows keeps
every matmul per sequence; each sequence attends to its own prefix cache, at
its own positions), and the requests' stop flags are read in one host sync per
step. Each request's step around the forward (schedule, sampling, acceptance,
renoising, the stop rule, its draws) is canvas.py's ``build_steps`` on its own
slice of the logits, so it draws and commits what it would alone.

``Member`` drives one request's canvas.Canvas, the generator the solo path
(canvas.drive) and structured output (structured.Grammar) run too: the batch
answers every member's ``Next`` (the step to build) with one decoder forward per
canvas length and one step graph per kind, reads the stop flags those requests
carry in one host sync, and evaluates every ``Sync`` (a canvas under a grammar
reads its step before the next is built) in one evaluation. Steps are
pipelined as alone: the batch's next step is built while the current one runs
(Metal/CUDA; on the CPU backend ``mx.async_eval`` returns only near the end of
the step: canvas.py's denoise_canvas), and rebuilt without the canvases that
turn out to have stopped (they drew nothing: their draws are rewound, as alone).
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx

from ...generation.progress import Block
from .canvas import Next, Sync, build_steps


class Member:
    """One request in the batch: its session and the canvas in progress (a
    canvas.Canvas generator, parked at its next request)."""

    def __init__(self, session):
        self.session = session
        self.finished: Optional[Block] = None  # the block of the canvas that just ended
        self.encoding: Optional[mx.array] = None  # the committed canvas to encode before the next step
        self.length = 0
        self._settings = None
        self.busy = False
        self.canvas = None
        self.request = None  # what the canvas waits for: a Next or a Sync
        self.launched = None  # the step running, the answer to the canvas's Next
        self.following = None  # the step built for the Next
        self.mark = None  # the draws before the step to build next
        self._gen = None

    # -- a canvas begins and ends ---------------------------------------------

    def begin(self, remaining: int) -> None:
        s = self.session
        if self.encoding is not None:  # a canvas that ran no step (a grammar completed it) committed one already
            s.model.encode(self.encoding, s.cache, compiled=True)
        self.encoding, self.length, self.canvas = s.open(remaining)  # encoded in Batch.step
        self.busy, self.finished, self.launched, self.following = True, None, None, None
        self._gen = self.canvas.run()
        self.resume(None)

    def resume(self, value) -> None:
        """Send the canvas what it waited for; run it to its next request or its end."""
        try:
            self.request = self._gen.send(value)
        except StopIteration as end:
            self.busy, self.request, self._gen, self.launched, self.following = False, None, None, None, None
            self.finished = self.session.finish(end.value)
            return
        if isinstance(self.request, Next):
            self.mark = self.session.draws.state()

    # -- the phases of one step ------------------------------------------------

    def account(self) -> None:
        """The step that ran goes to the canvas: it counts and shows it, and ends
        at its last step or on cancel (before the stop flag is read, as alone)."""
        if self.launched is not None:
            step, self.launched = self.launched, None
            self.resume(step)

    @property
    def inputs(self) -> tuple:
        """(canvas, sc_probs, revealed, cur_step) of the step to build next."""
        r = self.request
        return r.canvas, r.sc_probs, r.revealed, r.cur_step

    @property
    def history(self) -> list[mx.array]:
        return self.canvas.history

    @property
    def stop_flag(self) -> Optional[mx.array]:
        return self.request.stop if isinstance(self.request, Next) else None

    def stopped(self) -> None:
        """The step that ran says stop: the canvas ends; the next step drew nothing."""
        self.session.draws.restore(self.mark)
        self.resume(None)

    def kind(self) -> tuple:
        """Members of one kind build their next steps together (build_steps): the
        same settings, as much history, and draws of one kind (their steps of the
        schedule may differ: one temperature per canvas)."""
        window = self.session.denoise.stability_threshold or 0
        return (self.settings, min(len(self.history), window), type(self.session.draws))

    @property
    def settings(self) -> str:
        if self._settings is None:
            self._settings = repr(self.session.denoise)
        return self._settings

    def launch(self) -> list[mx.array]:
        """The step just built becomes the running step; returns what to evaluate."""
        self.launched, self.following = self.following, None
        return self.launched.outputs(last=self.request.cur_step == 1)


class Batch:
    """The family's part of the scheduler: its members and one step for all."""

    block_name = "canvas"

    def __init__(self, loaded):
        self.model = loaded.model
        self.eager = self.model.eager_experts()  # read once: every step asks (Model.speculates)

    def member(self, session) -> Member:
        return Member(session)

    def step(self, members: list[Member], renew: Callable[[Member], None]) -> None:
        """One denoising step of every busy member (one decoder forward per canvas
        length), after encoding the canvases that members just committed (one
        encoder forward per canvas length; a member cancelled since still encodes
        it, as alone: a kept prefix cache holds every committed canvas).
        ``renew(member)`` (the scheduler's): a canvas that ended in this step (its
        last step, a stop flag, cancel) is committed and the next one begun, which
        this step then builds: alone, the next canvas follows at once, so a member
        never sits out a step between canvases."""
        for m in [m for m in members if m.busy]:
            m.account()
            if not m.busy:  # its canvas ended (last step, cancel)
                renew(m)
        self._settle(members, renew)
        encode(self.model, [m for m in members if m.encoding is not None])
        going = [m for m in members if m.busy]
        # A step that reads on the host while it is built (Model.speculates) is
        # built after the stop flags, so a stopped canvas costs no forward.
        speculate = self.model.speculates(max((m.length for m in going), default=0), self.eager)
        if speculate:
            self._build(going)
        stops = [m for m in going if m.stop_flag is not None]
        stopped = []
        if stops:  # the one host sync of a step, for the whole batch
            flags = mx.stack([m.stop_flag for m in stops]).tolist()
            stopped = [m for m, flag in zip(stops, flags) if flag]
            for m in stopped:
                m.stopped()
                renew(m)
            encode(self.model, [m for m in members if m.encoding is not None])
        if stopped or not speculate:
            going = [m for m in members if m.busy]
            self._build(going)
        if going:  # one evaluation for the whole batch (Metal/CUDA: run while the next step is built)
            mx.async_eval([out for m in going for out in m.launch()])

    @staticmethod
    def _settle(members: list[Member], renew: Callable[[Member], None]) -> None:
        """Answer the canvases that read their step on the host (under a grammar:
        before their next step is built) with one evaluation for all."""
        syncs = [m for m in members if isinstance(m.request, Sync)]
        if not syncs:
            return
        mx.eval([v for m in syncs for v in m.request.values])
        for m in syncs:
            m.resume(None)
            if not m.busy:  # its canvas ended (the grammar completed it, cancel, its last step)
                renew(m)

    def _build(self, members: list[Member]) -> None:
        """The next step of every member: one decoder forward per canvas length,
        then one step graph (build_steps) per kind of member in it."""
        for group, logits in decode(self.model, [m.inputs[0] for m in members], [m.inputs[1] for m in members],
                                    [m.session.cache for m in members]):
            kinds: dict[tuple, list[int]] = {}
            for row, i in enumerate(group):
                kinds.setdefault(members[i].kind(), []).append(row)
            for rows in kinds.values():
                part = logits if len(rows) == len(group) else logits[mx.array(rows)]
                build([members[group[r]] for r in rows], part)


def build(members: list[Member], logits: mx.array) -> None:
    """The next steps of members of one kind around their logits [B, L, V]."""
    for m in members:
        m.session.draws.restore(m.mark)  # a rebuild draws again what the discarded build drew
    first = members[0]
    canvas = mx.concatenate([m.inputs[0] for m in members]) if len(members) > 1 else first.inputs[0]
    revealed = mx.concatenate([m.inputs[2] for m in members]) if len(members) > 1 else first.inputs[2]
    steps = build_steps(logits, [(m.session.draws, m.history) for m in members], first.session.denoise,
                        canvas, revealed, [m.inputs[3] for m in members])
    for m, step in zip(members, steps):
        m.following = step


def encode(model, members: list[Member]) -> None:
    """``model.encode`` of the members' committed canvases, each at its own
    positions into its own prefix cache: one forward per canvas length (lazy)."""
    groups: dict[int, list[Member]] = {}
    for m in members:
        groups.setdefault(m.encoding.shape[-1], []).append(m)
    for group in groups.values():
        if len(group) == 1:  # alone: exactly the solo call
            model.encode(group[0].encoding, group[0].session.cache, compiled=True)
        else:
            _encode_group(model, [m.encoding for m in group], [m.session.cache for m in group])
        for m in group:
            m.encoding = None


def _encode_group(model, canvases: list[mx.array], caches: list[list]) -> None:
    """Model.encode (compiled) of equal-length canvases [1, L], batched."""
    dec = model.model.decoder
    scalars = model.model.encoder.language_model.layers
    h = dec.embed(mx.concatenate(canvases))
    offsets = mx.array([c[0].offset for c in caches], dtype=mx.int32)
    last = len(dec.layers) - 1
    for i, layer in enumerate(dec.layers):
        h = layer(h, [c[i] for c in caches], offsets, True, scalars[i]["layer_scalar"],
                  attention_only=i == last, compiled=model.compile)


def decode(model, canvases: list[mx.array], sc_probs: list[Optional[mx.array]],
           caches: list[list]) -> list[tuple[list[int], mx.array]]:
    """``model.decode`` of many canvases ([1, L] each; self-conditioning
    probabilities [1, L, V] or None) against their own prefix caches: one forward
    per canvas length; returns (the canvases' indices, their logits [B, L, V] in
    that order) per forward."""
    out = []
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(canvases):
        groups.setdefault(c.shape[-1], []).append(i)
    for idx in groups.values():
        if len(idx) == 1:  # alone: exactly the solo call
            i = idx[0]
            out.append((idx, model.decode(canvases[i], caches[i], sc_probs=sc_probs[i])))
            continue
        # Canvases with self-conditioning first, then the first steps (no sc).
        idx = [i for i in idx if sc_probs[i] is not None] + [i for i in idx if sc_probs[i] is None]
        out.append((idx, _decode_group(model, [canvases[i] for i in idx], [sc_probs[i] for i in idx],
                                       [caches[i] for i in idx])))
    return out


def _decode_group(model, canvases, sc_probs, caches) -> mx.array:
    """Model.decode for equal-length canvases, batched: [B, L, V]."""
    dec = model.model.decoder
    ends = dec.ends(model.compile)
    with_sc = [i for i, s in enumerate(sc_probs) if s is not None]
    parts = []
    if with_sc:
        parts.append(ends.inputs_probs(mx.concatenate([canvases[i] for i in with_sc]),
                                       mx.concatenate([sc_probs[i] for i in with_sc])))
    if len(with_sc) < len(canvases):
        parts.append(ends.inputs(mx.concatenate(canvases[len(with_sc):])))
    h = mx.concatenate(parts) if len(parts) > 1 else parts[0]
    offsets = mx.array([c[0].offset for c in caches], dtype=mx.int32)
    for i, layer in enumerate(dec.layers):
        h = layer(h, [c[i] for c in caches], offsets, False, compiled=model.compile)
    return ends.head(h)

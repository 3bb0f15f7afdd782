"""LLaDA2.2's Levenshtein decoding of one block: mask-to-token fills, token-to-token
edits, DELETE and SPLIT tokens that shift the block, the anti-loop rule.

docs/llada2.md ("dlm's rules") is the specification, written from the hub
``_joint_decode_block`` of inclusionAI/LLaDA2.2-flash's ``modeling_llada2_moe.py``
as its ports describe it; the PyTorch reference (dlm.verify.llada2_moe) implements
the same text apart from this file.

Each iteration is one forward (``Forward``) and one host read (``Sync``) of the
block's candidates: the decisions (which masks fill, which tokens edit, the
DELETE/SPLIT scan, the seen-state check) are integer rules over a block of
``block_length`` ids, made on the host; the logits stay on the device unless the
anti-loop rule fires (a second read of the block's rows). The same generator runs
alone and in a batch (batch.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np

from .requests import Sync
from .sampling import transfer_quota

ANTI_LOOP_TRIES = 5


@dataclass(frozen=True)
class Rules:
    """What one block's decoding is built from (generate.Settings on a LLaDA2.2 checkpoint)."""

    mask_id: int
    delete_id: int
    split_id: int
    steps: int  # the mask-to-token schedule's length
    threshold: float  # mask-to-token: fill masks whose confidence exceeds this
    editing_threshold: float  # token-to-token: rewrite where the new token's confidence exceeds this
    max_post_steps: int
    max_steps_per_block: int


@dataclass
class BlockState:
    """A block on the host as the iterations rewrite it."""

    block: np.ndarray  # [bl] ids
    orig: np.ndarray  # [bl] bool: a mask the block held at entry (or that token, once filled)
    gen_from: int  # positions before it are prompt: never written
    schedule: list[int]
    step: int = 0
    post: int = 0
    seen: set = field(default_factory=set)

    @classmethod
    def enter(cls, block: np.ndarray, gen_from: int, steps: int) -> "BlockState":
        block = np.asarray(block, dtype=np.int64).copy()
        orig = np.arange(len(block)) >= gen_from
        return cls(block, orig, gen_from, transfer_quota(int(orig.sum()), steps))


@dataclass
class Decision:
    """One iteration's outcome: what was written where (``new`` before the scan), the
    block after it, and whether the block is done."""

    new: np.ndarray
    write: np.ndarray
    edit: np.ndarray  # the token-to-token part of ``write``
    final: bool
    done: bool


def most_confident(candidates: np.ndarray, p: np.ndarray, n: int) -> np.ndarray:
    """The n candidate positions of highest ``p`` (ties to the lower position), as a mask."""
    order = np.argsort(np.where(candidates, -p, np.inf), kind="stable")[:n]
    out = np.zeros_like(candidates)
    out[order] = True
    return out


def choose(st: BlockState, r: Rules, cand: np.ndarray, p: np.ndarray, alt: np.ndarray, alt_p: np.ndarray):
    """Steps 2-6 of an iteration: (new block before the scan, write, edit, p, final).
    ``alt``/``alt_p``: per position the best token other than DELETE and SPLIT."""
    block = st.block
    masks = block == r.mask_id
    o = int((masks & st.orig).sum())
    st.post = st.post + 1 if o == 0 else 0
    final = (o == 0 and st.post >= r.max_post_steps) or st.step == r.max_steps_per_block - 1
    if final or st.step >= r.steps:
        m2t = masks
    else:
        need = min(st.schedule[st.step] + int(masks.sum()) - o, int(masks.sum()))
        high = masks & (p > r.threshold)
        m2t = high if int(high.sum()) >= need else most_confident(masks, p, need)
    prompt = np.arange(len(block)) < st.gen_from
    edit = ~prompt & ~masks & (cand != block) & (p > r.editing_threshold)
    write = m2t | edit
    cand, p = cand.copy(), p.copy()
    if final:  # the block must end with neither edit token
        swap = write & ((cand == r.delete_id) | (cand == r.split_id))
        cand[swap], p[swap] = alt[swap], alt_p[swap]
    return np.where(write, cand, block), write, edit, p, final


def anti_loop(new: np.ndarray, block: np.ndarray, p: np.ndarray, seen: set, repick: Callable) -> None:
    """Step 7, in place: while ``new`` repeats a state of this block, re-pick the
    changed position of lowest confidence with its candidate banned (at most
    ANTI_LOOP_TRIES times). ``repick(position, banned ids) -> (token, probability)``."""
    banned: dict[int, set] = {}
    for _ in range(ANTI_LOOP_TRIES):
        if new.tobytes() not in seen:
            return
        changed = np.flatnonzero(new != block)
        if not changed.size:
            return
        i = int(changed[np.argmin(p[changed])])  # argmin: the first, the lower position, on ties
        banned.setdefault(i, set()).add(int(new[i]))
        new[i], p[i] = repick(i, banned[i])


def scan(new: np.ndarray, before: np.ndarray, orig: np.ndarray, r: Rules) -> tuple[np.ndarray, np.ndarray]:
    """Step 9: DELETE drops its position; SPLIT at i becomes MASK (not original), then
    the token i held before this iteration (its flag kept); cut or MASK-padded to length."""
    tokens, flags = [], []
    for i, t in enumerate(new.tolist()):
        if t == r.delete_id:
            continue
        if t == r.split_id:
            tokens += [r.mask_id, int(before[i])]
            flags += [False, bool(orig[i])]
        else:
            tokens.append(t)
            flags.append(bool(orig[i]))
    n = len(new)
    pad = max(0, n - len(tokens))
    return (np.array(tokens[:n] + [r.mask_id] * pad, dtype=np.int64),
            np.array(flags[:n] + [False] * pad, dtype=bool))


def apply(st: BlockState, r: Rules, new: np.ndarray, write, edit, final: bool) -> Decision:
    """Steps 8-11: remember the state, scan the edits, test the end, advance."""
    st.seen.add(new.tobytes())
    before = st.block
    block, orig = scan(new, before, st.orig, r)
    no_mask = not bool((block == r.mask_id).any())
    done = ((np.array_equal(block, before) and not bool((before == r.mask_id).any()))
            or (no_mask and st.post > r.max_post_steps) or st.step + 1 == r.max_steps_per_block)
    st.block, st.orig, st.step = block, orig, st.step + 1
    return Decision(new, write, edit, final, done)


def candidates(logits: mx.array, r: Rules) -> mx.array:
    """[4, bl] float32 on the device: argmax, its softmax probability, and the
    best token other than DELETE/SPLIT with its probability over the logits without
    those two (ids < 2**24: exact)."""
    lse = mx.logsumexp(logits, axis=-1)
    cand = mx.argmax(logits, axis=-1)
    edits = (mx.arange(logits.shape[-1]) == r.delete_id) | (mx.arange(logits.shape[-1]) == r.split_id)
    others = mx.where(edits, -mx.inf, logits)
    alt = mx.argmax(others, axis=-1)

    def prob(x, tok, lse):
        return mx.exp(mx.take_along_axis(x, tok[:, None], axis=-1)[:, 0] - lse)

    return mx.stack([cand.astype(mx.float32), prob(logits, cand, lse), alt.astype(mx.float32),
                     prob(others, alt, mx.logsumexp(others, axis=-1))])


def repicker(rows: np.ndarray) -> Callable:
    """The anti-loop's re-pick over the block's (biased) float32 logits rows [bl, V]:
    the argmax with the banned ids at -inf, and its softmax probability over those logits."""
    rows = rows.astype(np.float32)

    def repick(i: int, banned: set) -> tuple[int, float]:
        row = rows[i].copy()
        row[list(banned)] = -np.inf
        tok = int(np.argmax(row))
        return tok, float(1.0 / np.exp(row - row[tok]).sum())

    return repick


def decode_block(member, b: int, start: int, block: mx.array, gen_from: int):
    """Block ``b`` at ``start`` as a batch.Member generator: returns (block, iterations, cancelled)."""
    s = member.session
    r = s.rules
    st = BlockState.enter(np.array(block), gen_from, r.steps)
    if gen_from >= s.bl:  # all prompt: nothing to decode
        return block, 0, False
    while True:
        if s.cancel is not None and s.cancel():
            return mx.array(st.block.astype(np.int32)), st.step, True
        current = mx.array(st.block.astype(np.int32))
        logits = yield member._window(start, current)
        if s.s.on_step is not None:
            s.s.on_step(b, st.step, logits)
        if s.logit_bias is not None:
            logits = logits + s.logit_bias
        cand, p, alt, alt_p = (np.array(v) for v in (yield Sync(candidates(logits, r))))
        cand, alt = cand.astype(np.int64), alt.astype(np.int64)
        p, alt_p = p.astype(np.float32), alt_p.astype(np.float32)
        step, before = st.step, st.block
        new, write, edit, p, final = choose(st, r, cand, p, alt, alt_p)
        if not final and new.tobytes() in st.seen:
            rows = yield Sync(logits, host=True)
            anti_loop(new, before, p, st.seen, repicker(rows))
        d = apply(st, r, new, write, edit, final)
        s._trace(b, step, start, write, new, st.block, p, edit)
        if d.done:
            return mx.array(st.block.astype(np.int32)), st.step, False

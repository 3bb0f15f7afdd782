"""LLaDA2.2 Levenshtein decoding (M2T + T2T with DELETE and SPLIT edits), in PyTorch.

The hub ``generate()`` of inclusionAI/LLaDA2.2-flash (``_joint_decode_block`` in
its ``modeling_llada2_moe.py``) was not readable here, so this is written from
docs/llada2.md's "dlm's rules" section ("Decoding one block", steps 1-11),
which fixes what the sources leave open. One documented deviation from the hub
code: the anti-loop rule re-picks the changed position of lowest confidence
(ties to the lower position) where the hub picks one at random.

Written apart from dlm.runtime's loop on purpose; ``torch_generate.generate``
drives it block by block with ``levenshtein=True``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

ANTI_LOOP_TRIES = 5


def edit_schedule(n0: int, steps: int) -> list[int]:
    """M2T floor per step: ``n0 // steps``, plus one for the first ``n0 % steps`` steps."""
    if steps <= 0:
        return []
    base, extra = divmod(n0, steps)
    return [base + (1 if i < extra else 0) for i in range(steps)]


@dataclass(frozen=True)
class EditIds:
    mask: int
    delete: int
    split: int


@dataclass
class _Candidates:
    """One iteration's per-position argmax ``cand`` and its probability ``p``,
    over ``logits`` (MASK already -inf when suppressed; bans add -inf)."""

    logits: torch.Tensor
    cand: torch.Tensor
    p: torch.Tensor

    @classmethod
    def of(cls, logits: torch.Tensor) -> "_Candidates":
        probs = F.softmax(logits, dim=-1)
        cand = logits.argmax(-1)  # first maximum: ties to the lower id
        return cls(logits, cand, probs.gather(-1, cand[:, None])[:, 0])

    def repick(self, i: int, banned: list[int]) -> None:
        """Position ``i`` takes the argmax with ``banned`` ids at -inf; ``p``
        is that token's probability under the same banned logits."""
        row = self.logits[i].clone()
        row[banned] = float("-inf")
        self.cand[i] = row.argmax()
        self.p[i] = F.softmax(row, dim=-1)[self.cand[i]]


@torch.no_grad()
def levenshtein_block(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    block: torch.Tensor,
    gen_from: int,
    *,
    steps: int,
    threshold: float,
    editing_threshold: float,
    max_post_steps: int,
    max_steps_per_block: int,
    mask_id: int,
    delete_id: int,
    split_id: int,
    suppress_mask: bool = True,
    trace: Optional[list] = None,
    b: int = 0,
    start: int = 0,
    on_step: Optional[Callable] = None,
) -> tuple[torch.Tensor, int]:
    """Decode one block (1-D, ``block_length`` ids: prompt in ``[0, gen_from)``,
    MASK after) until stable, out of post-fill budget or at the step cap.

    ``logits_fn(block)`` returns float32 logits [block_length, V] for the block
    written in place. ``trace`` gets ``(b, step, positions, tokens)`` per
    iteration (positions = ``start`` + index); ``on_step(b, step, logits)``
    sees the raw logits. Returns (the final block, iterations run).
    """
    ids = EditIds(mask_id, delete_id, split_id)
    block = block.clone().to(torch.long).reshape(-1)
    _check_block(block, gen_from, ids, max_steps_per_block)
    bl = block.shape[0]
    prompt = torch.arange(bl) < gen_from
    orig = ~prompt  # every non-prompt position starts as an original MASK
    schedule = edit_schedule(bl - gen_from, steps)
    if gen_from >= bl:
        return block, 0
    post, step, seen = 0, 0, set()
    while True:
        logits = logits_fn(block).float()
        if on_step is not None:
            on_step(b, step, logits)
        if suppress_mask:
            logits = logits.clone()
            logits[:, mask_id] = float("-inf")
        c = _Candidates.of(logits)
        masks = block == mask_id
        o = int((masks & orig).sum())
        nw = int(masks.sum()) - o
        post = post + 1 if o == 0 else 0
        final = (o == 0 and post >= max_post_steps) or step == max_steps_per_block - 1
        m2t = _m2t(c.p, masks, nw, step, schedule, threshold, final or step >= steps)
        t2t = ~prompt & ~masks & (c.cand != block) & (c.p > editing_threshold)
        write = m2t | t2t
        if final:
            _drop_edit_tokens(c, write, ids)
        new = torch.where(write, c.cand, block)
        if not final:
            new = _anti_loop(c, block, new, seen)
        seen.add(tuple(new.tolist()))
        nxt, nxt_orig = apply_edits(new, block, orig, ids)
        if trace is not None:
            where = write.nonzero()[:, 0]
            trace.append((b, step, (where + start).tolist(), new[where].tolist()))
        done = _block_done(block, nxt, mask_id, post > max_post_steps, step + 1 == max_steps_per_block)
        block, orig, step = nxt, nxt_orig, step + 1
        if done:
            return block, step


def _block_done(before: torch.Tensor, after: torch.Tensor, mask_id: int, budget_spent: bool,
                capped: bool) -> bool:
    """Stable (unchanged, no MASK), out of post-fill budget with no MASK left, or at the step cap."""
    stable = bool(torch.equal(after, before)) and not bool((before == mask_id).any())
    return stable or (budget_spent and not bool((after == mask_id).any())) or capped


def _check_block(block: torch.Tensor, gen_from: int, ids: EditIds, max_steps_per_block: int) -> None:
    """The entry state the rules assume: a clean prompt, then only MASK."""
    if len({ids.mask, ids.delete, ids.split}) != 3:
        raise ValueError(f"MASK {ids.mask}, DELETE {ids.delete} and SPLIT {ids.split} must be distinct ids")
    if not 0 <= gen_from <= block.shape[0]:
        raise ValueError(f"gen_from {gen_from} is outside the block of length {block.shape[0]}")
    if max_steps_per_block < 1:
        raise ValueError(f"max_steps_per_block must be at least 1, got {max_steps_per_block}")
    head = block[:gen_from].tolist()
    bad = sorted({t for t in head if t in (ids.mask, ids.delete, ids.split)})
    if bad:
        raise ValueError(f"the prompt holds MASK/DELETE/SPLIT ids {bad}")
    if not bool((block[gen_from:] == ids.mask).all()):
        raise ValueError(f"block positions from gen_from {gen_from} on must all be MASK {ids.mask}")


def _m2t(p, masks, nw, step, schedule, threshold, take_all) -> torch.Tensor:
    """Mask-to-token picks: every mask on a final/post-schedule step; else the
    masks over the threshold when there are at least ``need`` of them, else the
    ``need`` most confident masks (ties to the lower position)."""
    if take_all:
        return masks.clone()
    n_masks = int(masks.sum())
    need = min(schedule[step] + nw, n_masks)
    hi = masks & (p > threshold)
    if int(hi.sum()) >= need:
        return hi
    conf = torch.where(masks, p, torch.tensor(float("-inf")))
    pick = torch.zeros_like(masks)
    pick[torch.sort(conf, descending=True, stable=True).indices[:need]] = True
    return pick


def _drop_edit_tokens(c: _Candidates, write: torch.Tensor, ids: EditIds) -> None:
    """Final iteration: a written DELETE/SPLIT becomes the best other token, so
    the block ends with neither (MASK stays -inf when it was suppressed)."""
    for i in write.nonzero()[:, 0].tolist():
        if int(c.cand[i]) in (ids.delete, ids.split):
            c.repick(i, [ids.delete, ids.split])


def _anti_loop(c: _Candidates, block: torch.Tensor, new: torch.Tensor, seen: set) -> torch.Tensor:
    """While ``new`` repeats a state seen in this block (at most 5 tries): the
    changed position of lowest ``p`` (ties to the lower position) bans its
    candidate and takes the next best (dlm's deterministic rule)."""
    banned: dict[int, list[int]] = {}
    for _ in range(ANTI_LOOP_TRIES):
        if tuple(new.tolist()) not in seen:
            break
        changed = (new != block).nonzero()[:, 0]
        if changed.numel() == 0:
            break
        i = int(changed[torch.sort(c.p[changed], stable=True).indices[0]])
        banned.setdefault(i, []).append(int(c.cand[i]))
        c.repick(i, banned[i])
        new = new.clone()
        new[i] = c.cand[i]
    return new


def apply_edits(new: torch.Tensor, before: torch.Tensor, orig: torch.Tensor,
                ids: EditIds) -> tuple[torch.Tensor, torch.Tensor]:
    """One left-to-right scan: DELETE drops its position; SPLIT at i gives
    [MASK (not original), ``before[i]`` with ``orig[i]``]; any other token
    stays with its flag. Cut to the block length or pad with non-original MASK."""
    bl = new.shape[0]
    toks: list[int] = []
    flags: list[bool] = []
    for i, t in enumerate(new.tolist()):
        if t == ids.delete:
            continue
        if t == ids.split:
            toks += [ids.mask, int(before[i])]
            flags += [False, bool(orig[i])]
        else:
            toks.append(t)
            flags.append(bool(orig[i]))
    toks, flags = toks[:bl], flags[:bl]
    pad = bl - len(toks)
    toks += [ids.mask] * pad
    flags += [False] * pad
    return torch.tensor(toks, dtype=torch.long), torch.tensor(flags, dtype=torch.bool)


@torch.no_grad()
def generate_levenshtein(model, x: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, P: int,
                         block_length: int, eos_ids: set, **block_kw) -> None:
    """Decode ``x`` [1, T] (prompt, then MASK) in place block by block from the
    block holding position P; each iteration re-runs ``x[:, :block_end]``
    under the block-causal ``mask``. Stops after the first block whose output
    positions hold an end id."""
    T = x.shape[1]
    for b in range(P // block_length, T // block_length):
        start, end = b * block_length, (b + 1) * block_length
        window = x[:, :end]

        def logits_fn(blk, start=start, end=end, window=window):
            window[0, start:end] = blk
            return model(window, mask[:, :, :end, :end], pos[:end])[0, start:end]

        out, _ = levenshtein_block(logits_fn, x[0, start:end].clone(), max(P - start, 0), b=b, start=start,
                                   **block_kw)
        x[0, start:end] = out
        if any(int(v) in eos_ids for v in x[0, P:end].tolist()):
            return

"""The hub 2.0 ``generate()``, LLaDA2.1 draft-and-edit and LLaDA2.2 Levenshtein decoding, in PyTorch.

Written from ``LLaDA2MoeModelLM.generate`` in the hub ``modeling_llada2_moe.py``
of inclusionAI/LLaDA2.0-mini (2.0) and of inclusionAI/LLaDA2.1-mini
(draft-and-edit), for the reference model in ``torch_model``; it reproduces
the hub algorithm exactly (including its temperature-0 sampling bug when
``hub_sampler=True``), with the hooks the parity suite needs: a shared uniform
stream (inverse-CDF sampling, so MLX and torch draw the same samples), a commit
trace, the fixed greedy sampler, a linear threshold schedule and editing.
LLaDA2.2 Levenshtein decoding (``levenshtein=True``) is in ``torch_levenshtein``,
written from docs/llada2.md's rules. Written apart from dlm.runtime's loop on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F

from . import torch_levenshtein
from .torch_model import EOS_ID, MASK_ID, LLaDA2Reference, block_causal_mask


# Levenshtein decoding of one block, re-exported for callers of this module.
levenshtein_block = torch_levenshtein.levenshtein_block


def transfer_quota(block_length: int, steps: int) -> list[int]:
    """Tokens each step must commit at least: bl // steps, remainder first."""
    if steps <= 0:
        return []
    base, extra = divmod(block_length, steps)
    return [base + (1 if s < extra else 0) for s in range(steps)]


def linear_threshold(threshold: float, minimum: Optional[float], step: int, steps: int) -> float:
    if minimum is None:
        return threshold
    return threshold - (threshold - minimum) * step / max(1, steps - 1)


def filter_logits(logits: torch.Tensor, top_k=None, top_p=None) -> torch.Tensor:
    """Hub top-k (ties kept) and top-p (exclusive cumulative mass > p dropped)."""
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
        drop_sorted = (cum - F.softmax(sorted_logits, dim=-1)) > top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index of the first token whose cumulative probability exceeds u·total."""
    cdf = torch.cumsum(probs, dim=-1)
    target = u.to(cdf.dtype)[:, None] * cdf[:, -1:]
    return (cdf <= target).sum(-1).clamp(max=probs.shape[-1] - 1)


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_k=None,
    top_p=None,
    *,
    hub_sampler: bool = True,
    uniforms: Optional[Callable[[int], Iterable[float]]] = None,
):
    """(tokens, confidences) for [n, V] float32 logits.

    hub_sampler=True is the 2.0 hub code: temperature 0 (or 1) leaves the logits
    unchanged and still samples.  hub_sampler=False is the greedy fix: at
    temperature 0, argmax with the unfiltered softmax probability.
    ``uniforms(n)`` replaces torch.multinomial by inverse-CDF sampling on a
    shared uniform stream.
    """
    logits = logits.float()
    if not hub_sampler and temperature == 0:
        probs = F.softmax(logits, dim=-1)
        tok = logits.argmax(-1)
        return tok, probs.gather(-1, tok[:, None])[:, 0]
    if temperature > 0 and temperature != 1:
        logits = logits / temperature
    probs = F.softmax(filter_logits(logits, top_k, top_p), dim=-1)
    if uniforms is None:
        tok = torch.multinomial(probs, num_samples=1)[:, 0]
    else:
        u = torch.as_tensor(list(uniforms(probs.shape[0])), dtype=torch.float32)
        tok = inverse_cdf(probs, u)
    return tok, probs.gather(-1, tok[:, None])[:, 0]


@torch.no_grad()
def generate(
    model: LLaDA2Reference,
    input_ids: torch.Tensor,
    temperature: float = 0.0,
    block_length: int = 32,
    steps: int = 32,
    gen_length: int = 2048,
    top_p=None,
    top_k=None,
    eos_early_stop: bool = False,
    minimal_topk: int = 1,
    threshold: float = 0.95,
    eos_id: int | Iterable[int] = EOS_ID,
    mask_id: int = MASK_ID,
    *,
    hub_sampler: bool = True,
    uniforms: Optional[Callable[[int], Iterable[float]]] = None,
    min_threshold: Optional[float] = None,
    suppress_mask: bool = False,
    editing_threshold: Optional[float] = None,
    max_post_steps: int = 16,
    trace: Optional[list] = None,
    on_step: Optional[Callable] = None,
    early_stop: bool = False,
    levenshtein: bool = False,
    delete_id: int | None = None,
    split_id: int | None = None,
    max_steps_per_block: int = 1000,
) -> torch.Tensor:
    """The hub 2.0 ``generate`` (LLaDA2.0-mini ``modeling_llada2_moe.py``), full recompute every step.

    Extensions (all off by default, i.e. hub-exact): ``min_threshold`` decays
    the threshold linearly over the steps; ``suppress_mask`` never predicts
    mask_id; ``editing_threshold`` switches to LLaDA2.1 draft-and-edit per
    block (the LLaDA2.1 hub ``generate``, with the block-causal log-mask);
    ``eos_id`` may be a set of ids. ``trace`` receives one ``(block, step,
    positions, tokens)`` tuple per step (absolute positions, sorted);
    ``on_step(block, step, logits)`` sees every step's raw float32 logits of
    the block [bl, V]. ``early_stop`` ends a block's step loop once its output
    is final (no mask before the first eos or before P + gen_length): same
    output, fewer steps (dlm's rule).

    ``levenshtein=True`` is LLaDA2.2 Levenshtein decoding (``torch_levenshtein``;
    greedy only: temperature 0, ``hub_sampler=False``), with ``delete_id``,
    ``split_id``, a float ``editing_threshold``, ``max_post_steps`` and
    ``max_steps_per_block``; ``steps`` is used as given.
    """
    eos_ids = {int(eos_id)} if isinstance(eos_id, int) else {int(e) for e in eos_id}
    x_in = input_ids.reshape(1, -1)
    if levenshtein:
        return _generate_levenshtein(
            model, x_in, block_length, gen_length, eos_ids, _refused_for_levenshtein(
                temperature=temperature, hub_sampler=hub_sampler, min_threshold=min_threshold, top_k=top_k,
                top_p=top_p, eos_early_stop=eos_early_stop, early_stop=early_stop, uniforms=uniforms),
            steps=steps, threshold=threshold, editing_threshold=editing_threshold,
            max_post_steps=max_post_steps, max_steps_per_block=max_steps_per_block, mask_id=mask_id,
            delete_id=delete_id, split_id=split_id, suppress_mask=suppress_mask, trace=trace, on_step=on_step)
    steps = min(steps, gen_length // minimal_topk)
    P = x_in.shape[1]
    nb = -(-(P + gen_length) // block_length)
    T = nb * block_length
    x = torch.full((1, T), mask_id, dtype=torch.long)
    x[0, :P] = x_in[0]

    def sample(logits):
        if suppress_mask:
            logits = logits.clone()
            logits[:, mask_id] = float("-inf")
        return sample_tokens(
            logits, temperature, top_k, top_p, hub_sampler=hub_sampler, uniforms=uniforms
        )

    run = _Run(model=model, x=x, mask=block_causal_mask(T, block_length, model.dtype), pos=torch.arange(T),
               P=P, gen_length=gen_length, steps=steps, quota=transfer_quota(block_length, steps),
               threshold=threshold, min_threshold=min_threshold, mask_id=mask_id, eos_ids=eos_ids,
               sample=sample, trace=trace, on_step=on_step)
    for b in range(P // block_length, nb):
        start, end = b * block_length, (b + 1) * block_length
        if editing_threshold is None:
            early = _denoise_block(run, b, start, end, early_stop, eos_early_stop)
            if early is not None:
                return early
        else:
            _edit_block(model, x[:, :end], run.mask[:, :, :end, :end], run.pos[:end], b, start, end, P,
                        steps, run.quota, threshold, min_threshold, editing_threshold,
                        max_post_steps, mask_id, sample, trace, on_step)
            if eos_early_stop and run.has_eos(x[0, P:end]) and not bool((x[0, P:end] == mask_id).any()):
                break
        if run.has_eos(x[0, P:end]):
            break

    return _cut_output(x, P, gen_length, eos_ids)


def _cut_output(x: torch.Tensor, P: int, gen_length: int, eos_ids: set) -> torch.Tensor:
    """The generated positions up to and including the first end id."""
    g = x[0, P : P + gen_length].tolist()
    n = next((i for i, v in enumerate(g) if v in eos_ids), len(g) - 1)
    return torch.tensor(g[: n + 1], dtype=torch.long)


def _refused_for_levenshtein(*, temperature, hub_sampler, min_threshold, top_k, top_p, eos_early_stop,
                             early_stop, uniforms) -> list[str]:
    """The ``generate`` settings that Levenshtein decoding (greedy, dlm's rules) does not take."""
    checks = {
        "temperature": temperature != 0,
        "hub_sampler": hub_sampler,
        "min_threshold": min_threshold is not None,
        "top_k": top_k is not None and top_k > 0,
        "top_p": top_p is not None and top_p < 1,
        "eos_early_stop": eos_early_stop,
        "early_stop": early_stop,
        "uniforms": uniforms is not None,
    }
    return [name for name, bad in checks.items() if bad]


def _generate_levenshtein(model, x_in, block_length, gen_length, eos_ids, refused, *, editing_threshold,
                          mask_id, delete_id, split_id, **block_kw) -> torch.Tensor:
    """LLaDA2.2 Levenshtein decoding over blocks tiled from position 0, full
    recompute of ``x[:, :block_end]`` every iteration; output as ``generate``."""
    if refused:
        raise ValueError(f"Levenshtein decoding is greedy only; refused: {', '.join(refused)}")
    if not isinstance(editing_threshold, (int, float)) or isinstance(editing_threshold, bool):
        raise ValueError(f"Levenshtein decoding needs a float editing_threshold, got {editing_threshold!r}")
    if delete_id is None or split_id is None:
        raise ValueError(f"Levenshtein decoding needs delete_id and split_id, got {delete_id!r} / {split_id!r}")
    bs = model.cfg.block_size
    if model.cfg.expert_capacity > 0 and block_length % bs:
        raise ValueError(f"block_length {block_length} is not a multiple of the routing block_size {bs}")
    bad = sorted({int(t) for t in x_in[0].tolist() if t in (mask_id, delete_id, split_id)})
    if bad:
        raise ValueError(f"the prompt holds MASK/DELETE/SPLIT ids {bad}")
    P = x_in.shape[1]
    T = -(-(P + gen_length) // block_length) * block_length
    x = torch.full((1, T), mask_id, dtype=torch.long)
    x[0, :P] = x_in[0]
    mask = block_causal_mask(T, block_length, model.dtype)
    torch_levenshtein.generate_levenshtein(
        model, x, mask, torch.arange(T), P, block_length, eos_ids, editing_threshold=float(editing_threshold),
        mask_id=mask_id, delete_id=delete_id, split_id=split_id, **block_kw)
    return _cut_output(x, P, gen_length, eos_ids)


@dataclass
class _Run:
    """What every block and step of one ``generate`` call shares: the model,
    the sequence ``x`` [1, T] (prompt, then mask_id) that the blocks fill in
    place, the block-causal mask and positions over all T, and the settings."""

    model: LLaDA2Reference
    x: torch.Tensor
    mask: torch.Tensor
    pos: torch.Tensor
    P: int
    gen_length: int
    steps: int
    quota: list
    threshold: float
    min_threshold: Optional[float]
    mask_id: int
    eos_ids: set
    sample: Callable
    trace: Optional[list]
    on_step: Optional[Callable]

    def has_eos(self, t) -> bool:
        return any(int(v) in self.eos_ids for v in t.tolist())


def _denoise_block(run: _Run, b: int, start: int, end: int, early_stop: bool,
                   eos_early_stop: bool) -> Optional[torch.Tensor]:
    """The hub 2.0 step loop of block ``b`` (positions [start, end)), until the
    block has no mask left or its ``steps`` are spent. Returns the hub's
    early-stop output (prompt included) when ``eos_early_stop`` ends the
    generation in this block, else None."""
    x, P, mask_id = run.x, run.P, run.mask_id
    window = x[:, :end]
    for s in range(run.steps):
        active = window[0, start:end] == mask_id
        if not bool(active.any()):
            break
        tok, commit = _denoise_step(run, window, b, s, start, end, active)
        if early_stop and _block_final(window[0, start:end], max(P - start, 0),
                                       P + run.gen_length - start, run.eos_ids, mask_id):
            break
        if eos_early_stop and run.has_eos(tok[commit]):
            e = next(i for i, v in enumerate(x[0].tolist()) if v in run.eos_ids)
            if not bool((x[0, P:e] == mask_id).any()):
                return x[0, : e + 1]  # hub quirk: includes the prompt
    return None


def _denoise_step(run: _Run, window: torch.Tensor, b: int, s: int, start: int, end: int,
                  active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``s`` of block ``b``: one full-recompute forward over ``window``,
    then commit every masked slot above the threshold if there are at least
    the step's quota of them, else the quota's most confident masked slots.
    Writes the commits into ``window``; returns (sampled tokens, commit mask)."""
    logits = run.model(window, run.mask[:, :, :end, :end], run.pos[:end])[0, start:end]
    if run.on_step is not None:
        run.on_step(b, s, logits)
    tok, p = run.sample(logits)
    conf = torch.where(active, p, torch.tensor(float("-inf")))
    thr = linear_threshold(run.threshold, run.min_threshold, s, run.steps)
    high = conf > thr
    if int(high.sum()) >= run.quota[s]:
        commit = high
    else:
        n = min(run.quota[s], int(active.sum()))
        commit = torch.zeros_like(high)
        commit[_most_confident(conf, n)] = True
    window[0, start:end] = torch.where(commit, tok, window[0, start:end])
    if run.trace is not None:
        where = commit.nonzero()[:, 0]
        run.trace.append((b, s, (where + start).tolist(), tok[where].tolist()))
    return tok, commit


def _most_confident(conf: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the n largest values; exact ties go to the lowest position
    (the hub's topk leaves ties implementation-defined; dlm fixes the rule so
    that both frameworks agree, e.g. on an all-mask block with no prompt)."""
    return torch.sort(conf, descending=True, stable=True).indices[:n]


def _block_final(block, gen_from, need, eos_ids, mask_id) -> bool:
    vals = block.tolist()
    need = min(need, len(vals))
    first_mask = next((i for i in range(gen_from, len(vals)) if vals[i] == mask_id), len(vals))
    first_eos = next((i for i in range(gen_from, len(vals)) if vals[i] in eos_ids), len(vals))
    return first_mask >= need or first_eos < first_mask


def _edit_block(model, window, mask, pos, b, start, end, P, steps, quota, threshold,
                min_threshold, editing_threshold, max_post_steps, mask_id, sample, trace, on_step):
    """LLaDA2.1 draft-and-edit for one block (LLaDA2.1-mini hub ``generate``; the
    LLaDA2.1 tech report, arXiv 2602.08676, eqs. 1-3).  The fallback commit is the
    quota of the step (1 per step with steps == block_length, as the hub's
    num_to_transfer=1); editable = non-prompt, non-mask positions of the block."""
    post, s = 0, 0
    editable_base = torch.arange(start, end) >= P
    while True:
        cur = window[0, start:end]
        active = cur == mask_id
        if not bool(active.any()):
            post += 1
        if post > max_post_steps:
            return
        logits = model(window, mask, pos)[0, start:end]
        if on_step is not None:
            on_step(b, s, logits)
        tok, p = sample(logits)
        commit = torch.zeros_like(active)
        if bool(active.any()):
            conf = torch.where(active, p, torch.tensor(float("-inf")))
            thr = linear_threshold(threshold, min_threshold, min(s, max(steps - 1, 0)), steps)
            high = conf > thr
            q = quota[s] if s < len(quota) else 1
            q = max(q, 1)
            if int(high.sum()) >= q:
                commit = high
            else:
                commit[_most_confident(conf, min(q, int(active.sum())))] = True
        edit = editable_base & ~active & (tok != cur) & (p > editing_threshold)
        write = commit | edit
        window[0, start:end] = torch.where(write, tok, cur)
        if trace is not None:
            where = write.nonzero()[:, 0]
            trace.append((b, s, (where + start).tolist(), tok[where].tolist()))
        s += 1
        if not bool(active.any()) and not bool(edit.any()):
            return

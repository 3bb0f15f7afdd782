"""LLaDA2.2's Levenshtein decoding in the MLX runtime (runtime/models/llada2_moe/levenshtein.py)
against the independent PyTorch reference (verify/llada2_moe), on scripted logits:
the same iterations, writes (DELETE and SPLIT included), shifts and end, for cases
built to exercise each rule of docs/llada2.md ("dlm's rules")."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dlm.runtime import api  # noqa: F401  (before MLX: dlm.runtime loads the optimized BLAS ahead of it)
from dlm.runtime.models.llada2_moe.levenshtein import Rules, decode_block
from dlm.runtime.models.llada2_moe.requests import Forward, Sync
from dlm.verify.llada2_moe.torch_generate import levenshtein_block

import mlx.core as mx  # noqa: E402  (isort: skip)

V, MASK, DELETE, SPLIT = 12, 11, 9, 10
PROMPT_TOKEN = 7


class _Session:
    """What decode_block reads of a BlockSession, and a trace of its writes."""

    def __init__(self, rules: Rules, bl: int):
        self.rules, self.bl, self.cancel, self.logit_bias = rules, bl, None, None
        self.s = SimpleNamespace(on_step=None)
        self.trace: list = []

    def _trace(self, b, step, start, write, new, block, p, edit):
        w = np.flatnonzero(write)
        self.trace.append((b, step, [int(start + i) for i in w], [int(t) for t in new[w]]))


class _Member:
    def __init__(self, session):
        self.session = session

    def _window(self, start, block):
        return Forward(block, None)


def runtime_block(script, block, gen_from, rules: Rules, start: int = 0):
    """decode_block driven by ``script(block ids) -> logits [bl, V]``: (block, iterations, trace)."""
    session = _Session(rules, len(block))
    gen = decode_block(_Member(session), 0, start, mx.array(np.array(block, np.int32)), gen_from)
    request = next(gen)
    try:
        while True:
            if isinstance(request, Forward):
                request = gen.send(mx.array(script(np.array(request.ids)).astype(np.float32)))
            else:
                assert isinstance(request, Sync)
                request = gen.send(request.read())
    except StopIteration as end:
        out, iterations, cancelled = end.value
    assert not cancelled
    return np.array(out).tolist(), iterations, session.trace


def reference_block(script, block, gen_from, rules: Rules, start: int = 0):
    trace: list = []
    out, iterations = levenshtein_block(
        lambda t: torch.from_numpy(script(t.numpy()).astype(np.float32)), torch.tensor(block), gen_from,
        steps=rules.steps, threshold=rules.threshold, editing_threshold=rules.editing_threshold,
        max_post_steps=rules.max_post_steps, max_steps_per_block=rules.max_steps_per_block, mask_id=MASK,
        delete_id=DELETE, split_id=SPLIT, suppress_mask=False, trace=trace, b=0, start=start)
    return [int(t) for t in out.tolist()], int(iterations), [
        (b, s, [int(p) for p in pos], [int(t) for t in tok]) for b, s, pos, tok in trace]


def rules(**kw) -> Rules:
    base = dict(mask_id=MASK, delete_id=DELETE, split_id=SPLIT, steps=4, threshold=0.5, editing_threshold=0.0,
                max_post_steps=2, max_steps_per_block=40)
    return Rules(**{**base, **kw})


def peaked(choices, confidence: float = 4.0, rng=None) -> np.ndarray:
    """Logits [n, V] whose argmax is ``choices[i]`` with margin ``confidence`` (plus noise)."""
    rng = rng or np.random.default_rng(0)
    x = rng.normal(0, 0.3, (len(choices), V))
    x[np.arange(len(choices)), choices] += confidence
    return x


def both(script, block, gen_from, r):
    got, want = runtime_block(script, block, gen_from, r, start=16), reference_block(script, block, gen_from, r,
                                                                                        start=16)
    assert got == want
    return got


def test_delete_shifts_left_and_pads_with_a_mask_that_is_filled_again():
    block = [PROMPT_TOKEN, PROMPT_TOKEN] + [MASK] * 4

    def script(b):  # first: fill [1, DELETE, 2, 3]; then: keep what stands, fill the pad with 4
        want = [PROMPT_TOKEN, PROMPT_TOKEN] + ([1, DELETE, 2, 3] if (b == MASK).sum() == 4 else
                                               [t if t != MASK else 4 for t in b[2:]])
        return peaked(want)

    out, iterations, trace = both(script, block, 2, rules())
    assert trace[0][2:] == ([18, 19, 20, 21], [1, DELETE, 2, 3])
    assert out == [PROMPT_TOKEN, PROMPT_TOKEN, 1, 2, 3, 4]
    assert iterations >= 2


def test_split_inserts_a_mask_before_the_old_token_and_cuts_the_end():
    block = [PROMPT_TOKEN] + [MASK] * 5
    seen = []

    def script(b):
        seen.append(b.tolist())
        if (b == MASK).sum() == 5:
            return peaked([PROMPT_TOKEN, 1, 2, 3, 4, 5])
        if b.tolist() == [PROMPT_TOKEN, 1, 2, 3, 4, 5]:  # SPLIT at 2: [.., 1, MASK, 2, 3, 4] (5 falls off)
            return peaked([PROMPT_TOKEN, 1, SPLIT, 3, 4, 5])
        return peaked([t if t != MASK else 6 for t in b])

    out, _, trace = both(script, block, 1, rules())
    assert [PROMPT_TOKEN, 1, MASK, 2, 3, 4] in seen
    assert out == [PROMPT_TOKEN, 1, 6, 2, 3, 4]
    assert trace[1][3] == [SPLIT]


def test_a_final_iteration_writes_no_edit_token_and_the_cap_leaves_no_mask():
    """The model insists on DELETE everywhere: only the final iteration (the cap) ends it."""
    block = [MASK] * 4

    def script(b):
        x = peaked([DELETE] * 4)
        x[:, 3] += 2.0  # the best other token: 3
        return x

    out, iterations, trace = both(script, block, 0, rules(max_steps_per_block=5, max_post_steps=100))
    assert iterations == 5 and out == [3, 3, 3, 3]
    assert all(DELETE not in t for *_, t in trace[-1:])


def test_the_schedule_spreads_the_masks_when_none_is_confident():
    block = [MASK] * 10

    def script(b):
        return np.zeros((10, V)) + np.linspace(0, 1, V) * 0.01  # flat: p < 0.5 everywhere, argmax V-1 -> 10

    def script2(b):
        x = script(b)
        x[:, SPLIT] = x[:, DELETE] = x[:, MASK] = -1.0
        return x

    _, _, trace = both(script2, block, 0, rules(steps=4))
    assert [len(t[2]) for t in trace[:4]] == [3, 3, 2, 2]


def test_the_anti_loop_breaks_a_two_state_cycle():
    """Edits that flip two tokens back and forth: the seen-state rule re-picks the
    least confident changed position, so both sides leave the cycle the same way."""
    block = [MASK] * 4

    def script(b):
        flip = {1: 2, 2: 1}
        want = [flip.get(int(t), 1) for t in b]
        x = peaked(want)
        x[0] += np.linspace(0, 0.5, V)  # distinct confidences
        return x

    out, iterations, _ = both(script, block, 0, rules(max_post_steps=6, max_steps_per_block=30))
    assert MASK not in out and iterations < 30


def random_case(seed: int):
    """A block, rules and a scripted model: random logits that favour DELETE/SPLIT now
    and then, a deterministic function of the block (as a model is)."""
    rng = np.random.default_rng(seed)
    bl = int(rng.integers(4, 9))
    gen_from = int(rng.integers(0, bl))
    block = [PROMPT_TOKEN] * gen_from + [MASK] * (bl - gen_from)
    r = rules(steps=int(rng.integers(1, bl + 1)), threshold=float(rng.choice([0.3, 0.5, 0.9])),
              editing_threshold=float(rng.choice([0.0, 0.5, 0.95])), max_post_steps=int(rng.choice([0, 1, 2, 3, 50])),
              max_steps_per_block=int(rng.integers(3, 25)))
    table = {}

    def script(b):
        key = tuple(int(t) for t in b)
        if key not in table:
            x = rng.normal(0, 2.0, (bl, V))
            x[:, DELETE] += rng.choice([0, 3.0], p=[0.8, 0.2])
            x[:, SPLIT] += rng.choice([0, 3.0], p=[0.8, 0.2])
            x[:, MASK] = -30.0
            x[:, :3] += rng.choice([0, 2.0])  # sometimes a few tokens dominate: cycles, then the anti-loop
            table[key] = x
        return table[key]

    return script, block, gen_from, r


@pytest.mark.parametrize("seed", range(40))
def test_random_scripts_with_edit_tokens_agree(seed):
    """The two implementations agree iteration by iteration: writes, shifts, end."""
    both(*random_case(seed))


def test_the_random_scripts_exercise_every_rule(monkeypatch):
    """The cases above are not vacuous: between them they write DELETE and SPLIT,
    fire the anti-loop rule, hit the iteration cap and end by settling."""
    from dlm.runtime.models.llada2_moe import levenshtein as L

    fired = []  # re-picks per firing
    real = L.anti_loop

    def counting(new, block, p, seen, repick):
        fired.append(0)

        def counted(i, banned):
            fired[-1] += 1
            return repick(i, banned)

        return real(new, block, p, seen, counted)

    monkeypatch.setattr(L, "anti_loop", counting)
    written, capped, settled = set(), 0, 0
    for seed in range(40):
        script, block, gen_from, r = random_case(seed)
        _, iterations, trace = runtime_block(script, block, gen_from, r)
        written |= {t for *_, tokens in trace for t in tokens}
        capped += iterations == r.max_steps_per_block
        settled += iterations < r.max_steps_per_block
    assert {DELETE, SPLIT} <= written
    assert max(fired) >= 2 and capped and settled  # a second re-pick ranks by the first one's p

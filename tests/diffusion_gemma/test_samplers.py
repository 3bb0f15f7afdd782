"""Sampler units against hand-computed cases (transformers'
``generation_diffusion_gemma.py``: ``_denoising_step``, ``EntropyBoundSampler``,
``StableAndConfidentStoppingCriteria``; the debug canvas of lablup/mlxcel's
``debug_canvas_pattern``), the denoising loop with a fake model, and the
thinking-channel parser."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dlm.runtime.models.diffusion_gemma import sampling as S
from dlm.runtime.models.diffusion_gemma.canvas import DebugDraws, DenoiseConfig, RandomDraws, denoise_canvas
from dlm.runtime.models.diffusion_gemma.scores import score
from dlm.runtime.generation.progress import trim
from dlm.runtime.generation.text import ChannelParser


def test_linear_temperature_matches_torch_float32():
    import torch

    for n_steps in (48, 7):
        for step in range(1, n_steps + 1):
            ref = 0.4 + (0.8 - 0.4) * (torch.tensor(step, dtype=torch.int32) / n_steps)
            assert S.linear_temperature(step, n_steps, 0.4, 0.8) == np.float32(ref.item())
    assert S.linear_temperature(48, 48, 0.4, 0.8) == np.float32(0.8)
    assert abs(S.linear_temperature(1, 48, 0.4, 0.8) - (0.4 + 0.4 / 48)) < 1e-7


def test_token_entropy():
    h = S.token_entropy(mx.array([[0.0, 0.0, 0.0, 0.0], [0.0, -1e9, -1e9, -1e9]]))
    assert np.allclose(np.array(h), [np.log(4.0), 0.0], atol=1e-6)
    import torch

    x = np.random.default_rng(0).normal(size=(3, 5, 50)).astype(np.float32) * 4
    ref = torch.distributions.Categorical(logits=torch.tensor(x)).entropy().numpy()
    assert np.abs(np.array(S.token_entropy(mx.array(x))) - ref).max() < 1e-5


def test_entropy_bound_hand_case():
    # sorted: .02(2) .04(3) .05(0) .3(1) .9(4); sums excluding the last: 0 .02 .06 .11 .41
    h = mx.array([0.05, 0.3, 0.02, 0.04, 0.9])
    assert np.array(S.entropy_bound_accept(h, 0.1)).tolist() == [True, False, True, True, False]


def test_entropy_bound_boundary_is_inclusive():
    # binary-exact values: sorted .03125(1) .0625(0) .125(2) .5(3); excluding-sums 0 .03125 .09375 .21875
    h = mx.array([0.0625, 0.03125, 0.125, 0.5])
    assert np.array(S.entropy_bound_accept(h, 0.09375)).tolist() == [True, True, True, False]
    assert np.array(S.entropy_bound_accept(h, 0.09375 - 2**-10)).tolist() == [True, True, False, False]


def test_entropy_bound_always_accepts_the_lowest():
    h = mx.array([[5.0, 6.0, 4.5], [9.0, 8.0, 7.0]])
    assert np.array(S.entropy_bound_accept(h, 0.1)).tolist() == [[False, False, True], [False, False, True]]


def test_confidence_accept_and_fallback():
    top1 = mx.array([0.5, 0.95, 0.7])
    none = mx.array([False, False, False])
    assert np.array(S.confidence_accept(top1, none, 0.9)).tolist() == [False, True, False]
    # nothing exceeds 0.96 (and 0.95 == threshold would not "exceed") -> the single most confident
    assert np.array(S.confidence_accept(top1, none, 0.96)).tolist() == [False, True, False]
    assert np.array(S.confidence_accept(top1, none, 0.95)).tolist() == [False, True, False]
    # revealed positions are never revealed again; fallback picks the best unrevealed one
    revealed = mx.array([False, True, False])
    assert np.array(S.confidence_accept(top1, revealed, 0.96)).tolist() == [False, False, True]
    assert np.array(S.confidence_accept(top1, revealed, 0.6)).tolist() == [False, False, True]
    assert not np.array(S.confidence_accept(top1, mx.array([True] * 3), 0.0)).any()


def test_stable_and_confident():
    a, b = mx.array([[1, 2, 3]]), mx.array([[1, 2, 4]])
    assert not S.stable(a, [], 1).item()  # first step of a canvas: never stable
    assert S.stable(a, [a], 1).item() and not S.stable(a, [b], 1).item()
    assert not S.stable(a, [a], 2).item() and S.stable(a, [a, a], 2).item()
    assert not S.stable(a, [b, a], 2).item()
    assert S.stable(a, [], 0).item()  # threshold 0: always stable
    assert S.confident(mx.array([0.004, 0.005]), 0.005).item()
    assert not S.confident(mx.array([0.005, 0.005]), 0.005).item()  # strict


def test_debug_canvas_pattern_by_hand():
    # 7919 mod 512 = 239, 15838 mod 512 = 478, 23757 mod 512 = 205; 104729 mod 512 = 281
    assert S.debug_canvas_pattern(0, 3, 512).tolist() == [239, 478, 205]
    assert S.debug_canvas_pattern(1, 3, 512).tolist() == [8, 247, 486]


@pytest.mark.parametrize("remaining, lo, hi, full, want", [
    (300, 64, 256, False, 256), (100, 64, 256, False, 100), (10, 64, 256, False, 64),
    (10, 64, 256, True, 256), (5, 2, 8, False, 5), (1, 64, 8, False, 8),
])
def test_canvas_length(remaining, lo, hi, full, want):
    assert S.canvas_length(remaining, lo, hi, full) == want


def test_trim_at_budget_and_stop_tokens():
    assert trim([1, 2, 3, 4], 3, [9]) == ([1, 2, 3], False)
    assert trim([5, 1, 7], 10, [1, 106]) == ([5], True)
    assert trim([5, 106, 1], 10, [1, 106]) == ([5], True)  # every EOS id counts
    assert trim([5, 6, 1], 2, [1]) == ([5, 6], False)  # EOS past the budget


# ---------------------------------------------------------------------------
# The loop with a fake decoder
# ---------------------------------------------------------------------------

V = 16


class FakeDecoder:
    """Returns logits from a script; records the canvases and SC inputs it sees."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def __call__(self, canvas, sc):
        self.calls.append((np.array(canvas), None if sc is None else np.array(sc)))
        return mx.array(self.script(len(self.calls) - 1, np.array(canvas)))


def peaked(tokens, margin):
    x = np.zeros((1, len(tokens), V), np.float32)
    x[0, np.arange(len(tokens)), tokens] = margin
    return x


def test_renoise_keeps_accepted_sample_and_redraws_the_rest():
    # Entropies: positions 0, 2 ~0; 3 moderate; 1 flat (ln 16). The rule accepts a
    # position when the entropies BEFORE it in sorted order sum to <= 0.1, so 0, 2
    # and 3 are accepted (3 only needs 0 + 0) and 1 is renoised.
    def script(i, canvas):
        x = peaked([3, 0, 5, 11], 30.0)
        x[0, 1] = 0.0
        x[0, 3, 11] = 2.0
        return x

    dec = FakeDecoder(script)
    cfg = DenoiseConfig(steps=3, t_min=None, t_max=None, stability_threshold=None, confidence_threshold=None)
    res = denoise_canvas(dec, DebugDraws(V), 4, cfg)
    assert res.steps == 3 and not res.stopped_early
    assert dec.calls[0][0].tolist() == [S.debug_canvas_pattern(0, 4, V).tolist()]
    for step in (1, 2):  # draw n = step renoises the unaccepted positions
        noise = S.debug_canvas_pattern(step, 4, V).tolist()
        assert dec.calls[step][0].tolist() == [[3, noise[1], 5, 11]]
    # first step without self-conditioning, then the softmax of the previous processed logits
    assert dec.calls[0][1] is None and np.allclose(dec.calls[1][1], softmax(script(0, None)), rtol=1e-5, atol=0)


def softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_self_conditioning_gets_temperature_scaled_logits():
    dec = FakeDecoder(lambda i, c: peaked([1, 2], 3.0))
    cfg = DenoiseConfig(steps=4, t_min=0.4, t_max=0.8, stability_threshold=None, confidence_threshold=None)
    denoise_canvas(dec, DebugDraws(V), 2, cfg)
    t4 = S.linear_temperature(4, 4, 0.4, 0.8)
    assert np.allclose(dec.calls[1][1], softmax(peaked([1, 2], 3.0) / np.float64(t4)), rtol=1e-5, atol=0)
    assert not np.allclose(dec.calls[1][1], softmax(peaked([1, 2], 3.0)), rtol=1e-3, atol=0)
    assert len(dec.calls) == 4


@pytest.mark.parametrize("stop_at", [2, 4])
def test_without_speculation_a_stopped_canvas_builds_no_further_step(stop_at):
    """speculate=False (a step whose build computes: Model.speculates) reads the stop
    flag before building: one decoder call fewer when a canvas stops early, and the
    same tokens, steps and random draws as the speculative loop."""
    cfg = DenoiseConfig(steps=6, t_min=None, t_max=None, stability_threshold=stop_at - 1,
                        confidence_threshold=0.005)
    runs = {}
    for speculate in (True, False):
        dec, draws = FakeDecoder(lambda i, c: peaked([1, 2, 3], 40.0)), RandomDraws(V, 7)
        res = denoise_canvas(dec, draws, 3, cfg, speculate=speculate)
        runs[speculate] = (res.steps, res.stopped_early, res.tokens.tolist(), len(dec.calls), np.array(draws.state()).tolist())
    assert runs[True][:3] == runs[False][:3] == (stop_at, True, [[1, 2, 3]])
    assert runs[True][3] == stop_at + 1 and runs[False][3] == stop_at
    assert runs[True][4] == runs[False][4]  # the speculative step's draws were rewound


def test_stop_rule_stable_and_confident():
    cfg = DenoiseConfig(steps=10, t_min=None, t_max=None, stability_threshold=1, confidence_threshold=0.005)
    res = denoise_canvas(FakeDecoder(lambda i, c: peaked([1, 2, 3], 40.0)), DebugDraws(V), 3, cfg)
    assert res.steps == 2 and res.stopped_early and res.tokens.tolist() == [[1, 2, 3]]
    cfg.stability_threshold = 3
    res = denoise_canvas(FakeDecoder(lambda i, c: peaked([1, 2, 3], 40.0)), DebugDraws(V), 3, cfg)
    assert res.steps == 4 and res.stopped_early
    # confident but the argmax keeps changing: runs every step, commits the last argmax
    res = denoise_canvas(FakeDecoder(lambda i, c: peaked([i % V, 2, 3], 40.0)), DebugDraws(V), 3,
                         DenoiseConfig(steps=5, t_min=None, t_max=None))
    assert res.steps == 5 and not res.stopped_early and res.tokens.tolist() == [[4, 2, 3]]
    # stable but not confident (flat logits)
    res = denoise_canvas(FakeDecoder(lambda i, c: peaked([1, 2, 3], 0.5)), DebugDraws(V), 3,
                         DenoiseConfig(steps=5, t_min=None, t_max=None))
    assert res.steps == 5 and not res.stopped_early


def test_debug_draw_count_matches_transformers_order():
    draws = DebugDraws(V)
    denoise_canvas(FakeDecoder(lambda i, c: peaked([1, 2], 40.0)), draws, 2,
                   DenoiseConfig(steps=6, t_min=None, t_max=None))
    assert draws.n == 1 + 2  # init + one renoise per step, including the stopping step
    denoise_canvas(FakeDecoder(lambda i, c: peaked([i, 2], 0.1)), draws, 2,
                   DenoiseConfig(steps=6, t_min=None, t_max=None))
    assert draws.n == 3 + 1 + 6  # ... and including the last step


def test_confidence_sampler_freezes_revealed_tokens():
    # step 0: position 0 is confident (token 7); 1 and 2 are not.
    # step 1: nothing unrevealed is confident -> fallback reveals the best one (2, token 12);
    #         position 0 now prefers token 8 but stays frozen at 7.
    # step 2: position 1 becomes confident (token 9) -> all revealed -> stop.
    def script(i, canvas):
        x = np.zeros((1, 3, V), np.float32)
        x[0, 0, 7 if i == 0 else 8] = 20.0
        x[0, 1, 9 if i == 2 else 4] = 20.0 if i == 2 else 1.0
        x[0, 2, 12] = 2.0
        return x

    dec = FakeDecoder(script)
    cfg = DenoiseConfig(steps=8, sampler=S.CONFIDENCE_THRESHOLD, threshold=0.9, t_min=None, t_max=None)
    res = denoise_canvas(dec, DebugDraws(V), 3, cfg)
    seen = [c[0].tolist()[0] for c in dec.calls]
    assert seen[1][0] == 7 and seen[2][0] == 7 and seen[2][2] == 12
    assert seen[1][1:] == S.debug_canvas_pattern(1, 3, V).tolist()[1:]  # unrevealed: renoised
    assert res.steps == 3 and res.stopped_early
    assert res.tokens.tolist() == [[8, 9, 12]]  # commit = the last step's argmax


def test_random_draws_seeded():
    a, b = RandomDraws(V, 3), RandomDraws(V, 3)
    assert a.canvas((1, 5)).tolist() == b.canvas((1, 5)).tolist()
    logits = mx.array(np.random.default_rng(1).normal(size=(1, 5, V)).astype(np.float32))
    assert a.sample(score(logits, 1.0), 1.0).tolist() == b.sample(score(logits, 1.0), 1.0).tolist()
    assert a.sample(score(logits, 1.0), 0.0).tolist() == mx.argmax(logits, -1).tolist()


def test_cancel_before_a_step():
    res = denoise_canvas(FakeDecoder(lambda i, c: peaked([1], 0.1)), DebugDraws(V), 1,
                         DenoiseConfig(steps=5), cancel=lambda: True)
    assert res.cancelled and res.steps == 0


# ---------------------------------------------------------------------------
# Thinking channel
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.builders import build_diffusion_gemma_tokenizer

    out = tmp_path_factory.mktemp("tok")
    build_diffusion_gemma_tokenizer(512, out)
    return AutoTokenizer.from_pretrained(str(out))


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_channel_parser_splits_reasoning(tokenizer):
    tok = tokenizer
    stream = [100] + ids(tok, "thought\nlet me see") + [101] + ids(tok, "The answer is 4.")
    parser = ChannelParser(tok)
    out_text, out_reason = [], []
    for i in range(0, len(stream), 5):  # canvases of 5 tokens
        t, r = parser.feed(stream[i:i + 5])
        out_text.append(t)
        out_reason.append(r)
    t, r = parser.flush()
    assert "".join(out_text) + t == "The answer is 4."
    assert "".join(out_reason) + r == "let me see"


def test_channel_parser_keeps_tool_tokens_and_prompt_state(tokenizer):
    tok = tokenizer
    parser = ChannelParser(tok)
    text, _ = parser.feed([48] + ids(tok, "call") + [49])
    assert text == "<|tool_call>call<tool_call|>"
    # a prompt that ends inside an open channel starts the output as reasoning
    parser = ChannelParser(tok, prompt_ids=[2, 105] + [100] + ids(tok, "thought\n"))
    t, r = parser.feed(ids(tok, "hmm") + [101] + ids(tok, "ok"))
    assert (t, r) == ("ok", "hmm") and parser.flush() == ("", "")
    parser = ChannelParser(tok, prompt_ids=[2, 105, 100])
    t, r = parser.feed(ids(tok, "thought\nhmm") + [101] + ids(tok, "ok"))
    assert (t, r) == ("ok", "hmm")


def test_channel_marker_quoted_by_the_user_does_not_start_reasoning(tokenizer):
    tok = tokenizer
    # <bos><|turn>user\n ... <|channel> ... <turn|>\n<|turn>model\n
    prompt = [2, 105] + ids(tok, "user\nwhat is ") + [100] + [106] + ids(tok, "\n") + [105] + ids(tok, "model\n")
    parser = ChannelParser(tok, prompt_ids=prompt)
    t, r = parser.feed(ids(tok, "an answer"))
    assert (t, r) == ("an answer", "")

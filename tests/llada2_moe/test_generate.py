"""LLaDA-2 block unmasking: the MLX loop vs the reference hub generate()."""

import numpy as np
import pytest
import torch

from dlm.runtime.models.llada2_moe import generate as G
from dlm.runtime.platform.errors import GenerationError
from dlm.runtime.loader import load
from dlm.runtime.models.llada2_moe import FAMILY
from dlm.runtime.registry import settings as family_settings
from dlm.verify.llada2_moe import torch_generate as RG
from tests.builders import LLADA2_EOS_ID, LLADA2_GEOMETRIES, LLADA2_MASK_ID, LLADA2_ROLE_END_ID, build_llada2

torch.set_num_threads(1)


@pytest.fixture(scope="module", params=sorted(LLADA2_GEOMETRIES))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"gen_{request.param}")
    ref = build_llada2(path, request.param)
    return ref, load(path)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen_base")
    ref = build_llada2(path, "base")
    return ref, load(path)


def prompt(n, seed=0):
    return np.random.RandomState(seed).randint(0, 240, n).tolist()


def settings(**kw):
    base = dict(mask_token_id=LLADA2_MASK_ID, eos_token_ids=(LLADA2_EOS_ID,), editing_threshold=None,
                stop_on_role_end=False)
    base.update(kw)
    return G.Settings(**base)


def run_mlx(loaded, ids, s):
    s.trace = []
    events = list(G.stream_generate(loaded, ids, s))
    tokens = [t for e in events[:-1] for t in e.token_ids]
    return tokens, s.trace, events


def run_ref(ref, ids, *, gen, bl, steps, thr, temp=0.0, hub=False, seed=None, eos=(LLADA2_EOS_ID,),
            early_stop=False, **kw):
    trace = []
    out = RG.generate(
        ref, torch.tensor(ids), temperature=temp, block_length=bl, steps=steps, gen_length=gen,
        threshold=thr, eos_id=list(eos), mask_id=LLADA2_MASK_ID, hub_sampler=hub,
        uniforms=G.UniformStream(seed) if seed is not None else None, suppress_mask=True,
        trace=trace, early_stop=early_stop, **kw,
    ).tolist()
    eos = set(eos)
    return [t for t in out if t not in eos], trace


# (prompt length, max tokens, block length, steps, threshold): prompts that are
# and are not multiples of the block, steps below / equal / above the block.
GREEDY_CASES = [(11, 64, 16, 16, 0.9), (5, 40, 8, 3, 0.8), (16, 48, 16, 4, 0.95), (21, 50, 32, 64, 0.7)]


@pytest.mark.parametrize("case", GREEDY_CASES)
def test_greedy_commit_stream_identical_to_reference(tiny, case):
    ref, loaded = tiny
    P, gen, bl, steps, thr = case
    ids = prompt(P, P)
    want, want_trace = run_ref(ref, ids, gen=gen, bl=bl, steps=steps, thr=thr)
    s = settings(max_tokens=gen, block_length=bl, steps=steps, threshold=thr, early_stop=False)
    got, got_trace, events = run_mlx(loaded, ids, s)
    assert got_trace == want_trace  # every step commits the same positions with the same tokens
    assert got == want
    if events[-1].finish_reason == "length":
        assert len(got) == gen
        # One event per block, in sequence order, covering exactly the budget.
        assert len(events) - 1 == -(-(P + gen) // bl) - P // bl
    else:
        assert events[-1].finish_reason == "stop" and len(got) < gen


def test_kv_cached_loop_identical_to_full_recomputation(tiny):
    _, loaded = tiny
    ids = prompt(13, 1)
    cached = settings(max_tokens=70, block_length=16, steps=8, threshold=0.85)
    full = settings(max_tokens=70, block_length=16, steps=8, threshold=0.85, kv_cache=False)
    a, trace_a, ev_a = run_mlx(loaded, ids, cached)
    b, trace_b, ev_b = run_mlx(loaded, ids, full)
    assert a == b and trace_a == trace_b
    assert ev_a[-1].stats.forwards == ev_b[-1].stats.forwards


def test_early_block_stop_keeps_the_output(base):
    """dlm ends a block once its output is final; the tokens equal the hub's."""
    ref, loaded = base
    ids = prompt(9, 2)
    want, _ = run_ref(ref, ids, gen=45, bl=16, steps=16, thr=0.9)
    got, _, events = run_mlx(loaded, ids, settings(max_tokens=45, block_length=16, steps=16, threshold=0.9))
    assert got == want
    late, late_trace = run_ref(ref, ids, gen=45, bl=16, steps=16, thr=0.9, early_stop=True)
    assert late == want
    assert sum(events[-1].stats.steps_per_block) == len(late_trace)


@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_head_runs_on_the_masked_positions_only(base, monkeypatch, temp):
    """Each step's head (and sampler) sees the block's masked positions only;
    the run equals the hub's, and the whole-block run (``on_step`` asks for
    every position), step for step."""
    ref, loaded = base
    ids = prompt(13, 6)
    rows = []
    head = loaded.model.head
    monkeypatch.setattr(loaded.model, "head", lambda h: rows.append(h.shape[1]) or head(h))
    kw = dict(max_tokens=35, block_length=16, steps=16, threshold=0.9, seed=5, temperature=temp)
    got, trace, _ = run_mlx(loaded, ids, settings(**kw))
    # Before each step: the block's generated positions (from 13) not yet revealed.
    masked, block = [], None
    for b, _, positions, _ in trace:
        if b != block:
            block, left = b, 16 - max(13 - 16 * b, 0)
        masked.append(left)
        left -= len(positions)
    assert rows == masked and rows[0] == 3 and min(rows) < 16 and max(rows) == 16
    rows.clear()
    full, full_trace, _ = run_mlx(loaded, ids, settings(**kw, on_step=lambda *a: None))
    assert set(rows) == {16} and len(rows) == len(trace)
    assert full == got and full_trace == trace
    want, want_trace = run_ref(ref, ids, gen=35, bl=16, steps=16, thr=0.9, temp=temp, seed=5, early_stop=True)
    assert got == want and trace == want_trace


def test_eos_mid_block_stops_after_that_block(base):
    ref, loaded = base
    ids = prompt(10, 4)
    free, _ = run_ref(ref, ids, gen=64, bl=16, steps=16, thr=0.9)
    # Use as EOS the token the model commits at generated position 20 (mid
    # second block), first occurrence.
    eos = free[20]
    first = free.index(eos)
    want, want_trace = run_ref(ref, ids, gen=64, bl=16, steps=16, thr=0.9, eos=(eos,))
    assert want == free[:first]
    s = settings(max_tokens=64, block_length=16, steps=16, threshold=0.9, eos_token_ids=(eos,),
                 early_stop=False)
    got, got_trace, events = run_mlx(loaded, ids, s)
    assert got == want and got_trace == want_trace
    assert events[-1].finish_reason == "stop"
    assert all(eos not in e.token_ids for e in events)
    last_block = (10 + first) // 16
    assert len(events) - 1 == last_block - 10 // 16 + 1  # nothing after the EOS block


@pytest.mark.parametrize("steps", [1, 4, 8, 32, 64])
def test_no_mask_token_in_any_output(base, steps):
    ref, loaded = base
    ids = prompt(7, steps)
    s = settings(max_tokens=61, block_length=32, steps=steps, threshold=0.95)
    got, _, events = run_mlx(loaded, ids, s)
    assert len(got) == 61 and LLADA2_MASK_ID not in got
    assert all(n <= min(steps, 61) for n in events[-1].stats.steps_per_block)
    want, _ = run_ref(ref, ids, gen=61, bl=32, steps=steps, thr=0.95)
    assert got == want


def test_mask_token_is_never_sampled(base):
    """Even when the model prefers the mask id, it is never committed."""
    ref, loaded = base
    import mlx.core as mx

    head = loaded.model.lm_head.weight
    loaded.model.lm_head.weight = mx.concatenate([head[: LLADA2_MASK_ID], head[LLADA2_MASK_ID:] * 0 + 5.0])
    try:
        got, _, _ = run_mlx(loaded, prompt(5), settings(max_tokens=20, block_length=8, steps=2))
    finally:
        loaded.model.lm_head.weight = head
    assert len(got) == 20 and LLADA2_MASK_ID not in got


@pytest.mark.parametrize("temp, top_p, top_k", [(1.0, None, None), (0.7, 0.9, None), (1.3, None, 20)])
def test_seeded_sampling_matches_reference_through_shared_uniforms(base, temp, top_p, top_k):
    ref, loaded = base
    ids = prompt(11, 7)
    want, want_trace = run_ref(ref, ids, gen=40, bl=16, steps=8, thr=0.9, temp=temp, seed=5,
                               top_p=top_p, top_k=top_k)
    s = settings(max_tokens=40, block_length=16, steps=8, threshold=0.9, temperature=temp, seed=5,
                 top_p=top_p, top_k=top_k, early_stop=False)
    got, got_trace, _ = run_mlx(loaded, ids, s)
    assert got == want and got_trace == want_trace
    if temp >= 1:  # hot enough that another seed draws other tokens
        other, _, _ = run_mlx(loaded, ids, settings(max_tokens=40, block_length=16, steps=8, threshold=0.9,
                                                    temperature=temp, seed=6, top_p=top_p, top_k=top_k))
        assert other != got


def test_reference_sampling_reproduces_hub_temperature_zero(base):
    """--reference-sampling: temperature 0 still samples (hub 2.0)."""
    ref, loaded = base
    ids = prompt(6, 8)
    want, want_trace = run_ref(ref, ids, gen=32, bl=16, steps=16, thr=0.95, hub=True, seed=3)
    greedy, _ = run_ref(ref, ids, gen=32, bl=16, steps=16, thr=0.95)
    s = settings(max_tokens=32, block_length=16, steps=16, reference_sampling=True, seed=3, early_stop=False)
    got, got_trace, _ = run_mlx(loaded, ids, s)
    assert got == want and got_trace == want_trace
    assert got != greedy


def test_linear_threshold_schedule_matches_reference(base):
    ref, loaded = base
    ids = prompt(12, 9)
    want, want_trace = run_ref(ref, ids, gen=48, bl=16, steps=8, thr=0.99, min_threshold=0.4)
    s = settings(max_tokens=48, block_length=16, steps=8, threshold=0.99, min_threshold=0.4, early_stop=False)
    got, got_trace, _ = run_mlx(loaded, ids, s)
    assert got == want and got_trace == want_trace
    const, _ = run_ref(ref, ids, gen=48, bl=16, steps=8, thr=0.99)
    assert const != want


@pytest.mark.parametrize("edit_thr", [0.5, 0.0])
def test_llada21_editing_matches_reference(tiny, edit_thr):
    ref, loaded = tiny
    ids = prompt(9, 11)
    want, want_trace = run_ref(ref, ids, gen=40, bl=16, steps=16, thr=0.9, editing_threshold=edit_thr,
                               max_post_steps=4)
    s = settings(max_tokens=40, block_length=16, steps=16, threshold=0.9, editing_threshold=edit_thr,
                 max_post_steps=4)
    got, got_trace, events = run_mlx(loaded, ids, s)
    assert got == want and got_trace == want_trace
    assert LLADA2_MASK_ID not in got and len(got) == 40


def test_editing_defaults_on_for_llada21_only(base, tmp_path):
    _, loaded = base
    assert not G.is_llada21(loaded)
    import dataclasses

    renamed = dataclasses.replace(loaded, path=tmp_path / "LLaDA2.1-mini-4bit")
    assert G.is_llada21(renamed)
    # A 2.0 directory whose name only looks like it ("llada2-1L": a 1-layer build) is 2.0.
    assert not G.is_llada21(dataclasses.replace(loaded, path=tmp_path / "llada2-1L-q4"))
    loop = G.BlockSession(renamed, [1, 2], settings(editing_threshold="auto"), None)
    assert loop.editing == G.EDITING_THRESHOLD_21
    loop = G.BlockSession(loaded, [1, 2], settings(editing_threshold="auto"), None)
    assert loop.editing is None


@pytest.mark.parametrize("max_tokens", [1, 5, 37])
def test_max_tokens_exact(base, max_tokens):
    _, loaded = base
    got, _, events = run_mlx(loaded, prompt(3), settings(max_tokens=max_tokens, block_length=8, steps=8))
    assert len(got) == max_tokens and events[-1].finish_reason == "length"
    assert events[-1].stats.completion_tokens == max_tokens


def test_text_is_streamed_block_by_block_and_role_end_stops(base):
    """The tokenizer's <|role_end|> (end of a chat turn) also stops generation."""
    ref, loaded = base
    ids = prompt(8, 12)
    free, _ = run_ref(ref, ids, gen=48, bl=16, steps=16, thr=0.9)
    events = list(G.stream_generate(loaded, ids, settings(max_tokens=48, block_length=16, steps=16,
                                                          threshold=0.9, stop_on_role_end=True)))
    text = "".join(e.text for e in events)
    assert text == loaded.tokenizer.decode([t for e in events for t in e.token_ids], skip_special_tokens=True)
    stop = G.stop_ids(loaded, settings(stop_on_role_end=True))
    assert stop == {LLADA2_EOS_ID, LLADA2_ROLE_END_ID}
    tokens = [t for e in events[:-1] for t in e.token_ids]
    cut = next((i for i, t in enumerate(free) if t in stop), len(free))
    assert tokens == free[:cut]


def test_cancel_is_polled_per_step(base):
    _, loaded = base
    calls = []

    def cancel():
        calls.append(1)
        return len(calls) > 3

    events = list(G.stream_generate(loaded, prompt(4), settings(max_tokens=64, block_length=16, steps=16,
                                                                threshold=1.0), cancel))
    assert events[-1].finish_reason == "cancelled"
    assert events[-1].stats.forwards == 3


def test_stats_count_forwards(base):
    _, loaded = base
    got, _, events = run_mlx(loaded, prompt(20), settings(max_tokens=44, block_length=16, steps=16))
    st = events[-1].stats
    assert st.forwards == sum(st.steps_per_block) and st.prompt_tokens == 20
    assert st.tokens_per_forward == pytest.approx(44 / st.forwards)


# -- settings ------------------------------------------------------------------------


class _Args:
    mask_token_id, eos_token_ids, vocab_size = 255, [252], 256
    block_routing = False  # LLaDA2.0/2.1


def test_settings_from_options_defaults_and_flags():
    s = family_settings(FAMILY, {"temp": 0.5, "top_p": 0.9, "max_denoising_steps": 8, "block_length": 16,
                                 "threshold": 0.8, "threshold_schedule": "linear:0.3",
                                 "editing_threshold": 0.7, "diffusion_full_canvas": False,
                                 "enable_thinking": None}, _Args, {"eos_token_id": [252, 7]})
    assert (s.temperature, s.top_p, s.steps, s.block_length, s.threshold) == (0.5, 0.9, 8, 16, 0.8)
    assert s.min_threshold == 0.3 and s.editing_threshold == 0.7 and s.eos_token_ids == (252, 7)
    d = family_settings(FAMILY, {}, _Args, {})
    assert (d.block_length, d.steps, d.threshold, d.temperature, d.editing_threshold) == (32, 32, 0.95, 0.0, "auto")
    assert d.min_threshold is None
    assert family_settings(FAMILY, {"threshold_schedule": "linear"}, _Args, {}).min_threshold == 0.5


@pytest.mark.parametrize(
    "options, message",
    [
        ({"draft_model": "x"}, "--draft-model"),
        ({"image": ["a.png"]}, "text-only"),
        ({"video": "v.mp4"}, "--video"),
        ({"diffusion_sampler": "entropy-bound"}, "--diffusion-sampler does not apply to LLaDA-2"),
        ({"diffusion_threshold": 0.5}, "--diffusion-threshold"),
        ({"diffusion_full_canvas": True}, "--diffusion-full-canvas"),
        ({"debug_canvas": True}, "--debug-canvas"),
        ({"frobnicate": 3}, "frobnicate"),
        ({"threshold_schedule": "cosine"}, "--threshold-schedule"),
        ({"threshold_schedule": "linear:0.99", "threshold": 0.9}, "floor"),
        ({"threshold": 1.5}, "--threshold"),
        ({"top_p": 0.0}, "--top-p"),
        ({"block_length": 0}, "--block-length"),
        ({"max_denoising_steps": 0}, "--max-denoising-steps"),
        ({"editing_threshold": 2.0}, "--editing-threshold"),
    ],
)
def test_settings_errors(options, message):
    with pytest.raises(GenerationError, match=message):
        family_settings(FAMILY, options, _Args, {})


def test_transfer_quota():
    assert G.transfer_quota(32, 8) == [4] * 8
    assert G.transfer_quota(32, 12) == [3] * 8 + [2] * 4
    assert G.transfer_quota(8, 12) == [1] * 8 + [0] * 4
    assert G.transfer_quota(32, 12) == RG.transfer_quota(32, 12)

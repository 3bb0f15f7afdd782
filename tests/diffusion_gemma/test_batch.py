"""DiffusionGemma batched canvases: every request in a batch gets exactly what it
gets alone (token ids, canvases, steps, stops, text), for mixed prompt lengths,
settings, early stops, EOS, cancellation and requests joining mid-way."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dlm.runtime import api  # before MLX: dlm.runtime loads the optimized BLAS ahead of it

import mlx.core as mx  # noqa: E402  (isort: skip)
from dlm.runtime.batch import Batcher
from dlm.runtime.models.cpu import experts as cpu_experts
from dlm.runtime.models.diffusion_gemma import batch as dg_batch
from tests import ROOT

SHORT = list(range(2, 14))
LONG = [2] + [(7 * i + 3) % 500 + 5 for i in range(27)]  # 28 tokens > sliding window 16
PROMPTS = [SHORT, LONG, [2, 7, 9, 11, 13], list(range(40, 80)), SHORT]
OPTIONS = [
    {"max_tokens": 24, "max_denoising_steps": 4, "seed": 1},
    {"max_tokens": 13, "max_denoising_steps": 3, "seed": 2, "diffusion_min_canvas_length": 2},
    {"max_tokens": 21, "max_denoising_steps": 5, "debug_canvas": True, "diffusion_full_canvas": True},
    {"max_tokens": 16, "diffusion_sampler": "confidence-threshold", "diffusion_threshold": 0.5, "seed": 5,
     "temp": 0.5, "diffusion_max_canvas_length": 4, "diffusion_min_canvas_length": 3},
    {"max_tokens": 20, "max_denoising_steps": 2, "seed": 1, "temp": 0.0},
]


def summary(result):
    s = result.stats
    return (result.token_ids, result.blocks, result.text, result.reasoning, result.finish_reason,
            s.steps_per_block, s.forwards, s.early_stops, s.completion_tokens, s.prompt_tokens)


def solo(loaded, prompts, options, cancel=None):
    cancel = cancel or [None] * len(prompts)
    return [summary(api.generate(loaded, p, o, c)) for p, o, c in zip(prompts, options, cancel)]


@pytest.fixture
def group_sizes(monkeypatch):
    """The batch sizes of the batched decoder forwards that ran."""
    sizes = []
    real = dg_batch._decode_group

    def counting(model, canvases, *args):
        sizes.append(len(canvases))
        return real(model, canvases, *args)

    monkeypatch.setattr(dg_batch, "_decode_group", counting)
    return sizes


@pytest.fixture
def kind_sizes(monkeypatch):
    """How many requests each merged step build (batch.build) took."""
    sizes = []
    real = dg_batch.build

    def counting(members, logits):
        sizes.append(len(members))
        return real(members, logits)

    monkeypatch.setattr(dg_batch, "build", counting)
    return sizes


@pytest.fixture
def encode_sizes(monkeypatch):
    """The batch sizes of the batched re-encodes of committed canvases that ran."""
    sizes = []
    real = dg_batch._encode_group

    def counting(model, canvases, caches):
        sizes.append(len(canvases))
        return real(model, canvases, caches)

    monkeypatch.setattr(dg_batch, "_encode_group", counting)
    return sizes


@pytest.fixture(scope="module")
def loaded(tiny_dg_mlx_dir):
    return api.load(tiny_dg_mlx_dir)


def test_mixed_prompts_and_settings_equal_solo(loaded, group_sizes):
    want = solo(loaded, PROMPTS, OPTIONS)
    got = [summary(r) for r in api.generate_batch(loaded, PROMPTS, OPTIONS)]
    assert got == want
    assert max(group_sizes) >= 3  # canvases really shared forwards
    assert {len(b) for r in want for b in r[1]} == {4, 5, 8}  # canvases of three lengths ran together


def test_every_step_logits_equal_solo_bitwise(loaded, group_sizes, encode_sizes):
    """The float32 logits of every step are the solo ones to the last bit (a merged
    GEMM over the batch's rows would differ here: canvases of 5 and 7 positions),
    with the committed canvases of one length re-encoded in one forward (their
    prompts of 12, 28, 3, 19 and 9 tokens: caches of different lengths)."""
    prompts = [SHORT, LONG, SHORT[:3], LONG[:19], SHORT, LONG[:9]]
    options = [{"max_tokens": 15, "max_denoising_steps": 3, "seed": i, "diffusion_max_canvas_length": n,
                "diffusion_min_canvas_length": 2} for i, n in enumerate([5, 5, 5, 7, 7, 8])]
    assert_step_logits_equal_solo(loaded, prompts, options)
    assert max(group_sizes) == 3 and max(encode_sizes) == 3


def test_numpy_vocabulary_rows_equal_solo(loaded, group_sizes, monkeypatch):
    """The CPU backend's numpy path for the softcap and the scores (cpu/vocab.py,
    taken at the released geometry) forced at every size: batched requests still
    get their solo commit streams, and every step's logits to the last bit."""
    from dlm.runtime.models.cpu import vocab as cpu_vocab

    calls = []
    real = cpu_vocab.score_rows
    monkeypatch.setattr(cpu_vocab, "score_rows", lambda *a: calls.append(a[0].shape) or real(*a))
    monkeypatch.setenv("DLM_CPU_VOCAB", "numpy")
    prompts = PROMPTS + [LONG[:11], SHORT[:6]]
    options = OPTIONS + [{**OPTIONS[0], "seed": s} for s in (7, 8)]  # three of one kind: merged step builds
    want = solo(loaded, prompts, options)
    got = [summary(r) for r in api.generate_batch(loaded, prompts, options)]
    assert got == want and max(group_sizes) >= 3
    assert any(len(shape) == 3 and shape[0] == 3 for shape in calls)  # merged canvases went through numpy
    assert_step_logits_equal_solo(loaded, PROMPTS[:3], OPTIONS[:3])


def test_vocabulary_path_is_chosen_per_sequence(loaded, group_sizes, monkeypatch):
    """cpu_vocab's numpy-or-MLX choice goes by one sequence's size: with the
    threshold between one canvas's logits and a batch's (as at the released
    geometry, where a canvas of 8 stays in MLX and four of them would not),
    a batch of short canvases stays on the path each takes alone, bit for bit."""
    from dlm.runtime.models.cpu import vocab as cpu_vocab

    vocab = loaded.args.vocab_size
    monkeypatch.setattr(cpu_vocab, "MIN_ENTRIES", 10 * vocab)  # one canvas of 8: MLX; three: would be numpy
    taken = []
    real = cpu_vocab.softcap
    monkeypatch.setattr(cpu_vocab, "softcap", lambda x, cap: taken.append(x.shape) or real(x, cap))
    prompts = [SHORT, LONG, SHORT[:5]]
    options = [{"max_tokens": 16, "max_denoising_steps": 3, "seed": i, "diffusion_max_canvas_length": 8,
                "diffusion_min_canvas_length": 8} for i in range(3)]
    assert_step_logits_equal_solo(loaded, prompts, options)
    assert max(group_sizes) == 3 and not taken


def assert_step_logits_equal_solo(loaded, prompts, options):
    def recorder(out):
        return lambda step, logits, argmax: out.append(np.array(logits))

    want = [[] for _ in prompts]
    for p, o, w in zip(prompts, options, want):
        api.generate(loaded, p, o, on_step=recorder(w))
    got = [[] for _ in prompts]
    batcher = Batcher(loaded)
    for i, (p, o) in enumerate(zip(prompts, options)):
        batcher.add(p, o, key=i).session.on_step = recorder(got[i])
    list(batcher.run())
    assert [len(g) for g in got] == [len(w) for w in want] and sum(map(len, want)) >= 12
    for g, w in zip(got, want):
        assert all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(g, w))


@pytest.fixture(scope="module")
def stopping(loaded):
    """Sharp logits (t = 0.05) and the confidence rule alone (stability 0): canvases
    stop after 1 to 5 steps, and some runs meet an EOS."""
    config = {**loaded.generation_config, "t_min": 0.05, "t_max": 0.05, "stability_threshold": 0,
              "confidence_threshold": 2.3}
    return dataclasses.replace(loaded, generation_config=config)


def test_early_stops_and_eos_equal_solo(stopping, group_sizes, kind_sizes):
    prompts = [list(range(2, 14 + i)) for i in range(5)]
    options = [{"max_tokens": 48, "max_denoising_steps": 8, "seed": 10 + i} for i in range(5)]
    want = solo(stopping, prompts, options)
    assert {r[4] for r in want} == {"stop", "length"}  # EOS ended some runs, not all
    assert len({s for r in want for s in r[5]}) >= 4 and all(r[7] for r in want)  # early stops, varied
    got = [summary(r) for r in api.generate_batch(stopping, prompts, options)]
    assert got == want
    assert max(group_sizes) == 5
    assert max(kind_sizes) == 5  # the five requests' steps were built as one (build_steps)


def test_canvases_at_different_steps_share_a_build(stopping, monkeypatch):
    """Early stops put the requests' canvases at different steps of the schedule
    (t_min != t_max: each its own temperature); their steps are still built as
    one (a temperature per row), and each request gets what it gets alone."""
    phases = []
    real = dg_batch.build

    def recording(members, logits):
        phases.append({m.inputs[3] for m in members})
        return real(members, logits)

    monkeypatch.setattr(dg_batch, "build", recording)
    scheduled = dataclasses.replace(stopping, generation_config={**stopping.generation_config,
                                                                 "t_min": 0.04, "t_max": 0.08})
    prompts = [list(range(2, 14 + i)) for i in range(4)]
    options = [{"max_tokens": 40, "max_denoising_steps": 8, "seed": 20 + i} for i in range(4)]
    want = solo(scheduled, prompts, options)
    assert all(r[7] for r in want)  # early stops
    got = [summary(r) for r in api.generate_batch(scheduled, prompts, options)]
    assert got == want
    assert max(len(p) for p in phases) >= 3  # one build held canvases at three different steps


def test_trained_demo_model_equal_solo(group_sizes):
    """A trained model: the stable-and-confident rule ends canvases early, EOS ends runs."""
    demo = api.load(ROOT / "demo" / "diffusion_gemma_sort")
    texts = ["sort 3 1 2", "sort 9 4 7 1 5 3", "sort 5", "sort 8 6 4 2 0 9 7"]
    prompts = [api.encode_prompt(demo, t) for t in texts]
    options = [{"max_tokens": 32, "seed": i} for i in range(3)] + [{"max_tokens": 32, "debug_canvas": True}]
    want = solo(demo, prompts, options)
    assert any(r[7] for r in want) and any(r[4] == "stop" for r in want)
    assert [summary(r) for r in api.generate_batch(demo, prompts, options)] == want


def polls_then_cancel(n):
    calls = {"n": 0}

    def cancel():
        calls["n"] += 1
        return calls["n"] > n

    return cancel


def test_cancelling_one_request_leaves_the_others_alone(loaded):
    options = [{"max_tokens": 64, "max_denoising_steps": 4, "seed": i} for i in range(3)]
    prompts = [SHORT, LONG, SHORT]
    want = solo(loaded, prompts, options, [None, polls_then_cancel(6), None])
    assert want[1][4] == "cancelled" and len(want[1][1]) == 1 and want[1][6] == 6
    got = api.generate_batch(loaded, prompts, options, cancel=[None, polls_then_cancel(6), None])
    assert [summary(r) for r in got] == want
    assert "cancelled" not in (want[0][4], want[2][4]) and min(len(want[0][0]), len(want[2][0])) > 8


def test_requests_join_mid_way_and_wait_for_room(loaded, group_sizes):
    prompts = PROMPTS[:4]
    options = [dict(o, max_tokens=24) for o in OPTIONS[:4]]
    want = solo(loaded, prompts, options)
    batcher = Batcher(loaded, max_batch=2)
    entries = [batcher.add(p, o, key=i) for i, (p, o) in enumerate(zip(prompts[:3], options[:3]))]
    events = {i: [] for i in range(4)}
    for _ in range(5):  # a few steps with two running and one waiting for room
        for entry, event in batcher.step():
            events[entry.key].append(event)
        assert len(batcher.active) == 2 and len(batcher.waiting) == 1
    entries.append(batcher.add(prompts[3], options[3], key=3))  # joins once there is room
    for entry, event in batcher.run():
        events[entry.key].append(event)
    got = []
    for i in range(4):
        result = api.GenerationResult()
        for event in events[i]:
            api._take(result, event)
        got.append(summary(result))
    assert got == want
    assert all(e.done for e in entries) and max(group_sizes) == 2


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the grouped kernels are the CPU backend's")
@pytest.mark.parametrize("mode,rows_per_expert", [("", 6), ("each", 4), ("each", 5)],
                         ids=["by-count", "by-expert-alone", "gather-alone"])
def test_grouped_cpu_experts_per_sequence(tiny_dg_mlx_dir, monkeypatch, mode, rows_per_expert, group_sizes):
    """CPU float experts run by copy count (8 positions x top-2 over 4 experts: 16
    copies a canvas). One expert at a time (as experts dequantized per call run)
    they run when one canvas routes enough rows per expert: at 4 each canvas runs
    that way alone; at 5 it runs gather_mm alone although the batch's 64 copies
    would pass. Every way the batch runs each canvas as it runs alone."""
    monkeypatch.setattr(cpu_experts, "GROUPED_MIN_WEIGHT", 1)
    monkeypatch.setattr(cpu_experts, "GROUPED_MIN_ROWS_PER_EXPERT", rows_per_expert)
    monkeypatch.setenv("DLM_CPU_EXPERTS", mode)
    fresh = api.load(tiny_dg_mlx_dir)  # compiled pieces follow the policy of their first use
    experts = fresh.model.layers[0].experts
    assert experts.eager and cpu_experts.stacks(experts.gate_up_proj) == (mode == "")
    assert cpu_experts.grouped(16, 4, experts.gate_up_proj) == (rows_per_expert == 4)
    options = [{"max_tokens": 16, "max_denoising_steps": 3, "seed": i} for i in range(4)]
    prompts = [SHORT, LONG, SHORT[:5], LONG[:20]]
    want = solo(fresh, prompts, options)
    assert [summary(r) for r in api.generate_batch(fresh, prompts, options)] == want
    assert_step_logits_equal_solo(fresh, prompts, options)
    assert max(group_sizes) == 4


def test_bad_request_names_the_prompt(loaded):
    from dlm.runtime.platform.errors import GenerationError

    with pytest.raises(GenerationError, match="prompt 1: .*--top-k does not apply"):
        api.generate_batch(loaded, [SHORT, SHORT], [{}, {"top_k": 3}])
    with pytest.raises(GenerationError, match="2 prompts need as many options"):
        api.generate_batch(loaded, [SHORT, SHORT], [{}])


def test_a_failing_request_leaves_the_others_alone(loaded):
    prompts, options = PROMPTS[:3], OPTIONS[:3]
    want = solo(loaded, prompts, options)
    batcher = Batcher(loaded)
    entries = [batcher.add(p, o, key=i) for i, (p, o) in enumerate(zip(prompts, options))]

    def broken():
        raise RuntimeError("prefill failed")

    entries[1].session.prefill = broken
    events = {0: [], 2: []}
    while not batcher.idle:
        for entry, event in batcher.step():
            events[entry.key].append(event)
    assert [(e.key, str(exc)) for e, exc in batcher.failed] == [(1, "prefill failed")]
    for i in (0, 2):
        result = api.GenerationResult()
        for event in events[i]:
            api._take(result, event)
        assert summary(result) == want[i]


def test_prompts_with_images_equal_solo(tiny_dg_vision_mlx_dir, group_sizes):
    from PIL import Image

    vision = api.load(tiny_dg_vision_mlx_dir)
    pictures = [Image.new("RGB", (40, 28), (230, 180, 30)), Image.new("RGB", (24, 36), (20, 90, 200))]
    prompts = [api.encode_inputs(vision, "What is this?", images=pictures[:1]),
               api.encode_prompt(vision, "No picture here."),
               api.encode_inputs(vision, "And these two?", images=pictures)]
    assert prompts[0].image_tokens and prompts[2].image_tokens > prompts[0].image_tokens
    options = [{"max_tokens": 16, "max_denoising_steps": 3, "seed": i} for i in range(3)]
    want = solo(vision, prompts, options)
    assert [summary(r) for r in api.generate_batch(vision, prompts, options)] == want
    assert max(group_sizes) == 3


def test_the_memory_budget_bounds_the_batch(loaded, group_sizes):
    """Room for two requests' estimates: the others wait for one to end."""
    batcher = Batcher(loaded)
    each = batcher.add(SHORT, OPTIONS[0]).memory
    prompts = [SHORT, LONG[:12], SHORT[:10], LONG[:11]]  # equal estimates (prompt + budget alike)
    options = [{"max_tokens": 24, "max_denoising_steps": 3, "seed": i} for i in range(4)]
    want = solo(loaded, prompts, options)
    got = api.generate_batch(loaded, prompts, options, memory_budget=2.5 * each / 1e9)
    assert [summary(r) for r in got] == want
    assert max(group_sizes) == 2


def test_no_step_is_sat_out_between_canvases(loaded):
    """The next canvas is built in the very step whose read ends the last one
    (Batcher renew), as alone it follows at once: a request's steps are its
    forwards plus the one that reads its last canvas."""
    batcher = Batcher(loaded)
    batcher.add(SHORT, {"max_tokens": 24, "max_denoising_steps": 4, "seed": 1, "diffusion_max_canvas_length": 8})
    steps, events = 0, []
    while not batcher.idle:
        events += batcher.step()
        steps += 1
    stats = events[-1][1].stats
    assert len(stats.steps_per_block) == 3 and stats.forwards == sum(stats.steps_per_block)
    assert steps == stats.forwards + 1

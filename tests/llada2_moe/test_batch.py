"""LLaDA-2 batched blocks: every request in a batch gets exactly what it gets
alone (token ids, blocks, steps, stops, text, every step's logits), for mixed
prompt lengths, block lengths, samplers, 2.1 editing, EOS, cancellation and
requests joining mid-way."""

from __future__ import annotations

import numpy as np
import pytest

from dlm.runtime import api  # before MLX: dlm.runtime loads the optimized BLAS ahead of it
from dlm.runtime.batch import Batcher
from dlm.runtime.models.cpu import experts as cpu_experts
from dlm.runtime.models.llada2_moe import batch as ll_batch
from tests import ROOT

import mlx.core as mx  # noqa: E402  (isort: skip)


def ids(n, seed=0):
    return np.random.RandomState(seed).randint(0, 240, n).tolist()


PROMPTS = [ids(17, 0), ids(67, 1), ids(4, 2), ids(32, 3), ids(17, 4)]
OPTIONS = [
    {"max_tokens": 40, "seed": 1, "block_length": 8, "max_denoising_steps": 4},
    {"max_tokens": 33, "seed": 2, "temp": 0.7, "top_k": 20, "block_length": 8},
    {"max_tokens": 20, "block_length": 4, "threshold": 0.5},
    {"max_tokens": 50, "seed": 3, "temp": 1.0, "top_p": 0.9, "editing_threshold": 0.5, "block_length": 8},
    {"max_tokens": 40, "seed": 4, "threshold_schedule": "linear", "block_length": 16, "max_denoising_steps": 8},
]


def summary(result):
    s = result.stats
    return (result.token_ids, result.blocks, result.text, result.finish_reason, s.steps_per_block,
            s.forwards, s.early_stops, s.completion_tokens)


def solo(loaded, prompts, options, cancel=None):
    cancel = cancel or [None] * len(prompts)
    return [summary(api.generate(loaded, p, o, c)) for p, o, c in zip(prompts, options, cancel)]


@pytest.fixture
def group_sizes(monkeypatch):
    sizes = []
    real = ll_batch.forward

    def counting(model, ids, *args):
        sizes.append(ids.shape[0])
        return real(model, ids, *args)

    monkeypatch.setattr(ll_batch, "forward", counting)
    return sizes


@pytest.fixture(scope="module")
def loaded(tiny_llada2_mlx_dir):
    return api.load(tiny_llada2_mlx_dir)


def test_mixed_prompts_and_settings_equal_solo(loaded, group_sizes):
    want = solo(loaded, PROMPTS, OPTIONS)
    assert any(s > 4 for r in want for s in r[4])  # 2.1 editing passes ran
    got = [summary(r) for r in api.generate_batch(loaded, PROMPTS, OPTIONS)]
    assert got == want
    assert max(group_sizes) >= 3


def assert_step_logits_equal_solo(loaded, prompts, options):
    """Every step's float32 logits, batched, equal the solo ones to the last bit."""

    def recorder(out):
        return lambda block, step, logits: out.append(np.array(logits))

    want = [[] for _ in prompts]
    for p, o, w in zip(prompts, options, want):
        api.generate(loaded, p, o, on_step=recorder(w))
    got = [[] for _ in prompts]
    batcher = Batcher(loaded)
    for i, (p, o) in enumerate(zip(prompts, options)):
        batcher.add(p, o, key=i).session.s.on_step = recorder(got[i])
    list(batcher.run())
    assert [len(g) for g in got] == [len(w) for w in want] and sum(map(len, want)) >= 12
    for g, w in zip(got, want):
        assert all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(g, w))


def test_every_step_logits_equal_solo_bitwise(loaded, group_sizes):
    """Odd block lengths (3, 5): a merged GEMM over the batch's rows would differ here.
    The last three prompts are as long: their caches attend in one batched call."""
    prompts = [ids(9, 5), ids(23, 6), ids(5, 7), ids(14, 8), ids(11, 9), ids(11, 10), ids(11, 11)]
    options = [{"max_tokens": 14, "seed": i, "block_length": n, "temp": 0.5}
               for i, n in enumerate([3, 3, 5, 5, 4, 4, 4])]
    assert_step_logits_equal_solo(loaded, prompts, options)
    assert max(group_sizes) == 3


def test_trained_demo_model_equal_solo(group_sizes):
    """A trained model: blocks end early once final, EOS / role end stop runs."""
    demo = api.load(ROOT / "demo" / "llada2_sort")
    texts = ["sort 3 1 2", "sort 9 4 7 1 5 3", "sort 5", "sort 8 6 4 2 0 9 7", "sort 4 4 1"]
    prompts = [api.encode_prompt(demo, t) for t in texts]
    options = [{"max_tokens": 32}, {"max_tokens": 32, "seed": 1, "temp": 0.8}, {"max_tokens": 24},
               {"max_tokens": 32, "editing_threshold": 0.9}, {"max_tokens": 32, "threshold": 0.6}]
    want = solo(demo, prompts, options)
    assert any(r[6] for r in want) and any(r[3] == "stop" for r in want)
    assert [summary(r) for r in api.generate_batch(demo, prompts, options)] == want
    assert max(group_sizes) >= 3


@pytest.fixture
def reveal_sizes(monkeypatch):
    """How many blocks each merged sampling-and-reveal graph (batch.reveal_rows) took."""
    sizes = []
    real = ll_batch.reveal_rows

    def counting(session, requests):
        sizes.append(len(requests))
        return real(session, requests)

    monkeypatch.setattr(ll_batch, "reveal_rows", counting)
    return sizes


def test_one_kind_steps_merge_and_equal_solo(loaded, group_sizes, reveal_sizes):
    """Requests of one kind (sampler, block length, stops) sample and reveal in
    one graph over their rows, each with its own seed, uniforms, threshold,
    schedule, step quota and budget: each still gets what it gets alone. The trained model
    stops early and at EOS; the random one makes every draw count."""
    demo = api.load(ROOT / "demo" / "llada2_sort")
    texts = ["sort 3 1 2", "sort 9 4 7 1 5 3", "sort 5", "sort 8 6 4 2 0 9 7", "sort 4 4 1"]
    cases = [(demo, [api.encode_prompt(demo, t) for t in texts]), (loaded, [ids(9 + 5 * i, i) for i in range(5)])]
    for model, prompts in cases:
        options = [{"max_tokens": 32 - 3 * i, "seed": i, "temp": 0.9, "threshold": 0.95 - 0.1 * i,
                    "block_length": 8, "max_denoising_steps": steps} for i, steps in enumerate([4, 8, 3, 8, 5])]
        options[1]["threshold_schedule"] = "linear"
        want = solo(model, prompts, options)
        if model is demo:
            assert any(r[6] for r in want) and any(r[3] == "stop" for r in want)
        reveal_sizes.clear()
        assert [summary(r) for r in api.generate_batch(model, prompts, options)] == want
        assert max(reveal_sizes) == 5
    assert max(group_sizes) == 5


def test_numpy_vocabulary_rows_equal_solo(loaded, group_sizes, reveal_sizes, monkeypatch):
    """The CPU backend's numpy sampler (cpu/vocab.py, taken at the released
    geometry) forced at every size: merged blocks of one kind and mixed settings
    (top-k/top-p stay in MLX) still get their solo runs."""
    from dlm.runtime.models.cpu import vocab as cpu_vocab

    rows = []
    real = cpu_vocab.sample_rows
    monkeypatch.setattr(cpu_vocab, "sample_rows", lambda x, *a: rows.append(x.shape) or real(x, *a))
    monkeypatch.setenv("DLM_CPU_VOCAB", "numpy")
    prompts = [ids(9 + 5 * i, i) for i in range(4)]
    options = [{"max_tokens": 30 - 3 * i, "seed": i, "temp": 0.9, "threshold": 0.9 - 0.1 * i, "block_length": 8}
               for i in range(4)]
    for p, o in ((prompts, options), (PROMPTS, OPTIONS)):
        want = solo(loaded, p, o)
        assert [summary(r) for r in api.generate_batch(loaded, p, o)] == want
    assert max(reveal_sizes) == 4 and any(shape[0] == 4 for shape in rows)  # four blocks' rows at once
    assert max(group_sizes) >= 3


def test_vocabulary_path_is_chosen_per_block(loaded, reveal_sizes, monkeypatch):
    """cpu_vocab's numpy-or-MLX choice goes by one block's size: with the
    threshold between one block's logits and a merged reveal's (as at the
    released geometry, where a block of 8 stays in MLX and four of them would
    not), merged blocks stay on the path each takes alone."""
    from dlm.runtime.models.cpu import vocab as cpu_vocab

    vocab = loaded.args.vocab_size
    monkeypatch.setattr(cpu_vocab, "MIN_ENTRIES", 10 * vocab)  # a block of 8: MLX; four: would be numpy
    taken = []
    real = cpu_vocab.sample_rows
    monkeypatch.setattr(cpu_vocab, "sample_rows", lambda x, *a: taken.append(x.shape) or real(x, *a))
    prompts = [ids(9 + 5 * i, i) for i in range(4)]
    options = [{"max_tokens": 24, "seed": i, "temp": 0.9, "block_length": 8} for i in range(4)]
    want = solo(loaded, prompts, options)
    assert [summary(r) for r in api.generate_batch(loaded, prompts, options)] == want
    assert max(reveal_sizes) == 4 and not taken


def polls_then_cancel(n):
    calls = {"n": 0}

    def cancel():
        calls["n"] += 1
        return calls["n"] > n

    return cancel


def test_cancelling_one_request_leaves_the_others_alone(loaded):
    options = [{"max_tokens": 64, "seed": i, "block_length": 8, "temp": 0.9} for i in range(3)]
    prompts = PROMPTS[:3]
    want = solo(loaded, prompts, options, [None, polls_then_cancel(9), None])
    assert want[1][3] == "cancelled" and want[1][5] == 9 and want[1][0]
    got = api.generate_batch(loaded, prompts, options, cancel=[None, polls_then_cancel(9), None])
    assert [summary(r) for r in got] == want
    assert "cancelled" not in (want[0][3], want[2][3])


def test_requests_join_mid_way_and_wait_for_room(loaded, group_sizes):
    want = solo(loaded, PROMPTS[:4], OPTIONS[:4])
    batcher = Batcher(loaded, max_batch=2)
    for i in range(3):
        batcher.add(PROMPTS[i], OPTIONS[i], key=i)
    events = {i: [] for i in range(4)}
    for _ in range(4):
        for entry, event in batcher.step():
            events[entry.key].append(event)
        assert len(batcher.active) == 2 and len(batcher.waiting) == 1
    batcher.add(PROMPTS[3], OPTIONS[3], key=3)
    for entry, event in batcher.run():
        events[entry.key].append(event)
    got = []
    for i in range(4):
        result = api.GenerationResult()
        for event in events[i]:
            api._take(result, event)
        got.append(summary(result))
    assert got == want and max(group_sizes) == 2


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the grouped kernels are the CPU backend's")
@pytest.mark.parametrize("mode,rows_per_expert", [("", 6), ("each", 2), ("each", 3)],
                         ids=["by-count", "by-expert-alone", "gather-alone"])
def test_grouped_cpu_experts_per_sequence(tiny_llada2_mlx_dir, monkeypatch, mode, rows_per_expert):
    """A block of 8 x top-4 over 16 experts routes 32 copies. By copy count (float
    experts' default), and one expert at a time (as experts dequantized per call
    run): at 2 rows per expert each block runs that way alone, at 3 it runs
    gather_mm alone although the batch's copies would pass. Every way the batch
    runs each block as it runs alone."""
    monkeypatch.setattr(cpu_experts, "GROUPED_MIN_WEIGHT", 1)
    monkeypatch.setattr(cpu_experts, "GROUPED_MIN_ROWS_PER_EXPERT", rows_per_expert)
    monkeypatch.setenv("DLM_CPU_EXPERTS", mode)
    fresh = api.load(tiny_llada2_mlx_dir)
    glu = fresh.model.layers[1].mlp.switch_mlp
    assert cpu_experts.stacks(glu.gate_proj) == (mode == "")
    assert cpu_experts.grouped(32, 16, glu.gate_proj) == (rows_per_expert == 2)
    options = [{"max_tokens": 16, "seed": i, "block_length": 8, "temp": 0.5} for i in range(3)]
    assert_step_logits_equal_solo(fresh, PROMPTS[:3], options)


def test_images_are_refused(loaded):
    from dlm.runtime.platform.errors import GenerationError
    from dlm.runtime.generation.inputs import ImageInput, PromptInputs

    image = ImageInput(np.zeros((4, 48), np.float32), np.zeros((4, 2), np.int64), 1)
    with pytest.raises(GenerationError, match="prompt 0: image input is not supported: LLaDA-2 is text-only"):
        api.generate_batch(loaded, [PromptInputs([3, 4, 5], [image])])

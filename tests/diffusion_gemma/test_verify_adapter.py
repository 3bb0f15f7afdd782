"""dlm-verify's DiffusionGemma adapter: the debug-canvas harness around
transformers' generate, self-conditioning inputs, and its registry entry."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dlm.verify.protocol import adapter_for
from dlm.verify.diffusion_gemma import adapter as R  # noqa: E402
from dlm.verify.protocol import check_adapter  # noqa: E402

PROMPT = [2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


@pytest.fixture(scope="module")
def ref(tiny_dg_dir):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield R.load_reference(tiny_dg_dir)
    torch.set_num_threads(n)


# -- the debug canvas around transformers' own generate -----------------------


def test_debug_canvas_replaces_every_draw_in_order(ref):
    """Canvas init is pattern 0, step k's renoise is pattern k (the draw order of
    transformers' ``EntropyBoundSampler.initialize_canvas`` / ``renoise_canvas``), the
    sample is the argmax; the global torch seed no longer matters."""
    settings = R.stream_settings(ref.config, ref.generation_config, blocks=1, steps=3)
    L, V = R._canvas_length(ref.config), R._vocab(ref.config)
    canvases, argmaxes = [], []
    real = ref.model.forward

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        canvases.append(kwargs["decoder_input_ids"][0].tolist())
        argmaxes.append(out.logits[0].argmax(-1).tolist())
        return out

    ref.model.forward = spy
    try:
        torch.manual_seed(1)
        a = R.reference_commit_stream(ref, PROMPT, settings)
    finally:
        del ref.model.forward
    torch.manual_seed(2)
    b = R.reference_commit_stream(ref, PROMPT, settings)
    assert a.tokens == b.tokens and a.steps_per_block == b.steps_per_block == [3]
    assert canvases[0] == R.debug_pattern(0, L, V).tolist()
    # Step 2's canvas: accepted positions hold step 1's argmax, the rest pattern 1.
    pattern1 = R.debug_pattern(1, L, V).tolist()
    kept = [i for i in range(L) if canvases[1][i] != pattern1[i]]
    assert kept and all(canvases[1][i] == argmaxes[0][i] for i in kept)
    assert len(kept) < L  # the random tiny model accepts few tokens per step
    # The commit is the last step's argmax, and the trace recorded it.
    assert a.blocks[0].tokens == argmaxes[-1]
    np.testing.assert_array_equal(a.blocks[0].step_argmax[-1], argmaxes[-1])
    assert torch.randint(0, 5, (3,)).shape == (3,)  # the patch is gone


def test_trace_records_the_positions_transformers_keeps(ref):
    """The trace's per-step accepted positions (adapter.acceptance: the runtime's
    entropy-bound rule on the recorded logits) are the ones transformers'
    sampler kept: the next step's canvas holds this step's argmax exactly there
    (positions where the renoise pattern happens to equal the argmax say
    nothing and are skipped)."""
    settings = R.stream_settings(ref.config, ref.generation_config, blocks=1, steps=6)
    # A bound that keeps a few positions a step (entropies here ~6 nats): the count depends on the
    # rule's cumulative sum.
    settings["entropy_bound"] = 13.0
    L, V = R._canvas_length(ref.config), R._vocab(ref.config)
    canvases = []
    real = ref.model.forward

    def spy(*args, **kwargs):
        canvases.append(kwargs["decoder_input_ids"][0].numpy().copy())
        return real(*args, **kwargs)

    ref.model.forward = spy
    try:
        block = R.reference_commit_stream(ref, PROMPT, settings).blocks[0]
    finally:
        del ref.model.forward
    assert block.step_accept is not None and block.step_scores.shape == block.step_argmax.shape
    assert block.step_accept.sum(-1).max() > 1  # the cumulative rule, not only the argmin
    for t in range(block.steps - 1):
        noise = R.debug_pattern(t + 1, L, V)
        telling = noise != block.step_argmax[t]
        kept = canvases[t + 1] == block.step_argmax[t]
        np.testing.assert_array_equal(block.step_accept[t][telling], kept[telling])


def test_self_conditioning_inputs_keep_top_probabilities():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 300)).astype(np.float32) * 3
    arrays = R.sc_inputs(logits, temperature=0.8, k=16)
    dense = R.dense_sc(arrays, 300)
    x = logits.astype(np.float64) / 0.8
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    q = np.exp(dense - dense.max(-1, keepdims=True))
    q /= q.sum(-1, keepdims=True)
    ids = arrays["sc_ids"]
    np.testing.assert_allclose(np.take_along_axis(q, ids, -1), np.take_along_axis(p, ids, -1), rtol=1e-5)


def test_adapter_is_found_through_the_registry():
    from dlm.runtime.registry import family_for_config

    family = family_for_config({"model_type": "diffusion_gemma"})
    assert adapter_for(family) is R
    check_adapter(R)


def test_mlx_logits_cases_of_one_prompt_share_its_prefill(tiny_dg_dir, tiny_dg_mlx_dir):
    """One MLX prefill serves the logits cases of a prompt (each gets a copy of
    the encoder cache, and a 'next' case encodes its committed canvas into its
    own copy); every case's logits equal those of its own fresh prefill, bit
    for bit, and equal the reference's."""
    from dlm.runtime import api

    loaded = api.load(tiny_dg_mlx_dir)
    ref = R.load_reference(tiny_dg_dir)
    cases = [c for c in R.logit_cases(ref.config, [PROMPT, PROMPT[:6]], ref.generation_config)
             if "sc_from" not in c.meta]
    calls = []
    real = loaded.model.prefill
    loaded.model.prefill = lambda *a, **k: calls.append(1) or real(*a, **k)
    R._prefilled.clear()
    shared = [R.mlx_logits(loaded, c) for c in cases]
    assert len(calls) == 2  # one per prompt, not one per case
    fresh = []
    for c in cases:
        R._prefilled.clear()
        fresh.append(R.mlx_logits(loaded, c))
    for c, a, b in zip(cases, shared, fresh):
        assert np.array_equal(a, b), c.name
        assert np.abs(a - R.reference_logits(ref, c, {})).max() < 1e-4, c.name
    # A case collecting per-layer hidden states runs its own prefill.
    collect: dict = {}
    R.mlx_logits(loaded, cases[0], collect)
    assert len(calls) == 2 + len(cases) + 1 and collect["encoder"]
    # The held cache goes when the model does (dlm-verify releases it before the same-weights reference).
    import gc

    del real  # (the spy's bound method)
    loaded.model = None
    gc.collect()
    assert not R._prefilled

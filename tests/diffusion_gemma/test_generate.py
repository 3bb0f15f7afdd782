"""DiffusionGemma generation loop: debug-canvas commit streams identical to
transformers' own ``generate`` (random draws replaced by lablup/mlxcel's
``debug_canvas_pattern``, multinomial by argmax), plus the runtime's own rules (max-tokens
trimming, canvas lengths, seeds, EOS, cancellation, samplers, streaming)."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import numpy as np
import pytest

from dlm.runtime import api
from dlm.runtime.platform.errors import GenerationError
from tests.builders import DG_GENERATION, build_diffusion_gemma, convert_dir, load_diffusion_gemma_hf

V, L = 512, 8
SHORT = list(range(2, 14))
LONG = [2] + [(7 * i + 3) % 500 + 5 for i in range(27)]  # 28 tokens > window 16


def pattern(n: int) -> np.ndarray:
    i = np.arange(1, L + 1)
    return (i * 7919 + n * 104729) % V


@contextlib.contextmanager
def debug_canvas_torch(model):
    """torch.randint(0, V, (B, L)) -> the n-th pattern, multinomial -> argmax;
    counts decoder passes per canvas (keyed by the canvas's first position)."""
    import torch

    real_randint, real_multinomial, real_forward = torch.randint, torch.multinomial, model.forward
    draws = {"n": 0}
    steps: dict[int, int] = {}

    def randint(low, high, size, **kwargs):
        assert (low, high, tuple(size)[-1]) == (0, V, L)
        out = torch.from_numpy(pattern(draws["n"])).expand(tuple(size)).clone()
        draws["n"] += 1
        return out

    def forward(*args, **kwargs):
        pos = kwargs.get("decoder_position_ids")
        if kwargs.get("decoder_input_ids") is not None and pos is not None:
            start = int(pos.reshape(-1)[0])
            steps[start] = steps.get(start, 0) + 1
        return real_forward(*args, **kwargs)

    torch.randint = randint
    torch.multinomial = lambda probs, num_samples=1, *a, **k: probs.argmax(-1, keepdim=True)
    model.forward = forward
    try:
        yield steps
    finally:
        torch.randint, torch.multinomial = real_randint, real_multinomial
        del model.forward


def hf_debug_generate(model, prompt, max_new_tokens, gen: dict):
    """transformers' generate in debug-canvas mode -> (tokens cut at the first EOS,
    EOS hit, decoder steps per canvas)."""
    import torch

    eos = gen["eos_token_id"]
    with torch.no_grad(), debug_canvas_torch(model) as steps:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, pad_token_id=0, **gen)
    new = out.sequences[0, len(prompt):].tolist()
    hit = next((i for i, t in enumerate(new) if t in eos), None)
    return (new if hit is None else new[:hit]), hit is not None, [steps[k] for k in sorted(steps)]


def with_generation_config(loaded, **changes):
    return dataclasses.replace(loaded, generation_config={**loaded.generation_config, **changes})


# (sampler_config, entropy bound 0.1, comes from both checkpoints' generation_config.json)
REFERENCE_GEN = dict(
    max_denoising_steps=8, t_min=0.4, t_max=0.8, stability_threshold=1, confidence_threshold=0.005, eos_token_id=[1, 106, 50],
)


def run_both(torch_model, loaded, prompt, max_tokens, **changes):
    gen = {**REFERENCE_GEN, **changes}
    ref_tokens, ref_eos, ref_steps = hf_debug_generate(torch_model, prompt, max_tokens, gen)
    ours = api.generate(
        with_generation_config(loaded, **gen), prompt,
        {"max_tokens": max_tokens, "debug_canvas": True, "diffusion_full_canvas": True},
    )
    return (ref_tokens, ref_eos, ref_steps), ours


@pytest.fixture(scope="module")
def loaded(tiny_dg_mlx_dir):
    return api.load(tiny_dg_mlx_dir)


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["short", "longer-than-window"])
def test_debug_canvas_matches_transformers_reference_settings(tiny_dg_torch, loaded, prompt):
    (ref, ref_eos, ref_steps), ours = run_both(tiny_dg_torch, loaded, prompt, 24)
    assert not ref_eos and ref_steps == [8, 8, 8]
    assert ours.token_ids == ref and len(ref) == 24
    assert ours.steps_per_block == ref_steps and ours.finish_reason == "length"


def test_debug_canvas_single_step_canvases(tiny_dg_torch, loaded):
    # stability_threshold 0: always stable; a loose confidence bound stops after step 1.
    (ref, _, ref_steps), ours = run_both(
        tiny_dg_torch, loaded, SHORT, 32, stability_threshold=0, confidence_threshold=100.0
    )
    assert ref_steps == [1, 1, 1, 1]
    assert ours.token_ids == ref and ours.steps_per_block == ref_steps
    assert ours.stats.early_stops == 4


@pytest.fixture(scope="module")
def stable_model(tmp_path_factory):
    """A tiny model whose argmax canvas often repeats between steps (embeddings
    pulled towards a common vector), so the stable-and-confident rule fires on
    some canvases and not on others."""
    import torch

    root = tmp_path_factory.mktemp("stable_dg")
    model = build_diffusion_gemma(root / "hf", form="hub")
    with torch.no_grad():
        w = model.model.decoder.embed_tokens.weight
        common = torch.randn(w.shape[1], generator=torch.Generator().manual_seed(5)) * 0.02
        w.copy_(common + 0.6 * w)
    model.save_pretrained(str(root / "hf"))
    cfg = json.loads((root / "hf" / "config.json").read_text())
    cfg["text_config"].pop("per_layer_config", None)
    cfg["text_config"].update(global_head_dim=32, num_global_key_value_heads=1)
    (root / "hf" / "config.json").write_text(json.dumps(cfg))
    (root / "hf" / "generation_config.json").write_text(json.dumps(DG_GENERATION))
    return load_diffusion_gemma_hf(root / "hf"), api.load(convert_dir(root / "hf", root / "mlx"))


def test_debug_canvas_early_stops_and_eos(stable_model):
    torch_model, loaded = stable_model
    loose = dict(max_denoising_steps=16, confidence_threshold=100.0)
    (ref, ref_eos, ref_steps), _ = run_both(torch_model, loaded, SHORT, 48, **loose)
    assert not ref_eos and len(ref_steps) == 6
    # Make the first token that first appears after the third canvas the EOS.
    at = next(i for i in range(3 * L, len(ref)) if ref[i] not in ref[:i])
    eos = ref[at]
    (ref, ref_eos, ref_steps), ours = run_both(
        torch_model, loaded, SHORT, 48, eos_token_id=[eos], **loose
    )
    assert ref_eos and len(ref) == at and len(ref_steps) == at // L + 1 >= 4
    assert any(s < 16 for s in ref_steps) and any(s == 16 for s in ref_steps)  # early stops and full runs
    assert ours.token_ids == ref and eos not in ours.token_ids
    assert ours.steps_per_block == ref_steps
    assert ours.finish_reason == "stop"
    assert ours.stats.early_stops == sum(s < 16 for s in ref_steps)


def test_env_var_enables_debug_canvas(loaded, monkeypatch):
    opts = {"max_tokens": 16, "max_denoising_steps": 3}
    a = api.generate(loaded, SHORT, {**opts, "debug_canvas": True})
    monkeypatch.setenv("DLM_DEBUG_CANVAS", "1")
    b = api.generate(loaded, SHORT, {**opts, "seed": 99})
    assert a.token_ids == b.token_ids


def test_seed_reproducible(loaded):
    opts = {"max_tokens": 24, "max_denoising_steps": 4}
    a = api.generate(loaded, SHORT, {**opts, "seed": 8})
    b = api.generate(loaded, SHORT, {**opts, "seed": 8})
    c = api.generate(loaded, SHORT, {**opts, "seed": 9})
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24
    assert a.token_ids != c.token_ids


def test_max_tokens_trims_last_canvas(loaded):
    steps_seen = []
    res = api.generate(loaded, SHORT, {"max_tokens": 13, "max_denoising_steps": 2, "seed": 0},
                       on_step=lambda i, logits, am: steps_seen.append(logits.shape))
    assert len(res.token_ids) == 13 and res.finish_reason == "length"
    assert [len(b) for b in res.blocks] == [8, 5]
    # default min canvas 64 > canvas_length 8: every canvas is the full 8
    assert all(shape == (1, 8, V) for shape in steps_seen)


def test_canvas_length_rule(loaded):
    shapes = []
    opts = {"max_tokens": 11, "max_denoising_steps": 1, "seed": 0, "diffusion_min_canvas_length": 2}
    res = api.generate(loaded, SHORT, opts, on_step=lambda i, lg, am: shapes.append(lg.shape[1]))
    assert shapes == [8, 3] and len(res.token_ids) == 11
    shapes.clear()
    res = api.generate(loaded, SHORT, {**opts, "diffusion_full_canvas": True},
                       on_step=lambda i, lg, am: shapes.append(lg.shape[1]))
    assert shapes == [8, 8] and len(res.token_ids) == 11
    shapes.clear()
    api.generate(loaded, SHORT, {**opts, "diffusion_max_canvas_length": 4},
                 on_step=lambda i, lg, am: shapes.append(lg.shape[1]))
    assert shapes == [4, 4, 3]


def test_trimmed_canvas_matches_committed_prefix(loaded):
    """Trimming only cuts the output: the kept tokens are the full-canvas commit's."""
    opts = {"max_denoising_steps": 3, "debug_canvas": True, "diffusion_full_canvas": True}
    full = api.generate(loaded, SHORT, {**opts, "max_tokens": 16})
    cut = api.generate(loaded, SHORT, {**opts, "max_tokens": 11})
    assert cut.token_ids == full.token_ids[:11]


def test_cancel_stops_at_a_step(loaded):
    calls = {"n": 0}

    def cancel():
        calls["n"] += 1
        return calls["n"] > 5

    events = list(api.stream_generate(loaded, SHORT, {"max_tokens": 64, "max_denoising_steps": 4,
                                                       "seed": 0}, cancel=cancel))
    assert events[-1].finish_reason == "cancelled"
    assert [len(e.token_ids) for e in events[:-1]] == [8]  # one canvas committed before
    assert events[-1].stats.forwards == 5


def test_stream_events_per_canvas(loaded):
    events = list(api.stream_generate(loaded, SHORT, {"max_tokens": 20, "max_denoising_steps": 2, "seed": 1}))
    assert [len(e.token_ids) for e in events[:-1]] == [8, 8, 4]
    assert all(not e.done for e in events[:-1]) and events[-1].done
    stats = events[-1].stats
    assert stats.completion_tokens == 20 and stats.steps_per_block == [2, 2, 2] and stats.forwards == 6
    assert stats.prompt_tokens == len(SHORT)
    # Deltas add up to the decoded answer (channel spans go to reasoning).
    ids = [t for e in events for t in e.token_ids]
    answer, inside = [], False
    for t in ids:
        if t == 100:
            inside = True
        elif t == 101 and inside:
            inside = False
        elif not inside:
            answer.append(t)
    assert "".join(e.text for e in events) == loaded.tokenizer.decode(answer, skip_special_tokens=False)


def test_confidence_threshold_sampler(loaded):
    # threshold 0: every position is revealed on the first step -> one step per canvas
    res = api.generate(loaded, SHORT, {"max_tokens": 16, "diffusion_sampler": "confidence-threshold",
                                       "diffusion_threshold": 0.0, "seed": 0})
    assert res.steps_per_block == [1, 1] and res.stats.early_stops == 2
    # threshold 1: nothing exceeds it -> one position revealed per step, all 8 after 8 steps
    res = api.generate(loaded, SHORT, {"max_tokens": 8, "diffusion_sampler": "confidence-threshold",
                                       "diffusion_threshold": 1.0, "max_denoising_steps": 20, "seed": 0})
    assert res.steps_per_block == [8]


def test_temp_zero_is_deterministic_without_seed(loaded):
    # temp 0 only removes sampling randomness; canvas draws still need a seed
    opts = {"max_tokens": 8, "max_denoising_steps": 3, "temp": 0.0, "seed": 3}
    assert api.generate(loaded, SHORT, opts).token_ids == api.generate(loaded, SHORT, opts).token_ids


@pytest.mark.parametrize("options, message", [
    ({"top_k": 5}, "--top-k does not apply"),
    ({"top_p": 0.9}, "--top-p does not apply"),
    ({"block_length": 32}, "--block-length does not apply"),
    ({"diffusion_sampler": "greedy"}, "--diffusion-sampler must be one of"),
    ({"diffusion_max_canvas_length": 9}, "canvas_length"),
    ({"max_tokens": 0}, "--max-tokens must be >= 1"),
    ({"temp": -1.0}, "--temp must be >= 0"),
])
def test_bad_options_are_errors(loaded, options, message):
    with pytest.raises(GenerationError, match=message):
        api.generate(loaded, SHORT, options)


def test_noop_sampling_options_accepted(loaded):
    res = api.generate(loaded, SHORT, {"max_tokens": 8, "max_denoising_steps": 1, "top_k": 0, "top_p": 1.0,
                                       "seed": 0})
    assert len(res.token_ids) == 8


def test_prompt_longer_than_context(loaded):
    too_long = [2] * loaded.args.max_position_embeddings
    with pytest.raises(GenerationError, match="context"):
        api.generate(loaded, too_long, {"max_tokens": 8})
    with pytest.raises(GenerationError, match="vocabulary"):
        api.generate(loaded, [2, 9999], {"max_tokens": 8})

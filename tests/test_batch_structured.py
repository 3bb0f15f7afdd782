"""Structured-output and tool-call requests in ``api.generate_batch``, batched with
plain ones, on both families (LLaDA2.0 and LLaDA2.2, DiffusionGemma): each gets
exactly what ``api.generate`` gives it alone (token ids, text, finish reason,
logprobs, tool calls, steps per canvas/block), their steps sharing forwards with
the plain requests'; a forced tool call cut short by max_tokens fails alone
(BatchError names it, every other prompt's result is its solo one)."""

from __future__ import annotations

import pytest

from dlm.runtime import api  # before MLX: dlm.runtime loads the optimized BLAS ahead of it

from dlm.runtime.models.diffusion_gemma import batch as dg_batch  # noqa: E402  (isort: skip)
from dlm.runtime.models.llada2_moe import batch as ll_batch  # noqa: E402
from dlm.runtime.platform.errors import GenerationError  # noqa: E402
from dlm.runtime.structured.tools import parse_tools  # noqa: E402
from tests.test_structured import SCHEMAS, TOOLS  # noqa: E402

FORCED = {"type": "function", "function": {"name": "get_weather"}}
# Per family: what every request of the mix runs with (LLaDA-2: small blocks, so requests span several).
OPTIONS = {"diffusion_gemma": {}, "llada2_moe": {"block_length": 8, "max_denoising_steps": 4}}


def fmt(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.fixture(scope="module", params=["diffusion_gemma", "llada2_moe"])
def loaded(request, tiny_dg_mlx_dir, tiny_llada2_mlx_dir):
    return api.load(tiny_dg_mlx_dir if request.param == "diffusion_gemma" else tiny_llada2_mlx_dir)


@pytest.fixture
def mixed_steps(monkeypatch):
    """For each shared step (a DiffusionGemma step build, a LLaDA-2 forward of
    several blocks): (structured members, plain members) in it."""
    seen, shaped_caches = [], set()
    real_build, real_forward, real_batch_forward = dg_batch.build, ll_batch.forward, ll_batch.Batch._forward

    def build(members, logits):
        shaped = sum(m.session.frontier is not None for m in members)
        seen.append((shaped, len(members) - shaped))
        return real_build(members, logits)

    def batch_forward(self, members):  # which caches are structured requests'
        shaped_caches.update(id(m.session.cache) for m in members if m.session.frontier is not None)
        return real_batch_forward(self, members)

    def forward(model, ids, caches, *args, **kwargs):
        shaped = sum(id(c) in shaped_caches for c in caches)
        seen.append((shaped, len(caches) - shaped))
        return real_forward(model, ids, caches, *args, **kwargs)

    monkeypatch.setattr(dg_batch, "build", build)
    monkeypatch.setattr(ll_batch.Batch, "_forward", batch_forward)
    monkeypatch.setattr(ll_batch, "forward", forward)
    return seen


def summary(result):
    return (result.token_ids, result.blocks, result.text, result.finish_reason, result.logprobs,
            [(c.name, c.arguments) for c in result.tool_calls], result.steps_per_block,
            result.stats.completion_tokens)


def alone(loaded, prompt, options, **shape):
    return summary(api.generate(loaded, prompt, options, **shape))


def mix(loaded):
    """(prompts, options, response formats, logprobs, tools): plain, json_schema,
    json_object with logprobs, a forced tool call, auto tools (OpenAI dicts), plain."""
    base = OPTIONS[loaded.family.name]
    forced = parse_tools(TOOLS, FORCED, False)
    answer = api.encode_prompt(loaded, "Answer in JSON.")
    prompts = [answer, answer, api.encode_prompt(loaded, "x"),
               api.encode_prompt(loaded, "Weather in Paris for 3 days?", tools=forced),
               api.encode_prompt(loaded, "Weather in Rome?", tools=parse_tools(TOOLS)),
               api.encode_prompt(loaded, "y")]
    options = [{**base, "max_tokens": 40, "seed": 1}, {**base, "max_tokens": 48, "seed": 2},
               {**base, "max_tokens": 36, "seed": 3}, {**base, "max_tokens": 128, "seed": 4},
               {**base, "max_tokens": 32, "seed": 5}, {**base, "max_tokens": 30, "seed": 6, "temp": 0.0}]
    formats = [None, fmt(SCHEMAS[1]), {"type": "json_object"}, None, None, None]
    logprobs = [None, None, 2, None, None, None]
    tools = [None, None, None, forced, TOOLS, None]
    return prompts, options, formats, logprobs, tools


def test_structured_and_tool_requests_batched_with_plain_equal_solo(loaded, mixed_steps):
    prompts, options, formats, logprobs, tools = mix(loaded)
    want = [alone(loaded, p, o, response_format=f, logprobs=k, tools=t)
            for p, o, f, k, t in zip(prompts, options, formats, logprobs, tools)]
    assert want[2][4] and want[3][3] == "tool_calls" and want[3][5]  # logprobs; a forced call
    got = api.generate_batch(loaded, prompts, options, response_format=formats, logprobs=logprobs, tools=tools)
    assert [summary(r) for r in got] == want
    assert any(shaped and plain for shaped, plain in mixed_steps)  # structured steps shared with plain ones


def test_one_value_for_every_prompt(loaded):
    """``response_format`` / ``logprobs`` / ``tools`` given once apply to every prompt
    (a list of OpenAI tool dicts is one value)."""
    base = OPTIONS[loaded.family.name]
    prompts = [api.encode_prompt(loaded, "Answer in JSON."), api.encode_prompt(loaded, "x")]
    options = [{**base, "max_tokens": 32, "seed": 7}, {**base, "max_tokens": 40, "seed": 8}]
    shape = {"response_format": {"type": "json_object"}, "logprobs": 1}
    want = [alone(loaded, p, o, **shape) for p, o in zip(prompts, options)]
    assert [summary(r) for r in api.generate_batch(loaded, prompts, options, **shape)] == want
    want = [alone(loaded, p, o, tools=TOOLS) for p, o in zip(prompts, options)]
    assert [summary(r) for r in api.generate_batch(loaded, prompts, options, tools=TOOLS)] == want


def test_a_forced_call_cut_by_max_tokens_fails_alone(loaded):
    base = OPTIONS[loaded.family.name]
    forced = parse_tools(TOOLS, "required", False)
    prompts = [api.encode_prompt(loaded, "Answer in JSON."),
               api.encode_prompt(loaded, "Weather in Paris?", tools=forced),
               api.encode_prompt(loaded, "x")]
    options = [{**base, "max_tokens": 32, "seed": 9}, {**base, "max_tokens": 8, "seed": 10},
               {**base, "max_tokens": 40, "seed": 11}]
    formats, tools = [None, None, fmt(SCHEMAS[1])], [None, forced, None]
    cut = r"max_tokens \(8\) ran out before the call was complete"
    with pytest.raises(GenerationError, match=cut):
        api.generate(loaded, prompts[1], options[1], tools=forced)
    want = [alone(loaded, prompts[i], options[i], response_format=formats[i]) for i in (0, 2)]
    with pytest.raises(api.BatchError, match="prompt 1: tool_choice forces a tool call, but " + cut) as caught:
        api.generate_batch(loaded, prompts, options, response_format=formats, tools=tools)
    assert list(caught.value.errors) == [1] and isinstance(caught.value.errors[1], GenerationError)
    results = caught.value.results
    assert [summary(results[i]) for i in (0, 2)] == want
    assert results[1].finish_reason is None


def test_per_prompt_lists_must_match_the_prompts(loaded):
    ids = api.encode_prompt(loaded, "x")
    with pytest.raises(GenerationError, match="2 prompts need as many response_format entries"):
        api.generate_batch(loaded, [ids, ids], response_format=[{"type": "json_object"}])
    with pytest.raises(GenerationError, match="prompt 1: logprobs are reported for structured output only"):
        api.generate_batch(loaded, [ids, ids], response_format=[{"type": "json_object"}, None], logprobs=1)


def test_llada22_structured_and_plain_blocks_batch_as_alone(tmp_path_factory, mixed_steps):
    """LLaDA2.2: a structured block (DELETE/SPLIT suppressed, no edits) batches with
    plain Levenshtein-edited blocks, each as alone."""
    from dlm.convert.pipeline import ConvertOptions, convert
    from tests.builders import LLADA22_EDIT_PROMPTS, LLADA22_EDIT_SETTINGS as S, build_llada22

    root = tmp_path_factory.mktemp("v22_structured")
    gc = {"eos_token_id": S["eos_id"], "pad_token_id": S["eos_id"][0], "block_length": S["block_length"],
          "steps": S["steps"], "max_post_steps": S["max_post_steps"]}
    build_llada22(root / "hf", generation_config=gc)
    convert(ConvertOptions(source=str(root / "hf"), output=str(root / "mlx"), progress=False), echo=lambda s: None)
    loaded = api.load(root / "mlx")
    options = {"max_tokens": 48, "block_length": S["block_length"], "max_denoising_steps": S["steps"],
               "threshold": S["threshold"], "editing_threshold": S["editing_threshold"],
               "max_post_steps": S["max_post_steps"]}
    prompts = [list(LLADA22_EDIT_PROMPTS[0]), [10, 20, 30], list(LLADA22_EDIT_PROMPTS[1])]
    formats = [None, fmt({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}), None]
    want = [alone(loaded, p, options, response_format=f) for p, f in zip(prompts, formats)]
    got = api.generate_batch(loaded, prompts, options, response_format=formats)
    assert [summary(r) for r in got] == want
    assert any(shaped and plain for shaped, plain in mixed_steps)

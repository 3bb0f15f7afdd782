"""DiffusionGemma structured-output and tool-call requests in a batch with plain
ones: each gets exactly what it gets alone (token ids, canvases, steps, stops,
logprobs, tool calls), its canvases sharing decoder forwards and step builds
with the plain requests' (one canvas loop, canvas.Canvas, for both)."""

from __future__ import annotations

import pytest

from dlm.runtime import api  # before MLX: dlm.runtime loads the optimized BLAS ahead of it

from dlm.runtime.batch import Batcher, Entry  # noqa: E402  (isort: skip)
from dlm.runtime.models.diffusion_gemma import batch as dg_batch  # noqa: E402
from dlm.runtime.structured.tools import parse_tools  # noqa: E402
from tests.test_structured import SCHEMAS, TOOLS  # noqa: E402


def fmt(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.fixture(scope="module")
def loaded(tiny_dg_mlx_dir):
    return api.load(tiny_dg_mlx_dir)


@pytest.fixture
def mixed_builds(monkeypatch):
    """For each merged step build (batch.build): (structured members, plain members)."""
    seen = []
    real = dg_batch.build

    def recording(members, logits):
        shaped = sum(m.session.frontier is not None for m in members)
        seen.append((shaped, len(members) - shaped))
        return real(members, logits)

    monkeypatch.setattr(dg_batch, "build", recording)
    return seen


def summary(result):
    s = result.stats
    return (result.token_ids, result.blocks, result.text, result.finish_reason, s.steps_per_block, s.forwards,
            s.early_stops, s.completion_tokens, result.logprobs, [(c.name, c.arguments) for c in result.tool_calls])


class Request:
    """One request: its prompt and options, and how ``api.generate`` shapes it."""

    def __init__(self, ids, options, response_format=None, logprobs=None, tools=None, cancel=None):
        self.ids, self.options, self.cancel = ids, options, cancel
        self.response_format, self.logprobs, self.tools = response_format, logprobs, tools

    def alone(self, loaded):
        return summary(api.generate(loaded, self.ids, self.options, self.cancel() if self.cancel else None,
                                    response_format=self.response_format, logprobs=self.logprobs,
                                    tools=self.tools))

    def join(self, batcher: Batcher, key) -> Entry:
        return batcher.add(self.ids, self.options, self.cancel() if self.cancel else None, key=key,
                           response_format=self.response_format, logprobs=self.logprobs, tools=self.tools)

    def collect(self, events):
        result = api.GenerationResult()
        for event in events:
            api._take(result, event)
        return summary(result)


def batched(loaded, requests, max_batch=8):
    batcher = Batcher(loaded, max_batch=max_batch)
    for i, r in enumerate(requests):
        r.join(batcher, i)
    events = {i: [] for i in range(len(requests))}
    for entry, event in batcher.run():
        events[entry.key].append(event)
    return [r.collect(events[i]) for i, r in enumerate(requests)]


def polls_then_cancel(n):
    def make():
        calls = {"n": 0}

        def cancel():
            calls["n"] += 1
            return calls["n"] > n

        return cancel

    return make


def test_structured_and_tool_requests_batched_with_plain_equal_solo(loaded, mixed_builds):
    tools = parse_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, False)
    answer = api.encode_prompt(loaded, "Answer in JSON.")
    requests = [
        Request(answer, {"max_tokens": 40, "seed": 1}),
        Request(answer, {"max_tokens": 48, "seed": 2}, fmt(SCHEMAS[1]), logprobs=2),
        Request(api.encode_prompt(loaded, "x"), {"max_tokens": 36, "seed": 3}, {"type": "json_object"}),
        Request(api.encode_prompt(loaded, "Weather in Paris for 3 days?", tools=tools),
                {"max_tokens": 64, "seed": 4}, tools=tools),
        Request(api.encode_prompt(loaded, "y"), {"max_tokens": 30, "seed": 5, "temp": 0.0}),
    ]
    want = [r.alone(loaded) for r in requests]
    assert want[1][3] == "stop" and want[1][8] and want[3][3] == "tool_calls" and want[3][9]
    assert batched(loaded, requests) == want
    assert any(shaped and plain for shaped, plain in mixed_builds)  # structured steps built with plain ones


def test_samplers_debug_canvas_and_early_stops_under_a_grammar_equal_solo(loaded, mixed_builds):
    ids = api.encode_prompt(loaded, "Answer in JSON.")
    confident = {"diffusion_sampler": "confidence-threshold", "diffusion_threshold": 0.5}
    requests = [
        Request(ids, {"max_tokens": 48, "seed": 6, **confident}, fmt(SCHEMAS[0])),
        Request(ids, {"max_tokens": 32, "seed": 6, **confident}),
        Request(ids, {"max_tokens": 40, "debug_canvas": True}, fmt(SCHEMAS[4])),
        Request(ids, {"max_tokens": 24, "debug_canvas": True, "max_denoising_steps": 3}),
        Request(ids, {"max_tokens": 12, "seed": 7}, fmt({"type": "object", "properties": {
            "s": {"type": "string", "minLength": 40}}, "required": ["s"]})),  # "length"
    ]
    want = [r.alone(loaded) for r in requests]
    assert want[4][3] == "length"
    assert batched(loaded, requests) == want
    assert sum(shaped for shaped, plain in mixed_builds if plain) >= 2


def test_cancelling_a_structured_request_leaves_the_others_alone(loaded):
    ids = api.encode_prompt(loaded, "Answer in JSON.")
    requests = [
        Request(ids, {"max_tokens": 64, "seed": 8}, fmt(SCHEMAS[2]), cancel=polls_then_cancel(5)),
        Request(ids, {"max_tokens": 40, "seed": 9}),
        Request(ids, {"max_tokens": 48, "seed": 10}, fmt(SCHEMAS[3])),
    ]
    want = [r.alone(loaded) for r in requests]
    assert want[0][3] == "cancelled" and "cancelled" not in (want[1][3], want[2][3])
    assert batched(loaded, requests) == want


def test_structured_requests_join_mid_way(loaded):
    """Two at a time: a structured request waits for room, then joins plain ones
    mid-canvas (continuous batching)."""
    ids = api.encode_prompt(loaded, "Answer in JSON.")
    requests = [
        Request(ids, {"max_tokens": 24, "seed": 11}),
        Request(ids, {"max_tokens": 56, "seed": 12}, fmt(SCHEMAS[1])),
        Request(ids, {"max_tokens": 40, "seed": 13}, {"type": "json_object"}),
        Request(ids, {"max_tokens": 32, "seed": 14}),
    ]
    want = [r.alone(loaded) for r in requests]
    assert batched(loaded, requests, max_batch=2) == want

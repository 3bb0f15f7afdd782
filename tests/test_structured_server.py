"""Structured output and tool calls over loopback HTTP with the official
``openai`` client, on tiny random models of both families: every answer
parses and validates (``jsonschema``), streaming or not; bad schemas and
tool declarations get a 400 naming the field; the server keeps serving."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from dlm.runtime import api
from dlm.runtime.server.app import create_app
from tests.test_structured import SCHEMAS, TOOLS

DEFAULTS = {"max_tokens": 96}
MSGS = [{"role": "user", "content": "Give me JSON."}]


@pytest.fixture(scope="module", params=["diffusion_gemma", "llada2_moe"])
def served(request, tiny_dg_mlx_dir, tiny_llada2_mlx_dir, serving):
    path = tiny_dg_mlx_dir if request.param == "diffusion_gemma" else tiny_llada2_mlx_dir
    app = create_app(api.load(path), DEFAULTS, queue_size=4)
    with serving(app) as base:
        yield base


def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
def test_every_schema_answer_validates(served, stream):
    c = client(served)
    for i, schema in enumerate(SCHEMAS):
        kwargs = dict(model="m", messages=MSGS, response_format=schema_format(schema), seed=i)
        if stream:
            chunks = list(c.chat.completions.create(stream=True, **kwargs))
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
        else:
            r = c.chat.completions.create(**kwargs)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_json_object_on_both_routes_and_logprobs(served):
    c = client(served)
    r = c.chat.completions.create(model="m", messages=MSGS, response_format={"type": "json_object"}, seed=1,
                                  logprobs=True, top_logprobs=2)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == r.choices[0].message.content
    assert all(e.logprob <= 0 and len(e.top_logprobs) <= 2 for e in content)
    body = httpx.post(served + "/v1/completions", timeout=120, json={
        "prompt": "JSON:", "response_format": {"type": "json_object"}, "logprobs": 1, "seed": 2}).json()
    choice = body["choices"][0]
    assert isinstance(json.loads(choice["text"]), dict)
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"]


def test_forced_tool_calls_validate_streaming_or_not(served):
    c = client(served)
    params = TOOLS[0]["function"]["parameters"]
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                  tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=0)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    assert call.id.startswith("call_") and call.function.name in ("get_weather", "noop")
    if call.function.name == "get_weather":
        jsonschema.validate(json.loads(call.function.arguments), params)
    chunks = list(c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, stream=True, seed=1,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["get_weather"]
    jsonschema.validate(json.loads(deltas[0].function.arguments), params)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    # The call and its result go back in the next turn (rendered by the chat template).
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [deltas[0].model_dump(exclude={"index"})]},
               {"role": "tool", "tool_call_id": deltas[0].id, "content": "sunny"}]
    r = c.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=8, seed=2)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("body,param", [
    ({"response_format": schema_format({"type": "bogus"})}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"logprobs": True}, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_structured_requests_get_a_400_naming_the_field(served, body, param):
    request = {"messages": MSGS, **body}
    with httpx.Client(base_url=served, timeout=60) as h:
        r = h.post("/v1/chat/completions", json=request)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
        ok = h.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4})
        assert ok.status_code == 200


@pytest.mark.parametrize("raw,param", [
    # A lone surrogate anywhere that reaches the chat template: a 400 naming it, never a 500 (issue 42).
    (b'{"messages": [{"role": "user", "content": "Weather?"}], "tools": [{"type": "function", "function": '
     b'{"name": "f", "description": "\\ud800", "parameters": {"type": "object"}}}]}',
     "tools[0].function.description"),
    (b'{"messages": [{"role": "user", "content": "Weather?"}], "tools": [{"type": "function", "function": '
     b'{"name": "f", "parameters": {"type": "object", "properties": {"city": {"type": "string", '
     b'"description": "\\udc00"}}}}}]}',
     "tools[0].function.parameters.properties.city.description"),
    (b'{"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": null, '
     b'"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", '
     b'"arguments": "{\\"city\\": \\"\\\\ud800\\"}"}}]}, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}',
     "messages[1].tool_calls[0].function.arguments.city"),
    (b'{"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": null, '
     b'"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", '
     b'"arguments": {"\\ud800": 1}}}]}, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}',
     "messages[1].tool_calls[0].function.arguments"),
])
def test_lone_surrogates_get_a_400_naming_the_field(served, raw, param):
    with httpx.Client(base_url=served, timeout=60) as h:
        r = h.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and "not valid UTF-8 text" in error["message"], r.text
        ok = h.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4})
        assert ok.status_code == 200

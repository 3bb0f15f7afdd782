"""dlm-run serve --max-batch 4: structured-output and tool-call requests sent at
once with plain ones run in the same batched steps (the batcher's own count),
each answered with what the runtime gives it alone; a forced tool call cut
short by max_tokens is a 400 for that request only. The distributed server's
scheduler (Lockstep, in one process) batches them from their JSON spec too."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from dlm.runtime import api
from dlm.runtime import batch as batch_module
from dlm.runtime.server.app import create_app
from dlm.runtime.structured.tools import parse_tools
from tests.test_structured import SCHEMAS, TOOLS

DEFAULTS = {"max_tokens": 16, "max_denoising_steps": 3}
FORCED = {"type": "function", "function": {"name": "get_weather"}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMAS[1]}}


@pytest.fixture
def steps(monkeypatch):
    """For each batched step: (structured requests in it, requests in it)."""
    seen = []
    real = batch_module.Batcher.step

    def step(self):
        events = real(self)
        ran = set(self.active) | {e for e, ev in events if ev.done}
        seen.append((sum(e.session.frontier is not None for e in ran), len(ran)))
        return events

    monkeypatch.setattr(batch_module.Batcher, "step", step)
    return seen


@pytest.fixture(scope="module")
def dg(tiny_dg_mlx_dir):
    return api.load(tiny_dg_mlx_dir)


REQUESTS = [
    {"messages": [{"role": "user", "content": "Answer in JSON."}], "seed": 1, "max_tokens": 48,
     "response_format": SCHEMA},
    {"messages": [{"role": "user", "content": "Tell me a long story."}], "seed": 2, "max_tokens": 128,
     "max_denoising_steps": 8},
    {"messages": [{"role": "user", "content": "Weather in Paris for 3 days?"}], "seed": 3, "max_tokens": 64,
     "tools": TOOLS, "tool_choice": FORCED},
    {"messages": [{"role": "user", "content": "Weather in Rome?"}], "seed": 4, "max_tokens": 8,
     "tools": TOOLS, "tool_choice": FORCED},  # cut short: a 400
    {"messages": [{"role": "user", "content": "And another long one."}], "seed": 5, "max_tokens": 128,
     "max_denoising_steps": 8},
]


def solo(loaded, request: dict):
    """(status, content, tool calls, finish reason) the runtime gives the request alone."""
    tools = parse_tools(request["tools"], request["tool_choice"]) if "tools" in request else None
    ids = api.encode_prompt(loaded, messages=request["messages"], tools=tools)
    options = {**DEFAULTS, **{k: v for k, v in request.items() if k in ("seed", "max_tokens",
                                                                         "max_denoising_steps")}}
    try:
        r = api.generate(loaded, ids, options, response_format=request.get("response_format"), tools=tools)
    except api.GenerationError as exc:
        return 400, str(exc), [], None
    content = (r.text or None) if r.tool_calls else r.text  # a tool-call answer's empty content is null
    return 200, content, [(c.name, c.arguments) for c in r.tool_calls], r.finish_reason


def ask(base: str, request: dict):
    r = httpx.post(base + "/v1/chat/completions", json={"model": "m", **request}, timeout=120)
    if r.status_code != 200:
        return r.status_code, r.json()["error"]["message"], [], None
    choice = r.json()["choices"][0]
    message = choice["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    return 200, message["content"], calls, choice["finish_reason"]


def test_structured_and_tool_requests_batch_with_plain_ones(dg, serving, steps):
    want = [solo(dg, r) for r in REQUESTS]
    assert want[2][3] == "tool_calls" and want[3][0] == 400 and "max_tokens (8) ran out" in want[3][1]
    json.loads(want[0][1])  # the schema answer parses
    app = create_app(dg, DEFAULTS, queue_size=8, max_batch=4)
    with serving(app) as base:
        with ThreadPoolExecutor(len(REQUESTS)) as pool:
            got = list(pool.map(lambda r: ask(base, r), REQUESTS))
        assert app.state.worker.wait_idle(30)
        assert app.state.worker.served == len(REQUESTS)
    assert got == want
    assert max(total for _, total in steps) <= 4  # never more than --max-batch
    assert any(shaped and total > shaped for shaped, total in steps)  # structured and plain in one step


def test_lockstep_ranks_batch_a_structured_request_from_its_json_spec(tiny_llada2_mlx_dir, steps):
    """The distributed server's scheduler (every rank's Lockstep, here in one process):
    a structured and a forced tool-call request join the batch from their broadcast
    JSON spec, beside a plain one, each with its solo answer."""
    from dlm.runtime.server.lockstep import Lockstep
    from dlm.runtime.server.requests import ModelCaps, parse_chat, structured_spec

    llada = api.load(tiny_llada2_mlx_dir)
    base = {"max_tokens": 24, "block_length": 8, "max_denoising_steps": 4}
    bodies = [{"messages": [{"role": "user", "content": "Answer in JSON."}], "response_format": SCHEMA, "seed": 1},
              {"messages": [{"role": "user", "content": "A story."}], "seed": 2},
              {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "tool_choice": "required",
               "seed": 3}]
    plan, want = {"join": []}, {}
    for key, body in enumerate(bodies):
        req = parse_chat(body, ModelCaps(family="LLaDA-2"))
        ids = api.encode_prompt(llada, messages=req.messages, tools=req.tools)
        options = {**base, "seed": body["seed"]}
        try:
            want[key] = ("ok", summary_of(api.generate(llada, ids, options, response_format=req.response_format,
                                                       tools=req.tools)))
        except api.GenerationError as exc:
            want[key] = ("error", str(exc))
        spec = json.loads(json.dumps(structured_spec(req, body)))  # as broadcast to the other ranks
        plan["join"].append({"id": key, "prompt": ids, "options": options, "structured": spec})
    assert want[2] == ("error", "tool_choice forces a tool call, but max_tokens (24) ran out before the call "
                                "was complete; raise max_tokens")
    lockstep = Lockstep(llada, max_batch=4)
    assert lockstep.apply(plan) == []
    results, got = {key: api.GenerationResult() for key in want}, {}
    while not lockstep.idle:
        tick = lockstep.step()
        for key, event in tick.events:
            api._take(results[key], event)
            if event.done:
                got[key] = ("ok", summary_of(results[key]))
        for key, exc in tick.failed:
            got[key] = ("error", str(exc))
    assert got == want
    assert any(shaped and total > shaped for shaped, total in steps)


def summary_of(result):
    return (result.token_ids, result.text, result.finish_reason, result.logprobs,
            [(c.name, c.arguments) for c in result.tool_calls], result.steps_per_block)

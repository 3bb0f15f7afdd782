"""A forced tool call (tool_choice "required" or a function) that the budget
cuts short is an error naming max_tokens, never ``<tool_call>...`` markup left
in the content; without max_tokens a forced call gets room for a whole call
(issue 42), on the tiny random LLaDA-2, through the API and the server."""

from __future__ import annotations

import json

import httpx
import pytest

from dlm.runtime import api
from dlm.runtime.platform.errors import GenerationError
from dlm.runtime.server.app import create_app
from dlm.runtime.structured.tools import parse_tools
from tests.builders import copy_checkpoint
from tests.test_structured import TOOLS

MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def short_default(tiny_llada2_mlx_dir, tmp_path_factory):
    """The tiny LLaDA-2 with the demo's short default budget (max_new_tokens 32)."""
    path = copy_checkpoint(tiny_llada2_mlx_dir, tmp_path_factory.mktemp("l2_short") / "m")
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "max_new_tokens": 32}))
    return api.load(path)


def _forced(loaded):
    tools = parse_tools(TOOLS, "required", False)
    return tools, api.encode_prompt(loaded, messages=MESSAGES, tools=tools)


def test_a_forced_call_cut_by_max_tokens_is_an_error(short_default):
    tools, ids = _forced(short_default)
    with pytest.raises(GenerationError, match=r"max_tokens \(16\) ran out before the call was complete"):
        api.generate(short_default, ids, {"max_tokens": 16, "seed": 0}, tools=tools)


def test_a_forced_call_without_max_tokens_gets_room_for_the_call(short_default):
    tools, ids = _forced(short_default)
    assert short_default.settings({}).max_tokens == 32
    result = api.generate(short_default, ids, {"seed": 0}, tools=tools)
    assert result.finish_reason == "tool_calls" and result.text == ""
    assert [c.name for c in result.tool_calls] and result.stats.completion_tokens > 32


def test_the_server_answers_a_cut_forced_call_with_an_error_not_markup(short_default, serving):
    app = create_app(short_default, {}, queue_size=2)
    with serving(app) as base:
        body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "seed": 0}
        r = httpx.post(base + "/v1/chat/completions", json={**body, "max_tokens": 16}, timeout=120)
        assert r.status_code == 400, r.text
        assert "max_tokens (16) ran out" in r.json()["error"]["message"]
        r = httpx.post(base + "/v1/chat/completions", json={**body, "max_tokens": 16, "stream": True}, timeout=120)
        assert "<tool_call" not in r.text and "max_tokens (16) ran out" in r.text  # an error event, no markup
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)  # the default: room for a call
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
        assert choice["message"]["tool_calls"]

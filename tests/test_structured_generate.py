"""Structured output and forced tool calls through the Python API and the CLI,
on tiny random (untrained) models of both families: every finished answer
parses and validates (judged by ``jsonschema``), a budget too small says
"length", and runs are reproducible under a seed."""

from __future__ import annotations

import json

import jsonschema
import pytest
from click.testing import CliRunner

from dlm.runtime import api
from dlm.runtime.cli.main import main as dlm_run
from dlm.runtime.structured.tools import parse_tools
from tests.test_structured import SCHEMAS, TOOLS


@pytest.fixture(scope="module", params=["diffusion_gemma", "llada2_moe"])
def loaded(request, tiny_dg_mlx_dir, tiny_llada2_mlx_dir):
    path = tiny_dg_mlx_dir if request.param == "diffusion_gemma" else tiny_llada2_mlx_dir
    return api.load(path)


def fmt(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_every_answer_validates(loaded, index):
    ids = api.encode_prompt(loaded, "Answer in JSON.")
    for seed in range(3):
        result = api.generate(loaded, ids, {"max_tokens": 120, "seed": seed}, response_format=fmt(SCHEMAS[index]))
        assert result.finish_reason == "stop", result.text
        jsonschema.validate(json.loads(result.text), SCHEMAS[index])


def test_json_object_and_reproducibility(loaded):
    ids = api.encode_prompt(loaded, "Answer in JSON.")
    runs = [api.generate(loaded, ids, {"max_tokens": 64, "seed": 3}, response_format={"type": "json_object"})
            for _ in range(2)]
    assert isinstance(json.loads(runs[0].text), dict)
    assert runs[0].token_ids == runs[1].token_ids


def test_a_budget_too_small_says_length_not_invalid_json(loaded):
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 40}}, "required": ["s"]}
    ids = api.encode_prompt(loaded, "x")
    result = api.generate(loaded, ids, {"max_tokens": 12, "seed": 0}, response_format=fmt(schema))
    assert result.finish_reason == "length" and len(result.token_ids) == 12
    assert result.text.startswith('{"s":"')


def test_logprobs_come_with_every_token(loaded):
    ids = api.encode_prompt(loaded, "x")
    result = api.generate(loaded, ids, {"max_tokens": 48, "seed": 0}, response_format=fmt(SCHEMAS[1]), logprobs=3)
    assert [r.token for r in result.logprobs] == result.token_ids
    for record in result.logprobs:
        assert record.logprob <= 0 and 1 <= len(record.top) <= 3
        values = [lp for _, lp in record.top]
        assert values == sorted(values, reverse=True) and record.logprob <= values[0] + 1e-6


def test_forced_tool_calls_validate(loaded):
    tools = parse_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, False)
    ids = api.encode_prompt(loaded, "Weather in Paris for 3 days?", tools=tools)
    for seed in range(3):
        result = api.generate(loaded, ids, {"max_tokens": 96, "seed": seed}, tools=tools)
        assert result.finish_reason == "tool_calls" and result.text == ""
        (call,) = result.tool_calls
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), TOOLS[0]["function"]["parameters"])


def test_tools_reach_the_chat_template(loaded, monkeypatch):
    seen = {}
    original = type(loaded.tokenizer).apply_chat_template

    def spy(self, messages, **kwargs):
        seen.update(kwargs)
        kwargs.pop("tools", None)
        return original(self, messages, **kwargs)

    monkeypatch.setattr(type(loaded.tokenizer), "apply_chat_template", spy)
    api.encode_prompt(loaded, "hi", tools=parse_tools(TOOLS, "auto"))
    assert [t["function"]["name"] for t in seen["tools"]] == ["get_weather", "noop"]


def test_cli_json_schema_and_its_errors(loaded, tmp_path):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMAS[2]))
    runner = CliRunner()
    out = runner.invoke(dlm_run, ["generate", "--model", str(loaded.path), "-p", "x", "--json-schema",
                                  str(schema_file), "--seed", "2", "-m", "96", "--json", "--logprobs", "1"])
    assert out.exit_code == 0, out.output
    body = json.loads(out.stdout)
    jsonschema.validate(json.loads(body["text"]), SCHEMAS[2])
    assert body["finish_reason"] == "stop" and len(body["logprobs"]) == len(body["token_ids"])
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "bogus"}')
    for args, fragment in [(["--json-schema", str(bad)], "Invalid type: bogus"),
                           (["--json-schema", str(tmp_path / "missing.json")], "cannot read it"),
                           (["--json-schema", str(schema_file), "--json-object"], "not both"),
                           (["--logprobs", "2"], "--logprobs goes with")]:
        out = runner.invoke(dlm_run, ["generate", "--model", str(loaded.path), "-p", "x", *args])
        assert out.exit_code != 0 and fragment in out.output, out.output

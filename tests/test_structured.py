"""The structured-output core on hand-made canvases: the grammar constraint,
the commit frontier, closing within a budget, tool-call parsing, and the
request checks. The grammar engine is llguidance; validity is judged by
``json`` and ``jsonschema``, never by dlm's own code."""

from __future__ import annotations

import json

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from dlm.runtime.structured import (Frontier, Rows, StructuredError, build_constraint, json_object, json_schema,
                                    parse_response_format)
from dlm.runtime.structured.toolcalls import ToolCallSplitter, gemma_arguments, parse_call
from dlm.runtime.structured.tools import GEMMA, JSON_TAGS, ToolSyntax, call_grammar, parse_tools
from tests.builders import build_diffusion_gemma_tokenizer

VOCAB = 512
STOP = 1

SCHEMAS = [
    {"type": "object", "properties": {"sorted": {"type": "string", "maxLength": 12}}, "required": ["sorted"],
     "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]}},
     "required": ["n", "ok", "tag"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"k": {"type": "string", "maxLength": 3}, "v": {"type": "number"}},
        "required": ["k", "v"], "additionalProperties": False}}}, "required": ["items"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "string", "minLength": 2, "maxLength": 4}}, "required": ["c"]}}, "required": ["b"]},
        "opt": {"type": "integer"}}, "required": ["a"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("structured_tok")
    build_diffusion_gemma_tokenizer(VOCAB, out)
    return AutoTokenizer.from_pretrained(str(out))


def frontier_for(tokenizer, fmt, budget=None, logprobs=None):
    return Frontier(build_constraint(fmt, tokenizer, VOCAB, [STOP, 106]), logprobs, budget)


class RandomRows(Rows):
    """A model that proposes anything: choose() picks a random allowed token."""

    def __init__(self, rng):
        super().__init__(mx.zeros((1, VOCAB)))
        self.rng = rng

    def choose(self, position, allowed):
        return int(self.rng.choice(np.nonzero(allowed)[0]))


def run_canvases(frontier, rng, tokenizer, fmt, length=16, steps=6, max_canvases=40):
    """Drive the frontier like a session: random proposals and acceptance each step."""
    rows = RandomRows(rng)
    for _ in range(max_canvases):
        frontier.begin(length)
        for step in range(steps):
            if frontier.complete:
                break
            before = frontier.position
            proposal = rng.integers(0, VOCAB, size=length)
            keep = rng.random(length) < 0.5
            quota = frontier.quota(steps - step)
            advance = frontier.advance(proposal, keep, quota, rows)
            assert advance.finished or frontier.position - before >= min(quota, length - before)
            # Every frozen prefix is a prefix of some valid answer: a fresh matcher takes all of it.
            fresh = frontier_for(tokenizer, fmt)
            assert fresh.constraint.matcher.validate_tokens(frontier.constraint.committed) == len(
                frontier.constraint.committed)
        assert frontier.complete
        if frontier.finished:
            return True
    return False


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_random_commits_always_give_a_valid_answer(tokenizer, index):
    schema = SCHEMAS[index]
    for seed in range(4):
        rng = np.random.default_rng(seed)
        fmt = json_schema(schema)
        frontier = frontier_for(tokenizer, fmt, budget=200)
        assert run_canvases(frontier, rng, tokenizer, fmt), "the closing reserve must finish the answer inside the budget"
        text = tokenizer.decode(frontier.constraint.committed)
        jsonschema.validate(json.loads(text), schema)


def test_the_schema_skeleton_is_pinned_before_the_first_step(tokenizer):
    frontier = frontier_for(tokenizer, json_schema(SCHEMAS[0]))
    pinned = frontier.begin(32)
    assert tokenizer.decode(pinned) == '{"sorted":"'


def test_a_proposal_the_grammar_refuses_is_replaced_by_the_best_allowed_token(tokenizer):
    frontier = frontier_for(tokenizer, json_schema(SCHEMAS[1]))
    start = len(frontier.begin(8))  # '{"n":'
    logits = np.full((8, VOCAB), -5.0, dtype=np.float32)
    seven = tokenizer.convert_tokens_to_ids("7")
    logits[start, seven] = 3.0  # the best token the grammar allows
    proposal = np.full(8, tokenizer.convert_tokens_to_ids("x"))  # refused everywhere
    keep = np.zeros(8, dtype=bool)
    keep[start] = True
    advance = frontier.advance(proposal, keep, 0, Rows(mx.array(logits)))
    assert advance.corrected == 1 and advance.tokens[0] == seven
    assert frontier.position == start + 1  # a correction ends the run: the next step sees it


def test_the_answer_ends_at_the_model_stop_only_when_complete(tokenizer):
    frontier = frontier_for(tokenizer, json_object())
    frontier.begin(8)  # '{'
    proposal = np.array([0, STOP] + [STOP] * 6)
    keep = np.ones(8, dtype=bool)
    logits = np.zeros((8, VOCAB), dtype=np.float32)
    logits[:, tokenizer.convert_tokens_to_ids("}")] = 5.0
    advance = frontier.advance(proposal, keep, 1, Rows(mx.array(logits)))
    # The stop at position 1 is refused ('{' is not complete): '}' replaces it; then the grammar is done.
    assert tokenizer.decode(frontier.constraint.committed) == "{}"
    assert advance.finished


def test_a_budget_too_small_closes_what_it_can(tokenizer):
    fmt = json_schema(SCHEMAS[0])
    frontier = frontier_for(tokenizer, fmt, budget=8)
    assert frontier.closing  # 8 tokens is inside the reserve from the start
    assert run_canvases(frontier, np.random.default_rng(0), tokenizer, fmt, length=64, steps=2)
    assert json.loads(tokenizer.decode(frontier.constraint.committed)) == {"sorted": ""}


def test_logprobs_are_the_model_distribution_over_allowed_tokens(tokenizer):
    frontier = frontier_for(tokenizer, json_schema(SCHEMAS[1]), logprobs=2)
    start = len(frontier.begin(8))  # '{"n":' is forced: log p = 0
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(8, VOCAB)).astype(np.float32)
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]  # what '"n":' allows
    best = max(digits, key=lambda t: logits[start, t])
    proposal = np.full(8, best)
    keep = np.zeros(8, dtype=bool)
    keep[start] = True
    frontier.advance(proposal, keep, 0, Rows(mx.array(logits)))
    assert [r.logprob for r in frontier.records[:start]] == [0.0] * start
    record = frontier.records[start]
    z = logits[start, digits]
    logp = {t: float(v - np.log(np.exp(z).sum())) for t, v in zip(digits, z)}
    assert record.token == best and record.logprob == pytest.approx(logp[best], abs=1e-5)
    top = sorted(digits, key=lambda t: -logits[start, t])[:2]
    assert [t for t, _ in record.top] == top
    assert [v for _, v in record.top] == pytest.approx([logp[t] for t in top], abs=1e-5)
    assert len(frontier.records) == start + 1


# -- tool calls ------------------------------------------------------------------

GEMMA_SYNTAX = ToolSyntax(GEMMA, "<|tool_call>", "<tool_call|>", '<|"|>')
TAGS_SYNTAX = ToolSyntax(JSON_TAGS, "<tool_call>", "</tool_call>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "noop"}}]


def test_gemma_call_dialect_parses_to_json_arguments():
    args = gemma_arguments('{city:<|"|>New York, "NY"<|"|>,days:3,opts:{metric:true,list:[1,<|"|>a<|"|>]}}', '<|"|>')
    assert args == {"city": 'New York, "NY"', "days": 3, "opts": {"metric": True, "list": [1, "a"]}}
    call = parse_call('call:get_weather{city:<|"|>Paris<|"|>,days:2}', GEMMA_SYNTAX)
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 2}
    assert parse_call("call:get_weather{city:", GEMMA_SYNTAX) is None


def test_splitter_holds_back_markers_across_feeds_and_keeps_bad_calls_as_text():
    s = ToolCallSplitter(TAGS_SYNTAX)
    pieces = ["Sure. <tool", '_call>{"name": "noop", "argu', 'ments": {}}</tool_call>', " <tool_call>oops</tool_call>"]
    shown = [s.feed(p) for p in pieces] + [s.feed("", final=True)]
    assert "".join(c for c, _ in shown) == "Sure.  <tool_call>oops</tool_call>"  # the text around the call
    assert [c.name for c in s.calls] == ["noop"] and json.loads(s.calls[0].arguments) == {}
    assert "<tool" not in shown[0][0]  # a possible marker start is not shown before it is known


def test_tool_requests_are_checked_naming_the_field():
    assert parse_tools(TOOLS, "none") is None and parse_tools(None, "auto") is None
    req = parse_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, False)
    assert req.forced and [f.name for f in req.targets()] == ["get_weather"] and not req.parallel
    for tools, choice, param in [
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
        (TOOLS, "always", "tool_choice"),
        ([{"type": "function", "function": {"name": "a b"}}], None, "tools[0].function.name"),
        (TOOLS + TOOLS[:1], None, "tools[2].function.name"),
        ([{"type": "retrieval"}], None, "tools[0]"),
        (None, "required", "tool_choice"),
    ]:
        with pytest.raises(StructuredError) as err:
            parse_tools(tools, choice)
        assert err.value.param == param


@pytest.mark.parametrize("syntax", [GEMMA_SYNTAX, TAGS_SYNTAX], ids=["gemma", "json-tags"])
def test_forced_calls_always_parse_and_validate(tokenizer, syntax):
    from dlm.runtime.structured.formats import TOOL_CALLS, ResponseFormat
    from dlm.runtime.generation.text import token_id

    request = parse_tools(TOOLS, "required", False)
    lark = call_grammar(request, syntax, lambda text: token_id(tokenizer, text))
    fmt = ResponseFormat(TOOL_CALLS, {}, where="tool_choice", lark=lark)
    for seed in range(4):
        frontier = frontier_for(tokenizer, fmt, budget=160)
        assert run_canvases(frontier, np.random.default_rng(seed), tokenizer, fmt)
        text = tokenizer.decode(frontier.constraint.committed, skip_special_tokens=False)
        splitter = ToolCallSplitter(syntax)
        content, calls = splitter.feed(text, final=True)
        assert content == "" and len(calls) == 1, text
        schema = {f["function"]["name"]: f["function"].get("parameters", {"type": "object"}) for f in TOOLS}
        jsonschema.validate(json.loads(calls[0].arguments), schema[calls[0].name])


# -- request shapes --------------------------------------------------------------

def test_response_formats_are_checked_naming_the_field():
    assert parse_response_format({"type": "text"}) is None
    assert parse_response_format({"type": "json_object"}).schema == {"type": "object"}
    fmt = parse_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS[0]}})
    assert fmt.schema == SCHEMAS[0] and fmt.name == "x"
    for value, param in [
        ({"type": "yaml"}, "response_format.type"),
        ("json", "response_format"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"schema": True}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "response_format.json_schema.strict"),
        ({"type": "json_object", "extra": 1}, "response_format"),
    ]:
        with pytest.raises(StructuredError) as err:
            parse_response_format(value)
        assert err.value.param == param


@pytest.mark.parametrize("schema,fragment", [
    ({"type": "bogus"}, "bogus"),
    ({"type": "integer", "minimum": "x"}, "minimum"),
    ({"$ref": "#/definitions/missing"}, "missing"),
])
def test_a_schema_the_engine_refuses_names_the_problem(tokenizer, schema, fragment):
    with pytest.raises(StructuredError) as err:
        build_constraint(json_schema(schema), tokenizer, VOCAB, [STOP])
    assert fragment in str(err.value) and err.value.param == "response_format.json_schema.schema"



def test_gemma_call_markers_survive_detokenizing_and_parse(tokenizer):
    """<|tool_call>, <tool_call|> and <|"|> are special tokens: the answer text
    keeps them (skip_special_tokens drops the others), so an unconstrained
    ("auto") call the model writes is found and parsed."""
    from dlm.runtime.generation.text import ChannelParser

    text = '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,days:2}<tool_call|>'
    enc = lambda t: tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
    ids = (enc("ok ") + [48] + enc("call:get_weather{city:") + [52] + enc("Oslo") + [52] + enc(",days:2}") + [49]
           + [tokenizer.convert_tokens_to_ids("<pad>")])
    assert tokenizer.convert_ids_to_tokens([48, 49, 52]) == ["<|tool_call>", "<tool_call|>", '<|"|>']
    kept = ChannelParser(tokenizer, skip_special_tokens=True, keep=GEMMA_SYNTAX.marker_tokens())
    answer, _ = kept.feed(ids, final=True)
    assert answer == "ok " + text  # markers kept, <pad> still skipped
    content, calls = ToolCallSplitter(GEMMA_SYNTAX).feed(answer, final=True)
    assert content == "ok " and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Oslo", "days": 2}

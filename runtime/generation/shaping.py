"""What a request asks of its output's shape, prepared once for a run alone
(``api.stream_generate``) and for a request in a batch (``dlm.runtime.batch``):
structured output (``response_format``, ``logprobs``), tool calls taken out of
the text, and a forced ``tool_choice`` (its grammar, and room for a whole call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

from ..platform.errors import GenerationError
from .events import GenerationEvent

# The budget a forced tool call gets when the request sets no max_tokens (the
# checkpoint's default can be far shorter than one call: the demo's is 32).
FORCED_CALL_TOKENS = 512


def tool_format(loaded, tools):
    """The response format that forces ``tools``' calls (a ToolRequest whose
    tool_choice is "required" or a function), or None."""
    if tools is None or not tools.forced:
        return None
    from ..structured.formats import TOOL_CALLS, ResponseFormat
    from ..structured.tools import call_grammar
    from .text import token_id

    lark = call_grammar(tools, loaded.family.tool_syntax, lambda text: token_id(loaded.tokenizer, text))
    return ResponseFormat(TOOL_CALLS, {}, where="tool_choice", lark=lark)


def structured_output(response_format=None, logprobs: Optional[int] = None):
    """The ``structured`` hook for a response format (OpenAI's ``response_format``
    dict, a ResponseFormat, or None for plain text), or None; ``logprobs``: report
    each token's log-probability and that many most likely allowed alternatives."""
    from ..structured import Structured, parse_response_format

    fmt = parse_response_format(response_format)
    if fmt is None:
        if logprobs is not None:
            raise GenerationError("logprobs are reported for structured output only (give a response format)")
        return None
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= 20):
        raise GenerationError(f"logprobs must be an integer in [0, 20], got {logprobs!r}")
    return Structured(fmt, logprobs)


class ToolCalls:
    """One run's events, one at a time in order, with the model's tool calls taken
    out of the text (structured.toolcalls). ``forced_budget``: the max_tokens of a
    forced tool_choice, whose run must end with complete calls: one cut short by
    the budget is an error, never markup left in the content."""

    def __init__(self, syntax, forced_budget: Optional[int] = None):
        from ..structured.toolcalls import ToolCallSplitter

        self.syntax, self.forced_budget = syntax, forced_budget
        self.splitter = ToolCallSplitter(syntax)

    def __call__(self, event: GenerationEvent) -> GenerationEvent:
        splitter, syntax = self.splitter, self.syntax
        if self.forced_budget is not None and event.done and event.finish_reason == "length":
            text, calls = splitter.feed(event.text)  # an open call stays held back
            if splitter.buffer.startswith(syntax.open) or not splitter.calls:  # a call begun, not closed
                raise GenerationError(
                    f"tool_choice forces a tool call, but max_tokens ({self.forced_budget}) ran out before the "
                    "call was complete; raise max_tokens")
            rest, more = splitter.feed("", final=True)
            event.text, event.tool_calls = text + rest, calls + more
        else:
            event.text, event.tool_calls = splitter.feed(event.text, final=event.done)
        if event.done and splitter.calls and event.finish_reason == "stop":
            event.finish_reason = "tool_calls"
        return event

    def stream(self, events: Iterator[GenerationEvent]) -> Iterator[GenerationEvent]:
        for event in events:
            yield self(event)


@dataclass
class Shaping:
    """A request's run, prepared: the family's settings (a forced call's budget
    in them), the ``structured`` hook of its session (None: plain text), and
    what every event of the run goes through (None: nothing)."""

    settings: object
    structured: object = None
    tool_calls: Optional[ToolCalls] = None


def shape(loaded, options: Optional[dict], prompt_tokens: int, response_format=None,
          logprobs: Optional[int] = None, tools=None) -> Shaping:
    """The Shaping of a request of ``prompt_tokens`` tokens (GenerationError for
    bad options, or a forced tool_choice with a response_format). ``tools``: a
    ToolRequest (dlm.runtime.structured.tools.parse_tools) or OpenAI tool dicts
    (tool_choice "auto")."""
    options = dict(options or {})
    settings = loaded.settings(options)
    if tools is not None and not hasattr(tools, "forced"):  # OpenAI tool dicts: tool_choice "auto"
        from ..structured.tools import parse_tools

        tools = parse_tools(list(tools))
    forced = tool_format(loaded, tools)
    if forced is not None:
        if response_format is not None:
            raise GenerationError("a forced tool_choice and a response_format cannot both shape the output")
        response_format = forced
        if options.get("max_tokens") is None:  # room for a whole call, within the context
            room = loaded.args.max_position_embeddings - prompt_tokens
            if settings.max_tokens < min(FORCED_CALL_TOKENS, room):
                settings = loaded.settings({**options, "max_tokens": min(FORCED_CALL_TOKENS, room)})
    structured = structured_output(response_format, logprobs)
    calls = None if tools is None else ToolCalls(loaded.family.tool_syntax,
                                                 settings.max_tokens if forced is not None else None)
    return Shaping(settings, structured, calls)

"""Tool calls: the request's ``tools`` / ``tool_choice`` and the grammar that
makes a forced call's arguments always parse and validate.

A family declares its call syntax once (``runtime/models/<family>/tools.py``,
``TOOL_SYNTAX``): Gemma 4's ``<|tool_call>call:NAME{...}<tool_call|>`` or the
JSON-in-tags form ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
The chat template renders the declarations and earlier calls/results; the
model's own calls are split from the answer text by toolcalls.py.

``tool_choice``: "none" (no tools rendered, nothing parsed), "auto" (free
generation; calls the model writes are parsed), "required" or a named
function (the output is constrained to one call, or several with
``parallel_tool_calls``, whose arguments are compact JSON valid against the
function's ``parameters``; DiffusionGemma's call syntax accepts JSON).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from .formats import StructuredError
from .grammar import JSON_OPTIONS

GEMMA, JSON_TAGS = "gemma", "json"
MAX_TOOLS = 128  # functions in one request (each schema is compiled: limits.py bounds one)
NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


@dataclass(frozen=True)
class ToolSyntax:
    """How a family's model writes a call (see the module docstring)."""

    style: str  # GEMMA | JSON_TAGS
    open: str  # the text (or special token) that opens a call
    close: str  # ... and closes it
    string_delim: Optional[str] = None  # GEMMA: the token that quotes strings ('<|"|>')

    def marker_tokens(self) -> tuple[str, ...]:
        """The markers that must survive detokenizing (they may be special tokens)."""
        return tuple(t for t in (self.open, self.close, self.string_delim) if t)


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict


@dataclass(frozen=True)
class ToolRequest:
    """The request's tools, checked: ``choice`` is "auto", "required" or a function name."""

    functions: tuple[Function, ...]
    choice: str = "auto"
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def template_tools(self) -> list[dict]:
        """The tools as chat templates take them (OpenAI's shape)."""
        return [{"type": "function", "function": {"name": f.name, "description": f.description,
                                                  "parameters": f.parameters}} for f in self.functions]

    def targets(self) -> tuple[Function, ...]:
        if self.choice in ("auto", "required"):
            return self.functions
        return tuple(f for f in self.functions if f.name == self.choice)


def _bad(message: str, param: str) -> StructuredError:
    return StructuredError(message, param)


def parse_tools(tools: Any, tool_choice: Any = None, parallel: Any = None) -> Optional[ToolRequest]:
    """The ToolRequest of OpenAI ``tools`` / ``tool_choice`` /
    ``parallel_tool_calls`` (None: no tools, or tool_choice "none"), or
    StructuredError naming the field at fault."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise _bad("'tool_choice' names a tool but the request has no 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    if len(tools) > MAX_TOOLS:
        raise _bad(f"'tools' declares {len(tools)} functions (limit {MAX_TOOLS})", "tools")
    functions, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise _bad(f"'{where}' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", where)
        extra = sorted(k for k in tool if k not in ("type", "function"))
        if extra:
            raise _bad(f"unsupported field(s) in '{where}': {', '.join(map(repr, extra))}", where)
        fn = tool["function"]
        extra = sorted(k for k in fn if k not in ("name", "description", "parameters", "strict"))
        if extra:
            raise _bad(f"unsupported field(s) in '{where}.function': {', '.join(map(repr, extra))}",
                       f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name or not set(name) <= NAME_CHARS or len(name) > 64:
            raise _bad(f"'{where}.function.name' must be 1-64 characters of a-z, A-Z, 0-9, _, - or ., "
                       f"got {name!r}", f"{where}.function.name")
        if name in names:
            raise _bad(f"'{where}.function.name': {name!r} is declared twice", f"{where}.function.name")
        names.add(name)
        description = fn.get("description", "")
        if not isinstance(description, str):
            raise _bad(f"'{where}.function.description' must be a string", f"{where}.function.description")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _bad(f"'{where}.function.parameters' must be a JSON Schema object", f"{where}.function.parameters")
        _check_schema(params, f"{where}.function.parameters")
        functions.append(Function(name, description, params))
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
        choice = fn["name"]
        if choice not in names:
            raise _bad(f"'tool_choice.function.name' {choice!r} is not one of the request's tools "
                       f"({', '.join(sorted(names))})", "tool_choice.function.name")
    elif choice == "none":
        return None
    elif choice not in ("auto", "required"):
        raise _bad(f"'tool_choice' must be \"none\", \"auto\", \"required\" or a function, got {choice!r}",
                   "tool_choice")
    return ToolRequest(tuple(functions), choice, True if parallel is None else parallel)


def _check_schema(schema: dict, where: str) -> None:
    """A schema within the limits (limits.py), or StructuredError naming
    ``where``; cheap: the grammar engine compiles it later (check_schemas), off
    a server's event loop."""
    from .formats import json_schema

    json_schema(schema, where=where)


def check_schemas(request: Optional[ToolRequest]) -> None:
    """Every function's ``parameters`` compiled by the grammar engine, or
    StructuredError naming the first it refuses (bounded by limits.py; run it
    with grammar.compile_bounded)."""
    from .formats import json_schema
    from .grammar import check_format

    for i, fn in enumerate(request.functions if request is not None else ()):
        check_format(json_schema(fn.parameters, where=f"tools[{i}].function.parameters"))


def _schema(params: dict) -> str:
    return json.dumps({**params, "x-guidance": {**params.get("x-guidance", {}), **JSON_OPTIONS}})


def _lark_string(text: str) -> str:
    return json.dumps(text)


def call_grammar(request: ToolRequest, syntax: ToolSyntax, token_id) -> str:
    """The llguidance (Lark) grammar of the calls a forced ``tool_choice`` allows.
    ``token_id(text)``: the id of a marker when it is a single token (then it is
    matched as that token), else None (matched as text)."""
    def marker(text: str) -> str:
        tid = token_id(text)
        return f"<[{tid}]>" if tid is not None else _lark_string(text)

    calls = []
    for fn in request.targets():
        if syntax.style == GEMMA:
            calls.append(f"{_lark_string('call:' + fn.name)} %json{_schema(fn.parameters)}")
        else:
            wrapper = {"type": "object", "properties": {"name": {"const": fn.name}, "arguments": fn.parameters},
                       "required": ["name", "arguments"], "additionalProperties": False}
            calls.append(f"%json{_schema(wrapper)}")
    body = " | ".join(f"({c})" for c in calls)
    repeat = "+" if request.parallel else ""
    return f"start: call{repeat}\ncall: {marker(syntax.open)} ({body}) {marker(syntax.close)}\n"

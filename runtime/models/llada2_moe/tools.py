"""LLaDA-2's tool-call syntax: the JSON-in-tags form,
``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`` (whitespace around
the JSON allowed), the convention of Hermes/Qwen-style templates. The released
LLaDA2.x ``chat_template.jinja`` was not available to check offline; a
checkpoint whose template writes calls differently needs this declaration changed."""

from ...structured.tools import JSON_TAGS, ToolSyntax

TOOL_SYNTAX = ToolSyntax(JSON_TAGS, "<tool_call>", "</tool_call>")

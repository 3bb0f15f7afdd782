"""LLaDA-2's tool-call syntax: the JSON-in-tags form of the Ling 2.0 chat
templates LLaDA2.x ships, ``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>``
(whitespace around the JSON allowed)."""

from ...structured.tools import JSON_TAGS, ToolSyntax

TOOL_SYNTAX = ToolSyntax(JSON_TAGS, "<tool_call>", "</tool_call>")

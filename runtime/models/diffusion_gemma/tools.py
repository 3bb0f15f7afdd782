"""DiffusionGemma's tool-call syntax (Gemma 4's): ``<|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|>``,
then ``<|tool_response>`` (an EOS id of the checkpoint) hands the turn to the caller."""

from ...structured.tools import GEMMA, ToolSyntax

TOOL_SYNTAX = ToolSyntax(GEMMA, "<|tool_call>", "<tool_call|>", '<|"|>')

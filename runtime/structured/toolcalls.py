"""The model's tool calls, split from its answer text (both families).

``ToolCallSplitter.feed(text)`` takes answer-text deltas and returns the
content to show now and the calls completed so far; text that may be the start
of a call marker is held back until it is known. Calls are parsed in the
family's syntax (tools.ToolSyntax): Gemma 4 writes ``call:NAME{key:<|"|>a
string<|"|>,n:3}`` (bare keys, strings between ``<|"|>``), which becomes JSON
arguments; the JSON-in-tags form holds ``{"name": ..., "arguments": {...}}``.
A call that does not parse stays in the content, as the model wrote it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Optional

from .tools import GEMMA, ToolSyntax


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def to_openai(self, index: Optional[int] = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def gemma_arguments(text: str, delim: str) -> Optional[dict]:
    """Gemma 4's argument dialect (or plain JSON) as a dict, or None."""
    try:
        value = json.loads(text)
        return value if isinstance(value, dict) else None
    except ValueError:
        pass
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith(delim, i):
            end = text.find(delim, i + len(delim))
            if end < 0:
                return None
            out.append(json.dumps(text[i + len(delim):end]))
            i = end + len(delim)
            continue
        m = re.match(r"[A-Za-z_][\w.-]*(?=\s*:)", text[i:])
        if m and (not out or out[-1].rstrip()[-1:] in "{,"):
            out.append(json.dumps(m.group(0)))
            i += m.end()
            continue
        out.append(text[i])
        i += 1
    try:
        value = json.loads("".join(out))
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def parse_call(body: str, syntax: ToolSyntax) -> Optional[ToolCall]:
    """One call's text between the markers, or None when it does not parse."""
    if syntax.style == GEMMA:
        m = re.match(r"\s*call:([\w.-]+)\s*(\{.*\})\s*$", body, re.DOTALL)
        if not m:
            return None
        args = gemma_arguments(m.group(2), syntax.string_delim or '"')
        return None if args is None else ToolCall(m.group(1), json.dumps(args), _new_id())
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(value["name"], json.dumps(args), _new_id())


class ToolCallSplitter:
    """Answer text in, (content delta, new calls) out (module docstring)."""

    def __init__(self, syntax: ToolSyntax):
        self.syntax = syntax
        self.buffer = ""  # text not yet shown: a possible marker start, or an open call
        self.calls: list[ToolCall] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.buffer += text
        shown, new = [], []
        s = self.syntax
        while True:
            start = self.buffer.find(s.open)
            if start < 0:
                keep = 0 if final else _partial(self.buffer, s.open)
                shown.append(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            end = self.buffer.find(s.close, start + len(s.open))
            if end < 0:
                shown.append(self.buffer[:start])
                self.buffer = self.buffer[start:]
                if final:  # an unclosed call: shown as written
                    shown.append(self.buffer)
                    self.buffer = ""
                break
            call = parse_call(self.buffer[start + len(s.open):end], s)
            if call is None:
                shown.append(self.buffer[:end + len(s.close)])
            else:
                shown.append(self.buffer[:start])
                new.append(call)
            self.buffer = self.buffer[end + len(s.close):]
        self.calls.extend(new)
        return "".join(shown), new


def _partial(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that starts ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0

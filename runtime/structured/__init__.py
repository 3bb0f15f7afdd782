"""Structured output on the canvas: JSON (``response_format``) and tool-call
arguments that always parse and validate, for every family.

formats.py (the request: OpenAI ``response_format``, checked), grammar.py
(llguidance over the model's tokenizer: masks, forced tokens), frontier.py
(how a canvas/block commits under a grammar), tools.py (``tools`` /
``tool_choice``: rendering, parsing, constraining). ``Structured`` is what
the API hands a family's session; the session calls ``frontier(...)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from .formats import JSON_OBJECT, JSON_SCHEMA, ResponseFormat, StructuredError, json_object, json_schema
from .formats import parse_response_format
from .frontier import Advance, Frontier, Rows, TokenLogprob
from .grammar import Constraint, build_constraint


@dataclass(frozen=True)
class Structured:
    """A structured run's request: the format, and logprobs (None: none; k:
    the chosen token's log-probability and the k most likely allowed tokens)."""

    format: ResponseFormat
    logprobs: Optional[int] = None

    def frontier(self, tokenizer, vocab: int, stop_ids: Iterable[int], budget: Optional[int] = None) -> Frontier:
        """A fresh frontier for one run; ``budget``: its token budget (closing, frontier.py)."""
        return Frontier(build_constraint(self.format, tokenizer, vocab, stop_ids), self.logprobs, budget)


__all__ = [
    "Advance", "Constraint", "Frontier", "JSON_OBJECT", "JSON_SCHEMA", "ResponseFormat", "Rows",
    "Structured", "StructuredError", "TokenLogprob", "build_constraint", "json_object", "json_schema",
    "parse_response_format",
]

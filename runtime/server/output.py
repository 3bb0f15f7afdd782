"""One request's output as the server relays it: ``stop`` strings applied to
text that arrives in pieces, and the committed text, reasoning, logprobs, tool
calls, token count, finish reason and stats accumulated from the events."""

from __future__ import annotations

from typing import Optional

from ..generation.events import GenerationEvent, GenerationStats


class StopMatcher:
    """Applies ``stop`` strings to text that arrives in pieces.

    ``feed`` returns the text that is safe to emit: everything before the first
    stop string, holding back a tail that could still grow into one."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""
        self.hit = False

    def feed(self, text: str) -> str:
        if self.hit:
            return ""
        buf = self.pending + text
        found = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if found:
            self.hit, self.pending = True, ""
            return buf[: min(found)]
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self.pending = buf[len(buf) - hold:]
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return "" if self.hit else out


class Output:
    """Accumulates one request's events: text after stop strings, reasoning,
    token count, finish reason and stats."""

    def __init__(self, stops: list[str]):
        self.matcher = StopMatcher(stops)
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.tokens = 0
        self.finish_reason: Optional[str] = None
        self.stats: Optional[GenerationStats] = None
        self.logprobs: Optional[list] = None  # structured runs with logprobs: every token's record
        self.delta_logprobs: Optional[list] = None  # the last event's
        self.tool_calls: list = []  # runs with tools: the calls the model made

    def add(self, event: GenerationEvent) -> tuple[str, str]:
        """Take one event; returns the (reasoning, text) deltas to emit now."""
        if self.finish_reason is not None:
            return "", ""
        self.tokens += len(event.token_ids)
        self.delta_logprobs = event.logprobs
        self.tool_calls.extend(event.tool_calls)
        if event.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(event.logprobs)
        reasoning = event.reasoning or ""
        text = self.matcher.feed(event.text or "")
        if self.matcher.hit:
            self.finish_reason = "stop"
        elif event.done:
            text += self.matcher.flush()
            # "cancelled" without a client disconnect means a shutdown; report
            # it as a stop, as mlxcel does.
            self.finish_reason = event.finish_reason if event.finish_reason in ("length", "tool_calls") else "stop"
        if event.stats is not None:
            self.stats = event.stats
        self.reasoning.append(reasoning)
        self.text.append(text)
        return reasoning, text

    @property
    def completion_tokens(self) -> int:
        return self.stats.completion_tokens if self.stats is not None else self.tokens

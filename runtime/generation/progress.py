"""The one outer generation loop every family shares.

A family supplies a *session* (its prefill and its per-canvas / per-block step,
with the model call inside); this loop owns everything around it: prefill
timing, the token budget, trimming at the budget and at the first stop token,
cancellation, detokenizing and the thinking channel, the stats, and the final
event with peak memory. The CLI, the API, the server and the parity suite all
consume the events it yields.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Protocol

import mlx.core as mx

from ..platform.errors import GenerationError
from .events import GenerationEvent, GenerationStats
from .text import ChannelParser


@dataclass
class Block:
    """What a session commits for one canvas or block."""

    tokens: list[int] = field(default_factory=list)  # the positions that reach the output, in order
    steps: int = 0  # forwards spent on it
    stopped_early: bool = False  # before its step budget
    cancelled: bool = False
    logprobs: Optional[list] = None  # structured runs: one TokenLogprob per token (before trimming)


@dataclass
class PrefixState:
    """A prefix cache kept across runs (``dlm-run chat`` turns): the family's
    cache and the token ids it holds. A run whose prompt starts with those ids
    encodes only the rest; the session updates it as it commits."""

    cache: object = None
    ids: list[int] = field(default_factory=list)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Session(Protocol):
    block_name: str  # "canvas" | "block": what stats.steps_per_block counts
    budget: int  # most tokens this run may emit
    stop_ids: frozenset[int]  # a token that ends the output (not emitted)
    skip_special_tokens: bool  # detokenize without special tokens
    cached_tokens: int  # prompt tokens a PrefixState served (set by prefill)

    def prefill(self) -> None: ...

    def next_block(self, remaining: int) -> Block: ...


def check_prompt(prompt_ids: list[int], args, max_tokens: Optional[int] = None) -> None:
    """A prompt any family can run: not empty, ids inside the vocabulary, shorter
    than the context, and with room in the context for ``max_tokens`` (the CLI
    and the server apply the same rule: a budget the context cannot hold is
    refused, never cut silently)."""
    if not prompt_ids:
        raise GenerationError("the prompt is empty")
    bad = [t for t in prompt_ids if not 0 <= int(t) < args.vocab_size]
    if bad:
        raise GenerationError(f"prompt token id {bad[0]} is outside the vocabulary (size {args.vocab_size})")
    if len(prompt_ids) >= args.max_position_embeddings:
        raise GenerationError(
            f"the prompt has {len(prompt_ids)} tokens; the model context is "
            f"{args.max_position_embeddings} (max_position_embeddings)"
        )
    if max_tokens is not None and len(prompt_ids) + max_tokens > args.max_position_embeddings:
        raise GenerationError(
            f"--max-tokens {max_tokens}: the prompt ({len(prompt_ids)} tokens) + max_tokens exceeds the model "
            f"context of {args.max_position_embeddings} tokens; lower --max-tokens (max_tokens) to at most "
            f"{args.max_position_embeddings - len(prompt_ids)}"
        )


def trim(tokens: list[int], remaining: int, stop_ids) -> tuple[list[int], bool]:
    """Cut a committed block to the output budget and at the first stop token
    (excluded). Returns (tokens to emit, whether a stop token ended the output)."""
    tokens = tokens[:remaining]
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[:i], True
    return tokens, False


class _NoText:
    def feed(self, ids):
        return "", ""

    def flush(self):
        return "", ""


class Progress:
    """One run's bookkeeping around its session: the token budget, trimming at
    the budget and at the first stop token, the thinking channel, the stats and
    the final event. ``run`` drives one session with it; the batch scheduler
    (dlm.runtime.batch) drives many, one committed canvas/block at a time."""

    def __init__(self, session: Session, loaded, prompt_ids: list[int]):
        tokenizer = getattr(loaded, "tokenizer", None)
        self.session = session
        family = getattr(loaded, "family", None)
        keep = family.tool_syntax.marker_tokens() if family is not None else ()
        self.text = (ChannelParser(tokenizer, prompt_ids, session.skip_special_tokens, keep)
                     if tokenizer is not None else _NoText())
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids), block_name=session.block_name)
        self.produced, self.finish = 0, "length"
        self.done = self.produced >= session.budget

    @property
    def remaining(self) -> int:
        return self.session.budget - self.produced

    def prefilled(self, seconds: float) -> None:
        """Record the prefill (``seconds`` include the vision encoder, reported apart)."""
        session, stats = self.session, self.stats
        stats.vision_seconds = getattr(session, "vision_seconds", 0.0)
        stats.image_tokens = getattr(session, "image_tokens", 0)
        stats.prompt_seconds = seconds - stats.vision_seconds
        stats.cached_prompt_tokens = getattr(session, "cached_tokens", 0)
        stats.deferred_prompt_tokens = getattr(session, "deferred_prompt_tokens", 0)

    def commit(self, block: Block) -> Optional[GenerationEvent]:
        """Take one block the session finished: its event, or None when it was
        cancelled. Sets ``done`` once the run is over."""
        stats = self.stats
        stats.forwards += block.steps
        if block.cancelled:
            self.finish, self.done = "cancelled", True
            return None
        stats.steps_per_block.append(block.steps)
        stats.early_stops += int(block.stopped_early)
        tokens, stopped = trim(block.tokens, self.remaining, self.session.stop_ids)
        self.produced += len(tokens)
        stats.completion_tokens = self.produced
        answer, reasoning = self.text.feed(tokens)
        if stopped:
            self.finish = "stop"
        # A session that commits nothing would never reach the budget.
        self.done = stopped or not block.tokens or self.produced >= self.session.budget
        logprobs = None if block.logprobs is None else block.logprobs[:len(tokens)]
        return GenerationEvent(token_ids=tokens, text=answer, reasoning=reasoning, logprobs=logprobs)

    def final(self, generation_seconds: float, peak_memory_gb: float) -> GenerationEvent:
        stats = self.stats
        stats.completion_tokens = self.produced
        stats.generation_seconds = generation_seconds
        stats.peak_memory_gb = peak_memory_gb
        answer, reasoning = self.text.flush()
        return GenerationEvent(text=answer, reasoning=reasoning, finish_reason=self.finish, stats=stats)


def run(session: Session, loaded, prompt_ids: list[int],
        cancel: Optional[Callable[[], bool]] = None) -> Iterator[GenerationEvent]:
    """Events: one per committed canvas/block (its tokens and text deltas, in
    sequence order), then the final one with finish_reason ("stop" | "length" |
    "cancelled") and stats. The session polls ``cancel`` once per step."""
    progress = Progress(session, loaded, prompt_ids)
    mx.reset_peak_memory()
    start = time.perf_counter()
    session.prefill()
    progress.prefilled(time.perf_counter() - start)

    start = time.perf_counter()
    while not progress.done:
        event = progress.commit(session.next_block(progress.remaining))
        if event is not None:
            yield event
    yield progress.final(time.perf_counter() - start, mx.get_peak_memory() / 1e9)

"""Batched generation: many requests denoised in shared forwards.

``Batcher`` is the scheduler the server's worker, ``api.generate_batch`` and
``dlm-run generate --prompts-file`` drive. Each request keeps its own session
(the family's ``Session``: prompt, caches, draws, settings) and its own
``Progress`` (dlm.runtime.generation.progress: budget, trimming, text, stats), exactly as
when it runs alone; the family's ``batch.Batch`` runs one step of every busy
request per ``step()``: the requests' canvases/blocks go through one forward
with a batch axis, and their stop flags are read in one host sync.

* Admission: waiting requests join, in order, at the start of a step, up to
  ``max_batch`` and while the sum of the requests' memory estimates
  (``session.memory_bytes``, what each was checked against alone) stays under
  the memory budget; a joiner's prompt is prefilled then (one request at a
  time), and it starts its first canvas/block with the others mid-way through
  theirs (continuous batching). A request that fits nowhere waits.
* Per-request: its own canvas/block lengths, settings, seed, budget, stop
  tokens and cancellation (its ``cancel`` is polled once per step, as alone),
  and its output's shape (generation.shaping, prepared as ``api.stream_generate``
  prepares it): a structured request's canvases/blocks follow its grammar in
  the shared steps, and a request with tools has its tool calls taken out of
  its own events. A request whose run raises (a prefill error; a forced tool
  call cut short by its budget, at its final event) fails alone (``failed``):
  the others go on.
  A request leaves the batch when it ends (budget, stop token, cancel); the
  others go on. A canvas/block that ends inside a step (a DiffusionGemma
  canvas ends when its last step or stop flag is read, at the next step) is
  committed there and the request's next one begins in that same step
  (``renew``), as alone it follows at once: no request sits out a step.
* Results: every request draws and commits what it would alone (same seed,
  same commit stream; dlm.runtime.models.rows says how the forwards keep that).
* Stats per request: its own prompt time, forwards and steps; generation time
  runs from its prefill to its end, sharing the machine with the others; the
  peak memory is the batch's since the batcher last went idle.
"""

from __future__ import annotations

import collections
import time
from typing import Callable, Hashable, Iterator, Optional

import mlx.core as mx

from .platform.errors import GenerationError
from .generation.events import GenerationEvent
from .generation.prefix_cache import PrefixCache
from .generation.progress import Progress
from .generation.inputs import split_prompt
from .generation.shaping import ToolCalls, shape
from .platform.memory import budget_bytes

# Requests generated together by the server's batching worker, api.generate_batch and
# --prompts-file; why 8: docs/benchmarks.md, batched serving (scripts/bench/serve.py).
DEFAULT_MAX_BATCH = 8


class Entry:
    """One request in a Batcher."""

    def __init__(self, key, loaded, session, prompt_ids: list[int], memory: int,
                 tool_calls: Optional[ToolCalls] = None):
        self.key = key
        self.session = session
        self.progress = Progress(session, loaded, prompt_ids)
        self.memory = memory
        self.tool_calls = tool_calls  # every event of a request with tools goes through it
        self.member = None  # the family's batch member, once admitted
        self.started_at: Optional[float] = None  # after its prefill
        self.final: Optional[GenerationEvent] = None
        self.error: Optional[Exception] = None  # what its run raised (it is in Batcher.failed)

    @property
    def done(self) -> bool:
        return self.final is not None or self.error is not None


class Batcher:
    """Requests in, events out, one shared step at a time (see the module doc)."""

    def __init__(self, loaded, max_batch: int = DEFAULT_MAX_BATCH, memory_budget: Optional[float] = None,
                 prefix_cache: Optional[PrefixCache] = None):
        """``prefix_cache``: prompt prefills shared across requests (generation/prefix_cache.py);
        its limit comes out of the memory budget that admits requests."""
        if max_batch < 1:
            raise GenerationError(f"--max-batch must be at least 1, got {max_batch}")
        module = loaded.family.batch
        if module is None:
            raise GenerationError(f"batched generation is not available for {loaded.family.title} models")
        self.loaded = loaded
        self.generation = loaded.family.generation
        self.family = module.Batch(loaded)
        self.max_batch = max_batch
        self.prefix_cache = prefix_cache
        self.budget = max(0, budget_bytes(memory_budget) - (prefix_cache.limit if prefix_cache is not None else 0))
        self.waiting: collections.deque[Entry] = collections.deque()
        self.active: list[Entry] = []
        self.failed: list[tuple[Entry, Exception]] = []  # requests whose run raised (the caller reports them)

    # -- requests ------------------------------------------------------------
    def session(self, prompt, options: Optional[dict] = None, cancel: Optional[Callable[[], bool]] = None, *,
                response_format=None, logprobs: Optional[int] = None, tools=None):
        """(the family's session for one request, its ToolCalls or None): its
        options, prompt and output shape checked (GenerationError names what is
        wrong), prepared as ``api.stream_generate`` prepares them (same keywords)."""
        loaded = self.loaded
        ids, images = split_prompt(prompt)
        shaping = shape(loaded, options, len(ids), response_format, logprobs, tools)
        if images and loaded.family.image_processor is None:
            raise GenerationError(f"image input is not supported: {loaded.family.title} is text-only")
        extra = {"images": images} if images else {}
        if self.prefix_cache is not None:
            extra["prefix_cache"] = self.prefix_cache
        session = self.generation.Session(loaded, ids, shaping.settings, cancel, structured=shaping.structured,
                                          **extra)
        return session, shaping.tool_calls

    def add(self, prompt, options: Optional[dict] = None, cancel: Optional[Callable[[], bool]] = None,
            key: Hashable = None, *, response_format=None, logprobs: Optional[int] = None, tools=None) -> Entry:
        """Queue a request (GenerationError at once for a bad prompt, options or
        output shape); ``response_format``, ``logprobs``, ``tools``: as
        ``api.stream_generate`` takes them."""
        session, tool_calls = self.session(prompt, options, cancel, response_format=response_format,
                                           logprobs=logprobs, tools=tools)
        ids = list(getattr(session, "prompt_ids", None) or session.prompt)
        entry = Entry(key, self.loaded, session, ids, session.memory_bytes(self.loaded.args), tool_calls)
        self.waiting.append(entry)
        return entry

    def remove(self, entry: Entry) -> None:
        """Drop a request that has not been admitted yet."""
        if entry in self.waiting:
            self.waiting.remove(entry)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active

    def can_admit(self, memory: int) -> bool:
        """Whether a request with this memory estimate joins now (else it waits)."""
        if len(self.active) >= self.max_batch:
            return False
        used = sum(e.memory for e in self.active)
        return not self.active or used + memory <= self.budget

    # -- the step --------------------------------------------------------------
    def step(self) -> list[tuple[Entry, GenerationEvent]]:
        """Admit what fits, run one step of every active request; the events it
        produced, in order: (entry, event), a request's final event last."""
        events: list[tuple[Entry, GenerationEvent]] = []
        self._admit(events)
        for entry in self.active:
            if not entry.member.busy and entry.member.finished is None:
                entry.member.begin(entry.progress.remaining)
        entries = {id(e.member): e for e in self.active}

        def renew(member) -> None:
            """A canvas/block that ended mid-step: commit it, and begin the next one
            at once (the family builds it into this step), as alone it follows at once."""
            entry = entries[id(member)]
            while self._commit(entry, events):
                member.begin(entry.progress.remaining)

        self.family.step([e.member for e in self.active], renew)
        for entry in list(self.active):
            self._commit(entry, events)
        return events

    def _commit(self, entry: Entry, events) -> bool:
        """Commit the member's ended canvas/block, if any; True when one was and
        the request goes on (it then begins its next one)."""
        block = entry.member.finished
        if block is None:
            return False
        entry.member.finished = None
        event = entry.progress.commit(block)
        if event is not None and not self._emit(entry, event, events):
            return False
        if entry.progress.done:
            self._finish(entry, events)
            return False
        return True

    def _admit(self, events) -> None:
        while self.waiting and self.can_admit(self.waiting[0].memory):
            entry = self.waiting.popleft()
            if not self.active:
                mx.reset_peak_memory()
            start = time.perf_counter()
            try:
                entry.session.prefill()
            except Exception as exc:  # this request's own failure: the others go on
                self._fail(entry, exc)
                continue
            entry.progress.prefilled(time.perf_counter() - start)
            entry.started_at = time.perf_counter()
            entry.member = self.family.member(entry.session)
            self.active.append(entry)
            if entry.progress.done:
                self._finish(entry, events)

    def _finish(self, entry: Entry, events) -> None:
        final = entry.progress.final(time.perf_counter() - entry.started_at, mx.get_peak_memory() / 1e9)
        self.active.remove(entry)
        if self._emit(entry, final, events):
            entry.final = final

    def _emit(self, entry: Entry, event: GenerationEvent, events) -> bool:
        """Hand out one of the request's events, its tool calls taken out of the
        text; False when that raised (the request fails alone, as alone it raises)."""
        if entry.tool_calls is not None:
            try:
                event = entry.tool_calls(event)
            except Exception as exc:
                self._fail(entry, exc)
                return False
        events.append((entry, event))
        return True

    def _fail(self, entry: Entry, exc: Exception) -> None:
        """This request's own failure: it leaves the batch, the others go on."""
        if entry in self.active:
            self.active.remove(entry)
        entry.error = exc
        self.failed.append((entry, exc))

    def fail(self) -> list[Entry]:
        """Drop every active request (after a step raised); returns them."""
        dropped, self.active = self.active, []
        return dropped

    def run(self) -> Iterator[tuple[Entry, GenerationEvent]]:
        """Step until every request has ended (a request that failed raises its error)."""
        while not self.idle:
            yield from self.step()
            if self.failed:
                raise self.failed[0][1]

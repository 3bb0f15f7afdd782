"""The server's batching generation worker (``dlm-run serve --max-batch N``).

Like GenerationWorker (worker.py), one thread does all MLX work and requests
wait in a bounded queue (a full queue is answered 429). Unlike it, the thread
runs up to ``max_batch`` requests at once through a dlm.runtime.batch.Batcher:
every step advances each running request by one denoising step in shared
forwards, and each committed canvas/block is posted to its own request as
soon as it commits. Queued requests join the running ones between steps (at
their own first canvas/block), within ``max_batch`` and the memory budget
(a request that finds the batch with room takes its slot at submit, even
mid-step, so it never holds a queue slot while the batch has room);
a request that ends (budget, stop token, cancel, client gone) leaves at once
and the others go on. Every request gets exactly what it would get alone:
structured and tool-call requests (a ``BatchRequest`` with ``structured``
keywords) batch with plain ones, and one whose run raises (a forced tool
call cut short by max_tokens) gets its error while the others go on.

A job without a ``request`` (a plain ``run`` callable) runs alone, as the
serial worker runs it, once the batch in progress has drained.
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple, Optional

from ..batch import DEFAULT_MAX_BATCH, Batcher
from .worker import GenerationWorker, Job


class BatchRequest(NamedTuple):
    """What the batcher needs of a job: its prompt (ids or PromptInputs), its
    resolved options and its ``structured`` keywords (``response_format``,
    ``logprobs``, ``tools``: server.requests.structured_hooks; none for plain text)."""

    prompt: Any
    options: dict
    structured: Optional[dict] = None


class BatchWorker(GenerationWorker):
    def __init__(self, loaded, max_batch: int = DEFAULT_MAX_BATCH, memory_budget: Optional[float] = None,
                 queue_size: int = 16, after_job: Callable[[], None] | None = None,
                 name: str = "dlm-batch-worker", prefix_cache=None):
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.loaded, self.max_batch, self.memory_budget = loaded, max_batch, memory_budget
        self.prefix_cache = prefix_cache  # a PrefixCache the requests share, or None
        # In the batch (it holds a slot of max_batch): handed to the batcher (running,
        # or waiting there for memory), or taken and handed over at the thread's next turn.
        self._active: list[Job] = []
        self._joining: list[Job] = []  # in _active, not handed to the batcher yet
        self._batcher: Optional[Batcher] = None
        super().__init__(queue_size, after_job, name)  # starts the thread

    def status(self) -> dict:
        return {**super().status(), "running": len(self._active), "max_batch": self.max_batch}

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True  # no job takes a slot after these are cancelled
            for job in self._active:
                job.cancel()
        super().stop(timeout)

    def _take(self, job: Job) -> bool:
        """A request takes its batch slot at submit when the batch has room and
        nothing waits ahead of it, even while a step runs (it joins the batcher
        at the thread's next turn): only requests without a slot hold queue
        slots. A plain job is taken when the worker is idle."""
        if self._pending:
            return False
        if job.request is None:
            return super()._take(job)  # idle: nothing current, so no batch either
        if len(self._active) >= self.max_batch or (self._current is not None and not self._active):
            return False  # the batch is full, or a plain job runs alone
        self._active.append(job)
        self._joining.append(job)
        self._current = self._active[0]
        return True

    # -- the thread ------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            alone = None
            with self._cond:
                while self._current is None and not self._pending and not self._stopping:
                    self._cond.wait()
                if self._current is None and not self._pending:  # stopping, nothing left
                    return
                if self._current is not None and not self._active:  # a plain job taken at submit
                    alone = self._current
                elif self._pending and self._pending[0].request is None:
                    if not self._active:  # a plain job runs alone, after the batch in progress
                        alone = self._current = self._pending.popleft()
                else:
                    while self._pending and self._pending[0].request is not None \
                            and len(self._active) < self.max_batch:
                        job = self._pending.popleft()
                        self._active.append(job)
                        self._joining.append(job)
                    self._current = self._active[0] if self._active else None
                joining, self._joining = self._joining, []
            if alone is not None:
                self._alone(alone)
                continue
            if self._batcher is None:
                self._batcher = Batcher(self.loaded, self.max_batch, self.memory_budget, self.prefix_cache)
            for job in joining:
                self._join(job)
            self._step()

    def _join(self, job: Job) -> None:
        """Hand a job to the batcher (a request it refuses ends with that error)."""
        job.started_at = time.perf_counter()
        request = BatchRequest(*job.request)
        try:
            self._batcher.add(request.prompt, request.options, cancel=job.should_stop, key=job,
                              **(request.structured or {}))
        except Exception as exc:
            job.post("error", exc)
            self._end(job)

    def _step(self) -> None:
        batcher = self._batcher
        for entry in list(batcher.waiting):  # gone before its turn: it never runs
            if entry.key.cancelled:
                batcher.remove(entry)
                self._end(entry.key, ran=False)
        if batcher.idle:
            return
        try:
            events = batcher.step()
        except Exception as exc:  # one bad step must not kill the worker: fail what ran in it
            for entry in batcher.fail():
                entry.key.post("error", exc)
                self._end(entry.key)
            return
        for entry, event in events:
            job = entry.key
            job.last_item = event
            job.post("item", event)
            if event.done:
                self._end(job)
        while batcher.failed:
            entry, exc = batcher.failed.pop()
            entry.key.post("error", exc)
            self._end(entry.key)

    def _end(self, job: Job, ran: bool = True) -> None:
        job.finished_at = time.perf_counter()
        job.post("end")
        with self._cond:
            self._active.remove(job)
            self._ended(job, ran, self._active[0] if self._active else None)
            idle = not self._active
        if idle:
            self._after()

"""The server's serial generation worker (``dlm-run serve --max-batch 1``;
batch_worker.py batches requests on the same queue).

One dedicated thread runs every generation, one request at a time, so MLX work
never interleaves (and a request's ``seed`` may safely reseed the global MLX RNG).
Requests wait in a bounded queue; a full queue is refused at once (the server
answers 429) instead of letting callers hang. Only a job that really waits
holds a queue slot: one submitted while the thread is free for it is taken at
once (``_take``), before the thread wakes.

Cancellation is cooperative: each job hands the generation loop a ``cancel``
callable that the loop polls once per denoising step, so a client that goes away
frees the worker within one step.  A job cancelled while still queued is
dropped without running.

Results travel back to the asyncio side through ``Job.next_message()``: a
sequence of ``("item", event)``, then at most one ``("error", exception)``,
then ``("end", None)``.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from typing import Any, Callable, Iterable, Optional

# run(cancel) -> iterable of items; cancel() -> True once the job should stop.
RunFn = Callable[[Callable[[], bool]], Iterable[Any]]


class QueueFull(Exception):
    """The worker's queue is at capacity."""


class WorkerStopped(Exception):
    """The worker is shutting down and takes no more jobs."""


class Job:
    """One request's generation, as seen by both the worker and the handler."""

    def __init__(self, run: RunFn, loop: asyncio.AbstractEventLoop, request: Any = None):
        self.run = run
        self.request = request  # what a batching worker batches (batch_worker.BatchRequest, lockstep's spec); None: alone
        self._loop = loop
        self._messages: asyncio.Queue = asyncio.Queue()
        self._cancel = threading.Event()
        self.enqueued_at = time.perf_counter()
        self.started_at: Optional[float] = None
        self.finished_at: Optional[float] = None
        self.cancelled_at: Optional[float] = None
        # Cancellation bookkeeping: how often the loop polled, and how many of
        # those polls came after cancel() (1 means "stopped at the next step").
        self.polls = 0
        self.polls_after_cancel = 0
        self.last_item: Any = None  # what the generation loop yielded last

    # -- handler side ------------------------------------------------------
    def cancel(self) -> None:
        if not self._cancel.is_set() and not self.done:
            self.cancelled_at = time.perf_counter()
            self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    @property
    def queue_seconds(self) -> float:
        end = self.started_at if self.started_at is not None else time.perf_counter()
        return end - self.enqueued_at

    async def next_message(self) -> tuple[str, Any]:
        return await self._messages.get()

    # -- worker side -------------------------------------------------------
    def should_stop(self) -> bool:
        """The ``cancel`` callable handed to the generation loop."""
        self.polls += 1
        if self._cancel.is_set():
            self.polls_after_cancel += 1
            return True
        return False

    def post(self, kind: str, payload: Any = None) -> None:
        try:
            self._loop.call_soon_threadsafe(self._messages.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is gone (server shut down)
            pass


class GenerationWorker:
    """A daemon thread that runs queued jobs one at a time."""

    def __init__(self, queue_size: int = 16, after_job: Callable[[], None] | None = None,
                 name: str = "dlm-generation-worker"):
        if queue_size < 1:
            raise ValueError("queue_size must be at least 1")
        self.queue_size = queue_size
        self._after_job = after_job
        self._pending: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._current: Optional[Job] = None
        self._stopping = False
        self.served = 0  # jobs that ran (finished, failed or cancelled mid-run)
        self.last_job: Optional[Job] = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # -- public API --------------------------------------------------------
    def submit(self, run: RunFn, loop: asyncio.AbstractEventLoop | None = None, request: Any = None) -> Job:
        """Queue a job; raises QueueFull when ``queue_size`` jobs already wait.
        ``request``: what a batching worker needs to batch it (this one runs ``run``)."""
        job = Job(run, loop or asyncio.get_running_loop(), request)
        with self._cond:
            if self._stopping:
                raise WorkerStopped("the server is shutting down")
            if not self._take(job):
                if len(self._pending) >= self.queue_size:
                    raise QueueFull(
                        f"the generation queue is full ({self.queue_size} requests waiting); retry later"
                    )
                self._pending.append(job)
            self._cond.notify_all()
        return job

    def cancel(self, job: Job) -> None:
        """Cancel a job: dropped at once if queued, stopped at the next step if running."""
        job.cancel()
        with self._cond:
            if job in self._pending:
                self._pending.remove(job)
                job.finished_at = time.perf_counter()
                job.post("end")
                self._cond.notify_all()

    @property
    def current(self) -> Optional[Job]:
        return self._current

    @property
    def busy(self) -> bool:
        return self._current is not None

    @property
    def queued(self) -> int:
        return len(self._pending)

    def status(self) -> dict:
        return {"busy": self.busy, "queued": self.queued, "queue_size": self.queue_size,
                "served": self.served, "alive": self._thread.is_alive()}

    def wait_idle(self, timeout: float) -> bool:
        """Block until nothing runs or waits (tests and shutdown)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._current is not None or self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new jobs, fail the queued ones, cancel the running one, join."""
        with self._cond:
            self._stopping = True
            pending, self._pending = list(self._pending), collections.deque()
            if self._current is not None:
                self._current.cancel()
            self._cond.notify_all()
        for job in pending:
            job.cancel()
            job.finished_at = time.perf_counter()
            job.post("error", WorkerStopped("the server is shutting down"))
            job.post("end")
        self._thread.join(timeout)

    def wait_stopped(self, timeout: Optional[float] = None) -> bool:
        """After ``stop``: wait until the thread has ended (True), i.e. finished the
        step it was in; never abandon it there. A daemon thread still inside MLX
        (its C++ code, the GIL released) when the interpreter finalizes is ended
        by pthread_exit as it takes the GIL back, and that unwinding through
        MLX's C++ frames aborts the process ("terminate called without an active
        exception", exit -6): the serve command waits here before it exits."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _take(self, job: Job) -> bool:
        """Called by ``submit`` under the lock: make ``job`` current at once when
        the thread is free for it (True), so a job that starts at the thread's
        next turn never takes a queue slot (else a burst at an idle worker
        could be refused while nothing waits); False: it queues."""
        if self._current is not None or self._pending:
            return False
        self._current = job
        return True

    # -- the thread --------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._current is None and not self._pending and not self._stopping:
                    self._cond.wait()
                if self._current is None:  # not taken at submit: the queue's first
                    if not self._pending:  # stopping, nothing left
                        return
                    self._current = self._pending.popleft()
                job = self._current
            self._alone(job)

    def _alone(self, job: Job) -> None:
        """Run the current job by itself, then free the worker for the next."""
        try:
            self._run(job)
        finally:
            with self._cond:
                self._current = None
                self.served += 1
                self.last_job = job
                self._cond.notify_all()

    def _ended(self, job: Job, ran: bool, current: Optional[Job]) -> None:
        """A batched job is over (under ``self._cond``): counted if it ran; ``current``:
        the job now in front (None: nothing runs); waiters woken."""
        if ran:
            self.served += 1
            self.last_job = job
        self._current = current
        self._cond.notify_all()

    def _after(self) -> None:
        """``after_job`` (its failure must not stop the worker)."""
        if self._after_job is not None:
            try:
                self._after_job()
            except Exception:
                pass

    def _run(self, job: Job) -> None:
        job.started_at = time.perf_counter()
        items = None
        try:
            if not job.cancelled:
                items = iter(job.run(job.should_stop))
                for item in items:
                    job.last_item = item
                    job.post("item", item)
                    if job.cancelled:  # do not trust every loop to poll
                        break
        except Exception as exc:  # bad input must never kill the worker
            job.post("error", exc)
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                try:
                    close()  # let the generator clean up here, on the worker thread
                except Exception:
                    pass
            self._after()
            job.finished_at = time.perf_counter()
            job.post("end")

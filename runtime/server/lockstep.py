"""``dlm-run serve`` over the ranks of an ``mlx.launch`` job (mlx-lm's server pattern).

Rank 0 serves HTTP; the other ranks serve nothing and follow. Every scheduler
tick must be the same on every rank, because the sharded forwards pair up
collectives across ranks: rank 0's worker decides each tick what happens (the
requests that join, with their prompt ids and resolved options; the requests
cancelled; whether to stop) and broadcasts that plan (one length, then its
bytes); every rank applies it to its own ``Lockstep`` (a Batcher, fed the same
requests in the same order), then all run the same batched step. A cancel
reaches the batch through the plan, never through rank 0's own flags, which a
client may set mid-step.

A request with structured output or tools joins the batch like any other: its
plan entry carries the request's JSON fields (``structured_spec``), from which
every rank rebuilds the same grammar and tool-call splitting
(``structured_from_spec``). Image inputs are refused (app.py): their pixels
would have to travel to every rank.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..batch import Batcher
from ..generation import prefix_cache
from ..platform import distributed
from .requests import structured_from_spec
from .worker import GenerationWorker, Job, WorkerStopped


@dataclass
class Tick:
    """What one batched step produced, by request id."""

    events: list = field(default_factory=list)  # (id, event)
    failed: list = field(default_factory=list)  # (id, exception)
    dropped: list = field(default_factory=list)  # ids cancelled before they ran


class Lockstep:
    """The scheduler state every rank holds an identical copy of."""

    def __init__(self, loaded, max_batch: int, memory_budget: Optional[float] = None,
                 prefix_cache_gb: Optional[float] = None):
        """Every rank keeps a prefix cache of the same limit: each applies the same
        plans in the same order, so each finds and evicts the same chunks."""
        self.loaded = loaded
        self.world = loaded.world
        self.prefix_cache = prefix_cache.sized(prefix_cache_gb, memory_budget)
        self.batcher = Batcher(loaded, max_batch, memory_budget, self.prefix_cache)
        self.cancelled: set[int] = set()  # ids rank 0 has said are cancelled

    def apply(self, plan: dict) -> list:
        """Rank 0's plan for this tick: cancellations, then the requests that join
        (those the batcher refuses come back with their error)."""
        self.cancelled.update(plan.get("cancel", ()))
        failed = []
        for spec in plan.get("join", ()):
            key = spec["id"]
            try:
                shape = structured_from_spec(spec["structured"]) if spec["structured"] is not None else {}
                self.batcher.add(spec["prompt"], spec["options"], cancel=self._cancel(key), key=key, **shape)
            except Exception as exc:  # the same refusal on every rank
                failed.append((key, exc))
        return failed

    def _cancel(self, key: int) -> Callable[[], bool]:
        return lambda: key in self.cancelled

    @property
    def idle(self) -> bool:
        return self.batcher.idle

    def step(self) -> Tick:
        """One batched step of every running request (the batching worker's step)."""
        tick, batcher = Tick(), self.batcher
        for entry in list(batcher.waiting):  # gone before its turn: it never runs
            if entry.key in self.cancelled:
                batcher.remove(entry)
                tick.dropped.append(entry.key)
        if not batcher.idle:
            try:
                tick.events = [(entry.key, event) for entry, event in batcher.step()]
            except Exception as exc:  # one bad step fails what ran in it, on every rank
                tick.failed = [(entry.key, exc) for entry in batcher.fail()]
            while batcher.failed:
                entry, exc = batcher.failed.pop()
                tick.failed.append((entry.key, exc))
        ended = tick.dropped + [k for k, _ in tick.failed] + [k for k, e in tick.events if e.done]
        self.cancelled.difference_update(ended)
        return tick


# While nothing runs, rank 0 still ticks (an empty plan), further apart the longer it
# idles, and the other ranks sleep between ticks: a rank waiting inside a collective
# spins a core (the ring backend polls), so none waits there for long. The first
# request after a long idle waits up to the last interval.
IDLE_WAITS = (0.05, 0.1, 0.2, 0.4, 0.8)


def idle_wait(idle_ticks: int) -> float:
    """Seconds rank 0 waits for work before its next tick, after ``idle_ticks`` idle ones."""
    return IDLE_WAITS[min(idle_ticks, len(IDLE_WAITS) - 1)]


def idle_tick(plan: dict, lockstep: "Lockstep") -> bool:
    """A tick with nothing to do on any rank (they all judge it alike)."""
    return not plan.get("join") and not plan.get("cancel") and lockstep.idle


def _beat(dog, busy: bool) -> None:
    dog.beat()
    dog.busy = busy


class DistributedWorker(GenerationWorker):
    """Rank 0's generation worker: plans each tick, broadcasts it, steps with the others.

    Jobs carry a ``request`` spec: {"prompt": ids, "options": resolved options,
    "structured": None or the fields structured_from_spec rebuilds}."""

    def __init__(self, loaded, max_batch: int, memory_budget: Optional[float] = None, queue_size: int = 16,
                 after_job: Callable[[], None] | None = None, name: str = "dlm-lockstep-worker",
                 prefix_cache_gb: Optional[float] = None):
        self.loaded, self.max_batch = loaded, max_batch
        self.lockstep = Lockstep(loaded, max_batch, memory_budget, prefix_cache_gb)
        self.prefix_cache = self.lockstep.prefix_cache
        self._active: dict[int, Job] = {}
        self._told: set[int] = set()  # cancellations already broadcast
        self._ids = itertools.count()
        super().__init__(queue_size, after_job, name)

    def status(self) -> dict:
        return {**super().status(), "running": len(self._active), "max_batch": self.max_batch,
                "ranks": self.loaded.world.size}

    def _take(self, job: Job) -> bool:
        """A request the batch has room for waits for the next tick without holding a
        queue slot (it joins then); others queue."""
        if len(self._active) + len(self._pending) >= self.max_batch:
            return False
        self._pending.append(job)
        return True

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            for job in self._active.values():
                job.cancel()
        super().stop(timeout)

    # -- the thread ------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._lockstep_loop()
        except BaseException as exc:  # a broadcast failed: the ranks are out of step, for good
            _leave(self.loaded.world, exc)

    def _lockstep_loop(self) -> None:
        world, idle = self.loaded.world, 0
        with distributed.Watchdog(world) as dog:
            while True:
                with self._cond:
                    if not self._pending and not self._active and not self._stopping:
                        self._cond.wait(idle_wait(idle))  # a request wakes it at once
                    plan = self._plan()
                _beat(dog, True)
                plan = distributed.broadcast(plan, world)
                if plan.get("stop"):
                    self._end_all()
                    return
                idle = idle + 1 if idle_tick(plan, self.lockstep) else 0
                try:
                    if not idle:
                        self._tick(plan)
                finally:
                    _beat(dog, False)

    def _plan(self) -> dict:
        """Under the lock: this tick's plan (the jobs that join move to ``_active``)."""
        if self._stopping:
            return {"stop": True}
        cancel = [k for k, job in self._active.items() if job.cancelled and k not in self._told]
        self._told.update(cancel)
        join = []
        while self._pending and len(self._active) < self.max_batch:
            key = self._admit(self._pending.popleft())
            join.append({"id": key, **self._active[key].request})
        self._current = next(iter(self._active.values()), None)
        return {"cancel": cancel, "join": join}

    def _admit(self, job: Job) -> int:
        key = next(self._ids)
        job.started_at = time.perf_counter()
        self._active[key] = job
        self._current = job
        return key

    def _tick(self, plan: dict) -> None:
        failed = self.lockstep.apply(plan)
        tick = self.lockstep.step()
        for key, exc in failed + tick.failed:
            self._active[key].post("error", exc)
            self._end(key)
        for key in tick.dropped:
            self._end(key, ran=False)
        for key, event in tick.events:
            job = self._active[key]
            job.last_item = event
            job.post("item", event)
            if event.done:
                self._end(key)

    def _end(self, key: int, ran: bool = True) -> None:
        with self._cond:
            job = self._active.pop(key)
            self._told.discard(key)
            job.finished_at = time.perf_counter()
            job.post("end")
            self._ended(job, ran, next(iter(self._active.values()), None))
            idle = not self._active
        if idle:
            self._after()

    def _end_all(self) -> None:
        """Stopping: the requests still running end with the shutdown error."""
        for key in list(self._active):
            self._active[key].post("error", WorkerStopped("the server is shutting down"))
            self._end(key, ran=False)


def _leave(world, exc: BaseException) -> None:
    """End this rank at once (the HTTP side cannot go on without its peers)."""
    import os
    import sys

    print(f"error: rank {world.rank} of {world.size}: the server's lockstep failed ({type(exc).__name__}: {exc}); "
          "another rank died or was stopped; stopping", file=sys.stderr, flush=True)
    os._exit(1)


def follow(loaded, max_batch: int, memory_budget: Optional[float] = None,
           prefix_cache_gb: Optional[float] = None) -> None:
    """A rank other than 0 under ``dlm-run serve``: apply rank 0's plans and step with
    it, until it says stop (its server shut down). No HTTP here."""
    import mlx.core as mx

    world, idle = loaded.world, 0
    lockstep = Lockstep(loaded, max_batch, memory_budget, prefix_cache_gb)
    with distributed.Watchdog(world) as dog:
        while True:
            plan = distributed.broadcast(None, world)  # waits (not busy) for rank 0's next tick
            if plan.get("stop"):
                return
            if idle_tick(plan, lockstep):
                idle += 1
                time.sleep(0.9 * idle_wait(idle))  # wake just before rank 0's next tick
                continue
            idle = 0
            _beat(dog, True)
            try:
                lockstep.apply(plan)
                lockstep.step()
            finally:
                _beat(dog, False)
            if lockstep.idle:  # as rank 0 frees its cache once its batch drains
                mx.clear_cache()


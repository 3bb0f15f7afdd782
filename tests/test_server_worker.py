"""The serve worker and stop-string logic on their own (no model, no HTTP)."""

import asyncio
import threading
import time

import pytest

from dlm.runtime.server.output import StopMatcher
from dlm.runtime.server.worker import GenerationWorker, QueueFull, WorkerStopped


async def drain(job, timeout=10.0):
    out = []
    while True:
        kind, payload = await asyncio.wait_for(job.next_message(), timeout)
        out.append((kind, payload))
        if kind == "end":
            return out


def steps(n, delay=0.0, log=None):
    """A fake generation loop: polls cancel once per 'step', yields the step index."""

    def run(cancel):
        for i in range(n):
            if cancel():
                return
            if log is not None:
                log.append(i)
            time.sleep(delay)
            yield i

    return run


def test_jobs_run_one_at_a_time_in_order():
    async def main():
        worker = GenerationWorker(queue_size=8)
        active, overlap = [0], []

        def run(tag):
            def gen(cancel):
                active[0] += 1
                overlap.append(active[0])
                time.sleep(0.01)
                active[0] -= 1
                yield tag
            return gen

        jobs = [worker.submit(run(i)) for i in range(5)]
        results = [await drain(j) for j in jobs]
        worker.stop()
        assert [r[0] for r in results] == [("item", i) for i in range(5)]
        assert max(overlap) == 1
        assert all(j.started_at >= jobs[k - 1].finished_at for k, j in enumerate(jobs) if k)

    asyncio.run(main())


def test_full_queue_is_refused_not_blocked():
    async def main():
        gate = threading.Event()

        def blocker(cancel):
            gate.wait(5)
            yield "done"

        worker = GenerationWorker(queue_size=2)
        first = worker.submit(blocker)
        while not worker.busy:
            await asyncio.sleep(0.001)
        queued = [worker.submit(steps(1)) for _ in range(2)]
        t0 = time.perf_counter()
        with pytest.raises(QueueFull, match="queue is full"):
            worker.submit(steps(1))
        assert time.perf_counter() - t0 < 0.1
        gate.set()
        for job in [first, *queued]:
            assert (await drain(job))[-2][0] == "item"
        worker.submit(steps(1))  # room again
        assert worker.wait_idle(5)
        worker.stop()

    asyncio.run(main())


def test_cancel_running_job_stops_at_next_poll():
    async def main():
        worker = GenerationWorker(queue_size=2)
        job = worker.submit(steps(10_000, delay=0.002))
        kind, _ = await job.next_message()
        assert kind == "item"
        worker.cancel(job)
        await drain(job)
        # stopped at the first poll after cancel (or before it, at the item boundary)
        assert job.polls_after_cancel <= 1
        assert job.polls < 10_000
        assert job.finished_at - job.cancelled_at < 1.0
        assert worker.wait_idle(5)
        worker.stop()

    asyncio.run(main())


def test_cancel_queued_job_never_runs():
    async def main():
        gate = threading.Event()
        ran = []

        def blocker(cancel):
            gate.wait(5)
            yield 0

        worker = GenerationWorker(queue_size=2)
        worker.submit(blocker)
        while not worker.busy:
            await asyncio.sleep(0.001)
        job = worker.submit(steps(3, log=ran))
        worker.cancel(job)
        assert worker.queued == 0
        assert await drain(job) == [("end", None)]
        gate.set()
        assert worker.wait_idle(5)
        assert ran == []
        worker.stop()

    asyncio.run(main())


def test_errors_do_not_kill_the_worker():
    async def main():
        worker = GenerationWorker(queue_size=4)

        def boom(cancel):
            yield 1
            raise ValueError("bad input")

        msgs = await drain(worker.submit(boom))
        assert msgs[0] == ("item", 1)
        assert msgs[1][0] == "error" and "bad input" in str(msgs[1][1])
        assert (await drain(worker.submit(steps(2))))[:2] == [("item", 0), ("item", 1)]
        assert worker.status()["alive"]
        worker.stop()
        with pytest.raises(WorkerStopped):
            worker.submit(steps(1))

    asyncio.run(main())


@pytest.mark.parametrize("stops,pieces,emitted,hit", [
    (["END"], ["abc", "deE", "NDxyz"], "abcde", True),      # spans two pieces
    (["END"], ["abE", "Nq", "rs"], "abENqrs", False),        # false start released
    (["xx", "b"], ["axxb"], "a", True),                      # earliest stop wins
    (["b", "xx"], ["axxb"], "a", True),
    (["\n\n"], ["one\n", "\ntwo"], "one", True),
    (["zz"], ["z"], "z", False),                             # flushed at the end
])
def test_stop_matcher(stops, pieces, emitted, hit):
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in pieces)
    if not m.hit:
        out += m.flush()
    assert (out, m.hit) == (emitted, hit)

"""Independent forward passes that share each layer load of a streamed reference.

A layer-streamed reference reads (and, for the same-weights reference,
dequantizes) every layer again on each forward pass. The logits cases are
independent passes, and so are a commit stream's greedy and seeded runs; run
one after the other they read every layer once per pass. ``Lockstep`` runs
them in threads instead and holds each thread at every layer's forward
pre-hook until all unfinished threads have arrived at one; it then loads the
layer the most threads wait on once, lets those threads through it together
and repeats. Each pass still runs the reference's own code on its own inputs,
so its numbers are those of the pass run alone; only the layer loads are
shared (LLaDA2.0-mini's 9 logits cases: 9 reads of each layer become 1).

torch's kernels release the GIL, so the threads also overlap their compute.
Memory: one layer, plus every pass's activations (small next to a layer).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable


class Lockstep:
    """The scheduler; ``streamer`` provides ``_materialize(layer_id)``,
    ``_order(layer_id)`` (its position in the stacks, for ties) and
    ``_share(layer_id)``: the layer whose load serves it (threads at layers
    with the same parameters go through together: DiffusionGemma's encoder
    and decoder layer N)."""

    def __init__(self, streamer):
        self.streamer = streamer
        self.cond = threading.Condition()
        self.workers: set[threading.Thread] = set()  # unfinished job threads
        self.waiting: dict[threading.Thread, int] = {}  # thread -> layer it waits on
        self.inside: set[threading.Thread] = set()  # threads running the loaded layer
        self.failed: BaseException | None = None

    def owns(self) -> bool:
        """Whether the calling thread is one of this lockstep's jobs."""
        return threading.current_thread() in self.workers

    # -- hooks (called by the streamer in a job thread) ------------------------

    def before(self, layer_id: int) -> None:
        me = threading.current_thread()
        with self.cond:
            self.waiting[me] = layer_id
            self._schedule()
            while me not in self.inside:
                if self.failed is not None:
                    raise self.failed
                self.cond.wait()

    def after(self) -> None:
        with self.cond:
            self.inside.discard(threading.current_thread())
            self._schedule()

    def _schedule(self) -> None:
        """Under the lock: when every unfinished job waits at a layer, load the
        layer most of them wait on and let them in."""
        if self.inside or not self.waiting or len(self.waiting) < len(self.workers):
            return
        share = self.streamer._share
        counts = Counter(share(lid) for lid in self.waiting.values())
        layer = max(counts, key=lambda lid: (counts[lid], -self.streamer._order(lid)))
        try:
            self.streamer._materialize(layer)
        except BaseException as exc:  # every waiting job fails with it (a missing tensor)
            self.failed = exc
            self.cond.notify_all()
            raise
        for thread, lid in list(self.waiting.items()):
            if share(lid) == layer:
                del self.waiting[thread]
                self.inside.add(thread)
        self.cond.notify_all()

    # -- running jobs ----------------------------------------------------------

    def run(self, jobs: list[Callable]) -> list:
        """Each job's result, in order; the first failing job's error is raised
        after every job has ended."""
        results: list = [None] * len(jobs)
        errors: dict[int, BaseException] = {}

        import torch

        def work(i: int, job: Callable) -> None:
            try:
                with torch.no_grad():  # grad mode is per thread; the caller's does not carry over
                    results[i] = job()
            except BaseException as exc:
                errors[i] = exc
            finally:
                with self.cond:
                    me = threading.current_thread()
                    self.workers.discard(me)
                    self.waiting.pop(me, None)
                    self.inside.discard(me)
                    try:
                        self._schedule()
                    except BaseException:
                        pass  # recorded in self.failed; the waiting jobs raise it

        threads = [threading.Thread(target=work, args=(i, job), name=f"lockstep-{i}", daemon=True)
                   for i, job in enumerate(jobs)]
        with self.cond:
            self.workers.update(threads)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[min(errors)]
        return results

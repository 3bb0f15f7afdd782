"""Where a request's time goes in a batch, in-process: ``--clients`` closed-loop
clients (each sends its next request when the last one ends, as
scripts/bench/serve.py's do over HTTP) on one Batcher, against one client
(the requests run one at a time), interleaved rounds, medians.

    .venv/bin/python -m scripts.bench.closed_loop --model path/to/mlx-model [--clients 4]

``--stagger N`` starts the clients N steps apart: a server's clients drift
apart (their requests arrive and end at different steps), where clients that
start together with the same request stay in lockstep.

Prints the milliseconds per request of each (wall and the process's CPU time), the requests a step carried
(on average: short rounds fill and drain the batch), and the scheduler's steps by what
else they did: admitted requests (and the milliseconds of their prefills) and
canvases/blocks begun (a DiffusionGemma canvas begins with the re-encoding of
the one committed before it). The same chat request as serve.py, every request its own seed.
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import resource
import statistics
import time

from dlm.runtime import api
from dlm.runtime.batch import Batcher
from scripts.bench import harness

MESSAGES = [{"role": "user", "content": "Explain why the sky is blue in two sentences."}]


class Counted:
    """Counts the admissions and begun canvases/blocks of each Batcher step, and
    the milliseconds of its prefills."""

    def __init__(self, loaded):
        self.now = collections.Counter()
        member, session = loaded.family.batch.Member, loaded.family.generation.Session
        begin, admit, prefill = member.begin, Batcher._admit, session.prefill

        def timed_prefill(s):
            t = time.perf_counter()
            prefill(s)
            self.now["prefill_ms"] += (time.perf_counter() - t) * 1e3

        def counted_begin(m, remaining):
            self.now["begun"] += 1
            return begin(m, remaining)

        def counted_admit(batcher, events):
            before = len(batcher.active)
            admit(batcher, events)
            self.now["admitted"] += len(batcher.active) - before

        member.begin, Batcher._admit, session.prefill = counted_begin, counted_admit, timed_prefill


def cpu_seconds() -> float:
    """This process's CPU time so far, all its threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def closed_loop(loaded, ids, options, clients: int, total: int, counted: Counted, steps: dict,
                stagger: int = 0, carried: list = None) -> tuple[float, float]:
    """(wall ms, CPU ms) per request of ``total`` requests from ``clients``
    closed-loop clients, the k-th of which starts ``k * stagger`` steps after the
    first; each step's (ms, prefill ms) goes to ``steps[(admitted, begun)]``, and
    the number of requests it carried to ``carried``."""
    batcher, seeds, done, started, n = Batcher(loaded, max_batch=max(clients, 1)), itertools.count(), 0, 0, 0
    start, cpu = time.perf_counter(), cpu_seconds()
    while done < total:
        while started < clients and n >= started * stagger:
            batcher.add(ids, {**options, "seed": next(seeds)})
            started += 1
        n += 1
        counted.now.clear()
        t = time.perf_counter()
        events = batcher.step()
        steps[(counted.now["admitted"], counted.now["begun"])].append(((time.perf_counter() - t) * 1e3,
                                                                      counted.now["prefill_ms"]))
        if carried is not None:  # the requests still going, and those that ended in this step
            carried.append(len(batcher.active) + sum(entry.final is event for entry, event in events))
        for entry, event in events:
            if entry.final is event:
                done += 1
                if done + len(batcher.active) + len(batcher.waiting) + clients - started < total:
                    batcher.add(ids, {**options, "seed": next(seeds)})
    return (time.perf_counter() - start) / total * 1e3, (cpu_seconds() - cpu) / total * 1e3


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--model", required=True, help="converted MLX model directory")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--requests", type=int, default=16, help="requests per run")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=8, help="max_denoising_steps (a canvas's, or a LLaDA-2 block's)")
    p.add_argument("--block-length", type=int, default=8, help="LLaDA-2's block length")
    p.add_argument("--stagger", type=int, default=0,
                   help="steps between the clients' first requests (0: all at once, in lockstep)")
    args = p.parse_args()
    loaded = api.load(args.model)
    ids = api.encode_prompt(loaded, messages=MESSAGES)
    llada = loaded.family.name == "llada2_moe"
    options = {"max_tokens": args.max_tokens, "max_denoising_steps": args.steps,
               **({"block_length": args.block_length} if llada else {})}
    counted = Counted(loaded)
    closed_loop(loaded, ids, options, args.clients, args.clients, counted, collections.defaultdict(list))  # warm-up
    sizes = (1, args.clients)
    steps = {n: collections.defaultdict(list) for n in sizes}
    carried = {n: [] for n in sizes}
    runs = harness.interleave({n: functools.partial(closed_loop, loaded, ids, options, n, args.requests, counted,
                                                    steps[n], args.stagger, carried[n]) for n in sizes},
                              args.rounds, run=harness.returned)
    for n, times in runs.items():
        print(json.dumps({"clients": n, "ms_per_request": round(statistics.median(w for w, _ in times), 1),
                          "cpu_ms_per_request": round(statistics.median(c for _, c in times), 1),
                          "rounds": [round(w) for w, _ in times],
                          "requests_a_step": round(statistics.mean(carried[n]), 2)}))
        for (admitted, begun), timed in sorted(steps[n].items()):
            row = {"clients": n, "admitted": admitted, "begun": begun, "steps": len(timed),
                   "median_ms": round(statistics.median(ms for ms, _ in timed), 1)}
            if admitted:
                row["prefill_median_ms"] = round(statistics.median(p for _, p in timed), 1)
            print(json.dumps(row))
    wall, cpu = ({n: statistics.median(x[i] for x in r) for n, r in runs.items()} for i in (0, 1))
    print(json.dumps({"ratio": round(wall[1] / wall[args.clients], 2), "cpu_ratio": round(cpu[1] / cpu[args.clients], 2)}))


if __name__ == "__main__":
    main()

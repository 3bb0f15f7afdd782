"""dlm-run serve batching requests (--max-batch): over loopback with the openai
client under concurrency, every response (plain or streamed per committed
canvas/block) equals the runtime's answer for that request alone; a client that
hangs up leaves the others untouched; a full queue still answers 429."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from dlm.runtime import api
from dlm.runtime import batch as batch_module
from dlm.runtime.server.app import create_app

DEFAULTS = {"max_tokens": 16, "max_denoising_steps": 3}
LONG = {"max_tokens": 256, "max_denoising_steps": 8}


def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture
def running(monkeypatch):
    """How many requests ran in each batched step."""
    sizes = []
    real = batch_module.Batcher.step

    def step(self):
        events = real(self)
        sizes.append(len(self.active) + sum(1 for e, ev in events if ev.done))
        return events

    monkeypatch.setattr(batch_module.Batcher, "step", step)
    return sizes


@pytest.fixture(scope="module")
def dg(tiny_dg_mlx_dir):
    return api.load(tiny_dg_mlx_dir)


def solo(loaded, request: dict, defaults=DEFAULTS):
    """The runtime's events for one request alone (chat messages or a raw prompt)."""
    if "messages" in request:
        ids = api.encode_prompt(loaded, messages=request["messages"])
    else:
        ids = api.encode_prompt(loaded, prompt=request["prompt"], chat_template=False)
    options = {k: v for k, v in request.items() if k not in ("messages", "prompt", "stream")}
    if "temperature" in options:
        options["temp"] = options.pop("temperature")
    return list(api.stream_generate(loaded, ids, {**defaults, **options}))


def ask(base, request: dict):
    """(texts of the content chunks, or the whole text; finish reason; usage) from the server."""
    c = client(base)
    body = {k: v for k, v in request.items() if k not in ("messages", "prompt", "stream", "seed", "max_tokens",
                                                           "temperature")}
    common = dict(model="m", seed=request.get("seed"), max_tokens=request.get("max_tokens"),
                  temperature=request.get("temperature"), extra_body=body)
    if "messages" in request:
        if request.get("stream"):
            chunks = list(c.chat.completions.create(messages=request["messages"], stream=True,
                                                    stream_options={"include_usage": True}, **common))
            parts = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
            finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
            return parts, finish[-1], chunks[-1].usage.completion_tokens
        r = c.chat.completions.create(messages=request["messages"], **common)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
    r = c.completions.create(prompt=request["prompt"], **common)
    return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens


def expected(events, stream: bool):
    final = events[-1]
    text = [e.text for e in events if e.text] if stream else "".join(e.text for e in events)
    finish = "length" if final.finish_reason == "length" else "stop"
    return text, finish, final.stats.completion_tokens


REQUESTS = [
    {"messages": [{"role": "user", "content": "Why is the sky blue?"}], "seed": 1},
    {"messages": [{"role": "user", "content": "Tell me about cats and dogs and birds."}], "seed": 2,
     "max_tokens": 24, "stream": True, "max_denoising_steps": 2},
    {"prompt": "The sky is", "seed": 3, "max_tokens": 13, "diffusion_min_canvas_length": 2},
    {"messages": [{"role": "user", "content": "Hi"}], "seed": 4, "temperature": 0.0, "stream": True},
    {"messages": [{"role": "user", "content": "A longer question about the weather today?"}], "seed": 5,
     "diffusion_sampler": "confidence-threshold", "diffusion_threshold": 0.5, "max_tokens": 20},
    {"prompt": "Once upon a time", "seed": 6, "max_tokens": 32, "temperature": 0.5, "max_denoising_steps": 4},
]


def test_concurrent_requests_get_their_solo_answers(dg, serving, running):
    want = [expected(solo(dg, r), bool(r.get("stream"))) for r in REQUESTS]
    app = create_app(dg, DEFAULTS, queue_size=8, max_batch=4)
    with serving(app) as base:
        with ThreadPoolExecutor(len(REQUESTS)) as pool:
            got = list(pool.map(lambda r: ask(base, r), REQUESTS * 2))
        assert app.state.worker.wait_idle(30)
        assert app.state.worker.served == 2 * len(REQUESTS)
    assert got == want * 2
    assert max(running) == 4  # requests really ran together, never more than --max-batch


def test_hanging_up_one_stream_leaves_the_others_alone(dg, serving, running):
    others = [{"messages": [{"role": "user", "content": f"Question {i}?"}], "seed": 10 + i, "max_tokens": 40,
               "stream": True} for i in range(2)]
    want = [expected(solo(dg, r), True) for r in others]
    app = create_app(dg, DEFAULTS, queue_size=8, max_batch=4)
    worker = app.state.worker
    jobs, submit = [], worker.submit
    worker.submit = lambda *args, **kwargs: jobs.append(submit(*args, **kwargs)) or jobs[-1]
    together = threading.Event()  # the three requests ran a step together
    with serving(app) as base:

        def hang_up():
            with httpx.Client(base_url=base, timeout=60) as h:
                body = {"messages": [{"role": "user", "content": "Go on"}], "stream": True, "seed": 3, **LONG}
                with h.stream("POST", "/v1/chat/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                            together.wait(30)
                            break  # hang up after a committed canvas, with the others running

        def watch():
            while not together.is_set() and thread.is_alive():
                if 3 in running:  # a step they ran together, not just their batch slots taken
                    together.set()
                time.sleep(0.001)

        thread = threading.Thread(target=hang_up)
        thread.start()
        while not worker.busy:
            time.sleep(0.002)
        watcher = threading.Thread(target=watch)
        watcher.start()
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda r: ask(base, r), others))
        thread.join(60)
        watcher.join(60)
        assert together.is_set()
        assert worker.wait_idle(30)
    assert got == want
    assert max(running) == 3
    job = next(j for j in jobs if j.request[1]["max_tokens"] == 256)
    assert job.cancelled_at is not None and job.last_item.finish_reason == "cancelled"
    assert job.polls_after_cancel <= 1 and 8 <= job.polls < 32 * 8  # stopped at its next step
    assert all(j.last_item.finish_reason in ("stop", "length") for j in jobs if j is not job)


def test_a_full_queue_still_answers_429(dg, serving, running, monkeypatch):
    """The worker held in its first step (one request running, --max-batch 2): a
    second request takes the free batch slot at once, mid-step, and is not
    queued; a third fills the queue of 1; a fourth gets 429 at once. Released,
    the three are served with their solo answers, two of them together."""
    from dlm.runtime.server.batch_worker import BatchWorker

    stepping, gate, real = threading.Event(), threading.Event(), BatchWorker._step

    def held(self):
        stepping.set()
        gate.wait(60)
        return real(self)

    monkeypatch.setattr(BatchWorker, "_step", held)
    requests = [{"messages": [{"role": "user", "content": f"Question {i}?"}], "seed": i, "max_tokens": 64,
                 "max_denoising_steps": 8} for i in range(3)]
    want = [expected(solo(dg, r), False) for r in requests]
    app = create_app(dg, DEFAULTS, queue_size=1, max_batch=2)
    worker = app.state.worker
    with serving(app) as base, ThreadPoolExecutor(3) as pool:
        deadline = time.monotonic() + 30

        def settled(total):
            """The worker's status once ``total`` requests were submitted to it
            (each submit counts a request as running or queued, atomically)."""
            while (s := worker.status())["running"] + s["queued"] < total:
                assert time.monotonic() < deadline, s
                assert not any(a.done() for a in answers), [a.exception() for a in answers if a.done()]
                time.sleep(0.002)
            return s

        try:
            answers = [pool.submit(ask, base, requests[0])]
            assert stepping.wait(30)  # the first request is in the batch, its step held
            assert settled(1)["running"] == 1
            answers.append(pool.submit(ask, base, requests[1]))
            s = settled(2)
            assert (s["running"], s["queued"]) == (2, 0), s  # a free slot is taken, not queued
            answers.append(pool.submit(ask, base, requests[2]))
            s = settled(3)
            assert (s["running"], s["queued"]) == (2, 1), s
            t0 = time.perf_counter()
            r = httpx.post(base + "/v1/chat/completions", json=requests[0], timeout=60)
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
            assert time.perf_counter() - t0 < 5
            assert worker.status()["queued"] == 1
        finally:
            gate.set()
        assert [a.result() for a in answers] == want
    assert max(running) == 2


def test_llada2_concurrent_requests_get_their_solo_answers(tiny_llada2_mlx_dir, serving, running):
    llada = api.load(tiny_llada2_mlx_dir)
    defaults = {"max_tokens": 16, "block_length": 4, "max_denoising_steps": 4}
    requests = [
        {"messages": [{"role": "user", "content": "Name a colour."}], "seed": 1, "temperature": 0.7},
        {"messages": [{"role": "user", "content": "Name two animals please."}], "seed": 2, "stream": True,
         "temperature": 0.9, "block_length": 8},
        {"prompt": "Red, green and", "seed": 3, "max_tokens": 12, "threshold": 0.5},
        {"messages": [{"role": "user", "content": "Count"}], "seed": 4, "stream": True, "temperature": 1.0,
         "top_p": 0.9, "max_tokens": 24},
    ]
    want = [expected(solo(llada, r, defaults), bool(r.get("stream"))) for r in requests]
    app = create_app(llada, defaults, queue_size=8, max_batch=4)
    with serving(app) as base, ThreadPoolExecutor(len(requests)) as pool:
        got = list(pool.map(lambda r: ask(base, r), requests))
    assert got == want
    assert max(running) >= 2


@pytest.mark.parametrize("batching", [False, True])
def test_a_burst_at_an_idle_worker_is_not_refused(dg, monkeypatch, batching):
    """Jobs that start at the worker thread's next turn take no queue slot, however
    late the thread wakes: with a queue of 1, an idle serial worker takes one job
    and queues one; an idle batching worker (--max-batch 2) takes two requests
    and queues one (and a plain job, when idle, runs at once). The next is refused."""
    from dlm.runtime.server.batch_worker import BatchWorker
    from dlm.runtime.server.worker import GenerationWorker, QueueFull

    cls = BatchWorker if batching else GenerationWorker
    awake, release, real = threading.Event(), threading.Event(), cls._loop
    monkeypatch.setattr(cls, "_loop", lambda self: (awake.wait(60), real(self)))  # the thread wakes late
    loop = asyncio.new_event_loop()
    worker = BatchWorker(dg, max_batch=2, queue_size=1) if batching else GenerationWorker(queue_size=1)
    try:
        ids = api.encode_prompt(dg, messages=[{"role": "user", "content": "Hi"}])
        request = (ids, {**DEFAULTS, "seed": 1}) if batching else None
        taken = 2 if batching else 1
        jobs = [worker.submit(lambda cancel: iter([1]), loop, request) for _ in range(taken + 1)]
        assert worker.current is jobs[0] and worker.queued == 1  # before the thread ran at all
        assert worker.status().get("running", 1) == taken
        with pytest.raises(QueueFull):
            worker.submit(lambda cancel: iter([1]), loop, request)
        awake.set()
        assert worker.wait_idle(60) and worker.served == taken + 1
        assert all(j.done and j.last_item is not None for j in jobs)
        if batching:  # a plain job at an idle batching worker is taken too
            plain = [worker.submit(lambda cancel: (release.wait(60), iter([1]))[1], loop),
                     worker.submit(lambda cancel: iter([1]), loop)]
            assert worker.current is plain[0] and worker.queued == 1
            release.set()
            assert worker.wait_idle(60) and [j.last_item for j in plain] == [1, 1]
    finally:
        awake.set()
        release.set()
        worker.stop()
        loop.close()

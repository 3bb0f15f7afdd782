"""dlm-run serve over real HTTP on loopback, against a tiny converted DiffusionGemma.

Answers are checked against the runtime's own Python API run on the same
prompt ids and options (same seed: same commits), driven with the official
openai client and, for error cases and raw SSE, with httpx.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from dlm.convert.pipeline import ConvertOptions, convert
from dlm.runtime import api
from dlm.runtime.server.app import create_app

DEFAULTS = {"max_tokens": 8, "max_denoising_steps": 3}
MSGS = [{"role": "user", "content": "Why is the sky blue?"}]
# Long enough to be cancelled mid-way: up to 32 canvases x 8 steps (seed 3 runs
# 28 canvases here before its EOS).
LONG = {"max_tokens": 256, "max_denoising_steps": 8, "seed": 3}


@pytest.fixture(scope="module")
def dg_paths(tiny_dg_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_dg")
    convert(ConvertOptions(source=str(tiny_dg_dir), output=str(root / "tiny-dg"), text_only=True,
                           progress=False), echo=lambda s: None)
    return {"tiny-dg": root / "tiny-dg"}


@pytest.fixture(scope="module")
def dg(dg_paths):
    return api.load(dg_paths["tiny-dg"])


@pytest.fixture(scope="module")
def served(dg, serving):
    app = create_app(dg, DEFAULTS, queue_size=4, max_body_bytes=64 * 1024)
    with serving(app) as base:
        yield base, app.state.worker


def oai(base, key="unused"):
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=60)


def reference(worker, loaded, options, messages=None, prompt=None):
    """The runtime's own answer: prompt ids and events (run while the server is idle,
    so MLX work never overlaps)."""
    assert worker.wait_idle(30)
    if messages is not None:
        ids = api.encode_prompt(loaded, messages=messages)
    else:
        ids = api.encode_prompt(loaded, prompt=prompt, chat_template=False)
    return ids, list(api.stream_generate(loaded, ids, {**DEFAULTS, **options}))


def commits(events):
    return [e.text for e in events if e.text]


def sse(h: httpx.Client, path: str, body: dict):
    """POST a streaming request; (status, [parsed data lines]) with "[DONE]" kept as a string."""
    with h.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.json()
        assert r.headers["content-type"].startswith("text/event-stream")
        data = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                raw = line[len("data: "):]
                data.append(raw if raw == "[DONE]" else json.loads(raw))
        return 200, data


# -- happy paths ----------------------------------------------------------------

def test_models_health_and_routing(served):
    base, worker = served
    assert [m.id for m in oai(base).models.list().data] == ["tiny-dg"]
    health = httpx.get(base + "/health").json()
    assert health["status"] == "ok" and health["worker"]["alive"]
    assert httpx.get(base + "/v1/models/tiny-dg").json()["id"] == "tiny-dg"
    assert httpx.get(base + "/v1/models/other").status_code == 404
    assert httpx.get(base + "/v1/chat/completions").status_code == 405
    r = httpx.post(base + "/v1/nope", json={})
    assert r.status_code == 404 and "error" in r.json()


def test_chat_matches_the_runtime(served, dg):
    base, worker = served
    client = oai(base)
    r = client.chat.completions.create(model="tiny-dg", messages=MSGS, seed=7, max_tokens=16)
    ids, events = reference(worker, dg, {"seed": 7, "max_tokens": 16}, messages=MSGS)
    final = events[-1]
    assert r.choices[0].message.content == "".join(e.text for e in events)
    assert r.choices[0].finish_reason == final.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == final.stats.completion_tokens == 16
    assert r.usage.total_tokens == len(ids) + 16
    timings = r.model_extra["timings"]
    assert timings["steps_per_block"] == final.stats.steps_per_block
    assert 0 <= timings["queue_seconds"] <= timings["total_seconds"]

    # `temperature` reaches the runtime as `temp`; another seed gives another answer.
    greedy = client.chat.completions.create(model="tiny-dg", messages=MSGS, seed=7, max_tokens=16,
                                            temperature=0)
    _, events0 = reference(worker, dg, {"seed": 7, "max_tokens": 16, "temp": 0.0}, messages=MSGS)
    assert greedy.choices[0].message.content == "".join(e.text for e in events0)
    other = client.chat.completions.create(model="tiny-dg", messages=MSGS, seed=8, max_tokens=16)
    assert other.choices[0].message.content != r.choices[0].message.content


def test_chat_stream_sends_each_committed_canvas_in_order(served, dg):
    base, worker = served
    stream = oai(base).chat.completions.create(
        model="tiny-dg", messages=MSGS, seed=3, max_tokens=24, stream=True,
        stream_options={"include_usage": True},
        extra_body={"max_denoising_steps": 2})
    chunks = list(stream)
    ids, events = reference(worker, dg, {"seed": 3, "max_tokens": 24, "max_denoising_steps": 2},
                            messages=MSGS)
    assert len(commits(events)) == 3  # three 8-token canvases
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert content == commits(events)  # one chunk per committed canvas, never partial ones
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == len(ids)
    assert chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].model_extra["timings"]["steps_per_block"] == [2, 2, 2]


def test_completions_plain_and_streamed(served, dg):
    base, worker = served
    r = oai(base).completions.create(model="tiny-dg", prompt="The sky is", seed=5, max_tokens=16)
    ids, events = reference(worker, dg, {"seed": 5, "max_tokens": 16}, prompt="The sky is")
    assert r.choices[0].text == "".join(e.text for e in events)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 16
    with httpx.Client(base_url=base, timeout=60) as h:
        status, data = sse(h, "/v1/completions", {"prompt": "The sky is", "seed": 5, "max_tokens": 16,
                                                   "stream": True})
    assert status == 200 and data[-1] == "[DONE]"
    assert all(d["object"] == "text_completion" for d in data[:-1])
    assert [d["choices"][0]["text"] for d in data[:-1] if d["choices"][0]["text"]] == commits(events)
    assert data[-2]["choices"][0]["finish_reason"] == "length"


class ThinkingRuntime:
    """The real runtime, with the first committed canvas relabelled as thinking
    (the tiny random model never opens a thought channel by itself)."""

    def encode_prompt(self, *args, **kwargs):
        return api.encode_prompt(*args, **kwargs)

    def stream_generate(self, *args, **kwargs):
        for i, event in enumerate(api.stream_generate(*args, **kwargs)):
            if i == 0:
                event.reasoning, event.text = event.text, ""
            yield event


def test_reasoning_streams_as_reasoning_content_and_stays_out_of_answers(dg, serving):
    app = create_app(dg, DEFAULTS, runtime=ThinkingRuntime())
    body = {"messages": MSGS, "seed": 4, "max_tokens": 16}
    with serving(app) as base:
        worker = app.state.worker
        _, events = reference(worker, dg, {"seed": 4, "max_tokens": 16}, messages=MSGS)
        thought, answer = events[0].text, "".join(e.text for e in events[1:])
        stream = list(oai(base).chat.completions.create(model="m", stream=True, **body))
        deltas = [c.choices[0].delta for c in stream if c.choices]
        assert [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)] == [thought]
        assert "".join(d.content or "" for d in deltas) == answer
        with httpx.Client(base_url=base, timeout=60) as h:
            message = h.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": answer}


def test_stop_strings_cut_the_committed_text(served, dg):
    base, worker = served
    _, events = reference(worker, dg, {"seed": 11, "max_tokens": 24}, messages=MSGS)
    parts = commits(events)
    stop = parts[0][-3:] + parts[1][:3]  # spans two canvases
    full = "".join(parts)
    expected = full[: full.find(stop)]
    client = oai(base)
    r = client.chat.completions.create(model="m", messages=MSGS, seed=11, max_tokens=24,
                                       stop=["\u2603 never", stop])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (expected, "stop")
    chunks = list(client.chat.completions.create(model="m", messages=MSGS, seed=11, max_tokens=24,
                                                 stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert worker.wait_idle(10)  # the rest of the generation was cancelled


# -- bad input --------------------------------------------------------------------

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
VIDEO = {"type": "video_url", "video_url": {"url": "https://example.invalid/v.mp4"}}


def user(*parts):
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}]}


BAD_REQUESTS = [
    ("chat", b'{"messages": [', 400, "malformed JSON"),
    ("chat", b"[1, 2]", 400, "JSON object"),
    ("chat", b"", 400, "empty"),
    ("chat", {"messages": MSGS, "temperature": "hot"}, 400, "'temperature'"),
    ("chat", {"messages": MSGS, "max_tokens": "8"}, 400, "'max_tokens'"),
    ("chat", {"messages": MSGS, "max_tokens": 0}, 400, "'max_tokens'"),
    ("chat", {"messages": MSGS, "stream": "yes"}, 400, "'stream'"),
    ("chat", {"messages": MSGS, "stop": [1]}, 400, "'stop'"),
    ("chat", {"messages": MSGS, "n": 2}, 400, "'n'"),
    ("chat", {"messages": "hi"}, 400, "'messages'"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("chat", {"messages": [{"role": "user", "content": ""}]}, 400, "empty"),
    ("completions", {"prompt": ""}, 400, "empty"),
    ("completions", {"prompt": 42}, 400, "'prompt'"),
    ("chat", {"messages": MSGS, "max_tokens": 5000}, 400, "context of 4096"),
    ("completions", {"prompt": "a" * 4095}, 400, "context of 4096"),  # + the default 8 tokens
    ("chat", {"messages": MSGS, "frequency_penalty": 0.5, "logprobs": False}, 400,
     "'frequency_penalty' must be 0 (got 0.5)"),
    ("chat", {"messages": MSGS, "logprobs": True}, 400, "'logprobs' is supported with structured output only"),
    ("chat", {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "no spaces"}}]}, 400,
     "'tools[0].function.name'"),
    ("chat", {"messages": MSGS, "tool_choice": "required"}, 400, "no 'tools'"),
    ("chat", {"messages": MSGS, "response_format": {"type": "yaml"}}, 400, "'response_format.type'"),
    ("chat", {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}}, 400, "Invalid type: bogus"),
    ("chat", {"messages": MSGS, "made_up": 1}, 400, "unsupported field(s) for /v1/chat/completions: 'made_up'"),
    ("chat", {"messages": MSGS, "block_length": 4}, 400, "block_length"),
    ("chat", {"messages": MSGS, "stream": True, "top_k": 5}, 400, "top_k"),
    ("chat", {"messages": MSGS, "diffusion_sampler": "greedy"}, 400, "diffusion_sampler"),
    ("chat", {"messages": MSGS, "diffusion_max_canvas_length": 999}, 400, "canvas_length"),
    ("chat", user(IMAGE), 400, "text-only"),
    ("chat", user(AUDIO), 400, "audio input is not supported"),
    ("chat", user(VIDEO), 400, "video input is not supported"),
    ("chat", {"messages": MSGS, "padding": "x" * 70_000}, 413, "limit"),
]


@pytest.mark.parametrize("route,body,status,fragment", BAD_REQUESTS,
                         ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_a_clear_4xx_and_the_next_one_is_served(served, route, body, status,
                                                                 fragment):
    base, worker = served
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    with httpx.Client(base_url=base, timeout=60) as h:
        if isinstance(body, bytes):
            r = h.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = h.post(path, json=body)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert fragment in error["message"]
        ok = h.post("/v1/chat/completions", json={"messages": MSGS, "seed": 1})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8
    assert worker.status()["alive"]


# -- queueing, concurrency, cancellation ----------------------------------------------

def test_many_concurrent_clients_get_the_sequential_answers(served):
    base, worker = served
    prompts = [(f"Question number {i}?", 100 + i) for i in range(4)]

    def body(i, stream=False):
        text, seed = prompts[i]
        return {"messages": [{"role": "user", "content": text}], "seed": seed, "stream": stream}

    with httpx.Client(base_url=base, timeout=60) as h:  # one at a time
        expected = [h.post("/v1/chat/completions", json=body(i)).json()["choices"][0]["message"]["content"]
                    for i in range(len(prompts))]
    assert len(set(expected)) == len(prompts)
    # A client has its answer once the last item is posted; the worker counts the job just after.
    assert worker.wait_idle(30)
    served_before = worker.served

    def one_client(c):
        results = []
        with httpx.Client(base_url=base, timeout=120) as h:
            for k in range(5):
                i, stream = (c + k) % len(prompts), (c + k) % 3 == 0
                if stream:
                    status, data = sse(h, "/v1/chat/completions", body(i, True))
                    content = ("".join(d["choices"][0]["delta"].get("content") or ""
                                       for d in data[:-1] if d["choices"])
                               if status == 200 else data)
                else:
                    r = h.post("/v1/chat/completions", json=body(i))
                    status = r.status_code
                    content = r.json()["choices"][0]["message"]["content"] if status == 200 else r.json()
                results.append((i, status, content))
        return results

    with ThreadPoolExecutor(max_workers=20) as pool:
        results = [x for f in [pool.submit(one_client, c) for c in range(20)] for x in f.result()]
    assert len(results) == 100
    statuses = Counter(status for _, status, _ in results)
    assert set(statuses) <= {200, 429}, statuses
    assert statuses[200] >= 5
    for i, status, content in results:
        if status == 200:
            assert content == expected[i]
        else:
            assert content["error"]["type"] == "rate_limit_error"
    assert worker.wait_idle(30)
    assert worker.served - served_before == statuses[200]  # nothing lost, nothing extra


def hold_worker(worker):
    """Occupy the worker with a job that runs until released (or cancelled)."""
    gate, loop = threading.Event(), asyncio.new_event_loop()

    def run(cancel):
        while not gate.wait(0.005) and not cancel():
            pass
        return iter(())

    job = worker.submit(run, loop)
    deadline = time.monotonic() + 10
    while worker.queued and time.monotonic() < deadline:
        time.sleep(0.002)

    def release():
        gate.set()
        assert worker.wait_idle(30)
        loop.close()

    return job, release


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_full_queue_answers_429_at_once_and_queueing_is_timed(served):
    base, worker = served
    _, release = hold_worker(worker)
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            waiting = [pool.submit(httpx.post, base + "/v1/chat/completions",
                                   json={"messages": MSGS, "seed": s}, timeout=60) for s in range(4)]
            wait_for(lambda: worker.queued == 4)
            t0 = time.perf_counter()
            r = httpx.post(base + "/v1/chat/completions", json={"messages": MSGS}, timeout=60)
            assert r.status_code == 429 and time.perf_counter() - t0 < 5
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert httpx.get(base + "/health").json()["worker"]["queued"] == 4
            time.sleep(0.2)
            release()
            answers = [f.result() for f in waiting]
    finally:
        release()
    assert [a.status_code for a in answers] == [200] * 4
    for a in answers:
        t = a.json()["timings"]
        assert t["queue_seconds"] >= 0.2 and t["total_seconds"] >= t["queue_seconds"]


def test_disconnect_mid_stream_frees_the_worker_within_a_step(served):
    base, worker = served
    with httpx.Client(base_url=base, timeout=60) as h:
        with h.stream("POST", "/v1/chat/completions",
                      json={"messages": MSGS, "stream": True, **LONG}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    break  # hang up after the first committed canvas
    assert worker.wait_idle(10)
    job = worker.last_job
    # The runtime saw the cancel and stopped (a natural end would say stop/length).
    assert job.last_item.finish_reason in (None, "cancelled")
    assert job.cancelled_at is not None and job.finished_at >= job.cancelled_at
    assert job.polls_after_cancel <= 1  # stopped at the first denoising-step poll after the disconnect
    assert 8 <= job.polls < 224  # polled once per step; far from the full 28 canvases x 8 steps
    step = (job.cancelled_at - job.started_at) / (job.polls - job.polls_after_cancel)
    assert job.finished_at - job.cancelled_at < 5 * step + 0.5
    r = oai(base).chat.completions.create(model="m", messages=MSGS, seed=1)
    assert r.usage.completion_tokens == 8


def post_then_hang_up(base, body, until):
    """Send a request on a raw socket and close the connection once ``until()``."""
    host, port = base.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        wait_for(until)


def test_disconnects_while_generating_or_queued_cancel_the_request(served):
    base, worker = served
    # A non-streaming client that gives up while its request runs.
    def generating():
        job = worker.current
        return job is not None and job.polls > 2

    post_then_hang_up(base, {"messages": MSGS, **LONG}, generating)
    assert worker.wait_idle(10)
    job = worker.last_job
    assert job.last_item is None or job.last_item.finish_reason in (None, "cancelled")
    assert job.cancelled_at is not None and job.polls_after_cancel <= 1 and job.polls < 224
    # A queued client that gives up never runs.
    _, release = hold_worker(worker)
    try:
        served_before = worker.served
        post_then_hang_up(base, {"messages": MSGS}, lambda: worker.queued == 1)
        wait_for(lambda: worker.queued == 0)
    finally:
        release()
    assert worker.served == served_before + 1  # only the holder ran


def test_api_key_is_required_on_every_route(dg, serving):
    app = create_app(dg, DEFAULTS, api_key="sekret-key")
    with serving(app) as base:
        assert httpx.get(base + "/health").status_code == 200  # probes send no key
        for method, path in (("GET", "/v1/models"),
                             ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret-key"}):
                r = httpx.request(method, base + path, headers=headers, json={"messages": MSGS})
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["type"] == "authentication_error"
        assert app.state.worker.served == 0
        with pytest.raises(openai.AuthenticationError):
            oai(base, key="wrong").models.list()
        r = oai(base, key="sekret-key").chat.completions.create(model="m", messages=MSGS, seed=2)
        assert r.usage.completion_tokens == 8
        assert httpx.get(base + "/health", headers={"Authorization": "Bearer sekret-key"}).status_code == 200


# -- the command line -------------------------------------------------------------------

# `dlm-run generate` parameters about the prompt and the output, not the generation.
PROMPT_PARAMS = {"model_path", "prompt", "prompt_ids", "system", "chat_template", "image", "audio",
                 "video", "profile", "as_json", "verbose", "prompts_file", "output", "trace_path",
                 # per request on the server: response_format, logprobs
                 "json_schema_path", "json_object", "logprobs"}


def test_serve_takes_generates_generation_flags():
    from dlm.runtime.cli.main import generate, main

    serve = main.commands["serve"]
    serve_params = {p.name: p for p in serve.params}
    for param in generate.params:
        if param.name in PROMPT_PARAMS:
            continue
        assert param.name in serve_params, f"dlm-run serve lacks generate's {param.opts}"
        assert set(param.opts) <= set(serve_params[param.name].opts)


def test_served_connections_send_without_nagle_delay():
    """dlm-run serve's socket names TCP as its protocol, so asyncio (uvicorn serves
    it with loop.create_server(sock=...)) sets TCP_NODELAY on each connection:
    without it every response and streamed chunk waited ~40 ms for a delayed ACK."""
    import asyncio
    import socket

    from dlm.runtime.cli.serve import bind

    sock = bind("127.0.0.1", 0)
    flags = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport):
            flags.append(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    async def connect():
        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        for _ in range(500):
            if flags:
                break
            await asyncio.sleep(0.01)
        writer.close()
        server.close()
        await server.wait_closed()

    asyncio.run(connect())
    assert flags and flags[0] != 0


def test_serve_command_binds_loopback_and_checks_defaults(dg_paths, monkeypatch):
    from click.testing import CliRunner

    from dlm.runtime.cli import serve as serve_cli
    from dlm.runtime.cli.main import main

    calls = []
    monkeypatch.setattr(serve_cli, "run_server", lambda app, sock, level: calls.append((app, sock)))
    model = str(dg_paths["tiny-dg"])
    result = CliRunner().invoke(main, ["serve", "--model", model, "--max-tokens", "8", "--port", "0",
                                       "--max-denoising-steps", "3", "--thinking"])
    assert result.exit_code == 0, result.output
    app, sock = calls[0]
    app.state.worker.stop()
    host, port = sock.getsockname()[:2]
    sock.close()
    assert host == "127.0.0.1" and port > 0  # loopback by default; --port 0 picks a free port
    assert f"at http://127.0.0.1:{port}/v1" in result.output  # the banner names the bound port
    assert {p.name: p.default for p in serve_cli.serve.params}["port"] == 8080
    server = app.state.server
    assert server.defaults == {"max_tokens": 8, "max_denoising_steps": 3}
    assert server.enable_thinking and server.model_id == "tiny-dg"

    result = CliRunner().invoke(main, ["serve", "--model", model, "--block-length", "4"])
    assert result.exit_code == 1 and "error:" in result.output and "--block-length does not apply" in result.output
    assert len(calls) == 1

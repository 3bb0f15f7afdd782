"""``mlx.launch -n 2 --backend ring dlm-run serve``: rank 0 serves HTTP, rank 1 follows
its plans with no HTTP; the openai client gets what one process answers (plain,
streamed, two requests batched together, a structured one), and a rank killed
while serving takes the whole job down, nothing left running. One launch."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import httpx
import openai
import pytest

from dlm.runtime import api
from tests.distributed import DLM_RUN, rank_pids, read, start

SERVE = {"max_tokens": 8, "block_length": 4, "max_denoising_steps": 4}
FLAGS = ["--max-tokens", "8", "--block-length", "4", "--max-denoising-steps", "4"]
MSGS = [{"role": "user", "content": "Name a colour."}]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(base: str, proc, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, read(proc.err)
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("the distributed server did not come up:\n" + read(proc.err))


def _alone(loaded, options: dict, **hooks):
    ids = api.encode_prompt(loaded, messages=MSGS)
    return list(api.stream_generate(loaded, ids, {**SERVE, **options}, **hooks))


@pytest.fixture(scope="module")
def server(tiny_llada2_mlx_dir):
    port = _free_port()
    proc = start(2, [str(DLM_RUN), "serve", "--model", str(tiny_llada2_mlx_dir), "--port", str(port),
                     "--max-batch", "4", *FLAGS], env={"DLM_DISTRIBUTED_TIMEOUT": "20"})
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", proc)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        for pid in rank_pids(proc).values():
            os.kill(pid, signal.SIGKILL)
        proc.wait(30)


def test_rank0_serves_what_one_process_answers_and_a_dead_rank_ends_the_job(server, tiny_llada2_mlx_dir):
    base, proc = server
    loaded = api.load(tiny_llada2_mlx_dir)
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
    assert httpx.get(base + "/health").json()["worker"]["ranks"] == 2

    r = client.chat.completions.create(model="m", messages=MSGS, seed=3, max_tokens=12, temperature=0.7)
    events = _alone(loaded, {"seed": 3, "max_tokens": 12, "temp": 0.7})
    assert r.choices[0].message.content == "".join(e.text for e in events)
    assert r.model_extra["timings"]["steps_per_block"] == events[-1].stats.steps_per_block

    chunks = list(client.chat.completions.create(model="m", messages=MSGS, seed=2, max_tokens=12,
                                                 temperature=0.7, stream=True))
    events = _alone(loaded, {"seed": 2, "max_tokens": 12, "temp": 0.7})
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert content == [e.text for e in events if e.text]  # one chunk per committed block

    # Two requests at once: batched on every rank, each answered as alone.
    answers = {}

    def ask(seed: int) -> None:
        answers[seed] = client.chat.completions.create(model="m", messages=MSGS, seed=seed, max_tokens=12,
                                                       temperature=0.7).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(seed,)) for seed in (5, 6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for seed in (5, 6):
        assert answers[seed] == "".join(e.text for e in _alone(loaded, {"seed": seed, "max_tokens": 12,
                                                                         "temp": 0.7}))

    # Structured output runs alone, each step's cancel poll broadcast from rank 0.
    fmt = {"type": "json_object"}
    r = client.chat.completions.create(model="m", messages=MSGS, seed=1, response_format=fmt)
    assert r.choices[0].message.content == "".join(e.text for e in _alone(loaded, {"seed": 1},
                                                                          response_format=fmt))

    # Rank 1 killed: mlx.launch stops rank 0 too, and nothing is left running.
    pids = rank_pids(proc)
    assert sorted(pids) == [0, 1]
    os.kill(pids[1], signal.SIGKILL)
    proc.wait(60)
    assert rank_pids(proc) == {}
    assert "rank 1 exited with code -9" in read(proc.err)

"""``mlx.launch -n 2 --backend ring dlm-run serve``: rank 0 serves HTTP, rank 1 follows
its plans with no HTTP; the openai client gets what one process answers (plain,
streamed, two requests batched together, a structured one: computed in this
process while the ranks start, without a prefix cache; the ranks served them from
theirs), and a rank killed while serving takes the whole
job down, nothing left running. One launch."""

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

# Prefill chunks of 8: every request after the first finds the prompt's chunks in each rank's prefix cache.
SERVE = {"max_tokens": 8, "block_length": 4, "max_denoising_steps": 4, "prefill_step_size": 8}
FLAGS = ["--max-tokens", "8", "--block-length", "4", "--max-denoising-steps", "4", "--prefill-step-size", "8"]
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


FMT = {"type": "json_object"}


@pytest.fixture(scope="module")
def server(tiny_llada2_mlx_dir):
    """(base URL, the launch, what one process streams for each request: computed while the ranks start)."""
    port = _free_port()
    proc = start(2, [str(DLM_RUN), "serve", "--model", str(tiny_llada2_mlx_dir), "--port", str(port),
                     "--max-batch", "4", *FLAGS], env={"DLM_DISTRIBUTED_TIMEOUT": "20"})
    try:
        loaded = api.load(tiny_llada2_mlx_dir)
        alone = {seed: _alone(loaded, {"seed": seed, "max_tokens": 12, "temp": 0.7}) for seed in (3, 2, 5, 6)}
        alone["json"] = _alone(loaded, {"seed": 1}, response_format=FMT)
        _wait_healthy(f"http://127.0.0.1:{port}", proc)
        yield f"http://127.0.0.1:{port}", proc, alone
    finally:
        for pid in rank_pids(proc).values():
            os.kill(pid, signal.SIGKILL)
        proc.wait(30)


def test_rank0_serves_what_one_process_answers_and_a_dead_rank_ends_the_job(server):
    base, proc, alone = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
    assert httpx.get(base + "/health").json()["worker"]["ranks"] == 2

    r = client.chat.completions.create(model="m", messages=MSGS, seed=3, max_tokens=12, temperature=0.7)
    events = alone[3]
    assert r.choices[0].message.content == "".join(e.text for e in events)
    assert r.model_extra["timings"]["steps_per_block"] == events[-1].stats.steps_per_block

    chunks = list(client.chat.completions.create(model="m", messages=MSGS, seed=2, max_tokens=12,
                                                 temperature=0.7, stream=True))
    events = alone[2]
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
        assert answers[seed] == "".join(e.text for e in alone[seed])

    # Structured output joins the batch like any other request.
    r = client.chat.completions.create(model="m", messages=MSGS, seed=1, response_format=FMT)
    assert r.choices[0].message.content == "".join(e.text for e in alone["json"])

    # Each rank's prefix cache served the same chunks (a rank that missed where rank 0 hit would
    # run other forwards and hang the collectives); the answers above are the uncached ones.
    assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens // 4 * 4  # its whole blocks
    cache = httpx.get(base + "/health").json()["prefix_cache"]
    assert cache["lookups"] == 5 and cache["hits"] == 4

    # Rank 1 killed: mlx.launch stops rank 0 too, and nothing is left running.
    pids = rank_pids(proc)
    assert sorted(pids) == [0, 1]
    os.kill(pids[1], signal.SIGKILL)
    proc.wait(60)
    assert rank_pids(proc) == {}
    assert "rank 1 exited with code -9" in read(proc.err)

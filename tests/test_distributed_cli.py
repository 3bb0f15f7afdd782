"""``mlx.launch -n N --backend ring dlm-run generate|chat`` on loopback with the tiny
LLaDA-2 and DiffusionGemma models: rank 0 prints exactly what one process prints
(same flags, same seed; batched and structured runs too), the other ranks print nothing; stdin reaches every rank through rank 0;
--profile adds the collectives; a rank that hangs ends every rank with an error.
All of it is one launch (tests/distributed.py: start_many), the hang last, with what
one plain process prints computed while the ranks run."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from tests.distributed import outputs, rank_pids, read, run_many_alone, start_many, started

STATS = ("stats", "wall_seconds")  # timings differ between runs


def _same(out: str) -> list:
    """Each JSON line of a command's output without its timings; text lines as they are."""
    lines = []
    for line in out.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            lines.append(line)
            continue
        lines.append({k: v for k, v in obj.items() if k not in STATS} if isinstance(obj, dict) else obj)
    return lines


@pytest.fixture(scope="module")
def files(tiny_llada2_mlx_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("distributed_cli")
    (root / "prompts.jsonl").write_text(json.dumps({"prompt_ids": [2, 10, 11], "seed": 1, "max_tokens": 12})
                                        + "\n" + json.dumps({"prompt": "Hi", "seed": 2, "max_tokens": 20}) + "\n")
    (root / "chat.txt").write_text("hello\nand then?\n/exit\n")
    return root


def _commands(model, root, dg) -> list:
    m, g = ["--model", str(model)], ["--model", str(dg)]
    return [
        ["generate", *m, "--prompt-ids", "2,10,11", "--max-tokens", "16", "--seed", "1", "--json"],
        ["generate", *m, "--prompt", "Hello there", "--max-tokens", "16", "--seed", "3", "--profile"],
        ["generate", *m, "--prompts-file", str(root / "prompts.jsonl"), "--output", "-"],
        ["generate", *m, "--max-tokens", "8", "--seed", "1"],  # the prompt from stdin
        {"args": ["chat", *m, "--max-tokens", "8", "--seed", "1"], "stdin": str(root / "chat.txt")},
        # DiffusionGemma: structured output (the families' own tests run the rest over 2 and 3 ranks)
        ["generate", *g, "--prompt", "Hi", "--max-tokens", "16", "--seed", "1", "--json-object", "--json"],
    ]


@pytest.fixture(scope="module")
def commands(tiny_llada2_mlx_dir, tiny_dg_mlx_dir, files) -> list:
    return _commands(tiny_llada2_mlx_dir, files, tiny_dg_mlx_dir)


def _hang(model) -> dict:
    """Rank 1 hangs after its first block; the watchdogs' limit 5 s (for this command only)."""
    return {"args": ["generate", "--model", str(model), "--prompt-ids", "2,10,11", "--max-tokens", "96",
                     "--block-length", "8", "--seed", "1"],
            "env": {"DLM_DISTRIBUTED_TIMEOUT": "5"}, "stall": "1:hang"}


@pytest.fixture(scope="module")
def ran(commands, tiny_llada2_mlx_dir):
    """One launch over 2 ranks: ``commands``, then ``_hang`` (it ends the job, so last).
    What one plain process prints for ``commands`` ({index: (exit code, output)},
    ``.alone``) is computed meanwhile; ``.ended``: when the launch ended (time.time())."""
    import types

    proc = start_many(2, [*commands, _hang(tiny_llada2_mlx_dir)], input="Why?\n")
    try:
        alone = outputs(run_many_alone(commands, input="Why?\n").stdout)
        proc.wait(timeout=300)
        ended = time.time()
    finally:
        if proc.poll() is None:  # the hang did not end the job: end it
            for pid in rank_pids(proc).values():
                os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait()
    return types.SimpleNamespace(stdout=read(proc.out), stderr=read(proc.err), tag=proc.tag, alone=alone,
                                 ended=ended)


def test_two_ranks_print_what_one_process_prints(commands, ran):
    got = outputs(ran.stdout)
    assert sorted(got)[:len(commands)] == list(range(len(commands))), ran.stderr
    for index in range(len(commands)):
        code, out = got[index]
        assert code == 0, (index, ran.stderr)
        assert _same(out) == _same(ran.alone[index][1]), index
    assert ran.stderr.count("Warm-up: one untimed generation") == 1  # rank 1 stays silent
    assert "Distributed: 2 ranks" in ran.stderr and "collectives per denoising step" in ran.stderr


def test_a_rank_that_hangs_ends_every_rank_with_an_error(commands, ran):
    hang = len(commands)  # the launch's last command
    assert ran.ended - started(ran.stderr)[hang] < 170
    assert [code for index, (code, _) in outputs(ran.stdout).items() if index == hang] in ([], [1])  # rank 0
    # never finished it. The first watchdog to fire ends its rank (exit 1); mlx.launch then stops the other
    # (SIGTERM, -15) unless that one's own watchdog, or its failed collective, ended it first.
    assert re.search(r"error: rank [01] of 2: no progress for 5 s", ran.stderr), ran.stderr
    for rank in (0, 1):
        assert re.search(rf"Node with rank {rank} exited with code (1|-15) ", ran.stderr), ran.stderr
    assert rank_pids(ran) == {}  # nothing left running

"""Hostile and careless input to dlm-run (CLI and HTTP), for both families:
every refusal is one line naming the flag, field or limit; no traceback, no
5xx, no process death; the server keeps serving afterwards."""

from __future__ import annotations

import httpx
import pytest
from click.testing import CliRunner

from dlm.runtime import api
from dlm.runtime.cli.main import main
from dlm.runtime.platform.errors import GenerationError
from dlm.runtime.platform.memory import budget_bytes, machine_memory_bytes
from dlm.runtime.server.app import create_app

FAST = {"diffusion_gemma": ["--max-denoising-steps", "2"],
        "llada2_moe": ["--max-denoising-steps", "2", "--block-length", "4"]}
DEFAULTS = {"diffusion_gemma": {"max_tokens": 4, "max_denoising_steps": 2},
            "llada2_moe": {"max_tokens": 4, "max_denoising_steps": 2, "block_length": 4}}
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module", params=["diffusion_gemma", "llada2_moe"])
def model(request):
    """(family name, converted model dir)."""
    fixture = {"diffusion_gemma": "tiny_dg_mlx_dir", "llada2_moe": "tiny_llada2_mlx_dir"}[request.param]
    return request.param, request.getfixturevalue(fixture)


def run(args, input=None):
    return CliRunner().invoke(main, ["generate", *args], input=input)


def one_line_error(r, fragment, code=1):
    assert r.exit_code == code, r.output
    assert "Traceback" not in r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert any(fragment in ln for ln in lines), r.output
    return lines


# -- sizes: bounded by the context and the memory budget, refused before allocating ------


def test_a_block_longer_than_the_context_is_refused(tiny_llada2_mlx_dir):
    r = run(["--model", str(tiny_llada2_mlx_dir), "--prompt", "hi", "--block-length", "1000000"])
    one_line_error(r, "error: --block-length 1000000 exceeds the model context of 4096 tokens")


def test_a_generation_over_the_memory_budget_is_refused(model):
    family, path = model
    r = run(["--model", str(path), "--prompt", "hi", "--max-tokens", "1000", *FAST[family],
             "--memory-budget", "0.0001"])
    one_line_error(r, "over the memory budget of 100.00 kB (--memory-budget)")


def test_the_default_budget_is_a_fraction_of_this_machine():
    assert 0 < budget_bytes() < machine_memory_bytes()
    assert budget_bytes(2.5) == 2_500_000_000


def test_an_oversized_prompt_is_refused_by_both_families(model):
    family, path = model
    loaded = api.load(path)
    ctx = loaded.args.max_position_embeddings
    with pytest.raises(GenerationError, match=f"model context is {ctx}"):
        list(api.stream_generate(loaded, [5] * ctx, {"max_tokens": 4}))


def test_max_tokens_beyond_the_context_is_refused_as_the_server_does(model):
    """One rule for the CLI, the API and the server: a budget the context cannot
    hold is an error naming --max-tokens, not cut silently (issue 42)."""
    family, path = model
    loaded = api.load(path)
    ctx = loaded.args.max_position_embeddings
    prompt = [5] * (ctx - 3)  # room for 3 tokens
    with pytest.raises(GenerationError, match=f"--max-tokens {10**9}: .* to at most 3$"):
        list(api.stream_generate(loaded, prompt, {**DEFAULTS[family], "max_tokens": 10**9}))
    events = list(api.stream_generate(loaded, prompt, {**DEFAULTS[family], "max_tokens": 3}))
    assert sum(len(e.token_ids) for e in events) <= 3


# -- values that used to pass validation and then crash -------------------------------


@pytest.mark.parametrize("flags, fragment, code", [
    (["--seed", str(2**64)], "--seed", 2),
    (["--temp", "nan"], "error: --temp must be a finite number", 1),
    (["--temp", "inf"], "--temp", 1),
])
def test_bad_numbers_are_one_line_errors(model, flags, fragment, code):
    family, path = model
    r = run(["--model", str(path), "--prompt", "hi", *FAST[family], *flags])
    one_line_error(r, fragment, code)


def test_the_largest_seed_works(model):
    family, path = model
    r = run(["--model", str(path), "--prompt", "hi", "--max-tokens", "2", *FAST[family],
             "--seed", str(2**64 - 1)])
    assert r.exit_code == 0, r.output


def test_invalid_utf8_on_stdin_and_argv(model):
    family, path = model
    r = run(["--model", str(path), *FAST[family]], input=b"sort \xff\xfe 123")
    one_line_error(r, "error: stdin is not valid UTF-8 (byte 0xff at offset 5)")
    r = run(["--model", str(path), *FAST[family], "--prompt", "caf\udce9"])
    one_line_error(r, "error: --prompt is not valid UTF-8 text")


def test_an_internal_error_is_one_line(model, monkeypatch):
    family, path = model

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(api, "encode_prompt", broken)
    r = run(["--model", str(path), "--prompt", "hi", *FAST[family]])
    one_line_error(r, "error: internal error (RuntimeError: boom); this is a dlm bug")


def test_an_empty_api_key_is_refused(tiny_dg_mlx_dir):
    r = CliRunner().invoke(main, ["serve", "--model", str(tiny_dg_mlx_dir), "--api-key", ""])
    one_line_error(r, "the API key is empty", code=2)


# -- the same over HTTP: 400 naming the field or limit, and the server keeps serving -----


@pytest.fixture(scope="module")
def served(model, serving):
    family, path = model
    loaded = api.load(path)
    app = create_app(loaded, DEFAULTS[family], queue_size=4)
    with serving(app) as base:
        yield family, base


def test_hostile_requests_are_400s_and_the_server_keeps_serving(served):
    family, base = served
    url = f"{base}/v1/chat/completions"
    bad = [
        ({"messages": MSGS, "seed": 2**70}, "'seed'"),
        ({"messages": MSGS, "max_tokens": 10**12}, "context"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}], "stop": 1}, "'stop'"),
    ]
    if family == "llada2_moe":
        bad.append(({"messages": MSGS, "block_length": 100000}, "exceeds the model context"))
    with httpx.Client(timeout=60) as client:
        for body, fragment in bad:
            r = client.post(url, json=body)
            assert r.status_code == 400 and fragment in r.json()["error"]["message"], (body, r.text)
        # Raw bodies a JSON parser accepts: a lone surrogate escape, a NaN.
        for raw, fragment in [(b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "not valid UTF-8"),
                              (b'{"messages": [{"role": "user", "content": "a"}], "temperature": NaN}',
                               "'temperature' must be a finite number")]:
            r = client.post(url, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
        r = client.post(url, json={"messages": MSGS})
        assert r.status_code == 200, r.text


def test_the_servers_memory_budget_refuses_before_queueing(model, serving):
    family, path = model
    app = create_app(api.load(path), {**DEFAULTS[family], "memory_budget": 1e-6})
    with serving(app) as base, httpx.Client(timeout=60) as client:
        r = client.post(f"{base}/v1/chat/completions", json={"messages": MSGS})
        assert r.status_code == 400 and "memory budget" in r.json()["error"]["message"], r.text
        assert client.get(f"{base}/health").json()["status"] == "ok"


def test_generate_and_chat_work_with_stdin_closed(tiny_dg_mlx_dir):
    """With fd 0 closed (``0<&-``, a supervisor's doing) the next file opened gets
    fd 0, and MLX's safetensors reader takes fd 0 for "not open": generation
    failed with "cannot read safetensors"."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    exe = str(Path(sys.executable).parent / "dlm-run")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    base = ["--model", str(tiny_dg_mlx_dir), "--max-tokens", "4", "--max-denoising-steps", "2"]
    # Both at once (each pays the CLI's imports): independent processes, checked one by one.
    procs = [subprocess.Popen([exe, *args], preexec_fn=lambda: os.close(0), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
             for args in (["generate", *base, "--prompt", "hi"], ["chat", *base])]
    try:
        done = [p.communicate(timeout=120) + (p.returncode,) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for _, stderr, returncode in done:
        assert "cannot read safetensors" not in stderr, stderr
        # generate answers; chat reads an empty stdin (EOF): no turns, a clean end
        assert returncode == 0 and "error" not in stderr, stderr

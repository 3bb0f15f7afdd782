"""``dlm-run generate``: output, --json, --profile, and clear errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dlm.runtime import api
from dlm.runtime.cli.main import main

FAST = ["--max-denoising-steps", "2"]


def run(args, input=None):
    return CliRunner().invoke(main, ["generate", *args], input=input)


def test_json_matches_api(tiny_dg_mlx_dir):
    r = run(["--model", str(tiny_dg_mlx_dir), "--prompt-ids", "2,10,11,12", "--max-tokens", "11",
             "--debug-canvas", "--json", *FAST])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    loaded = api.load(tiny_dg_mlx_dir)
    ref = api.generate(loaded, [2, 10, 11, 12], {"max_tokens": 11, "debug_canvas": True,
                                                  "max_denoising_steps": 2})
    assert out["token_ids"] == ref.token_ids and len(out["token_ids"]) == 11
    assert out["finish_reason"] == "length" and out["steps_per_canvas"] == [2, 2]
    assert out["tokens_per_canvas"] == [8, 3]
    assert out["text"] == ref.text and out["reasoning"] == ref.reasoning
    assert {"prompt_tps", "generation_tps", "tokens_per_forward", "peak_memory_gb"} <= set(out["stats"])


def test_text_stream_and_profile(tiny_dg_mlx_dir):
    r = run(["--model", str(tiny_dg_mlx_dir), "--prompt", "hello", "--max-tokens", "8", "--seed", "1",
             "--profile", *FAST])
    assert r.exit_code == 0, r.output
    for key in ("Prompt:", "Generation: 8 tokens", "Canvases: 1", "stopped early: 0",
                "Tokens per forward:", "Peak memory:", "MLX backend: cpu (mlx-cpu ", "float32 matmuls: full float32"):
        assert key in r.stderr


def test_prompt_from_stdin_uses_chat_template(tiny_dg_mlx_dir):
    loaded = api.load(tiny_dg_mlx_dir)
    r = run(["--model", str(tiny_dg_mlx_dir), "--json", "--max-tokens", "8", *FAST], input="hi\n")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["prompt_ids"] == api.encode_prompt(loaded, "hi\n")
    r = run(["--model", str(tiny_dg_mlx_dir), "--json", "--no-chat-template", "--prompt", "hi",
             "--max-tokens", "8", *FAST])
    assert json.loads(r.stdout)["prompt_ids"] == api.encode_prompt(loaded, "hi", chat_template=False)


@pytest.mark.parametrize("extra, message", [
    (["--top-k", "5"], "--top-k does not apply to DiffusionGemma"),
    (["--top-p", "0.5"], "--top-p does not apply to DiffusionGemma"),
    (["--image", "x.png"], "--image x.png: no such file"),
    (["--audio", "x.wav"], "audio input is not supported"),
    (["--diffusion-max-canvas-length", "64"], "--diffusion-max-canvas-length 64 exceeds"),
])
def test_errors_are_clear(tiny_dg_mlx_dir, extra, message):
    r = run(["--model", str(tiny_dg_mlx_dir), "--prompt", "x", *extra])
    assert r.exit_code == 1
    assert f"error: {message}" in r.stderr and "Traceback" not in r.output


def test_bad_model_dir(tmp_path):
    r = run(["--model", str(tmp_path), "--prompt", "x"])
    assert r.exit_code == 1 and "config.json not found" in r.stderr


def test_prompt_too_long(tiny_dg_mlx_dir):
    ids = ",".join(["2"] * 4096)
    r = run(["--model", str(tiny_dg_mlx_dir), "--prompt-ids", ids])
    assert r.exit_code == 1 and "model context is 4096" in r.stderr


def test_bad_prompt_ids(tiny_dg_mlx_dir):
    r = run(["--model", str(tiny_dg_mlx_dir), "--prompt-ids", "2,x"])
    assert r.exit_code == 2 and "comma-separated" in r.output

"""One rule for the CLI and the server (issue 42): a value that cannot take
effect, or is out of range, is an error naming the flag or field; family and
option errors come before the model load; --help lists no flag that is always
refused; sizes in errors read in MB below 1 GB; --profile times a warm run."""

from __future__ import annotations

import httpx
import pytest
from click.testing import CliRunner

from dlm.runtime import api
from dlm.runtime.cli import main as cli_main
from dlm.runtime.platform.errors import GenerationError
from dlm.runtime.platform.memory import size_text
from dlm.runtime.server.app import create_app

FAST = {"diffusion_gemma": ["--max-denoising-steps", "2"],
        "llada2_moe": ["--max-denoising-steps", "2", "--block-length", "4"]}


@pytest.fixture(scope="module", params=["diffusion_gemma", "llada2_moe"])
def model(request):
    fixture = {"diffusion_gemma": "tiny_dg_mlx_dir", "llada2_moe": "tiny_llada2_mlx_dir"}[request.param]
    return request.param, request.getfixturevalue(fixture)


def run(*args, input=None):
    return CliRunner().invoke(cli_main.main, ["generate", *args], input=input)


def error_line(r, fragment, code=1):
    assert r.exit_code == code, r.output
    assert "Traceback" not in r.output
    assert any(fragment in ln for ln in r.output.splitlines()), r.output


@pytest.fixture
def no_load(monkeypatch):
    """Fails the test if the model load starts."""
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(api, "load", load)


# -- max_tokens beyond the context: refused by the CLI, the API and the server alike ---


def test_max_tokens_beyond_the_context_is_refused_everywhere(model, serving):
    family, path = model
    r = run("--model", str(path), "--prompt", "hi", "--max-tokens", "4095", *FAST[family])
    error_line(r, "--max-tokens 4095: the prompt (")  # fits a one-token prompt, not this one
    assert "exceeds the model context of 4096 tokens" in r.output
    loaded = api.load(path)
    with pytest.raises(GenerationError, match="--max-tokens 100000"):
        list(api.stream_generate(loaded, [5] * 10, {"max_tokens": 100000}))
    with serving(create_app(loaded, {}, queue_size=2)) as base:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and "context of 4096" in r.text


def test_max_tokens_beyond_the_context_is_refused_before_the_load(model, no_load):
    family, path = model
    r = run("--model", str(path), "--prompt", "hi", "--max-tokens", "100000", *FAST[family])
    error_line(r, "error: --max-tokens 100000 exceeds the model context of 4096 tokens")


# -- cross-option rules, before the load -------------------------------------------


def test_min_canvas_over_max_canvas_is_refused_before_the_load(tiny_dg_mlx_dir, no_load):
    r = run("--model", str(tiny_dg_mlx_dir), "--prompt", "hi", "--diffusion-min-canvas-length", "6",
            "--diffusion-max-canvas-length", "4")
    error_line(r, "error: --diffusion-min-canvas-length 6 exceeds --diffusion-max-canvas-length 4")


def test_min_canvas_over_the_checkpoint_canvas_is_refused(tiny_dg_mlx_dir):
    loaded = api.load(tiny_dg_mlx_dir)
    canvas = loaded.args.canvas_length
    with pytest.raises(GenerationError, match=f"--diffusion-min-canvas-length {canvas + 1} exceeds the "
                                              f"checkpoint's canvas_length {canvas}"):
        loaded.settings({"diffusion_min_canvas_length": canvas + 1})
    with pytest.raises(GenerationError, match="^--diffusion-max-canvas-length 999 exceeds"):
        loaded.settings({"diffusion_max_canvas_length": 999})  # the flag, not the internal name


def test_the_server_refuses_min_over_max_canvas_naming_the_field(tiny_dg_mlx_dir, serving):
    with serving(create_app(api.load(tiny_dg_mlx_dir), {}, queue_size=2)) as base:
        body = {"messages": [{"role": "user", "content": "hi"}], "diffusion_min_canvas_length": 6,
                "diffusion_max_canvas_length": 4}
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and "--diffusion-min-canvas-length 6 exceeds" in r.text


@pytest.mark.parametrize("flags, fragment", [
    (["--block-length", "4"], "--block-length does not apply to DiffusionGemma"),
    (["--temp", "-1"], "--temp"),
])
def test_family_and_range_errors_come_before_the_load(tiny_dg_mlx_dir, no_load, flags, fragment):
    r = run("--model", str(tiny_dg_mlx_dir), "--prompt", "hi", *flags)
    assert r.exit_code in (1, 2) and fragment in r.output, r.output


@pytest.mark.parametrize("command", ["chat", "serve"])
def test_chat_and_serve_check_options_before_the_load(tiny_dg_mlx_dir, no_load, command):
    r = CliRunner().invoke(cli_main.main, [command, "--model", str(tiny_dg_mlx_dir), "--block-length", "4"],
                           input="hi\n")
    assert r.exit_code == 1 and "--block-length does not apply to DiffusionGemma" in r.output, r.output


# -- the empty prompt ------------------------------------------------------------------


@pytest.mark.parametrize("extra", [[], ["--no-chat-template"]])
def test_an_empty_prompt_is_refused(model, extra):
    family, path = model
    error_line(run("--model", str(path), "--prompt", "", *FAST[family], *extra), "the prompt is empty")
    error_line(run("--model", str(path), *FAST[family], *extra, input=""), "the prompt is empty")


def test_the_server_refuses_an_empty_completion_prompt(tiny_llada2_mlx_dir, serving):
    with serving(create_app(api.load(tiny_llada2_mlx_dir), {}, queue_size=2)) as base:
        r = httpx.post(base + "/v1/completions", json={"prompt": "", "max_tokens": 4}, timeout=60)
        assert r.status_code == 400 and "the prompt is empty" in r.text


# -- an option that takes effect but was not trained for: one warning line ----------


def test_editing_threshold_on_a_2_0_checkpoint_warns(tiny_llada2_mlx_dir):
    r = run("--model", str(tiny_llada2_mlx_dir), "--prompt", "hi", "--max-tokens", "4", *FAST["llada2_moe"],
            "--editing-threshold", "0.5")
    assert r.exit_code == 0, r.output
    warnings = [ln for ln in r.stderr.splitlines() if ln.startswith("warning: --editing-threshold 0.5")]
    assert len(warnings) == 1 and "not trained for token-to-token editing" in warnings[0]
    quiet = run("--model", str(tiny_llada2_mlx_dir), "--prompt", "hi", "--max-tokens", "4", *FAST["llada2_moe"])
    assert "warning:" not in quiet.stderr


# -- --help ----------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_help_lists_no_always_refused_flag(command):
    text = CliRunner().invoke(cli_main.main, [command, "--help"]).output
    for flag in ("--draft-model", "--audio", "--video"):
        assert flag not in text


def test_a_hidden_refused_flag_is_still_refused_by_name(tiny_dg_mlx_dir):
    r = run("--model", str(tiny_dg_mlx_dir), "--prompt", "hi", "--draft-model", "x")
    error_line(r, "--draft-model does not apply to DiffusionGemma")
    error_line(run("--model", str(tiny_dg_mlx_dir), "--prompt", "hi", "--audio", "a.wav"),
               "audio input is not supported")


# -- sizes in messages -----------------------------------------------------------------


def test_sizes_below_a_gigabyte_are_not_zero():
    assert size_text(2.5e9) == "2.50 GB"
    assert size_text(12_345_678) == "12.35 MB"
    assert size_text(100_000) == "100.00 kB"
    assert size_text(12) == "12 bytes"


def test_a_budget_refusal_prints_readable_sizes(model):
    family, path = model
    r = run("--model", str(path), "--prompt", "hi", "--max-tokens", "64", *FAST[family], "--memory-budget", "0.0001")
    error_line(r, "over the memory budget of 100.00 kB (--memory-budget)")
    assert "0.00 GB" not in r.output


# -- --profile times a warm run ---------------------------------------------------------


def test_profile_runs_an_untimed_warm_up_first(model, monkeypatch):
    family, path = model
    calls = []
    real = api.stream_generate

    def recording(loaded, prompt, options=None, *args, **kwargs):
        calls.append(dict(options or {}))
        return real(loaded, prompt, options, *args, **kwargs)

    monkeypatch.setattr(api, "stream_generate", recording)
    r = run("--model", str(path), "--prompt", "hi", "--max-tokens", "4", *FAST[family], "--profile")
    assert r.exit_code == 0, r.output
    assert len(calls) == 2 and calls[0]["max_tokens"] == 1 and calls[0]["max_denoising_steps"] == 1
    assert calls[1]["max_tokens"] == 4
    assert any(ln.startswith("Warm-up: one untimed generation") for ln in r.stderr.splitlines())
    plain = []
    monkeypatch.setattr(api, "stream_generate", lambda *a, **k: plain.append(1) or real(*a, **k))
    assert run("--model", str(path), "--prompt", "hi", "--max-tokens", "4", *FAST[family]).exit_code == 0
    assert len(plain) == 1  # no warm-up without --profile

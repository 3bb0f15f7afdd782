"""``dlm-run``: run converted models. ``generate`` here; ``serve`` lives in serve_cli.py.

Sampling flags for DiffusionGemma (defaults come from the checkpoint's
generation_config.json; see dlm.runtime.diffusion_gemma_generate):

* the sampler defaults to the checkpoint's entropy-bound rule with its
  t_max -> t_min temperature schedule; ``--temp`` rescales the denoiser's sampling
  distribution on top of that schedule (1.0 = the reference, 0 = argmax);
* ``--top-k`` / ``--top-p`` do not apply to DiffusionGemma and are refused;
* ``--debug-canvas`` (or DLM_DEBUG_CANVAS=1) makes every canvas draw the fixed
  pattern of the reference and sampling argmax (cross-implementation parity).
"""

from __future__ import annotations

import json
import sys
import time

import click

from .errors import DlmError


@click.group()
@click.version_option(package_name="dlm", prog_name="dlm-run")
def main():
    """Run DiffusionGemma / LLaDA-2 models converted to MLX."""


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise click.BadParameter("expected comma-separated integers, e.g. 2,10,11", param_hint="--prompt-ids")
    if not ids:
        raise click.BadParameter("no token ids given", param_hint="--prompt-ids")
    return ids


def _fail(message: str, code: int = 1):
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


_PLURAL = {"canvas": "Canvases", "block": "Blocks"}


def _profile_lines(stats) -> list[str]:
    steps = stats.steps_per_block
    mean = sum(steps) / len(steps) if steps else 0.0
    return [
        f"Prompt: {stats.prompt_tokens} tokens, {stats.prompt_tps:.3f} tokens-per-sec",
        f"Generation: {stats.completion_tokens} tokens, {stats.generation_tps:.3f} tokens-per-sec",
        f"{_PLURAL.get(stats.block_name, stats.block_name)}: {len(steps)}, denoising steps per {stats.block_name}: "
        f"{steps} (mean {mean:.1f}), "
        f"stopped early: {stats.early_stops}",
        f"Tokens per forward: {stats.tokens_per_forward:.3f} ({stats.forwards} forwards)",
        f"Peak memory: {stats.peak_memory_gb:.3f} GB",
    ]


@main.command()
@click.option("--model", "model_path", required=True, help="Converted MLX model directory.")
@click.option("--prompt", "-p", default=None, help="Prompt text ('-' or omitted: read stdin).")
@click.option("--prompt-ids", default=None, help="Comma-separated prompt token ids (parity work); "
              "no chat template is applied.")
@click.option("--system", default=None, help="System message (chat template only).")
@click.option("--chat-template/--no-chat-template", default=True, show_default=True,
              help="Apply the tokenizer's chat template (off: raw text after BOS).")
@click.option("--thinking/--no-thinking", default=False, show_default=True,
              help="Ask the chat template for the thinking channel.")
@click.option("--max-tokens", "-m", type=click.IntRange(min=1), default=None,
              help="Most tokens to generate [default: generation_config max_new_tokens, else 256].")
@click.option("--max-denoising-steps", type=click.IntRange(min=1), default=None,
              help="Most denoising steps per canvas [default: generation_config, else 48].")
@click.option("--diffusion-sampler", type=click.Choice(["entropy-bound", "confidence-threshold"]),
              default=None, help="Per-step acceptance rule [default: entropy-bound, the checkpoint's].")
@click.option("--diffusion-threshold", type=click.FloatRange(0.0, 1.0), default=None,
              help="confidence-threshold: reveal positions whose top-1 probability exceeds this [0.9].")
@click.option("--diffusion-min-canvas-length", type=click.IntRange(min=1), default=None,
              help="Smallest canvas [64].")
@click.option("--diffusion-max-canvas-length", type=click.IntRange(min=1), default=None,
              help="Largest canvas [the checkpoint's canvas_length].")
@click.option("--diffusion-full-canvas", is_flag=True, default=None,
              help="Always use the full canvas (the reference behaviour).")
@click.option("--seed", type=click.IntRange(min=0), default=None,
              help="Seed canvas draws and sampling (same seed, same machine: same output).")
@click.option("--temp", type=click.FloatRange(min=0.0), default=None,
              help="DiffusionGemma: denoiser sampling temperature on top of the checkpoint's "
                   "t_max->t_min schedule [1.0 = the reference; 0 = argmax]. LLaDA-2: sampling temperature.")
@click.option("--top-k", type=click.IntRange(min=0), default=None,
              help="LLaDA-2 sampling; refused by DiffusionGemma (no top-k in its sampler).")
@click.option("--top-p", type=click.FloatRange(0.0, 1.0), default=None,
              help="LLaDA-2 sampling; refused by DiffusionGemma (no top-p in its sampler).")
@click.option("--block-length", type=click.IntRange(min=1), default=None,
              help="LLaDA-2: tokens per generation block [32].")
@click.option("--threshold", type=click.FloatRange(0.0, 1.0), default=None,
              help="LLaDA-2: reveal every masked position whose confidence exceeds this [0.95].")
@click.option("--threshold-schedule", default=None, metavar="constant|linear[:FLOOR]",
              help="LLaDA-2: constant threshold, or a linear decay to FLOOR over a block's steps "
                   "[constant; linear alone decays to 0.5].")
@click.option("--editing-threshold", type=click.FloatRange(0.0, 1.0), default=None,
              help="LLaDA-2.1 token-to-token editing: rewrite a generated token when the new one's "
                   "confidence exceeds this [0.9 on LLaDA2.1 checkpoints, off otherwise; 1.0: off].")
@click.option("--max-post-steps", type=click.IntRange(min=0), default=None,
              help="LLaDA-2.1: most editing passes after a block's last mask is filled [16].")
@click.option("--reference-sampling", is_flag=True, default=None,
              help="LLaDA-2: the hub 2.0 sampler, which samples even at --temp 0 (parity work).")
@click.option("--draft-model", default=None,
              help="Speculative draft model (refused: diffusion models unmask blocks natively).")
@click.option("--debug-canvas", is_flag=True, default=None,
              help="Fixed canvas pattern + argmax sampling (parity with the reference; also DLM_DEBUG_CANVAS=1).")
@click.option("--prefill-step-size", type=click.IntRange(min=1), default=None,
              help="Prompt tokens per encoder chunk [2048].")
@click.option("--image", multiple=True, help="Image input (refused: text-only runtime).")
@click.option("--audio", multiple=True, help="Audio input (refused).")
@click.option("--video", multiple=True, help="Video input (refused).")
@click.option("--profile", is_flag=True, help="Print throughput, steps per canvas and peak memory to stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@click.option("--trust-remote-code", is_flag=True, help="Allow the tokenizer to run checkpoint code.")
def generate(model_path, prompt, prompt_ids, system, chat_template, thinking, image, audio, video,
             profile, as_json, trust_remote_code, **options):
    """Generate text with a converted model.

    Output streams to stdout as canvases commit; reasoning (the thinking
    channel) goes to stderr. Exit status 1 on a bad model or request."""
    from . import api

    try:
        if audio or video:
            raise DlmError(f"{'audio' if audio else 'video'} input is not supported by dlm-run")
        ids = _parse_ids(prompt_ids) if prompt_ids is not None else None
        if ids is not None and prompt is not None:
            raise click.UsageError("give --prompt or --prompt-ids, not both")
        loaded = api.load(model_path, trust_remote_code=trust_remote_code)
        if image:
            kind = "a text-only model" if getattr(loaded.args, "text_only", True) else "dlm-run (text-only runtime)"
            raise DlmError(f"image input is not supported by {kind}: {model_path}")
        options = {k: v for k, v in options.items() if v is not None}
        if ids is None:
            if prompt is None or prompt == "-":
                prompt = sys.stdin.read()
            ids = api.encode_prompt(loaded, prompt, system=system, chat_template=chat_template,
                                    enable_thinking=thinking)
        events = api.stream_generate(loaded, ids, options)
        start = time.perf_counter()
        token_ids, text, reasoning, blocks = [], [], [], []
        final = None
        for event in events:
            if event.done:
                final = event
            else:
                token_ids.extend(event.token_ids)
                blocks.append(len(event.token_ids))
            text.append(event.text)
            reasoning.append(event.reasoning)
            if not as_json:
                if event.reasoning:
                    click.echo(event.reasoning, nl=False, err=True)
                if event.text:
                    click.echo(event.text, nl=False)
        wall = time.perf_counter() - start
    except DlmError as exc:
        _fail(str(exc))
    stats = final.stats
    if as_json:
        click.echo(json.dumps({
            "prompt_ids": ids, "token_ids": token_ids, "text": "".join(text),
            "reasoning": "".join(reasoning), "finish_reason": final.finish_reason,
            "steps_per_canvas": stats.steps_per_block, "tokens_per_canvas": blocks,
            "stats": stats.to_dict(), "wall_seconds": wall,
        }))
    else:
        click.echo()
    if profile:
        for line in _profile_lines(stats):
            click.echo(line, err=True)


def _register_serve() -> None:
    """``dlm-run serve`` is defined in serve_cli.py (the server); register it when present."""
    try:
        from .serve_cli import serve
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.endswith("serve_cli"):
            return
        raise
    main.add_command(serve, "serve")


_register_serve()

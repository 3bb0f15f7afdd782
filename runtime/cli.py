"""``dlm-run``: run converted models. ``generate`` here; ``serve`` lives in serve_cli.py.

The generation flags are built from the families' option declarations
(``runtime/models/<family>/options.py``); a flag of another family is refused
with a message naming it. Defaults come from the checkpoint's
generation_config.json where the help says so.
"""

from __future__ import annotations

import json
import time

import click

from . import backend, blas, precision, trace_html
from . import trace as step_trace
from .batch_cli import batch_options, check_flags, read_prompts, run_prompts_file
from .console import Group, LiveView, check_text, echo_environment_notes, fail, model_options, read_stdin
from .errors import DlmError
from .images import open_file
from .options import click_options


@click.group(cls=Group)
@click.version_option(package_name="dlm", prog_name="dlm-run")
def main():
    """Run DiffusionGemma / LLaDA-2 models converted to MLX."""
    echo_environment_notes()


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise click.BadParameter("expected comma-separated integers, e.g. 2,10,11", param_hint="--prompt-ids")
    if not ids:
        raise click.BadParameter("no token ids given", param_hint="--prompt-ids")
    return ids


_PLURAL = {"canvas": "Canvases", "block": "Blocks"}


def live_view(loaded) -> LiveView:
    return LiveView(loaded.tokenizer, loaded.family.generation().Session.block_name, loaded.args.mask_token_id)


def profile_lines(stats, loaded=None) -> list[str]:
    steps = stats.steps_per_block
    mean = sum(steps) / len(steps) if steps else 0.0
    cached = f" ({stats.cached_prompt_tokens} from the kept cache)" if stats.cached_prompt_tokens else ""
    images = []
    if stats.image_tokens:  # the vision encoder apart from the text prefill (prompt_seconds excludes it)
        cached += f", {stats.image_tokens} of them image soft tokens"
        images = [f"Vision encoder: {stats.vision_seconds:.3f} s for {stats.image_tokens} image soft tokens"]
    rate = f"{stats.prompt_tps:.3f} tokens-per-sec"
    if stats.deferred_prompt_tokens:  # computed with the first block's forwards, not in the prefill's time
        prefilled = stats.prompt_tokens - stats.cached_prompt_tokens - stats.deferred_prompt_tokens
        rate = (f"{stats.deferred_prompt_tokens} in the first block's forwards, "
                + (f"{prefilled / stats.prompt_seconds:.3f} tokens-per-sec for the {prefilled} prefilled"
                   if prefilled > 0 and stats.prompt_seconds else "none prefilled"))
    return images + [
        f"Prompt: {stats.prompt_tokens} tokens{cached}, {rate}",
        f"Generation: {stats.completion_tokens} tokens, {stats.generation_tps:.3f} tokens-per-sec",
        f"{_PLURAL.get(stats.block_name, stats.block_name)}: {len(steps)}, denoising steps per {stats.block_name}: "
        f"{steps} (mean {mean:.1f}), "
        f"stopped early: {stats.early_stops}",
        f"Tokens per forward: {stats.tokens_per_forward:.3f} ({stats.forwards} forwards)",
        f"Peak memory: {stats.peak_memory_gb:.3f} GB",
        f"BLAS: {blas.STATUS if blas.STATUS not in ('off', 'reference') else 'MLX default'}",
        f"MLX backend: {backend.describe()}; float32 matmuls: {precision.describe()}",
    ] + ([compute_line(loaded)] if loaded is not None else [])


def compute_line(loaded) -> str:
    notes = []
    if loaded.upcast:
        notes.append("half-precision weights upcast")
    if loaded.dequantized:
        notes.append(f"{loaded.dequantized} quantized modules dequantized at load")
    if getattr(loaded, "per_call", 0):
        notes.append(f"{loaded.per_call} quantized modules dequantized per call")
    if getattr(loaded, "relaid", 0):
        notes.append(f"{loaded.relaid} weights stored [in, out]")
    return f"Compute: {loaded.compute_dtype}" + (f" ({', '.join(notes)}, for the CPU backend)" if notes else "")


@main.command()
@model_options
@click.option("--prompt", "-p", default=None, help="Prompt text ('-' or omitted: read stdin).")
@click.option("--prompt-ids", default=None, help="Comma-separated prompt token ids (parity work); "
              "no chat template is applied.")
@click.option("--system", default=None, help="System message (chat template only).")
@click.option("--chat-template/--no-chat-template", default=True, show_default=True,
              help="Apply the tokenizer's chat template (off: raw text after BOS).")
@click.option("--thinking/--no-thinking", default=False, show_default=True,
              help="Ask the chat template for the thinking channel.")
@click_options()
@batch_options
@click.option("--image", multiple=True, metavar="PATH",
              help="An image file (PNG, JPEG, WebP, GIF: its first frame) for a model with a vision tower; "
                   "repeat for several, placed before the prompt text in that order.")
@click.option("--audio", multiple=True, help="Audio input (refused: not supported).")
@click.option("--video", multiple=True, help="Video input (refused: not supported).")
@click.option("--profile", is_flag=True, help="Print throughput, steps per canvas and peak memory to stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@click.option("--verbose", is_flag=True, help="Show every canvas/block after each denoising step on stderr.")
@click.option("--json-schema", "json_schema_path", default=None, metavar="FILE.json",
              help="Structured output: the answer is JSON valid against this JSON Schema (always parses; "
                   "finish_reason 'length' when --max-tokens runs out first).")
@click.option("--json-object", is_flag=True, help="Structured output: the answer is a JSON object.")
@click.option("--logprobs", type=click.IntRange(0, 20), default=None, metavar="K",
              help="With --json-schema/--json-object: each token's log-probability and the K most likely "
                   "allowed alternatives (in --json output).")
@click.option("--trace", "trace_path", default=None, metavar="FILE.html",
              help="Write every canvas/block and denoising step (tokens, accepted/revealed/renoised/edited "
                   "positions, entropy or confidence, temperature, why it stopped) to one self-contained "
                   "HTML page.")
def generate(model_path, revision, prompt, prompt_ids, system, chat_template, thinking, image, audio, video,
             profile, as_json, verbose, json_schema_path, json_object, logprobs, trace_path, trust_remote_code,
             compute_dtype, **options):
    """Generate text with a converted model.

    Output streams to stdout as canvases commit; reasoning (the thinking
    channel) goes to stderr. Exit status 1 on a bad model or request.
    --prompts-file: many prompts generated together (batch_cli.py)."""
    from . import api

    prompts_file, output, max_batch = (options.pop(k) for k in ("prompts_file", "output", "max_batch"))
    try:
        check_flags(prompts_file, output, max_batch, {
            "--prompt": prompt, "--prompt-ids": prompt_ids, "--image": image, "--json": as_json,
            "--verbose": verbose, "--trace": trace_path, "--json-schema": json_schema_path,
            "--json-object": json_object})
        response_format = _response_format(json_schema_path, json_object, logprobs)
        if prompts_file is not None:
            items = read_prompts(prompts_file)  # before the (slow) model load
            loaded = api.load(model_path, trust_remote_code=trust_remote_code, revision=revision,
                              compute_dtype=compute_dtype)
            run_prompts_file(loaded, prompts_file, items, output,
                             {k: v for k, v in options.items() if v is not None},
                             {"system": system, "chat_template": chat_template, "thinking": thinking},
                             max_batch, profile)
            return
        if audio or video:
            raise DlmError(f"{'audio' if audio else 'video'} input is not supported by dlm-run")
        ids = _parse_ids(prompt_ids) if prompt_ids is not None else None
        if ids is not None and prompt is not None:
            raise click.UsageError("give --prompt or --prompt-ids, not both")
        if ids is not None and image:
            raise click.UsageError("--image takes a text prompt (--prompt or stdin), not --prompt-ids: "
                                   "raw ids carry no image")
        # Files only (a URL is a name like any other), read before the (slow) model load.
        pictures = [open_file(path, f"--image {path}") for path in image]
        trace_path = trace_html.check_path(trace_path) if trace_path else None
        loaded = api.load(model_path, trust_remote_code=trust_remote_code, revision=revision,
                          compute_dtype=compute_dtype)
        if pictures:
            api.image_processor(loaded)  # says why a model takes no images
        options = {k: v for k, v in options.items() if v is not None}
        prompt_input = ids
        if ids is None:
            if prompt is None or prompt == "-":
                prompt = read_stdin()
            check_text(prompt, "--prompt")
            if system is not None:
                check_text(system, "--system")
            if pictures:
                prompt_input = api.encode_inputs(loaded, prompt, images=pictures, system=system,
                                                 chat_template=chat_template, enable_thinking=thinking)
                ids = prompt_input.ids
            else:
                ids = prompt_input = api.encode_prompt(loaded, prompt, system=system,
                                                       chat_template=chat_template, enable_thinking=thinking)
        view = live_view(loaded) if verbose else None
        trace = step_trace.for_run(loaded) if trace_path else None
        hooks = {**({"watch": view} if view else {}), **({"step_trace": trace} if trace else {})}
        if response_format is not None:
            hooks.update(response_format=response_format, logprobs=logprobs)
        events = api.stream_generate(loaded, prompt_input, options, **hooks)
        if trace is not None:
            events = trace.follow(events)
        start = time.perf_counter()
        token_ids, text, reasoning, blocks, token_logprobs = [], [], [], [], []
        final = None
        for event in events:
            if event.done:
                final = event
            else:
                token_ids.extend(event.token_ids)
                blocks.append(len(event.token_ids))
                token_logprobs.extend(event.logprobs or [])
            text.append(event.text)
            reasoning.append(event.reasoning)
            if not as_json:
                if event.reasoning:
                    click.echo(event.reasoning, nl=False, err=True)
                if event.text:
                    click.echo(event.text, nl=False)
        wall = time.perf_counter() - start
        if view is not None:
            view.close()
    except DlmError as exc:
        fail(str(exc))
    stats = final.stats
    if as_json:
        out = {
            "prompt_ids": ids, "token_ids": token_ids, "text": "".join(text),
            "reasoning": "".join(reasoning), "finish_reason": final.finish_reason,
            "steps_per_canvas": stats.steps_per_block, "tokens_per_canvas": blocks,
            "stats": stats.to_dict(), "wall_seconds": wall,
        }
        if logprobs is not None:
            out["logprobs"] = [{"token_id": r.token, "logprob": r.logprob,
                                "top": [{"token_id": t, "logprob": lp} for t, lp in r.top]} for r in token_logprobs]
        click.echo(json.dumps(out))
    else:
        click.echo()
    if profile:
        for line in profile_lines(stats, loaded):
            click.echo(line, err=True)
    if trace is not None:
        try:
            data = step_trace.run_data(trace, loaded, options, ids, profile_lines(stats, loaded),
                                       thinking=thinking)
            click.echo(f"trace: {trace_html.write(trace_path, data)}", err=True)
        except DlmError as exc:
            fail(str(exc))


def _response_format(path, json_object: bool, logprobs):
    """The response format of --json-schema / --json-object (the file read and
    checked before the model loads), or None."""
    from .structured import json_schema, parse_response_format

    if path is not None and json_object:
        raise click.UsageError("give --json-schema or --json-object, not both")
    if logprobs is not None and path is None and not json_object:
        raise click.UsageError("--logprobs goes with --json-schema or --json-object")
    if json_object:
        return parse_response_format({"type": "json_object"})
    if path is None:
        return None
    try:
        text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as exc:
        raise DlmError(f"--json-schema {path}: cannot read it: {exc}") from None
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise DlmError(f"--json-schema {path}: not JSON: {exc}") from None
    fmt = json_schema(schema, where=f"--json-schema {path}")
    # Compile it now: a schema the grammar engine refuses fails before the model loads.
    from .structured.grammar import check_grammar, compile_grammar

    check_grammar(compile_grammar(fmt), None, fmt.where)
    return fmt


def _register() -> None:
    """``dlm-run serve`` (serve_cli.py) and ``dlm-run chat`` (chat_cli.py)."""
    from .chat_cli import chat
    from .serve_cli import serve

    main.add_command(serve, "serve")
    main.add_command(chat, "chat")


_register()

"""``dlm-run``: run converted models. ``generate`` here; ``serve`` lives in cli/serve.py.

The generation flags are built from the families' option declarations
(``runtime/models/<family>/options.py``); a flag of another family is refused
with a message naming it. Defaults come from the checkpoint's
generation_config.json where the help says so.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import click

from ..trace import html as trace_html
from .. import trace as step_trace
from . import ranks
from .batch import batch_options, check_flags, read_prompts_everywhere, run_prompts_file
from .console import (Group, check_text, echo_environment_notes, fail, live_view, model_options, profile_lines,
                      read_stdin)
from ..platform.errors import DlmError
from ..generation.images import open_file
from ..registry import click_options


@click.group(cls=Group)
@click.version_option(package_name="dlm", prog_name="dlm-run")
def main():
    """Run DiffusionGemma / LLaDA-2 models converted to MLX."""
    ranks.silence_followers()  # under mlx.launch rank 0 speaks for all
    echo_environment_notes()


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise click.BadParameter("expected comma-separated integers, e.g. 2,10,11", param_hint="--prompt-ids")
    if not ids:
        raise click.BadParameter("no token ids given", param_hint="--prompt-ids")
    return ids


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
@click.option("--audio", multiple=True, hidden=True, help="Audio input (refused: not supported).")
@click.option("--video", multiple=True, hidden=True, help="Video input (refused: not supported).")
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
    --prompts-file: many prompts generated together (cli/batch.py)."""
    from .. import api

    prompts_file, output, max_batch, prefix_cache_gb = (
        options.pop(k) for k in ("prompts_file", "output", "max_batch", "prefix_cache_gb"))
    options = {k: v for k, v in options.items() if v is not None}
    chat = {"system": system, "chat_template": chat_template, "thinking": thinking}

    def load():
        return api.load(model_path, trust_remote_code=trust_remote_code, revision=revision,
                        compute_dtype=compute_dtype)

    try:
        check_flags(prompts_file, output, max_batch, {
            "--prompt": prompt, "--prompt-ids": prompt_ids, "--image": image, "--json": as_json,
            "--verbose": verbose, "--trace": trace_path, "--json-schema": json_schema_path,
            "--json-object": json_object}, prefix_cache_gb)
        api.check_options(model_path, options)  # family and option errors before the (slow) load
        response_format = _response_format(json_schema_path, json_object, logprobs)
        world = ranks.world()  # under mlx.launch: the ranks this run is shared with
        if prompts_file is not None:
            items = read_prompts_everywhere(prompts_file, world)  # before the (slow) model load
            run_prompts_file(load(), prompts_file, items, output if ranks.speaks() else None, options, chat,
                             max_batch, profile, prefix_cache_gb)
            return
        ids = _check_inputs(prompt, prompt_ids, image, audio, video)
        # Files only (a URL is a name like any other), read before the (slow) model load.
        pictures = [open_file(path, f"--image {path}") for path in image]
        trace_path = trace_html.check_path(trace_path) if trace_path else None
        loaded = load()
        for line in api.option_warnings(loaded, options):
            click.echo(line, err=True)
        if pictures:
            api.image_processor(loaded)  # says why a model takes no images
        if ids is None:
            prompt_input, ids = _encode(loaded, prompt, pictures, world, **chat)
        else:
            prompt_input = ids  # raw ids: no chat template
        speaker = ranks.speaks()  # the other ranks run the same loop and show nothing
        view = live_view(loaded) if verbose and speaker else None
        trace = step_trace.for_run(loaded) if trace_path and speaker else None
        with ranks.watched(world) as dog, ranks.busy(dog):
            if profile:
                _warm_up(loaded, prompt_input, options, ranks.beating(dog))
            ranks.reset_counts()  # --profile: this run's collectives, not the warm-up's
            run = _stream(loaded, prompt_input, options, view=view, trace=trace, response_format=response_format,
                          logprobs=logprobs, echo=not as_json, cancel=ranks.beating(dog))
    except DlmError as exc:
        fail(str(exc))
    _print_output(run, ids, loaded, as_json=as_json, logprobs=logprobs, profile=profile)
    if trace is not None:
        _write_trace(trace, trace_path, loaded, options, ids, run.final.stats, thinking)


WARM_UP = {"max_tokens": 1, "max_denoising_steps": 1}
WARM_UP_LINE = ("Warm-up: one untimed generation (1 token, 1 denoising step, the same prompt) ran first: "
                "MLX builds its kernels on first use (on a fresh machine the CPU backend compiles them)")


def _warm_up(loaded, prompt_input, options, cancel=None) -> None:
    """--profile: one short untimed generation of the same prompt, so that the
    timed run's figures do not include MLX building (compiling, on the CPU
    backend) its kernels on first use."""
    from .. import api

    for _ in api.stream_generate(loaded, prompt_input, {**options, **WARM_UP}, cancel):
        pass


def _check_inputs(prompt, prompt_ids, image, audio, video) -> list[int] | None:
    """The --prompt-ids (None when not given), after refusing inputs that
    cannot be used, alone or together."""
    if audio or video:
        raise DlmError(f"{'audio' if audio else 'video'} input is not supported by dlm-run")
    ids = _parse_ids(prompt_ids) if prompt_ids is not None else None
    if ids is not None and prompt is not None:
        raise click.UsageError("give --prompt or --prompt-ids, not both")
    if ids is not None and image:
        raise click.UsageError("--image takes a text prompt (--prompt or stdin), not --prompt-ids: "
                               "raw ids carry no image")
    return ids


def _encode(loaded, prompt, pictures, world, system, chat_template, thinking):
    """(the model's input, the prompt's token ids) for a text prompt, read
    from stdin when omitted or '-' (by rank 0 under mlx.launch, which hands it
    to the others), with the images before it."""
    from .. import api

    if prompt is None or prompt == "-":
        prompt = ranks.from_rank0(ranks.read_launched_stdin if ranks.launched() else read_stdin, world)
    check_text(prompt, "--prompt")
    if system is not None:
        check_text(system, "--system")
    if pictures:
        inputs = api.encode_inputs(loaded, prompt, images=pictures, system=system,
                                   chat_template=chat_template, enable_thinking=thinking)
        return inputs, inputs.ids
    ids = api.encode_prompt(loaded, prompt, system=system, chat_template=chat_template, enable_thinking=thinking)
    return ids, ids


@dataclass
class _Run:
    """What one generation produced, gathered from its events."""

    token_ids: list = field(default_factory=list)
    text: list = field(default_factory=list)
    reasoning: list = field(default_factory=list)
    blocks: list = field(default_factory=list)  # tokens committed per canvas/block
    logprobs: list = field(default_factory=list)
    final: object = None  # the done event, carrying the stats
    wall: float = 0.0

    def add(self, event) -> None:
        if event.done:
            self.final = event
        else:
            self.token_ids.extend(event.token_ids)
            self.blocks.append(len(event.token_ids))
            self.logprobs.extend(event.logprobs or [])
        self.text.append(event.text)
        self.reasoning.append(event.reasoning)


def _stream(loaded, prompt_input, options, *, view, trace, response_format, logprobs, echo: bool,
            cancel=None) -> _Run:
    """Generate; with ``echo`` (no --json), print text to stdout and reasoning
    to stderr as each canvas/block commits. ``cancel``: polled once per step
    (under mlx.launch it beats the watchdog)."""
    from .. import api

    hooks = {**({"watch": view} if view else {}), **({"step_trace": trace} if trace else {})}
    if response_format is not None:
        hooks.update(response_format=response_format, logprobs=logprobs)
    events = api.stream_generate(loaded, prompt_input, options, cancel, **hooks)
    if trace is not None:
        events = trace.follow(events)
    run = _Run()
    start = time.perf_counter()
    for event in events:
        run.add(event)
        if echo and view is not None:  # held while the view redraws a terminal line
            view.echo(event.reasoning, err=True)
            view.echo(event.text)
        elif echo:
            if event.reasoning:
                click.echo(event.reasoning, nl=False, err=True)
            if event.text:
                click.echo(event.text, nl=False)
    run.wall = time.perf_counter() - start
    if view is not None:
        view.close()
    return run


def _print_output(run: _Run, ids, loaded, *, as_json: bool, logprobs, profile: bool) -> None:
    """The --json object, or the newline ending the streamed text; then the
    --profile lines on stderr."""
    stats = run.final.stats
    if as_json:
        click.echo(json.dumps(_json_output(run, ids, logprobs)))
    else:
        click.echo()
    if profile:
        steps = sum(stats.steps_per_block)
        for line in [WARM_UP_LINE] + profile_lines(stats, loaded) + ranks.profile_line(loaded, steps):
            click.echo(line, err=True)


def _json_output(run: _Run, ids, logprobs) -> dict:
    """The --json object: the prompt and answer ids, the text, the finish reason and the stats."""
    stats = run.final.stats
    out = {
        "prompt_ids": ids, "token_ids": run.token_ids, "text": "".join(run.text),
        "reasoning": "".join(run.reasoning), "finish_reason": run.final.finish_reason,
        "steps_per_canvas": stats.steps_per_block, "tokens_per_canvas": run.blocks,
        "stats": stats.to_dict(), "wall_seconds": run.wall,
    }
    if logprobs is not None:
        out["logprobs"] = [{"token_id": r.token, "logprob": r.logprob,
                            "top": [{"token_id": t, "logprob": lp} for t, lp in r.top]} for r in run.logprobs]
    return out


def _write_trace(trace, path, loaded, options, ids, stats, thinking) -> None:
    """--trace: the recorded run as one HTML page, its path on stderr."""
    try:
        data = step_trace.run_data(trace, loaded, options, ids, profile_lines(stats, loaded), thinking=thinking)
        click.echo(f"trace: {trace_html.write(path, data)}", err=True)
    except DlmError as exc:
        fail(str(exc))


def _response_format(path, json_object: bool, logprobs):
    """The response format of --json-schema / --json-object (the file read and
    checked before the model loads), or None."""
    from ..structured import json_schema, parse_response_format

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
    except (ValueError, RecursionError) as exc:
        raise DlmError(f"--json-schema {path}: not JSON: {exc}") from None
    fmt = json_schema(schema, where=f"--json-schema {path}")  # within the schema limits
    # Compile it now, within the time limit: a schema the grammar engine refuses fails before the model loads.
    from ..structured.grammar import check_format, compile_bounded

    compile_bounded(lambda: check_format(fmt), fmt.where)
    return fmt


def _register() -> None:
    """``dlm-run serve`` (cli/serve.py) and ``dlm-run chat`` (cli/chat.py)."""
    from .chat import chat
    from .serve import serve

    main.add_command(serve, "serve")
    main.add_command(chat, "chat")


_register()

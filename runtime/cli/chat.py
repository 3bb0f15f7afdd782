"""``dlm-run chat``: an interactive conversation, as ``mlx_lm.chat`` offers.

Each turn renders the whole conversation through the chat template, and the
prefix cache is kept between turns (``PrefixState``): a turn encodes only what
the previous turns' cache does not already hold (DiffusionGemma rewinds its
cache to the shared prefix; LLaDA-2 keeps the shared whole blocks). Commands:
``/reset`` starts over, ``/exit`` (or end of input) quits.
"""

from __future__ import annotations

import sys

import click

from . import ranks
from .console import Command, check_text, live_view, model_options, profile_lines
from ..platform import distributed
from ..platform.errors import DlmError
from ..registry import click_options

HELP = "/reset: forget the conversation  /exit: quit"
FIRST_TURN = ("Warm-up: included in this first turn's figures (MLX builds its kernels on first use; on a fresh "
              "machine the CPU backend compiles them); later turns are steady")


def _lines(tty: bool):
    """User turns from stdin, decoded as UTF-8 line by line (a bad line is reported, not fatal)."""
    stream = getattr(sys.stdin, "buffer", None)
    while True:
        if tty:
            click.echo("> ", nl=False, err=True)
        raw = stream.readline() if stream is not None else sys.stdin.readline().encode("utf-8", "surrogateescape")
        if not raw:
            return
        try:
            yield raw.decode("utf-8").rstrip("\n")
        except UnicodeDecodeError as exc:
            click.echo(f"error: that line is not valid UTF-8 (byte offset {exc.start}); say it again", err=True)


def _turns(tty: bool, world):
    """The user's lines: under mlx.launch rank 0 reads them and hands each one (and
    the end of input) to the other ranks, which run the same turns."""
    if world is None:
        yield from _lines(tty)
        return
    lines = _lines(tty) if world.primary else None
    while True:
        line = distributed.broadcast(next(lines, None) if world.primary else None, world)
        if line is None:
            return
        yield line


@click.command("chat", cls=Command)
@model_options
@click.option("--system", default=None, help="System message of the conversation.")
@click.option("--thinking/--no-thinking", default=False, show_default=True,
              help="Ask the chat template for the thinking channel (reasoning goes to stderr).")
@click_options()
@click.option("--profile", is_flag=True, help="Print each turn's throughput and cache use to stderr.")
@click.option("--verbose", is_flag=True, help="Show every canvas/block after each denoising step on stderr.")
def chat(model_path, revision, system, thinking, profile, verbose, trust_remote_code, compute_dtype,
         **options):
    """Chat with a converted model in the terminal (or over a pipe: one user turn per line)."""
    from .. import api

    options = {k: v for k, v in options.items() if v is not None}
    api.check_options(model_path, options)  # family and option errors before the (slow) load
    loaded = api.load(model_path, trust_remote_code=trust_remote_code, revision=revision,
                      compute_dtype=compute_dtype)
    loaded.settings(options)
    with ranks.watched(loaded.world) as dog:
        _converse(api, loaded, model_path, system, thinking, profile, verbose, options, dog)


def _converse(api, loaded, model_path, system, thinking, profile, verbose, options, dog) -> None:
    """The turns, until /exit or the end of input (``dog``: the watchdog under mlx.launch)."""
    from ..generation.progress import PrefixState

    for note in api.option_warnings(loaded, options):
        click.echo(note, err=True)
    base = [{"role": "system", "content": check_text(system, "--system")}] if system else []
    messages, state = list(base), PrefixState()
    view = live_view(loaded) if verbose and ranks.speaks() else None
    warmed = False  # --profile: the first turn's figures include the warm-up
    tty = sys.stdin.isatty() and ranks.speaks()
    if tty:
        click.echo(f"dlm-run chat: {model_path} ({HELP})", err=True)
    for line in _turns(tty, loaded.world):
        command = line.strip()
        if command in ("/exit", "/quit"):
            break
        if command == "/reset":
            messages, state = list(base), PrefixState()
            click.echo("(conversation reset)", err=True)
            continue
        if not command:
            continue
        try:
            messages.append({"role": "user", "content": check_text(line, "the message")})
            ids = api.encode_prompt(loaded, messages=messages, enable_thinking=thinking)
            answer, final = [], None
            hooks = {"prefix": state, **({"watch": view} if view else {})}
            ranks.reset_counts()
            with ranks.busy(dog):
                for event in api.stream_generate(loaded, ids, options, ranks.beating(dog), **hooks):
                    _show(event, view)
                    if event.text:
                        answer.append(event.text)
                    final = event if event.done else final
            if view is not None:
                view.close()
        except DlmError as exc:  # a turn that fails (prompt too long, ...) leaves the chat running
            messages.pop()
            if view is not None:
                view.close()
            click.echo(f"error: {exc}", err=True)
            continue
        click.echo()
        messages.append({"role": "assistant", "content": "".join(answer)})
        if profile:
            warm = [] if warmed else [FIRST_TURN]
            warmed = True
            steps = sum(final.stats.steps_per_block)
            for text in warm + profile_lines(final.stats, loaded) + ranks.profile_line(loaded, steps):
                click.echo(text, err=True)


def _show(event, view) -> None:
    """A committed canvas/block: text to stdout, reasoning to stderr."""
    if view is not None:  # held while the view redraws a terminal line
        view.echo(event.reasoning, err=True)
        view.echo(event.text)
        return
    if event.reasoning:
        click.echo(event.reasoning, nl=False, err=True)
    if event.text:
        click.echo(event.text, nl=False)

"""``dlm-run serve``: the OpenAI-compatible server on the command line."""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path
import sys

import click

from .console import Command, model_options
from .errors import DlmError
from .options import click_options
from .server import DEFAULT_MAX_BODY_BYTES, DEFAULT_QUEUE_SIZE

# The generation flags of `dlm-run generate`, here as request defaults (a
# request's own fields win), built from the same declarations.
_generation_options = click_options(help_prefix="Request default. ")
_thinking = click.option("--thinking/--no-thinking", default=False, show_default=True,
                         help="Chat default for the thinking channel (a request may override it "
                              "with chat_template_kwargs.enable_thinking).")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@click.command("serve", cls=Command)
@model_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to bind (loopback unless you choose otherwise).")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535))
@click.option("--api-key", envvar="DLM_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on every request (or set DLM_API_KEY).")
@click.option("--queue-size", default=DEFAULT_QUEUE_SIZE, show_default=True, type=click.IntRange(min=1),
              help="Requests that may wait behind the running one; more are answered 429.")
@click.option("--max-body-bytes", default=DEFAULT_MAX_BODY_BYTES, show_default=True,
              type=click.IntRange(min=1024), help="Largest accepted request body (413 beyond).")
@click.option("--model-id", default=None, help="Model name in /v1/models and responses "
                                               "[the model directory's name].")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@_generation_options
@_thinking
def serve(model_path, revision, host, port, api_key, queue_size, max_body_bytes, model_id, log_level,
          trust_remote_code, compute_dtype, thinking, **options):
    """Serve a converted model behind an OpenAI-compatible API.

    Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
    GET /health. One worker generates, one request at a time; the others wait
    in a bounded queue. Generation flags set defaults for requests that do not
    set them; extra request fields carry the diffusion controls
    (max_denoising_steps, diffusion_sampler, ..., block_length, threshold)."""
    from . import api
    from .server import check_options, create_app

    defaults = {k: v for k, v in options.items() if v is not None}
    if api_key is not None and not api_key.strip():
        raise click.BadParameter("the API key is empty (a client could authenticate with no token); "
                                 "give a real key or none", param_hint="--api-key / DLM_API_KEY")
    try:
        loaded = api.load(model_path, trust_remote_code=trust_remote_code, revision=revision,
                          compute_dtype=compute_dtype)
        check_options(loaded, defaults)  # refuse flags the family does not take, now
        if model_id is None and not Path(loaded.source).expanduser().is_dir():
            model_id = loaded.source  # a Hub repo id names the model better than its snapshot hash
        app = create_app(loaded, {**defaults, "enable_thinking": thinking}, api_key=api_key,
                         queue_size=queue_size, model_id=model_id, max_body_bytes=max_body_bytes)
    except DlmError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    if not _is_loopback(host) and api_key is None:
        click.echo(f"warning: serving on {host} without --api-key: anyone who can reach this port "
                   "can use the model", err=True)
    try:
        sock = bind(host, port)
    except OSError as exc:
        app.state.worker.stop()
        raise DlmError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    bound = sock.getsockname()[1]  # --port 0: the port the system chose
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"dlm-run serve: {app.state.server.model_id} at http://{shown}:{bound}/v1 "
               f"(queue {queue_size}{', API key required' if api_key else ''})", err=True)
    run_server(app, sock, log_level)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket for ``host:port`` (IPv4 or IPv6), bound before the banner
    so that the banner can name the real port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def run_server(app, sock: socket.socket, log_level: str) -> None:
    import uvicorn

    uvicorn.Server(uvicorn.Config(app, log_level=log_level)).run(sockets=[sock])

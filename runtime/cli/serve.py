"""``dlm-run serve``: the OpenAI-compatible server on the command line."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from pathlib import Path
import sys

import click

from .console import Command, model_options
from ..platform import settings
from ..platform.errors import DlmError
from ..registry import click_options
from ..generation.images import (DEFAULT_MAX_IMAGES, DEFAULT_MAX_PIXELS, DEFAULT_URL_MAX_BYTES, DEFAULT_URL_TIMEOUT, ImageLimits, RemoteImages)
from ..server.app import (DEFAULT_IMAGE_BODY_BYTES, DEFAULT_MAX_BATCH, DEFAULT_MAX_BODY_BYTES, DEFAULT_QUEUE_SIZE)

# The generation flags of `dlm-run generate`, here as request defaults (a
# request's own fields win), built from the same declarations.
_generation_options = click_options(help_prefix="Request default. ")
_thinking = click.option("--thinking/--no-thinking", default=False, show_default=True,
                         help="Chat default for the thinking channel (a request may override it "
                              "with chat_template_kwargs.enable_thinking).")


def _image_options(func):
    """The per-request image limits (models with a vision tower)."""
    options = (
        click.option("--max-images", default=DEFAULT_MAX_IMAGES, show_default=True, type=click.IntRange(min=0),
                     help="Most images (image_url content parts) one chat request may carry; more get a 400."),
        click.option("--max-image-pixels", default=DEFAULT_MAX_PIXELS, show_default=True,
                     type=click.IntRange(min=1),
                     help="Most pixels (width x height) an image may have, checked from its header before "
                          "it is decoded; the vision tower sees a downscaled copy, so this only bounds "
                          "decoding memory and time."),
        click.option("--allow-image-urls", is_flag=True,
                     help="Fetch http(s) image URLs (off: only data: URLs, other URLs get a 400). The "
                          "server then fetches any URL a client names, its own network's included."),
        click.option("--image-url-max-bytes", default=DEFAULT_URL_MAX_BYTES, show_default=True,
                     type=click.IntRange(min=1), help="Largest image a URL may deliver (with --allow-image-urls)."),
        click.option("--image-url-timeout", default=DEFAULT_URL_TIMEOUT, show_default=True,
                     type=click.FloatRange(min=0, min_open=True),
                     help="Seconds one image fetch may take (with --allow-image-urls)."),
    )
    for option in reversed(options):
        func = option(func)
    return func


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
@click.option("--api-key", envvar=settings.API_KEY.name, default=None,
              help="Require 'Authorization: Bearer KEY' on every request (or set DLM_API_KEY).")
@click.option("--queue-size", default=DEFAULT_QUEUE_SIZE, show_default=True, type=click.IntRange(min=1),
              help="Requests that may wait behind the running ones; more are answered 429.")
@click.option("--max-batch", default=DEFAULT_MAX_BATCH, show_default=True, type=click.IntRange(min=1),
              help="Requests generated together in shared forwards (each gets exactly what it gets "
                   "alone; also bounded by the memory budget); 1: one request at a time.")
@click.option("--prefix-cache-gb", default=None, type=click.FloatRange(min=0),
              help="GB of prompt prefills kept across requests: a request sharing a prefix with earlier ones "
                   "skips its prefill, results unchanged; 0: off [10% of the memory budget].")
@click.option("--max-body-bytes", default=None, type=click.IntRange(min=1024),
              help=f"Largest accepted request body (413 beyond) [{DEFAULT_MAX_BODY_BYTES}; "
                   f"{DEFAULT_IMAGE_BODY_BYTES} for a model that takes images].")
@click.option("--model-id", default=None, help="Model name in /v1/models and responses "
                                               "[the model directory's name].")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@_image_options
@_generation_options
@_thinking
def serve(model_path, revision, host, port, api_key, queue_size, max_batch, prefix_cache_gb, max_body_bytes, model_id,
          log_level, max_images, max_image_pixels, allow_image_urls, image_url_max_bytes, image_url_timeout,
          trust_remote_code, compute_dtype, thinking, **options):
    """Serve a converted model behind an OpenAI-compatible API.

    Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
    GET /health. One worker generates up to --max-batch requests together
    (they join and leave between denoising steps); the others wait in a
    bounded queue. Generation flags set defaults for requests that do not
    set them; extra request fields carry the diffusion controls
    (max_denoising_steps, diffusion_sampler, ..., block_length, threshold).
    A model with a vision tower takes image_url content parts in user
    messages (data: URLs; http(s) URLs with --allow-image-urls)."""
    from .. import api
    from ..server.app import check_options, create_app

    defaults = {k: v for k, v in options.items() if v is not None}
    if api_key is not None and not api_key.strip():
        raise click.BadParameter("the API key is empty (a client could authenticate with no token); "
                                 "give a real key or none", param_hint="--api-key / DLM_API_KEY")
    if not allow_image_urls:
        ctx = click.get_current_context()
        for name in ("image_url_max_bytes", "image_url_timeout"):
            if ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT,
                                                         click.core.ParameterSource.DEFAULT_MAP):
                flag = "--" + name.replace("_", "-")
                raise click.UsageError(f"{flag} takes effect only with --allow-image-urls")
    try:
        api.check_options(model_path, defaults)  # family and option errors before the (slow) load
        loaded = api.load(model_path, trust_remote_code=trust_remote_code, revision=revision,
                          compute_dtype=compute_dtype)
        check_options(loaded, defaults)  # refuse flags the family does not take, now
        for note in api.option_warnings(loaded, defaults):
            click.echo(note, err=True)
        if loaded.world is not None and not loaded.world.primary:
            _follow(loaded, max_batch, defaults, prefix_cache_gb)
            return
        if model_id is None and not Path(loaded.source).expanduser().is_dir():
            model_id = loaded.source  # a Hub repo id names the model better than its snapshot hash
        fetch = RemoteImages(image_url_max_bytes, image_url_timeout) if allow_image_urls else None
        app = create_app(loaded, {**defaults, "enable_thinking": thinking}, api_key=api_key,
                         queue_size=queue_size, max_batch=max_batch, model_id=model_id,
                         prefix_cache_gb=prefix_cache_gb,
                         max_body_bytes=max_body_bytes,
                         images=ImageLimits(max_images, max_image_pixels, fetch))
    except DlmError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    if app.state.server.image_problem:
        click.echo(f"warning: image input is off: {app.state.server.image_problem}", err=True)
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
    cache = app.state.server.prefix_cache
    cache = f", prefix cache {cache.limit / 1e9:.2f} GB" if cache is not None else ", no prefix cache"
    click.echo(f"dlm-run serve: {app.state.server.model_id} at http://{shown}:{bound}/v1 "
               f"(batch {max_batch}, queue {queue_size}{cache}{', API key required' if api_key else ''})", err=True)
    run_server(app, sock, log_level)


def _follow(loaded, max_batch: int, defaults: dict, prefix_cache_gb) -> None:
    """A rank other than 0 under mlx.launch: no HTTP; it steps every batch with rank 0
    (which serves and broadcasts each tick's plan) until rank 0's server stops."""
    from ..server.lockstep import follow

    follow(loaded, max_batch, defaults.get("memory_budget"), prefix_cache_gb)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket for ``host:port`` (IPv4 or IPv6), bound before the banner
    so that the banner can name the real port.

    The protocol is named (IPPROTO_TCP, not 0): asyncio sets TCP_NODELAY only on
    connections whose socket says TCP, and without it Nagle's algorithm holds a
    response's second write until the client's delayed ACK: ~40 ms per response
    on Linux (README, "The server's socket, and the step between canvases")."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def run_server(app, sock: socket.socket, log_level: str) -> None:
    """Serve until SIGINT or SIGTERM, then stop cleanly and exit 0.

    uvicorn drains the connections, the app's shutdown stops the worker; then
    the worker thread is waited for until it has left MLX (a daemon thread
    abandoned inside MLX's C++ code when the interpreter finalizes aborts the
    process: "terminate called without an active exception", exit -6), and
    uvicorn's re-raising of the signal it caught (exit 130 for SIGINT, death
    by SIGTERM) is not passed on: a requested stop is a clean one."""
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                if hasattr(self, "_captured_signals"):
                    self._captured_signals.clear()  # stopping was what the signal asked for

    server = _Server(uvicorn.Config(app, log_level=log_level))
    worker = app.state.worker
    try:
        server.run(sockets=[sock])
    finally:
        stop_worker(worker)
    _leave_without_native_threads()


def _leave_without_native_threads(patience: float = 5.0) -> None:
    """The other threads that may sit in native code at exit: grammar compiles
    (``dlm-grammar``, daemon threads a request stops waiting for after its time
    limit). Waited for up to ``patience`` seconds; one still running then would
    abort the interpreter's finalization as an abandoned worker would, so the
    process leaves without it (streams flushed, exit status 0)."""
    import threading
    import time

    deadline = time.monotonic() + patience
    for thread in [t for t in threading.enumerate() if t.daemon and t.name.startswith("dlm-grammar")]:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            import logging

            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(0)


def stop_worker(worker, patience: float = 10.0) -> None:
    """Stop the generation worker (again: the app's shutdown did already unless
    uvicorn was forced out) and wait for its thread to end, however long its
    last step takes; a note on stderr after ``patience`` seconds. A second
    Ctrl-C while waiting exits at once, without finalizing the interpreter
    (which the worker still inside MLX would turn into an abort)."""
    try:
        worker.stop(timeout=patience)
        if not worker.wait_stopped(0):
            click.echo("dlm-run serve: waiting for the running denoising step to finish "
                       "(Ctrl-C again to quit at once)", err=True)
            while not worker.wait_stopped(1.0):
                pass
    except KeyboardInterrupt:
        sys.stderr.flush()
        os._exit(130)

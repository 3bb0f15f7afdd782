"""OpenAI-compatible HTTP server for dlm models (``dlm-run serve``).

FastAPI routes validate a request, tokenize it, and queue it on the generation
worker (``batch_worker.py``: up to ``max_batch`` requests generated together;
``worker.py`` with ``max_batch`` 1); the response object (``responses.py``) then relays the worker's
committed canvases/blocks to the client, as one JSON body or as SSE chunks.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
GET /health.  Streams carry text only when a canvas/block is committed, in
sequence order; DiffusionGemma's thinking goes to ``reasoning_content`` deltas
in chat streams and is left out of non-streaming responses.  ``stop`` strings
are applied to the committed text.  A client that disconnects cancels its
request (polled once per denoising step).  Chat requests to a model that takes
images may carry ``image_url`` parts (data: URLs; http(s) with
``ImageLimits.fetch``), decoded in the request's thread before it is queued.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import threading
import time
from pathlib import Path
from typing import Any, Optional

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..platform.errors import DlmError, GenerationError
from ..generation.images import ImageError, ImageLimits, decode, fetch_bodies, open_url
from ..generation.inputs import PromptInputs
from ..generation import prefix_cache
from .requests import (OPTION_FIELDS, ModelCaps, ParsedRequest, RequestError, bad, parse_chat, parse_completion,
                       structured_hooks, structured_spec)
from ..batch import DEFAULT_MAX_BATCH
from .responses import JobResponse
from .batch_worker import BatchRequest, BatchWorker
from .worker import GenerationWorker, QueueFull, WorkerStopped

DEFAULT_QUEUE_SIZE = 16
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# For a model that takes images: base64 data: URLs of a few photos.
DEFAULT_IMAGE_BODY_BYTES = 32 * 1024 * 1024
# Runtime option -> the request field that sets it (temp <- temperature, ...).
FIELD_OF = {option.name: field for field, option in OPTION_FIELDS.items()}


class _Server:
    """State shared by the routes: the model, its defaults and the worker."""

    def __init__(self, loaded, defaults: dict, runtime, queue_size: int, model_id: str,
                 max_body_bytes: Optional[int], images: ImageLimits, max_batch: int = 1,
                 prefix_cache_gb: Optional[float] = None):
        self.loaded = loaded
        self.runtime = runtime
        defaults = dict(defaults or {})
        self.enable_thinking = bool(defaults.pop("enable_thinking", False))
        self.defaults = {k: v for k, v in defaults.items() if v is not None}
        self.model_id = model_id
        why, self.image_problem = image_support(loaded)
        self.world = getattr(loaded, "world", None)  # under mlx.launch: this is rank 0 of these ranks
        if self.world is not None and not why:  # the pixels would have to reach every rank
            why = f"image input is not available when serving over {self.world.size} ranks yet"
        self.images = images
        self.caps = ModelCaps(family=loaded.family.title, text_only=bool(why), why_text_only=why,
                              max_images=images.max_images)
        if max_body_bytes is None:
            max_body_bytes = DEFAULT_MAX_BODY_BYTES if why else DEFAULT_IMAGE_BODY_BYTES
        self.max_body_bytes = max_body_bytes
        self.context = loaded.args.max_position_embeddings
        # Request threads tokenize one at a time (a fast tokenizer mutated from two
        # threads at once raises "Already borrowed").
        self.tokenizer_lock = threading.Lock()
        # Requests decode their images one at a time: what decoded images hold
        # at once stays under max_images x max_pixels. (URLs are fetched before,
        # outside it: a slow one delays only its own request.)
        self.image_lock = threading.Lock()
        from .. import api

        # A runtime of the caller's own (tests), or a family without batching, runs each request alone;
        # with a runtime of its own, no prefix cache.
        budget = self.defaults.get("memory_budget")
        if self.world is not None:  # every rank steps the same batch (lockstep.py), each with its own cache
            from .lockstep import DistributedWorker

            self.worker = DistributedWorker(loaded, max_batch, budget, queue_size=queue_size,
                                            after_job=_clear_mlx_cache, prefix_cache_gb=prefix_cache_gb)
            self.prefix_cache = self.worker.prefix_cache
            return
        self.prefix_cache = prefix_cache.sized(prefix_cache_gb, budget) if runtime is api else None
        if max_batch > 1 and runtime is api and loaded.family.batch is not None:
            self.worker = BatchWorker(loaded, max_batch, budget, queue_size=queue_size,
                                      after_job=_clear_mlx_cache, prefix_cache=self.prefix_cache)
        else:
            self.worker = GenerationWorker(queue_size=queue_size, after_job=_clear_mlx_cache)

    async def read_json(self, request: Request) -> Any:
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise RequestError(413, f"request body of {declared} bytes exceeds the {limit}-byte limit "
                                    "(dlm-run serve --max-body-bytes)")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(413, f"request body exceeds the {limit}-byte limit "
                                        "(dlm-run serve --max-body-bytes)")
            chunks.append(chunk)
        raw = b"".join(chunks)
        if not raw.strip():
            raise bad("the request body is empty; send a JSON object")
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise bad(f"malformed JSON body: {exc}") from None

    def encode(self, req: ParsedRequest) -> PromptInputs:
        """The request's prompt: token ids and, for a chat with images, the images
        decoded here (a request thread, never the generation worker) and
        preprocessed by the model family."""
        thinking = self.enable_thinking if req.enable_thinking is None else req.enable_thinking
        if req.images:
            bodies = self.fetch_images(req)  # outside the lock: a slow URL delays only its own request
            with self.image_lock:
                pictures = self.open_images(req, bodies)
                with self.tokenizer_lock:
                    return self.runtime.encode_inputs(self.loaded, messages=req.messages, images=pictures,
                                                      chat_template=True, enable_thinking=thinking,
                                                      tools=req.tools)
        with self.tokenizer_lock:
            if req.kind == "chat":
                return PromptInputs(list(self.runtime.encode_prompt(
                    self.loaded, messages=req.messages, chat_template=True, enable_thinking=thinking,
                    tools=req.tools)))
            return PromptInputs(list(self.runtime.encode_prompt(self.loaded, prompt=req.prompt,
                                                                chat_template=False)))

    def fetch_images(self, req: ParsedRequest) -> list:
        """The bodies of the request's http(s) image URLs (None for the others),
        fetched together; only their decoding waits for ``image_lock``."""
        try:
            return fetch_bodies(req.images, self.images.fetch)
        except ImageError as exc:
            raise bad(str(exc), getattr(exc, "where", None)) from None

    def open_images(self, req: ParsedRequest, bodies: Optional[list] = None) -> list:
        limits, out = self.images, []
        bodies = bodies or [None] * len(req.images)
        for (where, url), body in zip(req.images, bodies):
            try:
                out.append(decode(body, where, limits.max_pixels) if body is not None
                           else open_url(url, where, max_pixels=limits.max_pixels, fetch=limits.fetch))
            except ImageError as exc:
                raise bad(str(exc), where) from None
        return out

    def structured_inputs(self, req: ParsedRequest):
        """(the response format or forced tool-call format, the llguidance
        tokenizer): the only grammar work that needs ``tokenizer_lock`` (built
        once, then shared read-only by every compile)."""
        from ..structured import StructuredError
        from ..structured.grammar import ll_tokenizer

        loaded = self.loaded
        with self.tokenizer_lock:
            fmt = req.response_format
            if fmt is None and req.tools is not None and req.tools.forced:
                fmt = self.runtime.tool_format(loaded, req.tools)
            if fmt is None:
                return None, None
            if loaded.tokenizer is None:
                raise StructuredError("structured output needs the model's tokenizer (none is loaded)")
            stops = sorted(set(int(t) for t in loaded.args.eos_token_ids))
            return fmt, ll_tokenizer(loaded.tokenizer, loaded.args.vocab_size, stops[0] if stops else 0)

    async def check_structured(self, req: ParsedRequest, request: Request) -> None:
        """Compile the request's grammars (response format, tool schemas) now:
        a schema the engine refuses is a 400 naming the field. The compile runs
        in a grammar thread (structured/grammar.py), outside any lock, within
        COMPILE_SECONDS; a client that leaves stops the wait."""
        import asyncio

        from ..structured import StructuredError
        from ..structured import grammar
        from ..structured.grammar import check_format, start_compile, too_slow
        from ..structured.tools import check_schemas

        try:
            fmt, ll = await run_in_threadpool(self.structured_inputs, req)
        except StructuredError as exc:
            raise bad(str(exc), exc.param) from None

        def work() -> None:
            check_schemas(req.tools)
            if fmt is not None:
                check_format(fmt, ll)

        future = start_compile(work)
        waiting = asyncio.wrap_future(future)
        deadline = time.monotonic() + grammar.COMPILE_SECONDS
        try:
            while not future.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    where = "response_format.json_schema.schema" if req.response_format is not None else "tools"
                    raise bad(str(too_slow(where)), where)
                await asyncio.wait({waiting}, timeout=min(left, 0.2))
                if not future.done() and await request.is_disconnected():
                    raise RequestError(499, "the client closed the request")
            future.result()
        except StructuredError as exc:
            raise bad(str(exc), exc.param) from None
        finally:
            future.cancel()  # a compile still waiting for a slot never starts
            if waiting.done() and not waiting.cancelled():
                waiting.exception()  # retrieved (asyncio would log it otherwise)

    def check_request_options(self, requested: dict, options: dict):
        """The family's settings for ``options``, or a 400 naming the request
        fields it refuses (its message speaks of options or CLI flags; the
        client needs its own field names)."""
        try:
            return check_options(self.loaded, options)
        except DlmError as exc:
            fields = []
            for name, value in requested.items():
                try:
                    check_options(self.loaded, {name: value})
                except DlmError:
                    fields.append(FIELD_OF.get(name, name))
            if not fields:
                raise bad(str(exc)) from None
            names = ", ".join(repr(f) for f in fields)
            raise bad(f"{names}: {exc}", fields[0]) from None

    async def handle(self, request: Request, kind: str) -> JobResponse:
        received_at = time.perf_counter()
        body = await self.read_json(request)
        req = parse_chat(body, self.caps) if kind == "chat" else parse_completion(body, self.caps)
        options = {**self.defaults, **req.options}
        try:
            inputs = await run_in_threadpool(self.encode, req)
        except DlmError as exc:  # TextError (a lone surrogate) names its field
            raise bad(str(exc), getattr(exc, "param", None)) from None
        prompt_ids, images = list(inputs.ids), list(inputs.images)
        if not prompt_ids:
            raise bad("the prompt is empty after tokenization", "messages" if kind == "chat" else "prompt")
        settings = self.check_request_options(req.options, options)
        max_tokens = getattr(settings, "max_tokens", None)
        if self.context and max_tokens and len(prompt_ids) + max_tokens > self.context:
            raise bad(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                      f"model context of {self.context} tokens", "max_tokens")
        try:  # the prompt and the memory budget, checked before the request takes a queue slot
            self.loaded.family.generation.Session(self.loaded, prompt_ids, settings,
                                                    **({"images": images} if images else {}))
        except DlmError as exc:
            raise bad(str(exc)) from None
        loaded, runtime = self.loaded, self.runtime
        prompt = inputs if images else prompt_ids
        if req.response_format is not None or req.tools is not None:
            # compiled now, off the event loop: a schema the grammar engine refuses is a 400
            await self.check_structured(req, request)
        structured = structured_hooks(req)

        shared = {"prefix_cache": self.prefix_cache} if self.prefix_cache is not None else {}

        def run(cancel):
            return runtime.stream_generate(loaded, prompt, options, cancel=cancel, **structured, **shared)

        request_of = BatchRequest(prompt, options, structured)  # structured requests batch too
        if self.world is not None:  # what every rank needs to run it (JSON, broadcast by the worker)
            request_of = {"prompt": prompt_ids, "options": options, "structured": structured_spec(req, body)}
        try:
            job = self.worker.submit(run, request=request_of)
        except QueueFull as exc:
            raise RequestError(429, str(exc), err_type="rate_limit_error") from None
        except WorkerStopped as exc:
            raise RequestError(503, str(exc), err_type="server_error") from None
        return JobResponse(self, job, req, len(prompt_ids), received_at)


def image_support(loaded) -> tuple[str, str]:
    """(why ``loaded`` takes no images, for clients; the detail for the server
    log): ("", "") when it takes them. The image processor is built now, so a
    model whose processor files or image tokens are unusable serves text and
    says so at startup, not on its first image."""
    from .. import api

    title = loaded.family.title
    try:
        api.image_processor(loaded)
    except GenerationError:
        if loaded.family.image_processor is None:
            return f"{title} models are text-only", ""
        return f"this {title} model has no vision tower (a text-only conversion)", ""
    except DlmError as exc:
        return f"this {title} model's image processor is unusable (see the server log)", str(exc)
    return "", ""


def check_options(loaded, options: dict):
    """Let the family refuse inapplicable or bad options (GenerationError naming
    them) without generating: the server checks each request before it takes a
    queue slot, and ``serve`` its defaults at startup."""
    return loaded.settings(options)


def _clear_mlx_cache() -> None:
    """After a job (on the worker thread): its MLX work finished, then the cache freed."""
    try:
        import mlx.core as mx

        from ..models.cpu.streams import synchronize_thread
    except ImportError:
        return
    synchronize_thread()  # nothing left queued on this thread's streams (its last job, or the server stopping)
    clear = getattr(mx, "clear_cache", None)
    if clear is not None:
        clear()


def create_app(loaded, defaults: dict | None = None, api_key: str | None = None,
               queue_size: int = DEFAULT_QUEUE_SIZE, *, model_id: str | None = None,
               max_body_bytes: int | None = None, images: ImageLimits | None = None,
               runtime=None, max_batch: int = DEFAULT_MAX_BATCH,
               prefix_cache_gb: Optional[float] = None) -> FastAPI:
    """Build the ASGI app serving ``loaded`` (a runtime ``LoadedModel``).

    ``defaults``: generation options (snake_case ``dlm-run generate`` flag
    names) used when a request does not set them; ``enable_thinking`` there
    sets the chat default.  ``api_key``: when set, every request needs
    ``Authorization: Bearer <key>``.  ``queue_size``: requests that may wait
    behind the running one before new ones get 429.  ``max_body_bytes``: the
    largest request body (default 4 MiB, 32 MiB for a model that takes images).
    ``images``: the per-request image limits (default ``ImageLimits()``: 8
    images of 50 megapixels, data: URLs only).  ``runtime``: the module
    providing ``encode_prompt`` / ``encode_inputs`` / ``stream_generate``
    (default ``dlm.runtime.api``). ``max_batch``: requests generated together
    in shared forwards (``dlm.runtime.server.batch_worker``; each gets what it would
    get alone); 1, or a runtime of the caller's own, runs one request at a time.
    ``prefix_cache_gb``: prompt prefills kept across requests (generation/prefix_cache.py;
    default: its share of the memory budget; 0: off; none with a runtime of the caller's own).
    """
    if runtime is None:
        from .. import api as runtime
    if model_id is None:
        model_id = Path(str(getattr(loaded, "path", "model"))).name or "model"
    server = _Server(loaded, defaults or {}, runtime, queue_size, model_id, max_body_bytes,
                     images or ImageLimits(), max_batch, prefix_cache_gb)
    app = FastAPI(title="dlm-run serve", lifespan=_lifespan(server), dependencies=[Depends(_key_check(api_key))],
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.state.worker = server.worker
    _add_error_handlers(app)
    _add_routes(app, server)
    return app


def _key_check(api_key: str | None):
    """The dependency every request passes: with ``api_key`` set, it needs
    ``Authorization: Bearer <key>``."""

    async def check_key(request: Request) -> None:
        if api_key is None or request.url.path == "/health":  # health probes carry no key
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 api_key.encode()):
            raise RequestError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                               err_type="authentication_error")

    return check_key


def _lifespan(server: _Server):
    """Stops the generation worker when the app shuts down."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await run_in_threadpool(server.worker.stop)

    return lifespan


def _add_error_handlers(app: FastAPI) -> None:
    """Every error, ours or the framework's, as an OpenAI-style error body."""

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError):
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        body = RequestError(exc.status_code, str(exc.detail)).body()
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        body = RequestError(500, f"internal server error: {type(exc).__name__}: {exc}",
                            err_type="server_error").body()
        return JSONResponse(body, status_code=500)


def _model_card(server: _Server) -> dict:
    return {"id": server.model_id, "object": "model", "created": int(time.time()),
            "owned_by": "dlm"}


def _add_routes(app: FastAPI, server: _Server) -> None:
    """/health, the model list and the two completion endpoints."""

    @app.get("/health")
    async def health():
        cache = server.prefix_cache.stats() if server.prefix_cache is not None else None
        return {"status": "ok", "model": server.model_id, "worker": server.worker.status(), "prefix_cache": cache}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(server)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != server.model_id:
            raise RequestError(404, f"model {model!r} not found; this server serves "
                                    f"{server.model_id!r}", "model")
        return _model_card(server)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.handle(request, "completion")

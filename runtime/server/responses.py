"""The response of one queued request (``dlm-run serve``): the worker's
committed canvases/blocks relayed as one JSON body or as SSE chunks, with the
connection watched so that a client that leaves cancels its job."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Optional

import anyio
from fastapi.responses import JSONResponse, Response

from ..generation.events import GenerationEvent
from ..platform.errors import DlmError
from ..structured.openai import logprobs_body
from .output import Output
from .requests import ParsedRequest, RequestError
from .worker import Job, WorkerStopped


def error_body(exc: BaseException) -> tuple[int, dict]:
    if isinstance(exc, RequestError):
        return exc.status, exc.body()
    if isinstance(exc, DlmError):
        return 400, RequestError(400, str(exc)).body()
    if isinstance(exc, WorkerStopped):
        return 503, RequestError(503, str(exc), err_type="server_error").body()
    message = f"generation failed: {type(exc).__name__}: {exc}"
    return 500, RequestError(500, message, err_type="server_error").body()


def _sse(obj: Any) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode("utf-8")


async def _events(job: Job) -> AsyncIterator[GenerationEvent]:
    while True:
        kind, payload = await job.next_message()
        if kind == "item":
            yield payload
        elif kind == "error":
            raise payload
        else:
            return


class JobResponse(Response):
    """ASGI response that relays one queued job to the client.

    It watches the connection for the whole request: a disconnect (while queued,
    while generating, or mid-stream) cancels the job, and any early exit frees
    the worker."""

    def __init__(self, server, job: Job, req: ParsedRequest, prompt_tokens: int,
                 received_at: float):
        self.server, self.job, self.req = server, job, req
        self.background = None  # FastAPI attaches background tasks here
        self.scope: dict = {}
        self.prompt_tokens = prompt_tokens
        self.received_at = received_at
        self.id = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    async def __call__(self, scope, receive, send) -> None:
        self.scope = scope
        async with anyio.create_task_group() as tg:

            async def watch_disconnect() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        self.server.worker.cancel(self.job)
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch_disconnect)
            try:
                if self.req.stream:
                    await self._stream(send)
                else:
                    await self._complete(send)
            finally:
                self.server.worker.cancel(self.job)  # no-op once the job is done
                tg.cancel_scope.cancel()

    # -- pieces ------------------------------------------------------------
    def _usage(self, out: Output) -> dict:
        completion = out.completion_tokens
        cached = out.stats.cached_prompt_tokens if out.stats is not None else 0  # the prefix cache's
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _timings(self, out: Output) -> dict:
        """Serial serving: queueing is part of the latency a client sees."""
        stats = out.stats
        timings = {"queue_seconds": round(self.job.queue_seconds, 6),
                   "total_seconds": round(time.perf_counter() - self.received_at, 6)}
        if stats is not None:
            timings.update(prompt_seconds=round(stats.prompt_seconds, 6),
                           generation_seconds=round(stats.generation_seconds, 6),
                           steps_per_block=list(stats.steps_per_block), forwards=stats.forwards,
                           early_stops=stats.early_stops)
            if stats.image_tokens:  # the vision encoder, apart from the text prefill
                timings.update(vision_seconds=round(stats.vision_seconds, 6), image_tokens=stats.image_tokens)
        return timings

    def _head(self) -> dict:
        obj = "chat.completion" if self.req.kind == "chat" else "text_completion"
        if self.req.stream:
            obj = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.server.model_id}

    async def _send_json(self, send, status: int, body: dict) -> None:
        await JSONResponse(body, status_code=status)(self.scope, None, send)

    async def _complete(self, send) -> None:
        out = Output(self.req.stop)
        try:
            async for event in _events(self.job):
                out.add(event)
                if out.finish_reason is not None:
                    break
        except Exception as exc:
            await self._send_json(send, *error_body(exc))
            return
        finish = out.finish_reason or "stop"
        text = "".join(out.text)
        logprobs = self._logprobs(out.logprobs if self.req.logprobs is not None else None)
        if self.req.kind == "chat":  # reasoning is left out of non-streaming answers
            message = {"role": "assistant", "content": text}
            if out.tool_calls:
                message = {"role": "assistant", "content": text or None,
                           "tool_calls": [c.to_openai() for c in out.tool_calls]}
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        body = {**self._head(), "choices": [choice], "usage": self._usage(out),
                "timings": self._timings(out)}
        await self._send_json(send, 200, body)

    def _logprobs(self, records: Optional[list], offset: int = 0) -> Optional[dict]:
        return logprobs_body(self.req.kind, records, self.server.loaded.tokenizer, offset)

    def _chunk(self, reasoning: str = "", text: str = "", finish: Optional[str] = None,
               role: bool = False, logprobs: Optional[dict] = None, tool_calls: Optional[list] = None) -> dict:
        if self.req.kind == "chat":
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
                delta["content"] = ""
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return {**self._head(), "choices": [choice]}

    async def _stream(self, send) -> None:
        out = Output(self.req.stop)
        events = _events(self.job)
        # Hold the status line until the worker answers: a request the runtime
        # refuses before generating still gets a proper 4xx.
        try:
            first = await events.__anext__()
        except StopAsyncIteration:
            first = None
        except Exception as exc:
            await self._send_json(send, *error_body(exc))
            return
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})

        async def body(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        if self.req.kind == "chat":
            await body(_sse(self._chunk(role=True)))

        async def emit(event: GenerationEvent) -> None:
            before = len(out.tool_calls)
            reasoning, text = out.add(event)
            if reasoning and self.req.kind == "chat":
                await body(_sse(self._chunk(reasoning=reasoning)))
            if text:
                records = out.delta_logprobs if self.req.logprobs is not None else None
                await body(_sse(self._chunk(text=text, logprobs=self._logprobs(records))))
            calls = [c.to_openai(before + i) for i, c in enumerate(out.tool_calls[before:])]
            if calls and self.req.kind == "chat":
                await body(_sse(self._chunk(tool_calls=calls)))

        try:
            if first is not None:
                await emit(first)
            if out.finish_reason is None:
                async for event in events:
                    await emit(event)
                    if out.finish_reason is not None:
                        break
        except Exception as exc:
            await body(_sse(error_body(exc)[1]))
        else:
            await body(_sse(self._chunk(finish=out.finish_reason or "stop")))
            if self.req.include_usage:
                usage = {**self._head(), "choices": [], "usage": self._usage(out),
                         "timings": self._timings(out)}
                await body(_sse(usage))
        await body(_sse("[DONE]"))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

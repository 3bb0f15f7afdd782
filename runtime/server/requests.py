"""Validation of OpenAI-style request bodies for ``dlm-run serve``.

Everything a client can get wrong is caught here, before the request reaches
the generation worker, and reported as a ``RequestError`` (a 4xx with a message
that names the field).  Which generation options apply to which family is not
decided here: the family's own settings parser rejects inapplicable options
(for example ``block_length`` on DiffusionGemma) and the server turns that into
a 400 as well.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from ..generation.images import DEFAULT_MAX_IMAGES
from ..generation.inputs import TextError, check_text
from ..generation.options import OptionError
from ..registry import request_options
from ..structured import ResponseFormat, StructuredError, parse_response_format
from ..structured.tools import ToolRequest, parse_tools

MAX_STOP_STRINGS = 4


class RequestError(Exception):
    """A request the server refuses; rendered as an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 err_type: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type,
                          "param": self.param, "code": None}}


def bad(message: str, param: str | None = None) -> RequestError:
    return RequestError(400, message, param)


# -- scalar checks -----------------------------------------------------------

def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be true or false, got {type(value).__name__}", name)
    return value


def _only_fields(value, name: str, allowed: str, hint: str = "") -> None:
    """``value`` is an object whose only field is ``allowed`` (a 400 naming ``name`` otherwise)."""
    if not isinstance(value, dict):
        raise bad(f"'{name}' must be an object", name)
    extra = sorted(k for k in value if k != allowed)
    if extra:
        raise bad(f"unsupported field(s) in '{name}': {', '.join(map(repr, extra))}{hint}", name)


def _str(value: Any, name: str) -> str:
    """A string field; JSON can carry lone surrogates (``"\\ud800"``), which no
    tokenizer can encode: refused here, naming the field."""
    if not isinstance(value, str):
        raise bad(f"'{name}' must be a string, got {type(value).__name__}", name)
    try:
        return check_text(value, name)  # the one check every prompt string goes through (api.encode_inputs)
    except TextError as exc:
        raise bad(str(exc), exc.param) from None


# The same checks for the lines of a prompts file (dlm.runtime.cli.batch).
check_string, check_bool = _str, _bool


# -- field tables ------------------------------------------------------------

# Generation fields: the declared options a request may set (dlm.runtime.generation.options),
# under their request names (``temperature`` sets ``temp``).
OPTION_FIELDS = request_options()
# Accepted and ignored: identify the client, not the generation.
IGNORED_FIELDS = {"model", "user"}
# Fields OpenAI front-ends send by default, with the values that change nothing:
# those are accepted silently; any other value would change the answer in a way
# dlm does not implement, and is refused naming the field.
NEUTRAL_FIELDS = {
    "n": (1,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
    "store": (False,),
    "service_tier": ("auto", "default"),
}
COMPLETION_NEUTRAL_FIELDS = {"echo": (False,), "best_of": (1,), "suffix": ("",)}
COMMON_FIELDS = (set(OPTION_FIELDS) | IGNORED_FIELDS | set(NEUTRAL_FIELDS)
                 | {"max_tokens", "stop", "stream", "stream_options", "response_format", "logprobs"})
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "chat_template_kwargs", "top_logprobs",
                               "tools", "tool_choice", "parallel_tool_calls"}
COMPLETION_FIELDS = COMMON_FIELDS | set(COMPLETION_NEUTRAL_FIELDS) | {"prompt"}

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MESSAGE_KEYS = {"role", "content", "name", "reasoning_content", "tool_calls", "tool_call_id"}
IMAGE_PARTS = {"image_url", "input_image", "image"}
DETAILS = ("auto", "low", "high")
AUDIO_PARTS = {"input_audio", "audio_url", "audio"}
VIDEO_PARTS = {"video_url", "input_video", "video"}


@dataclass
class ModelCaps:
    """What the loaded model accepts (filled by the server from LoadedModel)."""

    family: str
    text_only: bool = True  # takes no images
    why_text_only: str = ""  # why not (shown to the client)
    max_images: int = DEFAULT_MAX_IMAGES  # per request
    # Prompts-file lines: images are files listed beside the messages, and a
    # {"type": "image"} part takes the next one (api.encode_inputs).
    image_files: bool = False


@dataclass
class ParsedRequest:
    kind: str  # "chat" | "completion"
    options: dict = field(default_factory=dict)  # request-level generation options
    messages: Optional[list[dict]] = None
    prompt: Optional[str] = None
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    enable_thinking: Optional[bool] = None
    images: list[tuple[str, str]] = field(default_factory=list)  # (content part, URL), in prompt order
    response_format: Optional[ResponseFormat] = None  # structured output (dlm.runtime.structured)
    logprobs: Optional[int] = None  # structured output: alternatives per token (0: the token's own only)
    tools: Optional[ToolRequest] = None  # tools / tool_choice (None: none, or tool_choice "none")


def _check_fields(body: dict, allowed: set[str], route: str) -> None:
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        raise bad(f"unsupported field(s) for {route}: {names}", unknown[0])


def _is(value, neutral) -> bool:
    if isinstance(neutral, bool) or isinstance(value, bool):  # False is not 0, True is not 1
        return value is neutral
    return value == neutral


def _check_neutral(body: dict, table: dict) -> None:
    for name, neutral in table.items():
        value = body.get(name)
        if value is not None and not any(_is(value, n) for n in neutral):
            allowed = " or ".join(json.dumps(n) for n in neutral)
            why = ("the server returns one choice per request" if name == "n"
                   else "dlm-run serve does not implement it, and only a value that changes nothing is accepted")
            raise bad(f"'{name}' must be {allowed} (got {json.dumps(value)}): {why}", name)


def parse_options(body: dict) -> dict:
    """The generation options ``body`` sets under their request names (a request,
    or a prompts-file line), checked: option name -> value."""
    out = {}
    for name, option in OPTION_FIELDS.items():
        if body.get(name) is not None:
            try:
                out[option.name] = option.check(body[name], f"'{name}'")
            except OptionError as exc:
                raise bad(str(exc), name) from None
    return out


def _common(body: dict, req: ParsedRequest) -> None:
    if "model" in body and body["model"] is not None:
        _str(body["model"], "model")
    if "user" in body and body["user"] is not None:
        _str(body["user"], "user")
    _check_neutral(body, NEUTRAL_FIELDS)
    req.options.update(parse_options(body))
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad("'stop' must be a string or a list of strings", "stop")
        stops = [_str(s, "stop") for s in stops]
        if len(stops) > MAX_STOP_STRINGS:
            raise bad(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
        if any(s == "" for s in stops):
            raise bad("'stop' strings must not be empty", "stop")
        req.stop = stops
    if body.get("stream") is not None:
        req.stream = _bool(body["stream"], "stream")
    opts = body.get("stream_options")
    if opts is not None:
        _only_fields(opts, "stream_options", "include_usage")
        if opts.get("include_usage") is not None:
            req.include_usage = _bool(opts["include_usage"], "stream_options.include_usage")
    try:
        req.response_format = parse_response_format(body.get("response_format"))
    except StructuredError as exc:
        raise bad(str(exc), exc.param) from None


def _int(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad(f"'{name}' must be an integer in [{low}, {high}], got {json.dumps(value)}", name)
    return value


def _logprobs(req: ParsedRequest, wanted: Optional[int], name: str) -> None:
    """Logprobs are reported where dlm computes a distribution per committed
    token under a grammar: structured output."""
    if wanted is None:
        return
    if req.response_format is None:
        raise bad(f"'{name}' is supported with structured output only (response_format json_object or "
                  "json_schema): a diffusion canvas commits positions in any order, and dlm reports the "
                  "log-probabilities of the tokens a grammar frontier commits", name)
    req.logprobs = wanted


def _content(content: Any, where: str, role: str, caps: ModelCaps, images: list) -> str | list:
    """A message's content for the chat template: its text, or (when it holds
    images) the list ``[{"type": "text", ...}, {"type": "image"}, ...]`` in
    order; each image's (part, URL) is appended to ``images``. Media the model
    cannot take are refused naming the part."""
    if content is None:
        return ""
    if isinstance(content, str):
        return _str(content, f"{where}.content")
    if not isinstance(content, list):
        raise bad(f"'{where}.content' must be a string or a list of content parts", where)
    parts, has_image = [], False
    for j, part in enumerate(content):
        pwhere = f"{where}.content[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad(f"'{pwhere}' must be an object with a string 'type'", pwhere)
        kind = part["type"]
        if kind == "text":
            parts.append({"type": "text", "text": _str(part.get("text"), f"{pwhere}.text")})
        elif kind in IMAGE_PARTS:
            if caps.text_only:
                why = caps.why_text_only or f"this {caps.family} model is text-only"
                raise bad(f"'{pwhere}': image input is not supported: {why}", pwhere)
            if kind == "image" and caps.image_files:
                if role != "user":
                    raise bad(f"'{pwhere}': images are taken in user messages only, not in a {role} message",
                              pwhere)
                parts.append({"type": "image"})
                has_image = True
                continue
            if kind != "image_url":
                raise bad(f"'{pwhere}': content part type {kind!r} is not supported; send "
                          '{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}', pwhere)
            if role != "user":
                raise bad(f"'{pwhere}': images are taken in user messages only, not in a {role} message", pwhere)
            images.append((pwhere, _image_url(part, pwhere)))
            parts.append({"type": "image"})
            has_image = True
        elif kind in AUDIO_PARTS or kind in VIDEO_PARTS:
            media = "audio" if kind in AUDIO_PARTS else "video"
            raise bad(f"'{pwhere}': {media} input is not supported for {caps.family} models", pwhere)
        else:
            raise bad(f"'{pwhere}': unsupported content part type {kind!r}", pwhere)
    if not has_image:  # text only: the plain string, rendered exactly as a string content is
        return "".join(p["text"] for p in parts)
    return parts


def _image_url(part: dict, where: str) -> str:
    """The URL of an ``image_url`` part: ``{"url": ..., "detail": ...}`` or a bare string."""
    value = part.get("image_url")
    if isinstance(value, dict):
        extra = sorted(k for k in value if k not in ("url", "detail"))
        if extra:
            raise bad(f"unsupported field(s) in '{where}.image_url': {', '.join(map(repr, extra))}",
                      f"{where}.image_url")
        detail = value.get("detail")  # a hint for OpenAI's own resizing: accepted, ignored
        if detail is not None and detail not in DETAILS:
            raise bad(f"'{where}.image_url.detail' must be one of {', '.join(DETAILS)}, got {detail!r}",
                      f"{where}.image_url.detail")
        value, name = value.get("url"), f"{where}.image_url.url"
    else:
        name = f"{where}.image_url"
    if value is None:
        raise bad(f"'{where}' has no image URL: send \"image_url\": {{\"url\": \"data:image/...;base64,...\"}}",
                  where)
    url = _str(value, name)
    if not url.strip():
        raise bad(f"'{name}' is empty", name)
    return url


def parse_chat(body: Any, caps: ModelCaps) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
    req = ParsedRequest(kind="chat")
    _common(body, req)
    top = body.get("top_logprobs")
    if top is not None:
        top = _int(top, "top_logprobs", 0, 20)
    if body.get("logprobs") is not None and _bool(body["logprobs"], "logprobs"):
        _logprobs(req, top or 0, "logprobs")
    elif top:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    if body.get("max_completion_tokens") is not None:
        try:
            req.options["max_tokens"] = OPTION_FIELDS["max_tokens"].check(
                body["max_completion_tokens"], "'max_completion_tokens'")
        except OptionError as exc:
            raise bad(str(exc), "max_completion_tokens") from None
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        _only_fields(kwargs, "chat_template_kwargs", "enable_thinking", " (only 'enable_thinking')")
        if kwargs.get("enable_thinking") is not None:
            req.enable_thinking = _bool(kwargs["enable_thinking"],
                                        "chat_template_kwargs.enable_thinking")

    images = []
    out = parse_messages(body.get("messages"), caps, images)
    try:
        req.tools = parse_tools(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
    except StructuredError as exc:
        raise bad(str(exc), exc.param) from None
    if req.tools is not None and req.tools.forced and req.response_format is not None:
        raise bad("'tool_choice' forces a tool call, so 'response_format' cannot also shape the answer",
                  "response_format")
    if len(images) > caps.max_images:
        first = images[caps.max_images][0]
        raise bad(f"'{first}': the request has {len(images)} images; this server takes at most "
                  f"{caps.max_images} per request (dlm-run serve --max-images)", first)
    req.messages, req.images = out, images
    return req


def parse_messages(messages: Any, caps: ModelCaps, images: list) -> list[dict]:
    """The chat messages of a request (``dlm-run serve``) or of a prompts-file line
    (``dlm-run generate --prompts-file``), checked and put in the chat template's
    form; each image's (part, URL) is appended to ``images``."""
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad(f"'{where}' must be an object", where)
        extra = sorted(k for k in msg if k not in MESSAGE_KEYS)
        if extra:
            raise bad(f"unsupported field(s) in '{where}': {', '.join(map(repr, extra))}", where)
        role = msg.get("role")
        if role not in ROLES:
            raise bad(f"'{where}.role' must be one of {', '.join(sorted(ROLES))}, got {role!r}",
                      f"{where}.role")
        # reasoning_content of earlier assistant turns is dropped on purpose:
        # thoughts stay out of the multi-turn history (model card).
        message = {"role": ROLES[role], "content": _content(msg.get("content"), where, ROLES[role], caps, images)}
        _tool_fields(msg, message, where)
        out.append(message)
    if not any(m["content"] or m.get("tool_calls") for m in out):
        raise bad("the prompt is empty: every message has empty content", "messages")
    return out


def _tool_fields(msg: dict, message: dict, where: str) -> None:
    """An assistant turn's ``tool_calls`` (arguments as objects, as chat templates
    take them) and a tool turn's ``tool_call_id`` / ``name``, checked."""
    role = message["role"]
    calls = msg.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise bad(f"'{where}.tool_calls' belongs to an assistant message", f"{where}.tool_calls")
        if not isinstance(calls, list):
            raise bad(f"'{where}.tool_calls' must be a list", f"{where}.tool_calls")
        out = []
        for j, call in enumerate(calls):
            cwhere = f"{where}.tool_calls[{j}]"
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise bad(f"'{cwhere}' must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                          f"\"arguments\": \"{{...}}\"}}}}", cwhere)
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args or "{}")
                except ValueError as exc:
                    raise bad(f"'{cwhere}.function.arguments' is not JSON: {exc}", f"{cwhere}.function.arguments") \
                        from None
            if not isinstance(args, dict):
                raise bad(f"'{cwhere}.function.arguments' must be a JSON object", f"{cwhere}.function.arguments")
            out.append({"id": call.get("id"), "type": "function",
                        "function": {"name": _str(fn["name"], f"{cwhere}.function.name"), "arguments": args}})
        message["tool_calls"] = out
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if msg.get(key) is not None:
                message[key] = _str(msg[key], f"{where}.{key}")
    elif msg.get("tool_call_id") is not None:
        raise bad(f"'{where}.tool_call_id' belongs to a tool message", f"{where}.tool_call_id")


def parse_completion(body: Any, caps: ModelCaps) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _check_fields(body, COMPLETION_FIELDS, "/v1/completions")
    req = ParsedRequest(kind="completion")
    _common(body, req)
    if body.get("logprobs") not in (None, False):
        _logprobs(req, _int(body["logprobs"], "logprobs", 0, 5), "logprobs")
    _check_neutral(body, COMPLETION_NEUTRAL_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and any(isinstance(p, dict) for p in prompt):
        raise bad("/v1/completions takes a text prompt only; send images to /v1/chat/completions as "
                  "image_url content parts", "prompt")
    if not isinstance(prompt, str):
        raise bad("'prompt' must be a string (one prompt per request)", "prompt")
    _str(prompt, "prompt")
    if prompt == "":
        raise bad("the prompt is empty", "prompt")
    req.prompt = prompt
    return req


def structured_hooks(req: ParsedRequest) -> dict:
    """The ``stream_generate`` keywords of a request's structured output (response
    format, logprobs, tools); empty for a plain request."""
    hooks: dict = {}
    if req.response_format is not None or (req.tools is not None and req.tools.forced):
        hooks = {"response_format": req.response_format, "logprobs": req.logprobs}
    if req.tools is not None:
        hooks["tools"] = req.tools
    return hooks


def structured_spec(req: ParsedRequest, body: dict) -> Optional[dict]:
    """The body fields another rank rebuilds ``structured_hooks(req)`` from (JSON,
    for a distributed server); None for a plain request."""
    if not structured_hooks(req):
        return None
    tools = [body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")] \
        if req.tools is not None else None
    return {"response_format": body.get("response_format"), "logprobs": req.logprobs, "tools": tools}


def structured_from_spec(spec: dict) -> dict:
    """``structured_hooks`` of the request ``structured_spec`` described (parsed as rank 0 parsed it)."""
    req = ParsedRequest(kind="")
    req.response_format = parse_response_format(spec["response_format"])
    req.logprobs = spec["logprobs"]
    if spec["tools"] is not None:
        req.tools = parse_tools(*spec["tools"])
    return structured_hooks(req)

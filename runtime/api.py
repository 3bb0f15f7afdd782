"""dlm's Python API: what ``dlm-run``, the parity suite and the server use.

    from dlm.runtime import api
    loaded = api.load("path/to/mlx-model")
    ids = api.encode_prompt(loaded, "Why is the sky blue?")
    for event in api.stream_generate(loaded, ids, {"max_tokens": 256, "seed": 0}):
        print(event.reasoning or event.text, end="", flush=True)
    result = api.generate(loaded, ids, {"max_tokens": 64})

    # Many prompts in shared forwards, each with its own options (same results as alone).
    results = api.generate_batch(loaded, [ids, other_ids], [{"seed": 0}, {"seed": 1, "max_tokens": 32}])
    # Structured and tool-call prompts batch too: one value for every prompt, or one per prompt.
    results = api.generate_batch(loaded, [ids, other_ids], response_format=[{"type": "json_object"}, None])

    # Images (DiffusionGemma with a vision tower): paths, bytes, data: URLs or PIL images.
    inputs = api.encode_inputs(loaded, "What is in this picture?", images=["cat.png"])
    result = api.generate(loaded, inputs, {"max_tokens": 64})

``options`` use the snake_case names of the ``dlm-run generate`` flags, as each
family declares them in ``dlm.runtime.models.<family>.options``. An option that
does not apply to the family raises GenerationError naming its flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from .platform.errors import ConfigError, DlmError, GenerationError
from .generation.events import GenerationEvent, GenerationStats
from .generation.inputs import PromptInputs, check_text, split_prompt
from .generation.prefix_cache import PrefixCache  # noqa: F401  (api.PrefixCache)
from .generation.shaping import ToolCalls, shape, structured_output, tool_format  # noqa: F401  (re-exported)
from .loader import LoadedModel
from .loader import load as _load


@dataclass
class GenerationResult:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    reasoning: str = ""
    finish_reason: Optional[str] = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    # Token ids of each committed canvas/block as emitted (trimmed at EOS / budget).
    blocks: list[list[int]] = field(default_factory=list)
    # Structured runs with logprobs: one dlm.runtime.structured.TokenLogprob per token.
    logprobs: Optional[list] = None
    tool_calls: list = field(default_factory=list)  # runs with tools: dlm.runtime.structured.toolcalls.ToolCall

    @property
    def steps_per_block(self) -> list[int]:
        return list(self.stats.steps_per_block)

    def to_dict(self) -> dict:
        return {
            "token_ids": self.token_ids, "text": self.text, "reasoning": self.reasoning,
            "finish_reason": self.finish_reason, "steps_per_block": self.steps_per_block,
            "blocks": self.blocks, "stats": self.stats.to_dict(),
        }


def load(path, *, trust_remote_code: bool = False, revision: Optional[str] = None,
         compute_dtype: Optional[str] = None) -> LoadedModel:
    """Load a converted MLX directory or Hub repo id (dlm or mlx-community
    conversions, or an HF checkpoint of a supported family). ``compute_dtype``:
    "auto" (default: float32 on the CPU backend, the stored dtype on Metal/CUDA),
    "native" or "float32" (``dlm.runtime.loader.COMPUTE_DTYPES``)."""
    return _load(path, trust_remote_code=trust_remote_code, revision=revision, compute_dtype=compute_dtype)


def check_options(path, options: dict) -> None:
    """Refuse, before the (slow) load, ``options`` that ``path``'s family refuses
    (another family's option, out of range, options that contradict each other):
    the same check ``loaded.settings`` runs, with config.json read alone. A Hub
    repo id, or a directory without a readable config.json, is left to the load."""
    from pathlib import Path

    from .checkpoint import read_config
    from .registry import family_for_config, resolve_options

    directory = Path(str(path)).expanduser()
    if not (directory / "config.json").is_file():
        return
    try:
        config = read_config(directory)
        family = family_for_config(config, str(directory / "config.json"))
    except DlmError:  # the load reports a bad or unsupported config.json in full
        return
    resolved = resolve_options(family, dict(options or {}))
    try:
        context = family.config.from_config(config, str(directory / "config.json")).max_position_embeddings
    except DlmError:
        return
    max_tokens = resolved.get("max_tokens")
    if max_tokens is not None and max_tokens >= context:  # a prompt takes at least one token
        raise GenerationError(f"--max-tokens {max_tokens} exceeds the model context of {context} tokens "
                              f"(with a one-token prompt: at most {context - 1})")


def option_warnings(loaded: LoadedModel, options: dict) -> list[str]:
    """One line for each option that takes effect on this checkpoint but that
    it was not trained for (LLaDA-2: --editing-threshold on a 2.0 checkpoint);
    an option that cannot take effect at all is an error instead."""
    warn = loaded.family.option_warnings
    return list(warn(loaded, dict(options or {}))) if warn is not None else []


def encode_prompt(
    loaded: LoadedModel,
    prompt: Optional[str] = None,
    messages: Optional[list[dict]] = None,
    system: Optional[str] = None,
    chat_template: bool = True,
    enable_thinking: bool = False,
    tools=None,
) -> list[int]:
    """Token ids of a text prompt.

    With ``chat_template`` (default) the tokenizer's template renders
    ``messages`` (or a single user turn holding ``prompt``, after an optional
    ``system`` turn) with the generation prompt appended and ``enable_thinking``
    passed to the template. Without it ``prompt`` is tokenized as raw text,
    starting with BOS when the tokenizer has one. Prompts with images:
    ``encode_inputs``.
    """
    return encode_inputs(loaded, prompt, messages, system=system, chat_template=chat_template,
                         enable_thinking=enable_thinking, tools=tools).ids


def encode_inputs(
    loaded: LoadedModel,
    prompt: Optional[str] = None,
    messages: Optional[list[dict]] = None,
    images: Optional[list] = None,
    system: Optional[str] = None,
    chat_template: bool = True,
    enable_thinking: bool = False,
    tools=None,
) -> PromptInputs:
    """A prompt with images, ready for ``generate`` / ``stream_generate``.

    ``images``: file paths, bytes, ``data:`` URLs or PIL images, in prompt
    order. With a chat template, a ``prompt`` becomes one user turn with the
    images before the text; ``messages`` place them themselves, as content
    parts ``{"type": "image"}`` in any turn: a part holding its source
    (``"image"``, ``"path"`` or ``"url"``: a data: URL) takes it, the others
    take the next of ``images``. Audio and video parts are refused. Without
    a chat template the raw ``prompt`` must hold one image token per image.
    Each image is preprocessed by the family (the model's own
    processor files) and its placeholder expanded to its soft tokens.
    ``tools``: a ToolRequest (dlm.runtime.structured.tools.parse_tools) or
    OpenAI tool dicts, rendered by the chat template. A lone surrogate in any
    string (prompt, system, messages, tools) is a TextError naming it.
    """
    tok = loaded.tokenizer
    if tok is None:
        raise ConfigError(f"{loaded.path}: no tokenizer loaded")
    check_text(prompt, "prompt")
    check_text(system, "system")
    check_text(messages, "messages")
    images = _image_sources(messages, list(images or []))
    if messages is None and isinstance(prompt, str) and not prompt.strip() and not images:
        # The CLI (--prompt) and the server ('prompt') share this check: an empty
        # prompt is refused, not generated from a bare chat template or BOS.
        raise GenerationError("the prompt is empty (--prompt / 'prompt'): give some text")
    processor = image_processor(loaded) if images else None
    if not chat_template:
        if prompt is None:
            raise GenerationError("a raw (no chat template) prompt needs prompt text, not messages")
        text = prompt
    else:
        if messages is None:
            if prompt is None:
                raise GenerationError("give a prompt or messages")
            content = ([{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
                       if images else prompt)
            messages = [{"role": "user", "content": content}]
        if system is not None:
            messages = [{"role": "system", "content": system}] + list(messages)
        if not getattr(tok, "chat_template", None):
            raise ConfigError(f"{loaded.path}: the tokenizer has no chat template (use raw text: --no-chat-template)")
        extra = {}
        if tools:
            extra["tools"] = check_text(tools.template_tools() if hasattr(tools, "template_tools")
                                        else list(tools), "tools")
        try:
            text = tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking, **extra
            )
        except Exception as exc:
            raise GenerationError(f"chat template failed: {exc}") from None
    processed = []
    if processor is not None:
        processed = processor.preprocess(images)
        text = processor.expand(text, processed)
    # Backstop: a string that reached the text some other way still fails here, not in the tokenizer.
    check_text(text, "messages" if chat_template else "prompt", label="the rendered prompt")
    ids = list(tok.encode(text, add_special_tokens=False))
    if not chat_template:
        bos = getattr(tok, "bos_token_id", None)
        if bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
    return PromptInputs(ids, processed)


_SOURCE_KEYS = ("image", "path", "url")


def _image_sources(messages, images: list) -> list:
    """The image of every image part of ``messages`` in order (its own source,
    else the next of ``images``); every one of ``images`` must be used."""
    if not messages:
        return images
    given, out = iter(images), []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("audio", "input_audio", "video"):
                raise GenerationError(f"messages[{i}].content[{j}]: {'video' if kind == 'video' else 'audio'} "
                                      "input is not supported")
            if kind != "image":
                continue
            own = next((part[k] for k in _SOURCE_KEYS if part.get(k) is not None), None)
            if own is None:
                own = next(given, None)
                if own is None:
                    raise GenerationError(f"messages[{i}].content[{j}]: an image part without an image "
                                          f"(give it an 'image' or pass images=[...]; {len(images)} given)")
            out.append(own)
    left = sum(1 for _ in given)
    if left:
        raise GenerationError(f"{left} of the {len(images)} image(s) given have no image part in the messages")
    return out


def image_processor(loaded: LoadedModel):
    """The family's image processor for this model (built from its processor
    files on first use), or GenerationError when the model takes no images (a
    text-only conversion, a text-only family)."""
    if loaded.image_processor is None:
        title, processor = loaded.family.title, loaded.family.image_processor
        if processor is None or loaded.args.text_only:
            why = (f"{title} is text-only" if processor is None
                   else f"this {title} model has no vision tower (a text-only conversion)")
            raise GenerationError(f"{loaded.source or loaded.path}: image input is not supported: {why}")
        loaded.image_processor = processor.from_model_dir(loaded.path, loaded.args, loaded.tokenizer)
    return loaded.image_processor


def _split_tool_calls(events: Iterator[GenerationEvent], syntax,
                      forced_budget: Optional[int] = None) -> Iterator[GenerationEvent]:
    """Events with the model's tool calls taken out of the text (generation.shaping.ToolCalls)."""
    return ToolCalls(syntax, forced_budget).stream(events)


def stream_generate(
    loaded: LoadedModel, prompt, options: Optional[dict] = None,
    cancel: Optional[Callable[[], bool]] = None, *, response_format=None,
    logprobs: Optional[int] = None, tools=None, **hooks,
) -> Iterator[GenerationEvent]:
    """``prompt``: token ids, or the PromptInputs of ``encode_inputs`` (images).
    ``response_format``: ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}}}`` (dlm.runtime.structured):
    the answer always parses and validates, or ends with finish_reason
    "length"; ``logprobs`` (structured runs): events carry each token's
    log-probability and that many most likely allowed alternatives.
    ``tools``: a ToolRequest (dlm.runtime.structured.tools.parse_tools) or OpenAI
    tool dicts (tool_choice "auto"); render them with ``encode_inputs(..., tools=)``: calls the model writes come out of the
    text as ``event.tool_calls`` (finish_reason "tool_calls"); a forced
    tool_choice constrains the output to calls whose arguments validate.
    Events: one per committed canvas/block in sequence order, then a final one
    with ``finish_reason`` ("stop" | "length" | "cancelled") and ``stats``.
    ``cancel`` is polled once per denoising step. Keyword hooks go to the
    family's loop; every family takes ``watch(block_index, step, token_ids)``
    (the canvas/block after each step) and ``prefix`` (a
    ``dlm.runtime.generation.progress.PrefixState`` kept across runs, as ``dlm-run chat``
    does), ``prefix_cache`` (a ``PrefixCache`` shared across runs and requests:
    the prompt skips the prefill of the chunks it holds, results unchanged),
    and ``step_trace`` (a ``dlm.runtime.trace.Trace`` that records every
    denoising step, as ``dlm-run generate --trace`` does); ``on_step`` is the
    family's own parity hook."""
    ids, images = split_prompt(prompt)
    if images:
        hooks["images"] = images
    shaping = shape(loaded, options, len(ids), response_format, logprobs, tools)
    if shaping.structured is not None:
        hooks["structured"] = shaping.structured
    events = loaded.family.generation.stream_generate(loaded, ids, shaping.settings, cancel, **hooks)
    return events if shaping.tool_calls is None else shaping.tool_calls.stream(events)


def generate(
    loaded: LoadedModel, prompt, options: Optional[dict] = None,
    cancel: Optional[Callable[[], bool]] = None, **hooks,
) -> GenerationResult:
    """``stream_generate``, collected (same keywords)."""
    result = GenerationResult()
    for event in stream_generate(loaded, prompt, options, cancel, **hooks):
        _take(result, event)
    return result


def _take(result: GenerationResult, event: GenerationEvent) -> None:
    result.text += event.text
    result.reasoning += event.reasoning
    if event.done:
        result.finish_reason = event.finish_reason
        result.stats = event.stats or GenerationStats()
    else:
        result.token_ids.extend(event.token_ids)
        result.blocks.append(list(event.token_ids))
        if event.logprobs is not None:
            result.logprobs = (result.logprobs or []) + list(event.logprobs)
    result.tool_calls.extend(event.tool_calls)


class BatchError(GenerationError):
    """Prompts of a batch whose runs raised (each what ``generate`` raises for it
    alone: a failed prefill, a forced tool call cut short by max_tokens); every
    other prompt ran to its end. ``errors``: prompt index -> its exception;
    ``results`` (``generate_batch``): every prompt's GenerationResult, a failed
    one's holding what it committed before (its finish_reason None)."""

    def __init__(self, errors: dict, results: Optional[list] = None):
        self.errors, self.results = errors, results
        super().__init__("; ".join(f"prompt {i}: {exc}" for i, exc in sorted(errors.items())))


def _per_prompt(value, count: int, name: str, many: bool) -> list:
    """``value`` for each of ``count`` prompts: the list itself when ``many``, else one value for all."""
    values = list(value) if many else [value] * count
    if len(values) != count:
        raise GenerationError(f"{count} prompts need as many {name} entries (got {len(values)})")
    return values


def stream_generate_batch(
    loaded: LoadedModel, prompts: list, options=None, *, max_batch: Optional[int] = None,
    memory_budget: Optional[float] = None, cancel: Optional[list] = None, response_format=None,
    logprobs=None, tools=None, prefix_cache: Optional[PrefixCache] = None,
) -> Iterator[tuple[int, GenerationEvent]]:
    """Generate for many prompts at once (dlm.runtime.batch): (prompt index,
    event) pairs as canvases/blocks commit, each prompt's final event last.
    ``options``: one dict for every prompt, or a list with one per prompt
    (seed, max_tokens, sampler settings...); ``cancel``: None or a list of
    callables (or None), one per prompt. ``response_format``, ``logprobs``,
    ``tools`` (as ``stream_generate`` takes them): one value for every prompt,
    or a list with one per prompt (for ``tools``, a list of OpenAI tool dicts
    is one value; a per-prompt list holds None, ToolRequests or such lists).
    Structured and tool-call prompts batch with plain ones. Every prompt gets
    what ``stream_generate`` gives it alone. Up to ``max_batch`` prompts
    (default ``dlm.runtime.batch.DEFAULT_MAX_BATCH``) run together, within the
    memory budget; the rest wait their turn. Bad prompts, options or formats
    raise GenerationError, naming the prompt, before anything runs. A prompt
    whose run raises (what ``generate`` raises for it alone) has no final
    event and the others go on: once they have all ended, BatchError names
    every failed prompt. ``prefix_cache``: a PrefixCache the prompts share
    (and other runs given it): a prompt skips the prefill of the chunks it
    holds, results unchanged."""
    from .batch import DEFAULT_MAX_BATCH, Batcher

    prompts = list(prompts)
    n = len(prompts)
    per = _per_prompt(options, n, "options", isinstance(options, (list, tuple)))
    cancels = _per_prompt(cancel, n, "cancel", cancel is not None)
    formats = _per_prompt(response_format, n, "response_format", isinstance(response_format, (list, tuple)))
    counts = _per_prompt(logprobs, n, "logprobs", isinstance(logprobs, (list, tuple)))
    many_tools = isinstance(tools, (list, tuple)) and not any(isinstance(t, dict) for t in tools)
    toolsets = _per_prompt(tools, n, "tools", many_tools)
    batcher = Batcher(loaded, max_batch or DEFAULT_MAX_BATCH, memory_budget, prefix_cache)
    for i, (prompt, opts, stop, fmt, k, own) in enumerate(zip(prompts, per, cancels, formats, counts, toolsets)):
        try:
            batcher.add(prompt, opts, stop, key=i, response_format=fmt, logprobs=k, tools=own)
        except GenerationError as exc:
            raise GenerationError(f"prompt {i}: {exc}") from None
    errors: dict[int, Exception] = {}
    while not batcher.idle:
        for entry, event in batcher.step():
            yield entry.key, event
        for entry, exc in batcher.failed:
            errors[entry.key] = exc
        batcher.failed.clear()
    if errors:
        raise BatchError(errors)


def generate_batch(
    loaded: LoadedModel, prompts: list, options=None, *, max_batch: Optional[int] = None,
    memory_budget: Optional[float] = None, cancel: Optional[list] = None,
    on_event: Optional[Callable[[int, GenerationEvent], None]] = None, response_format=None,
    logprobs=None, tools=None, prefix_cache: Optional[PrefixCache] = None,
) -> list[GenerationResult]:
    """``generate`` for many prompts in shared forwards: one GenerationResult per
    prompt, in order, each what ``generate`` returns for it alone (logprobs,
    tool_calls and finish_reason "tool_calls" included; see
    ``stream_generate_batch`` for the keywords; ``on_event(index, event)`` sees
    every event). A prompt whose run raises fails alone: BatchError, raised
    once every prompt has ended, names it and carries every result."""
    results = [GenerationResult() for _ in prompts]
    try:
        for i, event in stream_generate_batch(loaded, prompts, options, max_batch=max_batch,
                                              memory_budget=memory_budget, cancel=cancel,
                                              response_format=response_format, logprobs=logprobs, tools=tools,
                                              prefix_cache=prefix_cache):
            _take(results[i], event)
            if on_event is not None:
                on_event(i, event)
    except BatchError as exc:
        exc.results = results
        raise
    return results

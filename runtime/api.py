"""dlm's Python API: what ``dlm-run``, the parity suite and the server use.

    from dlm.runtime import api
    loaded = api.load("path/to/mlx-model")
    ids = api.encode_prompt(loaded, "Why is the sky blue?")
    for event in api.stream_generate(loaded, ids, {"max_tokens": 256, "seed": 0}):
        print(event.reasoning or event.text, end="", flush=True)
    result = api.generate(loaded, ids, {"max_tokens": 64})

``options`` use the snake_case names of the ``dlm-run generate`` flags, as each
family declares them in ``dlm.runtime.models.<family>.options``. An option that
does not apply to the family raises GenerationError naming its flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from .errors import ConfigError, GenerationError
from .events import GenerationEvent, GenerationStats
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


def encode_prompt(
    loaded: LoadedModel,
    prompt: Optional[str] = None,
    messages: Optional[list[dict]] = None,
    system: Optional[str] = None,
    chat_template: bool = True,
    enable_thinking: bool = False,
) -> list[int]:
    """Token ids of a prompt.

    With ``chat_template`` (default) the tokenizer's template renders
    ``messages`` (or a single user turn holding ``prompt``, after an optional
    ``system`` turn) with the generation prompt appended and ``enable_thinking``
    passed to the template. Without it ``prompt`` is tokenized as raw text,
    starting with BOS when the tokenizer has one.
    """
    tok = loaded.tokenizer
    if tok is None:
        raise ConfigError(f"{loaded.path}: no tokenizer loaded")
    if not chat_template:
        if prompt is None:
            raise GenerationError("a raw (no chat template) prompt needs prompt text, not messages")
        ids = list(tok.encode(prompt, add_special_tokens=False))
        bos = getattr(tok, "bos_token_id", None)
        if bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids
    if messages is None:
        if prompt is None:
            raise GenerationError("give a prompt or messages")
        messages = [{"role": "user", "content": prompt}]
    if system is not None:
        messages = [{"role": "system", "content": system}] + list(messages)
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"{loaded.path}: the tokenizer has no chat template (use raw text: --no-chat-template)")
    try:
        text = tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
        )
    except Exception as exc:
        raise GenerationError(f"chat template failed: {exc}") from None
    return list(tok.encode(text, add_special_tokens=False))


def stream_generate(
    loaded: LoadedModel, prompt_ids: list[int], options: Optional[dict] = None,
    cancel: Optional[Callable[[], bool]] = None, **hooks,
) -> Iterator[GenerationEvent]:
    """Events: one per committed canvas/block in sequence order, then a final one
    with ``finish_reason`` ("stop" | "length" | "cancelled") and ``stats``.
    ``cancel`` is polled once per denoising step. Keyword hooks go to the
    family's loop; every family takes ``watch(block_index, step, token_ids)``
    (the canvas/block after each step) and ``prefix`` (a
    ``dlm.runtime.generate.PrefixState`` kept across runs, as ``dlm-run chat``
    does); ``on_step`` is the family's own parity hook."""
    gen = loaded.family.generation()
    settings = gen.Settings.from_options(dict(options or {}), loaded.args, loaded.generation_config)
    return gen.stream_generate(loaded, list(prompt_ids), settings, cancel, **hooks)


def generate(
    loaded: LoadedModel, prompt_ids: list[int], options: Optional[dict] = None,
    cancel: Optional[Callable[[], bool]] = None, **hooks,
) -> GenerationResult:
    result = GenerationResult()
    text, reasoning = [], []
    for event in stream_generate(loaded, prompt_ids, options, cancel, **hooks):
        text.append(event.text)
        reasoning.append(event.reasoning)
        if event.done:
            result.finish_reason = event.finish_reason
            result.stats = event.stats or GenerationStats()
        else:
            result.token_ids.extend(event.token_ids)
            result.blocks.append(list(event.token_ids))
    result.text, result.reasoning = "".join(text), "".join(reasoning)
    return result

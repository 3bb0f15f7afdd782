"""What a generation loop yields: shared by every family, the CLI, the parity
suite and the server."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_seconds: float = 0.0
    generation_seconds: float = 0.0
    # One entry per canvas (DiffusionGemma) or block (LLaDA-2): forwards run on it.
    steps_per_block: list[int] = field(default_factory=list)
    early_stops: int = 0  # canvases/blocks that stopped before the step budget
    forwards: int = 0  # decoder/model forwards spent on generation
    peak_memory_gb: float = 0.0
    block_name: str = "canvas"  # what steps_per_block counts: "canvas" or "block"
    cached_prompt_tokens: int = 0  # prompt tokens served from a kept prefix cache (chat)
    # Prompt tokens computed with the first block's denoising forwards rather than in the
    # prefill (LLaDA-2: the prompt's last, partial block), so not in prompt_seconds.
    deferred_prompt_tokens: int = 0
    # Images: the vision encoder's time (not in prompt_seconds) and the soft tokens
    # the images became (counted in prompt_tokens).
    vision_seconds: float = 0.0
    image_tokens: int = 0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def generation_tps(self) -> float:
        return self.completion_tokens / self.generation_seconds if self.generation_seconds else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.completion_tokens / self.forwards if self.forwards else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            prompt_tps=self.prompt_tps,
            generation_tps=self.generation_tps,
            tokens_per_forward=self.tokens_per_forward,
        )
        return out


@dataclass
class GenerationEvent:
    """One committed canvas/block (``text`` / ``reasoning`` deltas, in sequence
    order), or the final event (``finish_reason`` set, ``stats`` filled)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    reasoning: str = ""
    finish_reason: Optional[str] = None  # "stop" | "length" | "cancelled"
    stats: Optional[GenerationStats] = None
    # Structured runs asked for logprobs: one dlm.runtime.structured.TokenLogprob per token_ids entry.
    logprobs: Optional[list] = None
    # Runs with tools: the calls completed in this event (dlm.runtime.structured.toolcalls.ToolCall);
    # their text is not in ``text``.
    tool_calls: list = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

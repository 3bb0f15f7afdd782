"""The parity suite's budget (how many prompts, canvases and steps), declared
once: dlm-verify's options, their help and both modes' defaults come from here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class BudgetItem:
    """One knob of the suite's budget, declared once: dlm-verify's option
    (``--logits-prompts``...), its help text and both modes' defaults come
    from here. ``None`` as a default means ``unlimited``."""

    name: str
    minimum: int
    help: str
    whole: Optional[int]
    streamed: Optional[int]
    unlimited: str = "all"


# A layer-streamed run reads every layer from disk for every forward, so its
# defaults are smaller: at the released DiffusionGemma 26B-A4B geometry a
# decoder pass takes minutes per framework on a laptop-class CPU (README,
# "dlm-verify --parity at full size").
BUDGET = (
    BudgetItem("logits_prompts", 1, "How many prompts get logits cases, in order: --prompts FILE's, the built-in "
               "ones, then the long one (longer than the sliding window)", None, 1),
    BudgetItem("canvases", 1, "Canvases per commit stream", 2, 1),
    BudgetItem("steps", 1, "Max denoising steps per canvas in commit streams", None, 4, "generation_config"),
    BudgetItem("stream_prompts", 0, "How many prompts get a commit stream", 2, 1),
)
STREAMED_BUDGET = {b.name: b.streamed for b in BUDGET}
WHOLE_BUDGET = {b.name: b.whole for b in BUDGET}


def budget_help(item: BudgetItem) -> str:
    def show(v):
        return item.unlimited if v is None else str(v)

    return f"{item.help} [default: {show(item.whole)}; {show(item.streamed)} when layer-streamed]."

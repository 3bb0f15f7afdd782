"""The synthetic task of the bundled demo models: sort a list of digits.

"sort 31415" -> "11345". The answer is a deterministic function of the prompt
(so a well-trained model is confident and the early-stop rule can fire), it
cannot be produced without reading the prompt, and with canvases/blocks of 8
tokens the longer lists (answer + end token > 8) span two or three canvases.

Runtime-independent on purpose: the training scripts, the fidelity benchmark
and the tests all generate examples and check answers with this module.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

MIN_DIGITS = 3
MAX_DIGITS = 16
PREFIX = "sort "
# The demo prompt used by scripts/demo.sh and the README (a 2-canvas answer).
DEMO_DIGITS = "9081726354"


def prompt_text(digits: str) -> str:
    """The user message for one example."""
    return PREFIX + digits


def messages(digits: str) -> list[dict]:
    """Chat messages for one example (the demo models are chat-formatted)."""
    return [{"role": "user", "content": prompt_text(digits)}]


def answer_text(digits: str) -> str:
    """The correct answer: the digits in ascending order."""
    return "".join(sorted(digits))


def digits_of(prompt: str) -> str:
    """Inverse of prompt_text; raises ValueError for text that is not a task prompt."""
    body = prompt.strip()
    if not body.startswith(PREFIX.strip()):
        raise ValueError(f"not a sort prompt: {prompt!r}")
    digits = body[len(PREFIX.strip()):].strip()
    if not digits.isdigit():
        raise ValueError(f"not a sort prompt: {prompt!r}")
    return digits


def is_correct(digits: str, output: str) -> bool:
    """Exact match of the model's answer text (surrounding whitespace ignored)."""
    return output.strip() == answer_text(digits)


def sample_digits(rng: random.Random, n: int | None = None) -> str:
    """A random digit string; n defaults to a uniform length in [MIN_DIGITS, MAX_DIGITS]."""
    if n is None:
        n = rng.randint(MIN_DIGITS, MAX_DIGITS)
    return "".join(rng.choice("0123456789") for _ in range(n))


def heldout_set(count: int = 200, seed: int = 1234) -> list[str]:
    """A fixed held-out set, balanced over lengths (so multi-canvas answers are well represented).

    Training excludes these strings (see `in_heldout`), so accuracy on them is
    generalization, not recall (it matters for the short lists, of which there
    are few).
    """
    rng = random.Random(seed)
    lengths = list(range(MIN_DIGITS, MAX_DIGITS + 1))
    out, seen = [], set()
    i = 0
    while len(out) < count:
        d = sample_digits(rng, lengths[i % len(lengths)])
        i += 1
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


_HELDOUT_CACHE: dict[tuple[int, int], frozenset[str]] = {}


def in_heldout(digits: str, count: int = 1000, seed: int = 1234) -> bool:
    """True if `digits` is one of the first `count` held-out examples (training skips those)."""
    key = (count, seed)
    if key not in _HELDOUT_CACHE:
        _HELDOUT_CACHE[key] = frozenset(heldout_set(count, seed))
    return digits in _HELDOUT_CACHE[key]


def num_blocks(digits: str, block: int = 8) -> int:
    """Canvases/blocks the answer occupies: answer + one end token, rounded up to blocks."""
    return -(-(len(digits) + 1) // block)


def publish_checkpoint(tmp: Path, out: Path, tokenizer_dir: Path, summary: dict | None,
                       card: str | None) -> None:
    """Finish a checkpoint written into ``tmp`` (tokenizer, summary, card) and
    swap it into ``out``, so a reader never sees a half-written model."""
    for f in Path(tokenizer_dir).iterdir():
        shutil.copy2(f, tmp / f.name)
    if summary is not None:
        (tmp / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if card is not None:
        (tmp / "README.md").write_text(card)
    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)

"""Prompts of the parity suite: built-ins plus ``--prompts FILE``, as token ids.

Tokenized with the reference checkpoint's own tokenizer and chat template
(bundles store the ids, so comparisons need no tokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path

from dlm.runtime.platform.errors import ConfigError

BUILTIN = [
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "What is 17 * 23? Answer with the number.",
]
_LONG_TEXT = (
    "The committee met on Tuesday to review the budget, the schedule and the open questions "
    "about the new library; after a long discussion they agreed to publish the minutes. "
)


def read_prompts_file(path: str | Path) -> list[dict]:
    """One prompt per line: plain text, or JSON {"prompt": str} | {"messages": [...]} | {"ids": [...]}."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read prompts ({exc})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not valid UTF-8 (byte offset {exc.start})") from None
    out = []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{n}: invalid JSON ({exc})") from None
            if not isinstance(item, dict) or not any(k in item for k in ("prompt", "messages", "ids")):
                raise ConfigError(f"{path}:{n}: expected a 'prompt', 'messages' or 'ids' key")
            if "ids" in item and not all(isinstance(i, int) for i in item["ids"]):
                raise ConfigError(f"{path}:{n}: 'ids' must be a list of integers")
            out.append(item)
        else:
            out.append({"prompt": line})
    if not out:
        raise ConfigError(f"{path}: no prompts")
    return out


class Encoder:
    """Chat-templated encoding with the checkpoint's tokenizer."""

    def __init__(self, model_dir: str | Path, trust_remote_code: bool = False):
        from transformers import AutoTokenizer

        from .noise import expected_config_messages

        try:
            with expected_config_messages():  # a model type transformers does not know (llada2_moe)
                self.tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
        except Exception as exc:
            raise ConfigError(f"{model_dir}: cannot load the tokenizer ({exc})") from None

    def __call__(self, item: dict) -> list[int]:
        if "ids" in item:
            return [int(i) for i in item["ids"]]
        messages = item.get("messages") or [{"role": "user", "content": item["prompt"]}]
        if getattr(self.tok, "chat_template", None):
            ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        return [int(i) for i in self.tok(messages[-1]["content"])["input_ids"]]


def suite_prompts(model_dir: str | Path, extra_file: str | Path | None, *, builtin: bool = True,
                  long_prompt_tokens: int | None = None, trust_remote_code: bool = False) -> list[list[int]]:
    """Token ids of the file's prompts (first: they get the commit streams),
    the built-in prompts, then the long prompt (when ``long_prompt_tokens``:
    longer than the sliding window)."""
    enc = Encoder(model_dir, trust_remote_code)
    prompts = [enc(item) for item in read_prompts_file(extra_file)] if extra_file else []
    items = [{"prompt": p} for p in BUILTIN] if builtin else []
    prompts += [enc(item) for item in items]
    if builtin and long_prompt_tokens:
        one, two = enc({"prompt": _LONG_TEXT}), enc({"prompt": _LONG_TEXT * 2})
        per_copy = max(1, len(two) - len(one))
        k = max(1, -(-(long_prompt_tokens + 1 - len(one)) // per_copy) + 1)
        ids = enc({"prompt": _LONG_TEXT * k})
        while len(ids) <= long_prompt_tokens:
            k += 1
            ids = enc({"prompt": _LONG_TEXT * k})
        prompts.append(ids)
    if not prompts:
        raise ConfigError("no prompts: pass --prompts FILE or keep the built-in prompts")
    return prompts

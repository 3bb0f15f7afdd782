"""Detokenizing committed token ids into answer text and reasoning (the
thinking channel), for every family (runtime/generation/progress.py).

Gemma 4 style models write reasoning as ``<|channel>NAME\\n ... <channel|>``.
Channel markers are ordinary special tokens inside canvases, so the split is
done on ids (never by decoding with skip_special_tokens, which would also strip
tool-call tokens). The channel name line (``thought\\n``) is dropped from the
reasoning. Text is re-decoded from all ids of a stream on every feed and only
the new suffix is returned, so multi-byte characters split across canvases
come out whole. A tokenizer without channel markers (LLaDA-2) has only answer
text; a family whose special tokens carry no text decodes with
``skip_special_tokens``, except the ``keep`` tokens (the family's tool-call
markers), whose text stays so that calls can be parsed from the answer.
"""

from __future__ import annotations

from typing import Optional

OPEN = "<|channel>"
CLOSE = "<channel|>"
TURN = "<|turn>"


def token_id(tokenizer, token: str) -> Optional[int]:
    """The id of ``token`` when the tokenizer has it as one token, else None."""
    try:
        tid = tokenizer.convert_tokens_to_ids(token)
    except Exception:
        return None
    unk = getattr(tokenizer, "unk_token_id", None)
    return None if tid is None or tid == unk else int(tid)


class _Stream:
    def __init__(self):
        self.emitted = ""

    def delta(self, text: str, final: bool) -> str:
        if not final:
            text = text.rstrip("\ufffd")  # an incomplete multi-byte character
        if not text.startswith(self.emitted):
            return ""
        out = text[len(self.emitted):]
        self.emitted = text
        return out


class ChannelParser:
    """feed(ids) -> (text_delta, reasoning_delta); flush() returns what was held back."""

    def __init__(self, tokenizer, prompt_ids: Optional[list[int]] = None, skip_special_tokens: bool = False,
                 keep: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.keep = {tid: text for text in keep if (tid := token_id(tokenizer, text)) is not None}
        self.open_id = token_id(tokenizer, OPEN)
        self.close_id = token_id(tokenizer, CLOSE)
        self.answer: list[int] = []
        self.segments: list[list[int]] = []  # reasoning, one list per channel
        self.in_channel = False
        # A prompt that ends inside an open channel starts the output in it (the
        # channel's tokens already in the prompt complete its name line). Only
        # the model's own turn counts: a user message quoting the marker does not.
        prompt_ids = list(prompt_ids or [])
        turn_id = token_id(tokenizer, TURN)
        for i in range(len(prompt_ids) - 1, -1, -1):
            if turn_id is not None and prompt_ids[i] == turn_id:
                break
            if prompt_ids[i] in (self.open_id, self.close_id):
                self.in_channel = prompt_ids[i] == self.open_id
                if self.in_channel:
                    self.segments.append(prompt_ids[i + 1 :])
                break
        self._text, self._reasoning = _Stream(), _Stream()

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if not (self.skip_special_tokens and self.keep and any(t in self.keep for t in ids)):
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        parts, run = [], []
        for t in ids:
            if t in self.keep:
                parts.append(self.tokenizer.decode(run, skip_special_tokens=True) if run else "")
                parts.append(self.keep[t])
                run = []
            else:
                run.append(t)
        parts.append(self.tokenizer.decode(run, skip_special_tokens=True) if run else "")
        return "".join(parts)

    def _reasoning_text(self, final: bool) -> str:
        parts = []
        for seg in self.segments:
            text = self._decode(seg)
            head, newline, body = text.partition("\n")
            if newline:
                parts.append(body)
            elif final:
                parts.append(text)
            else:
                break  # channel name line not complete yet
        return "\n".join(parts)

    def feed(self, ids: list[int], final: bool = False) -> tuple[str, str]:
        for t in ids:
            if self.open_id is not None and t == self.open_id:
                self.in_channel = True
                self.segments.append([])
            elif self.close_id is not None and t == self.close_id and self.in_channel:
                self.in_channel = False
            elif self.in_channel:
                self.segments[-1].append(t)
            else:
                self.answer.append(t)
        text = self._text.delta(self._decode(self.answer), final)
        reasoning = self._reasoning.delta(self._reasoning_text(final), final)
        return text, reasoning

    def flush(self) -> tuple[str, str]:
        return self.feed([], final=True)

    @property
    def text(self) -> str:
        return self._text.emitted

    @property
    def reasoning(self) -> str:
        return self._reasoning.emitted

"""Structured results in OpenAI's response shapes (``dlm-run serve``)."""

from __future__ import annotations

from typing import Optional


def _token(tokenizer, token: int) -> str:
    return tokenizer.decode([int(token)], skip_special_tokens=False)


def chat_logprobs(records: list, tokenizer) -> dict:
    """``choices[].logprobs`` of a chat completion: {"content": [{token, logprob,
    bytes, top_logprobs}]}; top_logprobs are the most likely tokens the
    grammar allowed at that position."""
    def entry(token: int, logprob: float) -> dict:
        text = _token(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(r.token, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top]}
                        for r in records]}


def completion_logprobs(records: list, tokenizer, offset: int = 0) -> dict:
    """``choices[].logprobs`` of a legacy completion: tokens, token_logprobs,
    top_logprobs (token -> logprob) and text_offset."""
    tokens, offsets, at = [], [], offset
    for r in records:
        text = _token(tokenizer, r.token)
        tokens.append(text)
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": [r.logprob for r in records],
            "top_logprobs": [{_token(tokenizer, t): lp for t, lp in r.top} for r in records],
            "text_offset": offsets}


def logprobs_body(kind: str, records: Optional[list], tokenizer, offset: int = 0) -> Optional[dict]:
    if records is None:
        return None
    return chat_logprobs(records, tokenizer) if kind == "chat" else completion_logprobs(records, tokenizer, offset)

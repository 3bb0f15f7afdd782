"""``--trace``: a record of every denoising step of a run, for the HTML view.

A ``Trace`` is handed to the family's generation loop as its ``step_trace``
hook (``api.stream_generate(..., step_trace=trace)``); the family's summariser
(``runtime/models/<family>/trace.py``) calls ``begin`` / ``step`` / ``end`` for
every canvas (DiffusionGemma) or block (LLaDA-2), and ``follow(events)`` passes
the run's events through, recording what was committed, the answer and
reasoning text and the stats. Without a trace the loops do none of this: no
summary is built and nothing is read back from the device.

Per step and position only small values are kept (never logits): the token
shown (an id), a status code (one character), the entropy and/or the
confidence rounded to 3 significant digits; plus the step's scalars
(temperature, threshold, counts). ``to_dict`` is the JSON the HTML view embeds
(``dlm.runtime.trace.html``).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Iterable, Iterator, Optional

import numpy as np

FORMAT = "dlm-trace/1"

# Status of a position after a step: one character each in a step's "status" string.
RENOISED, ACCEPTED, KEPT, REVEALED, EDITED, FIXED = range(6)
STATUS_NAMES = ["renoised", "accepted", "kept", "revealed", "edited", "prompt"]
# LLaDA-2 says "masked" where DiffusionGemma re-draws noise.
MASKED = RENOISED
# LLaDA2.2's edit tokens, written at a position: DELETE drops it, SPLIT inserts a mask before it.
DELETED, INSERTED = 6, 7
EDIT_TOKEN_NAMES = ["deleted", "inserted"]

# Why a canvas/block stopped denoising (``end``); the view words them.
STOP_REASONS = {
    "stable-and-confident": "stable and confident (argmax unchanged, mean entropy under the threshold)",
    "all-revealed": "all positions revealed",
    "step-budget": "step budget used up",
    "eos": "a stop token (EOS) before the first mask",
    "edits-settled": "all revealed and no more edits",
    "post-step-budget": "all revealed, editing passes used up (max_post_steps)",
    "block-settled": "settled: an iteration changed nothing and no mask was left",
    "post-fill-budget": "no mask left and the editing iterations after the last fill used up (max_post_steps)",
    "iteration-cap": "iteration cap reached (max_steps_per_block); the last iteration filled every mask",
    "cancelled": "cancelled",
}


def rounded(values, digits: int = 3) -> list[float]:
    """Floats to ``digits`` significant digits (compact JSON; NaN/inf become None)."""
    out = []
    for v in np.asarray(values, dtype=np.float64).reshape(-1).tolist():
        out.append(float(f"{v:.{digits}g}") if math.isfinite(v) else None)
    return out


def status_string(codes) -> str:
    return "".join(str(int(c)) for c in np.asarray(codes).reshape(-1))


def jsonable(value):
    """Settings (dataclasses, dtypes, tuples) as plain JSON values; callables and hooks dropped."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            if callable(v) and not isinstance(v, type):
                continue
            out[f.name] = jsonable(v)
        return out
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items() if not callable(v)}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, np.generic):
        return value.item()
    return str(value).replace("mlx.core.", "")


class Trace:
    """Every canvas/block of one run, step by step (see the module docstring)."""

    def __init__(self, unit: str = "canvas", family: str = "", status_names: Optional[list[str]] = None):
        self.unit = unit
        self.family = family
        self.status_names = list(status_names or STATUS_NAMES)
        self.canvases: list[dict] = []
        self.meta: dict = {}
        self.answer, self.reasoning = "", ""
        self.finish_reason: Optional[str] = None
        self.stats: Optional[dict] = None
        self.token_ids: list[int] = []
        # Ids the view names itself instead of the tokenizer's text (LLaDA2.2's DELETE/SPLIT).
        self.labels: dict[int, str] = {}
        self._committed = 0

    # -- what the families' summarisers call ----------------------------------

    def begin(self, index: int, length: int, **info) -> dict:
        """A new canvas/block of ``length`` positions; ``info``: JSON-able extras
        (its first sequence position, the output window, the rule's thresholds)."""
        canvas = dict(index=int(index), length=int(length), steps=0, stop_reason=None,
                      committed=None, records=[], **info)
        self.canvases.append(canvas)
        return canvas

    def step(self, pred, status, *, held=None, entropy=None, confidence=None, after=None, replaced=None,
             **scalars) -> None:
        """One step of the current canvas: ``pred`` the token id per position,
        ``status`` a code per position (``STATUS_NAMES``), ``held`` the positions
        whose held token differs from ``pred`` as [[position, token], ...],
        ``entropy`` / ``confidence`` per position (float), ``after`` the block
        once the step's edits shifted it (LLaDA2.2: ids per position),
        ``replaced`` the token a written position held before the step as
        [[position, token], ...], ``scalars`` the step's own numbers
        (temperature, threshold, ...)."""
        canvas = self.canvases[-1]
        record = dict(pred=[int(t) for t in np.asarray(pred).reshape(-1)], status=status_string(status))
        if held:
            record["held"] = [[int(p), int(t)] for p, t in held]
        if after is not None:
            record["after"] = [int(t) for t in np.asarray(after).reshape(-1)]
        if replaced:
            record["replaced"] = [[int(p), int(t)] for p, t in replaced]
        if entropy is not None:
            record["entropy"] = rounded(entropy)
        if confidence is not None:
            record["confidence"] = rounded(confidence)
        for key, value in scalars.items():
            record[key] = rounded([value])[0] if isinstance(value, float) else jsonable(value)
        canvas["records"].append(record)
        canvas["steps"] = len(canvas["records"])

    def end(self, reason: str, **info) -> None:
        """The current canvas stopped denoising (``reason``: a ``STOP_REASONS`` key)."""
        if reason not in STOP_REASONS:
            raise ValueError(f"unknown stop reason {reason!r}")
        canvas = self.canvases[-1]
        canvas["stop_reason"] = reason
        canvas.update(info)

    # -- the run around it ------------------------------------------------------

    def follow(self, events: Iterable) -> Iterator:
        """Pass the run's events through, recording commits, text and the final stats."""
        answer, reasoning = [], []
        for event in events:
            answer.append(event.text)
            reasoning.append(event.reasoning)
            if event.done:
                self.finish_reason = event.finish_reason
                self.stats = jsonable(event.stats.to_dict()) if event.stats is not None else None
                self._mark_end(event.finish_reason)
            else:
                self._commit(list(event.token_ids))
            self.answer, self.reasoning = "".join(answer), "".join(reasoning)
            yield event

    def _commit(self, tokens: list[int]) -> None:
        self.token_ids.extend(tokens)
        if self._committed < len(self.canvases):
            self.canvases[self._committed]["committed"] = tokens
        self._committed += 1

    def _mark_end(self, finish_reason: Optional[str]) -> None:
        """The last committed canvas holds the stop token that ended the output ("stop")."""
        if finish_reason == "stop" and 0 < self._committed <= len(self.canvases):
            self.canvases[self._committed - 1]["ends_output"] = "eos"
        elif finish_reason == "length" and 0 < self._committed <= len(self.canvases):
            self.canvases[self._committed - 1]["ends_output"] = "budget"

    def vocabulary(self, tokenizer) -> dict[str, str]:
        """Decoded text of every token id the trace shows."""
        ids: set[int] = set(self.token_ids)
        for canvas in self.canvases:
            for r in canvas["records"]:
                ids.update(r["pred"])
                ids.update(r.get("after", []))
                ids.update(t for _, t in r.get("held", []) + r.get("replaced", []))
            ids.update(canvas.get("committed") or [])
        vocab = decode_each(tokenizer, ids)
        vocab.update({str(t): label for t, label in self.labels.items() if t in ids})
        return vocab

    def to_dict(self, tokenizer=None, **meta) -> dict:
        """The JSON the HTML view embeds; ``meta``: title, settings, profile lines, prompt, ..."""
        out = dict(format=FORMAT, unit=self.unit, family=self.family, status_names=self.status_names,
                   stop_reasons=STOP_REASONS, answer=self.answer, reasoning=self.reasoning,
                   finish_reason=self.finish_reason, stats=self.stats, token_ids=self.token_ids,
                   canvases=self.canvases)
        out.update(jsonable({**self.meta, **meta}))
        out["vocab"] = self.vocabulary(tokenizer) if tokenizer is not None else {}
        return out


def decode_each(tokenizer, ids: Iterable[int]) -> dict[str, str]:
    """{id: text} decoding each id alone (special tokens kept: the view shows them)."""
    out = {}
    for t in sorted(set(int(i) for i in ids)):
        try:
            out[str(t)] = tokenizer.decode([t], skip_special_tokens=False)
        except Exception:  # an id the tokenizer cannot decode: shown as its number
            out[str(t)] = f"#{t}"
    return out


def for_run(loaded) -> Trace:
    """An empty trace for a run of ``loaded`` (its family and unit: canvas or block)."""
    return Trace(loaded.family.generation.Session.block_name, loaded.family.title)


def run_data(trace: Trace, loaded, options: dict, prompt_ids: list[int], profile: list[str],
             **extra) -> dict:
    """The page data of a ``dlm-run generate`` run: the trace plus the run's
    settings (the options given and what they resolved to), the profile lines
    and the prompt. The resolved settings leave out what no option sets: the
    hooks the loops take from code (tests, ``--trace``, dlm-verify) and
    internal switches."""
    internal = {"uniforms", "on_step", "trace", "step_trace", "sc_dtype", "kv_cache", "suppress_mask",
                "early_stop", "stop_on_role_end"}

    def public(value):
        if isinstance(value, dict):
            return {k: public(v) for k, v in value.items() if k not in internal}
        return value

    resolved = loaded.settings(dict(options))
    tok = loaded.tokenizer
    prompt = {"ids": list(prompt_ids)}
    if tok is not None:
        prompt["text"] = tok.decode(list(prompt_ids), skip_special_tokens=False)
    settings = {"model": loaded.source or str(loaded.path), "family": loaded.family.title,
                "compute_dtype": loaded.compute_dtype, "options": dict(options),
                "resolved": public(jsonable(resolved)), **extra}
    title = f"dlm denoising trace: {Path(str(loaded.source or loaded.path)).name}"
    return trace.to_dict(tok, title=title, model=settings["model"], settings=settings, profile=list(profile),
                         prompt=prompt)

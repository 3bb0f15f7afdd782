"""``dlm-verify --parity ... --trace-dir DIR``: a side-by-side denoising view
of every commit stream that diverges, the PyTorch reference beside MLX.

The page is the ``dlm-run generate --trace`` view (dlm.runtime.trace.html)
drawn twice with one step slider per canvas/block: the argmax of every step
at every position, coloured by its confidence (the top-1 probability among
the top-K logits the commit stream keeps), positions whose argmax changed at
that step outlined, positions where the two frameworks differ underlined, and
the first divergence (metrics.first_divergence) outlined in red, with the
slider starting at its step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from dlm.runtime.trace import html as trace_html
from dlm.runtime.platform.errors import DlmError
from dlm.runtime.trace import Trace

from . import metrics as M
from .protocol import CommitStream, TOPK

STATUS = ["unchanged", "changed"]  # the argmax at a position vs the step before


def _top1_share(topk_logits: np.ndarray) -> np.ndarray:
    """softmax over the kept top-K logits, its first (best) entry: [positions]."""
    x = np.asarray(topk_logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return (e[..., 0] / e.sum(axis=-1)).astype(np.float32)


def stream_trace(stream: CommitStream, unit: str, family: str, tokenizer=None) -> dict:
    """The trace page data of one commit stream (either framework)."""
    trace = Trace(unit, family, STATUS)
    for i, block in enumerate(stream.blocks):
        positions = int(block.step_argmax.shape[1]) if block.steps else len(block.tokens)
        # LLaDA-2 blocks start inside the prompt: where the output starts is not in the stream.
        trace.begin(i, positions, output_from=0 if unit == "canvas" else None)
        previous = None
        for s in range(block.steps):
            pred = block.step_argmax[s]
            changed = np.ones_like(pred, bool) if previous is None else pred != previous
            trace.step(pred, changed.astype(np.int8), confidence=_top1_share(block.topk_logits[s]))
            previous = pred
        trace.canvases[-1]["committed"] = list(block.tokens)
    trace.token_ids = stream.tokens
    trace.finish_reason = stream.finish_reason
    if tokenizer is not None:
        trace.answer = tokenizer.decode(stream.tokens, skip_special_tokens=False)
    prompt = {"ids": list(stream.prompt_ids)}
    if tokenizer is not None:
        prompt["text"] = tokenizer.decode(list(stream.prompt_ids), skip_special_tokens=False)
    return trace.to_dict(tokenizer, prompt=prompt)


def _tokenizer(mlx_dir: Path):
    from dlm.runtime.loader import load_tokenizer

    try:
        return load_tokenizer(mlx_dir)
    except DlmError:
        return None  # the page shows token ids instead of text


def write_divergences(trace_dir, mlx_dir: Path, family, reference: Optional[list[CommitStream]],
                      mlx: list[CommitStream], reference_label: str = "PyTorch reference") -> list[str]:
    """One page per prompt whose commit streams diverge, in ``trace_dir``
    (created); returns report notes naming them, or the one note that says
    why no page was written (nothing diverged, or no commit stream was compared)."""
    if not reference:
        return [f"--trace-dir {trace_dir}: no page written: no commit stream was compared with a reference"]
    pages = []
    tokenizer, unit = None, family.generation.Session.block_name  # "canvas" | "block"
    for i, (ref, out) in enumerate(zip(reference, mlx)):
        div = M.first_divergence(ref, out)
        if div is None:
            continue
        if tokenizer is None:
            tokenizer = _tokenizer(Path(mlx_dir)) or False
        tok = tokenizer or None
        data = trace_html.pair(
            stream_trace(ref, unit, family.title, tok), stream_trace(out, unit, family.title, tok),
            (reference_label, "MLX"), div.to_dict(),
            title=f"dlm-verify commit stream, prompt {i}: {Path(mlx_dir).name}",
            subtitle=f"{family.title} \u00b7 {mlx_dir} \u00b7 first divergence: {div.describe()}",
            settings={"model": str(mlx_dir), "prompt": i, "reference": reference_label,
                      "colour": f"confidence: top-1 probability among the top-{TOPK} logits kept per step"},
        )
        folder = Path(trace_dir)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DlmError(f"--trace-dir {folder}: {exc.strerror or exc}") from None
        path = trace_html.write(folder / f"commit-stream-prompt{i}.html", data)
        pages.append(f"commit stream of prompt {i} diverges: side-by-side trace in {path}")
    if not pages:
        n = min(len(reference), len(mlx))
        which = "the commit stream agrees" if n == 1 else f"all {n} commit streams agree"
        return [f"--trace-dir {trace_dir}: no page written: {which} with the {reference_label} step for step"]
    return pages

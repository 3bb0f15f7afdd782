"""Shared helpers for the dlm-verify tests (not a test module)."""

from __future__ import annotations

from pathlib import Path

# Drift thresholds are meant for real checkpoints; a random tiny model is
# chaotic (near-uniform logits, routing flips), so they are informational here.
TINY_DRIFT = {"drift": {"kl_mean": None, "top1": None, "commit_match": None, "steps_ratio": None}}
FAST = dict(canvases=2, steps=8, stream_prompts=1, progress=False)


def convert(src: Path, out: Path, **kw) -> Path:
    from dlm.convert.pipeline import ConvertOptions, convert as run

    run(ConvertOptions(source=str(src), output=str(out), progress=False, **kw), echo=lambda s: None)
    return out


def options(**kw):
    from dlm.verify.suite import Options

    return Options(**{**FAST, "thresholds": TINY_DRIFT, **kw})


def record_bundle(reference: Path, out: Path, **kw) -> Path:
    from dlm.verify import bundle as B
    from dlm.verify.suite import Options, record

    data = record(str(reference), Options(reference=str(reference), **{**FAST, **kw}))
    return B.save(data, out)

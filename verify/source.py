"""Where the PyTorch reference comes from: a directory or a Hub repo id.

Default: the source recorded by the converter in the converted config.json
(``"dlm": {"source": ..., "revision": ...}``). Repo ids are resolved through
``dlm.convert.source`` when it provides a resolver, else through
``huggingface_hub.snapshot_download`` (cache only when HF_HUB_OFFLINE is set).
"""

from __future__ import annotations

import os
from pathlib import Path

from dlm.runtime.errors import DlmError

# What the reference needs from a repo: config, weights, tokenizer, templates.
_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]


def recorded_source(config: dict) -> tuple[str | None, str | None]:
    meta = config.get("dlm") or {}
    # The snapshot commit pins the exact weights; the asked-for revision is a fallback.
    return meta.get("source"), meta.get("commit") or meta.get("revision")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_reference(source: str, revision: str | None = None) -> Path:
    """A local directory holding the reference checkpoint."""
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise DlmError(f"reference {path}: no config.json in this directory")
        return path
    if path.exists():
        raise DlmError(f"reference {source}: not a directory")
    if source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise DlmError(f"reference {source!r}: no such directory, and not a Hub repo id (org/name)")
    resolver = _convert_resolver()
    if resolver is not None:
        try:
            return Path(resolver(source, revision))
        except DlmError:
            raise
        except Exception as exc:  # the converter's resolver reports its own way
            raise DlmError(f"cannot fetch the reference {source!r}: {exc}") from None
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            source, revision=revision, allow_patterns=_PATTERNS, local_files_only=_offline()
        )
    except Exception as exc:
        hint = " (HF_HUB_OFFLINE is set: only the local cache is searched)" if _offline() else ""
        raise DlmError(f"cannot fetch the reference {source!r}{hint}: {exc}") from None
    return Path(local)


def _convert_resolver():
    """dlm.convert.source's resolver, if the converter provides one."""
    try:
        from dlm.convert import source as convert_source
    except ImportError:
        return None
    for name in ("resolve_source", "resolve", "resolve_checkpoint", "local_checkpoint"):
        fn = getattr(convert_source, name, None)
        if callable(fn):
            return _adapt(fn)
    return None


def _adapt(fn):
    def call(source, revision):
        result = fn(source, revision=revision) if revision else fn(source)
        # A resolver may return a path or an object carrying one.
        for attr in ("path", "local_dir", "directory"):
            if hasattr(result, attr):
                return getattr(result, attr)
        return result

    return call

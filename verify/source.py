"""Where the PyTorch reference comes from: a directory or a Hub repo id.

Default: the source recorded by the converter in the converted config.json
(``"dlm": {"source": ..., "revision": ...}``). Repo ids are resolved by the
converter's ``dlm.runtime.hub.resolve_source`` (the same files, cache and
HF_HUB_OFFLINE rules as dlm-convert).
"""

from __future__ import annotations

from pathlib import Path

from dlm.runtime.platform.errors import DlmError

def recorded_source(config: dict) -> tuple[str | None, str | None]:
    meta = config.get("dlm") or {}
    # The snapshot commit pins the exact weights; the asked-for revision is a fallback.
    return meta.get("source"), meta.get("commit") or meta.get("revision")


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
    from dlm.runtime.hub import offline, resolve_source

    try:
        return resolve_source(source, revision=revision).path
    except DlmError:
        raise
    except Exception as exc:  # network / cache errors the resolver did not wrap
        hint = " (HF_HUB_OFFLINE is set: only the local cache is searched)" if offline() else ""
        raise DlmError(f"cannot fetch the reference {source!r}{hint}: {exc}") from None

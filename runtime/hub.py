"""Resolve dlm-convert's SOURCE: a local checkpoint directory or a Hugging Face Hub repo id.

Hub sources go through ``huggingface_hub.snapshot_download`` into the standard
cache (HF_HUB_CACHE / HF_HOME), with its progress bars, honouring --revision
and HF_HUB_OFFLINE.  Only what the converter needs is fetched: first the small
metadata files, then exactly the shards the index names.  Pickle weights
(.bin/.pt) are never downloaded.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .platform.errors import DlmError
from .checkpoint import INDEX_NAME

# Files copied next to the converted weights (vision ones only when the vision tower is kept).
SIDECAR_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
    "chat_template.jinja", "chat_template.json",
)
VISION_SIDECARS = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")
# Small files fetched before the weights: config, index, the sidecars and the card.
METADATA_PATTERNS = ["config.json", INDEX_NAME, *SIDECAR_FILES, *VISION_SIDECARS, "README.md"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_TRUE = {"1", "true", "yes", "on"}


class SourceError(DlmError):
    """SOURCE cannot be found or fetched."""


@dataclass(frozen=True)
class ResolvedSource:
    path: Path  # local directory holding the checkpoint
    repo_id: Optional[str]  # None for a local directory
    revision: Optional[str]  # what the user asked for (None: the default branch)
    commit: Optional[str]  # the snapshot's commit hash for Hub sources

    @property
    def display(self) -> str:
        return self.repo_id or str(self.path)


def source_name(source: str) -> str:
    """Base name of SOURCE (repo name or directory name), known before any download."""
    return Path(source.rstrip("/")).expanduser().name or "model"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def resolve_source(
    source: str,
    revision: Optional[str] = None,
    cache_dir: Optional[str | Path] = None,
    progress: bool = True,
) -> ResolvedSource:
    local = Path(source).expanduser()
    if local.exists():
        if not local.is_dir():
            raise SourceError(f"{source} is a file; pass the checkpoint directory that holds config.json")
        if revision is not None:
            raise SourceError("--revision applies to Hub repo ids, not to a local directory")
        return ResolvedSource(local.resolve(), None, None, None)
    if source.startswith((".", "/", "~")) or not _REPO_ID.match(source):
        raise SourceError(f"{source} is not a directory and not a Hugging Face Hub repo id (org/name)")
    return _download(source, revision, cache_dir, progress)


def _download(repo_id: str, revision: Optional[str], cache_dir, progress: bool) -> ResolvedSource:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    # Read at call time (the library reads these at import time).
    cache_dir = cache_dir or os.environ.get("HF_HUB_CACHE") or None
    kwargs = dict(revision=revision, cache_dir=cache_dir, local_files_only=offline())
    if not progress:
        disable_progress_bars()
    try:
        snap = Path(_snapshot(snapshot_download, repo_id, kwargs, METADATA_PATTERNS))
        if not (snap / "config.json").is_file():
            raise SourceError(f"{repo_id} has no config.json")
        index = snap / INDEX_NAME
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError) as exc:
                raise SourceError(f"{repo_id}: {INDEX_NAME} is not a valid index: {exc}") from exc
        else:
            shards = ["model.safetensors"]
        snap = Path(_snapshot(snapshot_download, repo_id, kwargs, shards))
        if not index.is_file() and not (snap / "model.safetensors").is_file():
            # No index and no model.safetensors: take whatever safetensors the repo has.
            snap = Path(_snapshot(snapshot_download, repo_id, kwargs, ["*.safetensors"]))
    finally:
        if not progress:
            enable_progress_bars()
    return ResolvedSource(snap, repo_id, revision, snap.name)


def _snapshot(snapshot_download, repo_id: str, kwargs: dict, patterns: list[str]) -> str:
    from huggingface_hub import errors

    where = f"{repo_id}" + (f" at revision {kwargs['revision']}" if kwargs.get("revision") else "")
    try:
        return snapshot_download(repo_id, allow_patterns=patterns, **kwargs)
    except errors.RevisionNotFoundError as exc:
        raise SourceError(f"revision {kwargs.get('revision')!r} not found in {repo_id}") from exc
    except errors.GatedRepoError as exc:
        raise SourceError(
            f"{repo_id} is gated: accept its license on huggingface.co and log in (hf auth login)"
        ) from exc
    except errors.RepositoryNotFoundError as exc:
        raise SourceError(
            f"{repo_id} not found on the Hub (or it is private and you are not logged in)"
        ) from exc
    except errors.LocalEntryNotFoundError as exc:
        if kwargs.get("local_files_only"):
            raise SourceError(
                f"{where} is not in the Hugging Face cache and HF_HUB_OFFLINE is set; "
                "download it first or unset HF_HUB_OFFLINE"
            ) from exc
        raise SourceError(f"cannot download {where}: {exc}") from exc
    except errors.HfHubHTTPError as exc:
        raise SourceError(f"cannot download {where}: {exc}") from exc
    except OSError as exc:
        raise SourceError(f"cannot download {where}: {exc}") from exc

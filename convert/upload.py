"""Publishing to the Hugging Face Hub: ``dlm-convert --upload-repo ORG/NAME``
uploads the converted folder, ``dlm-verify --update-card --upload-repo``
uploads the updated model card (and the JSON report when written), as
mlx-lm and mlx-vlm do. The token comes from huggingface_hub's usual places
(``HF_TOKEN``, ``hf auth login``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Optional

from ..runtime.platform.errors import DlmError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+\Z")


class UploadError(DlmError):
    """The Hub refused or could not be reached; the local output is complete."""


def check_repo_id(repo_id: Optional[str]) -> str:
    """``repo_id`` if the Hub would take it as ORG/NAME: huggingface_hub's own
    validator (characters, no leading or trailing '-' or '.', no '--' or '..',
    no '.git' ending, 96 characters), and exactly one '/' (the validator also
    takes a bare NAME). Checked before any conversion work, so a typo costs
    nothing; an empty value is an error, never a silently skipped upload."""
    text = "" if repo_id is None else str(repo_id)
    why = None
    if not text.strip():
        why = "it is empty"
    elif not _REPO_ID.match(text) or text.count("/") != 1 or any(c.isspace() or not c.isprintable() for c in text):
        why = "expected ORG/NAME of letters, digits, '-', '_' and '.'"
    else:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(text)
        except HFValidationError as exc:
            why = str(exc).split(":")[0].strip().rstrip(".") or "refused by huggingface_hub"
        else:
            if "--" in text or ".." in text:  # the validator's own rule, kept if it ever drops it
                why = "cannot have '--' or '..'"
    if why:
        raise UploadError(f"--upload-repo {text!r} is not a Hub repo id ({why})")
    return text


def upload(folder: Path, repo_id: str, files: Optional[list[str]] = None, *, private: bool = False,
           message: str = "Upload with dlm", echo: Callable[[str], None] = print, api=None) -> str:
    """Create ``repo_id`` if needed and upload ``folder`` (or only ``files`` of it).
    Returns the repo URL. ``api`` is an ``huggingface_hub.HfApi`` (tests pass a stand-in)."""
    check_repo_id(repo_id)
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    folder = Path(folder)
    try:
        url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        if files is None:
            api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                              commit_message=message)
        else:
            for name in files:
                api.upload_file(path_or_fileobj=str(folder / name), path_in_repo=name, repo_id=repo_id,
                                repo_type="model", commit_message=message)
    except Exception as exc:  # auth, network, permissions: the Hub library's own errors
        raise UploadError(f"uploading {folder} to {repo_id} failed ({type(exc).__name__}: {exc}); "
                          "the local files are complete, retry the upload later") from None
    echo(f"Uploaded {folder if files is None else ', '.join(files)} to {url}")
    return str(url)

"""The ``--trace`` HTML file: one self-contained page (inline CSS and script,
no external resource), its data embedded as JSON.

``render(data)`` returns the page for a trace (``dlm.runtime.trace.Trace
.to_dict``) or a side-by-side pair (``pair(...)``, dlm-verify's divergence
view); ``write`` puts it in a file; ``read(path)`` gets the embedded data back
(tests, tools). The JSON sits in ``<script type="application/json"
id="dlm-trace">`` with ``<``, ``>`` and ``&`` escaped, so no token text can
close the block or inject markup.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Optional

from ..platform.errors import DlmError
from .assets import CSS, JS

PAIR_FORMAT = "dlm-trace-pair/1"
_BLOCK = re.compile(r'<script type="application/json" id="dlm-trace">(.*?)</script>', re.S)


def embed(data: dict) -> str:
    """JSON safe inside a <script> element (json.loads reads it back unchanged)."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def render(data: dict) -> str:
    title = html.escape(str(data.get("title") or "dlm denoising trace"))
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<title>{title}</title><style>{CSS}</style></head>\n<body>"
        "<noscript>This trace is drawn by its inline script; the data is in the JSON block below.</noscript>"
        f"<div id=\"app\"></div>\n<script type=\"application/json\" id=\"dlm-trace\">{embed(data)}</script>\n"
        f"<script>{JS}</script>\n</body></html>\n"
    )


def pair(left: dict, right: dict, labels: tuple[str, str], divergence: Optional[dict] = None, **meta) -> dict:
    """The data of a side-by-side page: two traces of the same run (reference, MLX)."""
    return dict(format=PAIR_FORMAT, sides=[left, right], labels=list(labels), divergence=divergence, **meta)


def check_path(path) -> Path:
    """A --trace output path whose folder exists (checked before a slow run)."""
    path = Path(path)
    if path.is_dir():
        raise DlmError(f"--trace {path}: is a directory (give a file name, e.g. trace.html)")
    if not path.parent.is_dir():
        raise DlmError(f"--trace {path}: folder {path.parent} does not exist")
    return path


def write(path, data: dict) -> Path:
    path = Path(path)
    try:
        path.write_text(render(data), encoding="utf-8")
    except OSError as exc:
        raise DlmError(f"cannot write the trace to {path}: {exc.strerror or exc}") from None
    return path


def read(path) -> dict:
    """The data embedded in a trace page."""
    text = Path(path).read_text(encoding="utf-8")
    m = _BLOCK.search(text)
    if not m:
        raise DlmError(f"{path}: no dlm trace data in this file")
    return json.loads(m.group(1))

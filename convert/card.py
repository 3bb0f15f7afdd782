"""The README.md model card: rendered by dlm-convert, one section filled later by dlm-verify."""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Optional

import yaml

VERIFY_BEGIN = "<!-- dlm-verify:begin -->"
VERIFY_END = "<!-- dlm-verify:end -->"
DEFAULT_TEMPLATE = "default.md"


@dataclass
class TableRow:
    modules: str
    bits: str
    group_size: str
    mode: str
    count: int = 0
    parameters: int = 0
    patterns: list[str] = field(default_factory=list)


def module_pattern(path: str) -> str:
    """``model.decoder.layers.12.self_attn.q_proj`` -> ``model.decoder.layers.*.self_attn.q_proj``."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", path)


def recipe_table(decisions, params_by_name: dict[str, int], float_label: str) -> list[dict]:
    """One row per (bits, group, mode): the module patterns it covers, tensor and parameter counts."""
    rows: dict[tuple, TableRow] = {}
    for d in decisions:
        if d.spec is not None:
            key = (0, -d.spec.bits, d.spec.group_size, d.spec.mode)
            row = rows.setdefault(key, TableRow("", str(d.spec.bits), str(d.spec.group_size), d.spec.mode))
        elif d.fallback:
            row = rows.setdefault((1,), TableRow("", float_label, "-", "float (group-size fallback)"))
        else:
            row = rows.setdefault((2,), TableRow("", float_label, "-", "float"))
        row.count += 1
        row.parameters += params_by_name[d.name]
        pattern = module_pattern(d.path if d.path is not None else d.name)
        if pattern not in row.patterns:
            row.patterns.append(pattern)
    out = []
    for key in sorted(rows):
        row = rows[key]
        shown = row.patterns if len(row.patterns) <= 10 else row.patterns[:10] + [f"... {len(row.patterns) - 10} more"]
        row.modules = "<br>".join(f"`{p}`" if not p.startswith("...") else p for p in shown)
        out.append({**row.__dict__, "parameters": f"{row.parameters:,}"})
    return out


def render_card(context: dict, template: Optional[str] = None) -> str:
    """Render the model card; ``template`` names a file in dlm.model_cards (family.md, else default.md)."""
    import jinja2

    files = resources.files("dlm.model_cards")
    name = template if template and files.joinpath(template).is_file() else DEFAULT_TEMPLATE
    # A family template extends default.md and overrides only its blocks.
    loader = jinja2.FunctionLoader(lambda n: files.joinpath(n).read_text())
    env = jinja2.Environment(loader=loader, keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    text = env.get_template(name).render(**context)
    return re.sub(r"\n{3,}", "\n\n", text)


def front_matter(base_model: Optional[str], tags: list[str], pipeline_tag: str,
                 license: Optional[str] = None) -> str:
    meta: dict = {"library_name": "mlx"}
    if license:
        meta["license"] = license
    if base_model:
        meta["base_model"] = base_model
    meta["pipeline_tag"] = pipeline_tag
    meta["tags"] = tags
    return yaml.safe_dump(meta, sort_keys=False)


def source_license(readme: Path) -> Optional[str]:
    """The ``license`` of a source model card's front matter, if it has one."""
    try:
        text = readme.read_text()
    except OSError:
        return None
    m = re.match(r"---\n(.*?)\n---", text, re.S)
    if not m:
        return None
    try:
        meta = yaml.safe_load(m.group(1)) or {}
    except yaml.YAMLError:
        return None
    value = meta.get("license") if isinstance(meta, dict) else None
    return str(value) if value else None


def update_card_section(readme_path: str | os.PathLike, markdown: str) -> None:
    """Replace the dlm-verify section of a model card with ``markdown``.

    The section is the text between ``<!-- dlm-verify:begin -->`` and
    ``<!-- dlm-verify:end -->``; a card without the markers gets a
    "## Parity" section appended.  The file is replaced atomically.
    """
    path = Path(readme_path)
    text = path.read_text() if path.exists() else ""
    body = f"{VERIFY_BEGIN}\n{markdown.strip()}\n{VERIFY_END}"
    begin, end = text.find(VERIFY_BEGIN), text.find(VERIFY_END)
    if begin != -1 and end > begin:
        text = text[:begin] + body + text[end + len(VERIFY_END):]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + "## Parity\n\n" + body + "\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

"""The documentation stays short enough to read and names only real things.

README.md and docs/*.md: their length limits, every relative link (and its
#anchor), every repository path and ``python -m scripts.…`` module they name in
backticks, every flag of the three commands, and every DLM_* variable the code
reads. No model is loaded; the CLIs are imported only to list their flags.
"""

from __future__ import annotations

import importlib
import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
PAGE_IDS = [str(p.relative_to(ROOT)) for p in PAGES]

README_MAX_LINES = 250
BENCHMARKS_MAX_LINES = 200

# A backticked word starting with one of these is a path into the repository.
PATH_PREFIXES = ("runtime/", "convert/", "quantize/", "verify/", "tests/", "scripts/", "demo/", "docs/",
                 "model_cards/")
# Placeholders and globs (``tests/<family>/``, ``scripts/bench/*.py``) name no one file.
PLACEHOLDER = re.compile(r"[*?\[\]<>{}|…]|\.\.\.")
MODULE = re.compile(r"^scripts(?:\.[A-Za-z_]\w*)+$")
FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
DATE = re.compile(r"\b(19|20)\d\d-\d\d-\d\d\b")


def _split(text: str) -> tuple[list[str], list[str]]:
    """(prose lines, fenced code lines) of a markdown page."""
    prose, code, fenced = [], [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        (code if fenced else prose).append(line)
    return prose, code


@lru_cache(maxsize=None)
def _page(path: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    prose, code = _split(path.read_text(encoding="utf-8"))
    return tuple(prose), tuple(code)


@lru_cache(maxsize=None)
def _paragraphs(path: Path) -> tuple[str, ...]:
    """The prose as paragraphs, each joined into one line (a link or code span may wrap)."""
    joined = "\n".join(_page(path)[0])
    return tuple(" ".join(line.strip() for line in block.splitlines())
                 for block in re.split(r"\n\s*\n", joined) if block.strip())


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\([^)]*\)", r"\1", heading)
    text = text.strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


@lru_cache(maxsize=None)
def _anchors(path: Path) -> frozenset[str]:
    prose, _ = _page(path)
    seen: dict[str, int] = {}
    anchors = set()
    for line in prose:
        anchors.update(HTML_ANCHOR.findall(line))
        m = HEADING.match(line)
        if not m:
            continue
        slug = _slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(anchors)


def _code_texts(path: Path) -> list[str]:
    """Every inline code span's text, and every fenced code line, of a page."""
    spans = [m.group(2) for block in _paragraphs(path) for m in CODE_SPAN.finditer(block)]
    return spans + list(_page(path)[1])


def _named_paths(text: str) -> list[str]:
    """Repository paths and ``scripts.…`` modules named in one piece of code, as paths to check."""
    named = []
    for raw in text.split():
        token = raw.strip("(\"'").rstrip(")\"',;:.")
        if MODULE.match(token):  # python -m scripts.bench.x, from scripts.bench.x import ...
            named.append("module:" + token)
            continue
        if not token.startswith(PATH_PREFIXES) or PLACEHOLDER.search(token):
            continue
        named.append(token)
    return named


def _resolve(named: str) -> tuple[bool, str]:
    """Whether a named path (or module) exists, and what was looked for."""
    if named.startswith("module:"):
        parts = named[len("module:"):].split(".")
        base = ROOT.joinpath(*parts)
        return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file(), named
    path, _, name = named.partition("::")
    path = re.sub(r":\d+(?:-\d+)?$", "", path)
    target = ROOT / path
    if not target.exists():
        return False, path
    if name:  # tests/test_x.py::test_name: the test is defined there
        test = name.split("[")[0]
        if not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(test)}\b", target.read_text(),
                         re.MULTILINE):
            return False, named
    return True, named


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def test_benchmarks_page_is_short():
    lines = (DOCS / "benchmarks.md").read_text(encoding="utf-8").count("\n")
    assert lines <= BENCHMARKS_MAX_LINES, f"docs/benchmarks.md has {lines} lines (at most {BENCHMARKS_MAX_LINES})"


def test_every_docs_page_is_linked_from_the_readme():
    targets = {(README.parent / m.group(1).split("#")[0]).resolve()
               for block in _paragraphs(README) for m in LINK.finditer(block)}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in targets]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_no_dates_as_headings():
    dated = [f"{p.relative_to(ROOT)}: {line}" for p in PAGES for line in _page(p)[0]
             if HEADING.match(line) and DATE.search(line)]
    assert not dated, "headings that are dates (history belongs in git):\n" + "\n".join(dated)


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_relative_links_resolve(page):
    broken = []
    for block in _paragraphs(page):
        for m in LINK.finditer(block):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            path = (page.parent / file_part).resolve() if file_part else page
            if not path.exists():
                broken.append(f"{target}: no such file")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{target}: no heading with anchor #{anchor} in {path.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_named_repository_paths_exist(page):
    missing = sorted({what for text in _code_texts(page) for named in _named_paths(text)
                      for ok, what in [_resolve(named)] if not ok})
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist:\n" + "\n".join(missing)


def _console_scripts() -> dict[str, str]:
    """``[project.scripts]`` of pyproject.toml: command -> "module:attr"."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    try:
        import tomllib
    except ImportError:  # Python 3.10
        section = re.search(r"^\[project\.scripts\]\n(.*?)(?=^\[|\Z)", text, re.MULTILINE | re.DOTALL)
        assert section, "pyproject.toml has no [project.scripts]"
        return dict(re.findall(r'^([\w-]+)\s*=\s*"([^"]+)"', section.group(1), re.MULTILINE))
    return dict(tomllib.loads(text)["project"]["scripts"])


def _flags(command, path: str):
    import click

    for param in command.params:
        if isinstance(param, click.Option):
            for opt in [*param.opts, *param.secondary_opts]:
                if opt.startswith("--") and opt not in ("--help", "--version"):
                    yield path, opt
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from _flags(sub, f"{path} {name}")


def test_every_cli_flag_is_documented():
    scripts = _console_scripts()
    assert {"dlm-convert", "dlm-verify", "dlm-run"} <= set(scripts)
    text = "\n".join(p.read_text(encoding="utf-8") for p in PAGES)
    undocumented = []
    for name, target in sorted(scripts.items()):
        module, _, attr = target.partition(":")
        command = getattr(importlib.import_module(module), attr)
        for path, flag in _flags(command, name):
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
                undocumented.append(f"{path} {flag}")
    assert not undocumented, "flags no page documents:\n" + "\n".join(sorted(set(undocumented)))


# DLM_* names as the code spells them (not DLM_CPU_* wildcards, not f-string prefixes).
ENV_NAME = re.compile(r"\bDLM_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_]|\*)")
ENV_ROW = re.compile(r"^\| `(DLM_[A-Z0-9_]+)` \| [^|]+ \| [^|]+ \|\s*$")


def _variables_in_code() -> set[str]:
    files = [f for folder in ("runtime", "convert", "verify", "quantize") for f in (ROOT / folder).rglob("*.py")]
    files += sorted((ROOT / "scripts").glob("*.sh"))
    return {name for f in files for name in ENV_NAME.findall(f.read_text(encoding="utf-8"))}


def _variables_documented() -> set[str]:
    prose, _ = _page(DOCS / "environment.md")
    return {m.group(1) for line in prose for m in [ENV_ROW.match(line)] if m}


def test_every_environment_variable_has_its_row():
    in_code = _variables_in_code()
    assert {"DLM_BLAS", "DLM_COMPUTE_DTYPE", "DLM_API_KEY", "DLM_MLX_BACKEND"} <= in_code  # the scan works
    missing = sorted(in_code - _variables_documented())
    assert not missing, ("DLM_* variables without a '| `NAME` | default | what it does |' row in "
                         f"docs/environment.md: {missing}")


def test_every_documented_variable_is_read_somewhere():
    stale = sorted(_variables_documented() - _variables_in_code())
    assert not stale, f"docs/environment.md documents DLM_* variables no code reads: {stale}"

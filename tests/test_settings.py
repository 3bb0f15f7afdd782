"""Every DLM_* environment variable is declared once, in dlm.runtime.platform.settings:
no other module reads one; docs/environment.md has a row for each declaration (the
one ``python -m dlm.runtime.platform.settings`` prints) with its default; each is
parsed as before the declarations (a bad value of a checked choice is the same
ConfigError naming the variable)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dlm.runtime.platform import settings
from dlm.runtime.platform.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("runtime", "convert", "quantize", "verify", "model_cards")
HOME = ROOT / "runtime" / "platform" / "settings.py"
DOC = ROOT / "docs" / "environment.md"

NAME = re.compile(r"^DLM_[A-Z0-9_]+$")
# A read written any other way (an f-string key, getenv, click's envvar=) on one line.
READ = re.compile(r"(environ\b|getenv\b|envvar\s*=)[^\n]*DLM_")


def dlm_reads(path: Path) -> list[str]:
    """Where ``path`` names a DLM_* variable as a key (``os.environ["DLM_X"]``,
    ``os.environ.get("DLM_X")``, ``os.getenv``, ``envvar="DLM_X"``, a dict of them):
    every string that is exactly a variable's name, and every environ/getenv/envvar
    line that mentions DLM_."""
    text = path.read_text()
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    found = [f"{where}:{node.lineno}: {node.value!r}" for node in ast.walk(ast.parse(text))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.match(node.value)]
    found += [f"{where}:{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1) if READ.search(line)]
    return found


def sources() -> list[Path]:
    return [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py")) if p != HOME]


def test_no_module_but_the_declarations_reads_a_dlm_variable():
    bad = [hit for path in sources() for hit in dlm_reads(path)]
    assert not bad, "read DLM_* variables through dlm.runtime.platform.settings:\n" + "\n".join(bad)


@pytest.mark.parametrize("line", [
    'os.environ.get("DLM_X", "")', 'os.environ["DLM_X"]', 'os.getenv("DLM_X")', '"DLM_X" in os.environ',
    'os.environ[f"DLM_{name}"]', 'click.option("--x", envvar="DLM_X")', 'env = {"DLM_X": "1"}',
])
def test_the_scan_catches_a_read(tmp_path, line):
    module = tmp_path / "x.py"
    module.write_text(f"import os\nimport click\n{line}\n")
    assert dlm_reads(module), line
    module.write_text('"""DLM_X=1 turns it on."""\nHELP = "or set DLM_X"\n')  # prose is no read
    assert not dlm_reads(module)


def test_the_declarations_read_at_call_time(monkeypatch):
    monkeypatch.setenv("DLM_CPU_VOCAB", "mlx")
    assert settings.CPU_VOCAB.get() == "mlx"
    monkeypatch.setenv("DLM_CPU_VOCAB", "numpy")
    assert settings.CPU_VOCAB.get() == "numpy"
    monkeypatch.delenv("DLM_CPU_VOCAB")
    assert settings.CPU_VOCAB.get() == ""


def test_each_variable_is_declared_once():
    names = settings.declared_names()
    assert len(names) == len(set(names)), names
    assert all(s.name.startswith("DLM_") for s in settings.SETTINGS)
    assert [s.name for s in settings.SETTINGS] == sorted(s.name for s in settings.SETTINGS)
    assert settings.by_name("DLM_CPU_LAYOUT") is settings.CPU_LAYOUT
    with pytest.raises(KeyError):
        settings.by_name("DLM_NOT_A_SETTING")


def _literal_keys(path: Path) -> set[str]:
    """The environment variable names ``path`` reads or sets with a literal (or a
    module-level constant): os.environ[...], os.environ.get/setdefault/pop(...), os.getenv(...)."""
    tree = ast.parse(path.read_text())
    constants = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for t in node.targets if isinstance(t, ast.Name)}

    def name_of(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return constants.get(node.id)
        return None

    def is_environ(node):
        return isinstance(node, ast.Attribute) and node.attr == "environ" or (
            isinstance(node, ast.Name) and node.id == "environ")

    keys = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and is_environ(node.value):
            keys.add(name_of(node.slice))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if (is_environ(node.func.value) and node.func.attr in ("get", "setdefault", "pop")) or \
                    node.func.attr == "getenv":
                keys.add(name_of(node.args[0]))
    return keys - {None}


def test_every_variable_the_code_reads_or_sets_is_declared():
    # Others' variables stay read where they are (they belong to those libraries), named in FOREIGN.
    read = {key: path for path in sources() + [HOME] for key in _literal_keys(path)}
    assert {"HF_HUB_OFFLINE", "MLX_ENABLE_TF32", "OPENBLAS_THREAD_TIMEOUT"} <= set(read)
    missing = sorted(f"{key} ({path.relative_to(ROOT)})" for key, path in read.items()
                     if key not in settings.declared_names())
    assert not missing, "declare these in dlm.runtime.platform.settings (FOREIGN):\n" + "\n".join(missing)


# --- docs/environment.md ----------------------------------------------------------

def doc_rows() -> dict[str, tuple[str, str, str]]:
    """docs/environment.md's table rows: each variable named in a row's first cell ->
    (the whole row, its default cell, its first name)."""
    rows = {}
    for line in DOC.read_text().splitlines():
        if not line.startswith("| `"):
            continue
        cells = line[2:-2].split(" | ", 2)
        assert len(cells) == 3 and line.endswith(" |"), line
        names = re.findall(r"`([^`]+)`", cells[0])
        for name in names:
            assert name not in rows, f"two rows name {name}"
            rows[name] = (line, cells[1], names[0])
    return rows


def test_the_doc_has_each_declared_variable_with_its_default():
    rows = doc_rows()
    for setting in settings.SETTINGS:
        assert setting.name in rows, f"docs/environment.md has no row for {setting.name}"
        assert rows[setting.name][1] == setting.shown, (setting.name, rows[setting.name][1], setting.shown)
    for documented in settings.SHELL + settings.FOREIGN:
        for name in documented.names:
            assert name in rows, f"docs/environment.md has no row for {name}"
            assert rows[name][1] == documented.shown, (name, rows[name][1], documented.shown)


def test_the_doc_declares_nothing_else_and_matches_the_generated_rows():
    rows = doc_rows()
    undeclared = sorted(set(rows) - set(settings.declared_names()))
    assert not undeclared, f"docs/environment.md names undeclared variables: {undeclared}"
    generated = settings.rows()
    stale = [name for name, (line, _, first) in rows.items() if name == first and line != generated[name]]
    assert not stale, (f"docs/environment.md rows differ from the declarations: {stale} "
                       "(regenerate them with `python -m dlm.runtime.platform.settings`)")


def test_python_m_prints_the_tables():
    out = subprocess.run([sys.executable, "-m", "dlm.runtime.platform.settings"], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout == settings.markdown() and not out.stderr
    for setting in settings.SETTINGS:
        assert f"| `{setting.name}` | {setting.shown} |" in out.stdout


# --- parsing: as before the declarations ---------------------------------------------

@pytest.mark.parametrize("setting, raw, want", [
    (settings.COMPILE, None, True), (settings.COMPILE, "0", False), (settings.COMPILE, "", True),
    (settings.COMPILE, "false", True),  # only "0" turns it off
    (settings.DEBUG, None, False), (settings.DEBUG, "", False), (settings.DEBUG, "0", True),  # any value
    (settings.DEBUG_CANVAS, None, False), (settings.DEBUG_CANVAS, " Yes ", True), (settings.DEBUG_CANVAS, "on", True),
    (settings.DEBUG_CANVAS, "0", False), (settings.DEBUG_CANVAS, "2", False),
    (settings.CPU_STREAMS, None, None), (settings.CPU_STREAMS, " 3 ", 3), (settings.CPU_STREAMS, "0", None),
    (settings.CPU_STREAMS, "two", None), (settings.CPU_STREAMS, "-2", None),
    (settings.BLAS, None, None), (settings.BLAS, " /x/libopenblas.so ", "/x/libopenblas.so"),
    (settings.BLAS, "Reference", "Reference"),
    (settings.COMPUTE_DTYPE, None, "auto"), (settings.COMPUTE_DTYPE, " native ", "native"),
    (settings.COMPUTE_DTYPE, "Native", "Native"),  # case kept: the loader's check names --compute-dtype
    (settings.CPU_DEQUANTIZE, None, "auto"), (settings.CPU_DEQUANTIZE, " CALL ", "call"),
    (settings.CPU_LAYOUT, None, "auto"), (settings.CPU_LAYOUT, "", "auto"), (settings.CPU_LAYOUT, "Native", "native"),
    (settings.CPU_EXPERTS, None, ""), (settings.CPU_EXPERTS, " Gather", "gather"),
    (settings.CPU_EXPERTS, "sometimes", "sometimes"),  # a benchmark switch: another word acts as unset
    (settings.CPU_VOCAB, None, ""), (settings.CPU_VOCAB, "NumPy", "numpy"),
    (settings.API_KEY, None, None), (settings.API_KEY, "k", "k"),
])
def test_each_variable_parses_as_before(monkeypatch, setting, raw, want):
    if raw is None:
        monkeypatch.delenv(setting.name, raising=False)
    else:
        monkeypatch.setenv(setting.name, raw)
    assert setting.get() == want


@pytest.mark.parametrize("setting, value, message", [
    (settings.CPU_DEQUANTIZE, "sometimes", "DLM_CPU_DEQUANTIZE='sometimes': choose from auto, call, kernels"),
    (settings.CPU_LAYOUT, "transposed", "DLM_CPU_LAYOUT='transposed': choose auto (the default) or native"),
])
def test_a_bad_choice_is_a_config_error_naming_the_variable(monkeypatch, setting, value, message):
    assert setting.kind == "choice"
    monkeypatch.setenv(setting.name, value)
    with pytest.raises(ConfigError) as exc:
        setting.get()
    assert str(exc.value) == message


def test_every_checked_choice_has_an_error_test():
    checked = {s.name for s in settings.SETTINGS if s.kind == "choice"}
    assert checked == {"DLM_CPU_DEQUANTIZE", "DLM_CPU_LAYOUT"}


@pytest.mark.parametrize("name, value, message", [
    ("DLM_CPU_DEQUANTIZE", "sometimes", "DLM_CPU_DEQUANTIZE='sometimes': choose from auto, call, kernels"),
    ("DLM_COMPUTE_DTYPE", "half", "--compute-dtype 'half': choose from auto, native, float32"),
])
def test_the_loader_checks_its_variables_first(monkeypatch, tmp_path, name, value, message):
    from dlm.runtime import loader

    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as exc:
        loader.load(tmp_path / "no-such-model")  # checked before the path is looked at
    assert str(exc.value) == message


def test_the_layout_check_names_a_bad_value(monkeypatch):
    from dlm.runtime.models.cpu import layout

    monkeypatch.setenv("DLM_CPU_LAYOUT", "transposed")
    with pytest.raises(ConfigError, match="DLM_CPU_LAYOUT='transposed': choose auto"):
        layout.measured()
    monkeypatch.setenv("DLM_CPU_LAYOUT", "native")
    assert layout.measured() is False


def test_the_cpu_streams_count_falls_back_to_the_cores(monkeypatch):
    import os

    from dlm.runtime.models.cpu import streams

    monkeypatch.setenv("DLM_CPU_STREAMS", "3")
    assert streams.cores() == 3
    monkeypatch.setenv("DLM_CPU_STREAMS", "0")
    assert streams.cores() == (os.cpu_count() or 1)


def test_serve_reads_the_api_key_through_the_declaration():
    from dlm.runtime.cli.serve import serve

    (option,) = [p for p in serve.params if p.name == "api_key"]
    assert option.envvar == settings.API_KEY.name == "DLM_API_KEY"

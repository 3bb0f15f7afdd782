"""The import rule of docs/architecture.md, checked on the source: runtime/
imports nothing from convert/, quantize/ or verify/; inside it every import goes
to its own floor or a lower one; and no two modules import each other, directly
or through others (every import counts, those inside functions too)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"convert": "dlm.convert", "quantize": "dlm.quantize", "verify": "dlm.verify",
           "runtime": "dlm.runtime", "model_cards": "dlm.model_cards"}

# runtime's floors, bottom to top (docs/architecture.md): a module's floor is that
# of the longest prefix listed; it may import from its own floor or lower ones.
FLOORS = [
    ("platform", ["dlm.runtime.platform"]),
    ("libraries", ["dlm.runtime.structured", "dlm.runtime.trace"]),
    ("models", ["dlm.runtime.models"]),
    ("generation", ["dlm.runtime.generation"]),
    ("families", ["dlm.runtime.models.diffusion_gemma", "dlm.runtime.models.llada2_moe"]),
    ("engine", ["dlm.runtime"]),
    ("server", ["dlm.runtime.server"]),
    ("cli", ["dlm.runtime.cli"]),
]


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def imports(name: str, path: Path, known: dict) -> set[str]:
    """The dlm modules ``name`` imports (``from pkg import module`` counts as the module)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            # ``from pkg import module`` imports that module; any other name, pkg itself.
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            targets = subs + ([base] if len(subs) < len(node.names) else [])
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and target != "dlm":
                out.add(target)
    return out


def floor(name: str) -> int:
    best, level = "", None
    for i, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best):
                best, level = prefix, i
    return level


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_runtime_imports_nothing_from_the_jobs_above_it():
    bad = [f"{a} -> {b}" for a, bs in graph().items() if a.startswith("dlm.runtime")
           for b in bs if not b.startswith("dlm.runtime")]
    assert not bad, bad


def test_runtime_imports_go_down_the_floors():
    bad = []
    for a, bs in graph().items():
        if not a.startswith("dlm.runtime"):
            continue
        for b in bs:
            if b.startswith("dlm.runtime") and b != "dlm.runtime" and floor(b) > floor(a):
                bad.append(f"{a} ({FLOORS[floor(a)][0]}) -> {b} ({FLOORS[floor(b)][0]})")
    assert not bad, "\n".join(bad)


def test_every_runtime_module_has_a_floor():
    assert all(floor(name) is not None for name in modules() if name.startswith("dlm.runtime"))


def test_no_import_cycles():
    edges = graph()
    seen, stack, cycles = {}, [], []

    def visit(node):  # depth-first: a back edge is a cycle
        seen[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if seen.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in seen:
                visit(nxt)
        stack.pop()
        seen[node] = "done"

    for node in sorted(edges):
        if node not in seen:
            visit(node)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_floor_check_catches_an_upward_import(tmp_path):
    # The rule's own check fails on a breach: a platform module importing the server.
    known = {"dlm.runtime.platform.x": tmp_path / "x.py", "dlm.runtime.server.app": tmp_path / "app.py"}
    known["dlm.runtime.platform.x"].write_text("from ..server import app\n")
    found = imports("dlm.runtime.platform.x", known["dlm.runtime.platform.x"], known)
    assert found == {"dlm.runtime.server.app"}
    assert floor("dlm.runtime.server.app") > floor("dlm.runtime.platform.x")

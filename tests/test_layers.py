"""The library's layout: imports run one way, from the stages down through stages.core's
subpackages, with no circles, no private name crossing a module boundary, and no room over about
600 lines without a reason its docstring gives (docs/science.md, "A map of the library").

Every import is parsed, at module level and inside functions; imports under `if TYPE_CHECKING:`
are exempt (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ROOT / "stages"

CORE_ORDER = ["common", "data", "reward", "models", "statistics", "training", "report", "plans"]
"""stages.core's subpackages, lowest first: each may import only those before it (and itself)."""

MAX_LINES = 600
REASON = "Over 600 lines:"
"""A room over MAX_LINES says why in its docstring, in a paragraph that starts with this."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_shim(path: Path) -> bool:
    """The old flat paths (stages/core/<name>.py), kept for this release as aliases."""
    return path.parent == STAGES / "core" and path.name != "__init__.py"


LIBRARY = sorted(p for p in STAGES.rglob("*.py") if not is_shim(p))
MODULES = {module_name(p) for p in LIBRARY}


def resolve(name: str) -> str | None:
    """The library module an imported name lives in (a module, or a package's __init__)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def type_checking_nodes(tree: ast.AST) -> set[int]:
    exempt = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            exempt.update(id(n) for n in ast.walk(node))
    return exempt


def imports(path: Path, package: str | None = None) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) of every import that runs, in one file (whose
    package, for relative imports, is read from its path unless given)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    exempt = type_checking_nodes(tree)
    if package is None:
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if id(node) in exempt:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [a.name for a in node.names]
            # `from package import module` imports the module
            subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
            if subs:
                found += [(node.lineno, s, []) for s in subs]
                names = [n for n in names if f"{module}.{n}" not in MODULES]
                if not names:
                    continue
            found.append((node.lineno, module, names))
    return found


def graph() -> dict[str, dict[str, int]]:
    """module -> {library module it imports: first line}."""
    edges: dict[str, dict[str, int]] = {}
    for path in LIBRARY:
        name = module_name(path)
        edges[name] = {}
        for line, module, _ in imports(path):
            target = resolve(module) if module.startswith("stages") else None
            if target and target != name and not target.startswith(name + "."):
                edges[name].setdefault(target, line)
    return edges


def level(module: str) -> tuple[int, int]:
    """(tier, position): stages.core's subpackages in CORE_ORDER at tier 0 (stages.core itself,
    which the checks skip, and its old-path aliases, which they refuse, have none); the config
    and keys at tier 1; the stages above."""
    parts = module.split(".")
    if parts[:2] == ["stages", "core"] and len(parts) > 2:
        return 0, CORE_ORDER.index(parts[2])
    if module in ("stages.config", "stages.keys") or module.startswith("stages.config."):
        return 1, 0
    return 2, 0


def test_every_core_subpackage_is_in_the_order():
    found = {p.name for p in (STAGES / "core").iterdir() if (p / "__init__.py").exists()}
    assert found == set(CORE_ORDER)


def test_imports_run_one_way():
    wrong = []
    for path in LIBRARY:
        name = module_name(path)
        for line, module, _ in imports(path):
            target = resolve(module) if module.startswith("stages") else None
            if not target or target in ("stages", "stages.core") or target == name:
                continue
            if level(target) > level(name):  # one subpackage's modules share a level
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}, above it")
    assert not wrong, "\n".join(wrong)


def test_the_library_imports_no_old_path():
    olds = {module_name(p) for p in (STAGES / "core").glob("*.py") if is_shim(p)}
    used = [f"{path.relative_to(ROOT)}:{line} imports {module}"
            for path in LIBRARY for line, module, _ in imports(path) if module in olds]
    assert not used, "\n".join(used)


def test_no_import_circles():
    edges = graph()
    circles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in edges.get(node, {}):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(stack[stack.index(nxt):] + [node, nxt])
                               if nxt in stack else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, stack + [node])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [])
    assert not circles, "\n".join(circles)


def test_no_private_name_crosses_a_module():
    crossing = [f"{path.relative_to(ROOT)}:{line} takes {module}.{n}"
                for path in LIBRARY for line, module, names in imports(path)
                if module.startswith("stages") for n in names
                if n.startswith("_") and not n.startswith("__")]
    assert not crossing, "\n".join(crossing)


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_room_over_600_lines_without_a_reason(path):
    lines = len(path.read_text().splitlines())
    if lines > MAX_LINES:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert REASON in doc, (f"{path.relative_to(ROOT)} has {lines} lines and its docstring "
                               f"gives no reason ('{REASON} ...')")


def test_the_checks_see_what_they_must(tmp_path):
    """The parser finds a function-level and a relative import, ignores one under TYPE_CHECKING,
    and the order puts the library's floor below its trainer and the config above both."""
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from stages.train import main\n"
                      "def f():\n    from stages.core.training.actor import _x\n"
                      "    from ..statistics import stats\n")
    found = {m: names for _, m, names in imports(source, package="stages.core.models")}
    assert found["stages.core.training.actor"] == ["_x"]
    assert "stages.core.statistics.stats" in found and "stages.train" not in found
    assert level("stages.core.common.io") < level("stages.core.training.actor") < level("stages.config")

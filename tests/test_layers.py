"""The library's layout: imports run one way, from the stages down through stages.core's
subpackages, with no circles, no private name crossing a module boundary, and no room over about
600 lines without a reason its docstring gives (docs/science.md, "A map of the library").

Every import is parsed, at module level and inside functions; imports under `if TYPE_CHECKING:`
are exempt (they never run).
"""

from __future__ import annotations

import ast
import re
import subprocess
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


LIBRARY = sorted(STAGES.rglob("*.py"))
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
    which the checks skip, has none); the config
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


def old_paths() -> re.Pattern:
    """The removed modules (stages.core.MOVED) as dotted names or file paths."""
    from stages.core import MOVED

    names = "|".join(re.escape(old).replace(r"\.", "[./]") for old in sorted(MOVED, key=len, reverse=True))
    return re.compile(rf"\bstages[./]core[./](?:{names})(?![\w/])")


LISTS_THEM = {"CHANGELOG.md", "stages/core/__init__.py", "tests/test_layers.py"}
"""The files that name the old paths on purpose: the changelog, the table of where they went, and
this test."""


def test_no_file_names_an_old_path():
    tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip(f"not a git checkout: {tracked.stderr.strip()}")
    pattern, found = old_paths(), []
    for name in tracked.stdout.splitlines():
        path = ROOT / name
        if name in LISTS_THEM or not path.is_file() or path.suffix in (".parquet", ".png", ".gguf"):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m[0]}" for m in pattern.finditer(text)]
    assert not found, "\n".join(found)
    # the pattern sees the forms an old path is written in, and not their new homes
    assert all(pattern.search(t) for t in ("stages.core.stats", "stages/core/actor.py",
                                          "from stages.core.reward.rewards import GRADERS"))
    assert not any(pattern.search(t) for t in ("stages.core.statistics.stats", "stages.core.reward",
                                               "stages/core/training/actor.py", "stages.core.io_x"))


def test_the_library_imports_no_old_path():
    from stages.core import MOVED

    olds = {f"stages.core.{old}" for old in MOVED}
    used = [f"{path.relative_to(ROOT)}:{line} imports {module}"
            for path in LIBRARY for line, module, _ in imports(path) if module in olds]
    assert not used, "\n".join(used)


@pytest.mark.parametrize("statement, home", [
    ("import stages.core.actor", "stages.core.training.actor"),
    ("from stages.core import stats", "stages.core.statistics.stats"),
    ("from stages.core.rewards import dapo_math", "scores.math_dapo: dapo_math"),
    ("from stages.core.reward.grading import grade_many", "registry: grade, grade_many"),
])
def test_an_old_path_names_its_new_home(statement, home):
    with pytest.raises(ModuleNotFoundError, match=re.escape(home)):
        exec(statement, {})


def test_a_selector_module_on_an_old_path_is_a_config_error_naming_the_new_one(tmp_path, test_raw):
    from stages.config import ConfigError, validate

    module = tmp_path / "mine.py"
    module.write_text("from stages.core.selectors import register_selector\n")
    test_raw["selector_modules"] = [str(module)]
    with pytest.raises(ConfigError, match=r"selector_modules\.0: cannot import .*stages\.core\.training\.selectors"):
        validate(test_raw, "mine.yaml")


def module_settings(path: Path) -> set[str]:
    """The numbers and flags a module assigns at its top level (its settings)."""
    settings = set()
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else [])
        value = getattr(node, "value", None)
        leaves = [n for n in ast.walk(value) if not isinstance(n, (ast.BinOp, ast.UnaryOp, ast.operator,
                                                                  ast.unaryop))] if value else []
        if leaves and all(isinstance(n, ast.Constant) and isinstance(n.value, (int, float))
                          for n in leaves):  # 10, 2 ** 20, -1.5, True
            settings |= {t.id for t in targets if isinstance(t, ast.Name)}
    return settings


def test_no_module_re_exports_a_setting():
    """A module re-exports functions, types and constants of meaning, never a number or flag that
    another module reads: patching the copy would change nothing."""
    by_module = {module_name(p): p for p in LIBRARY}
    found = []
    for path in LIBRARY:
        tree = ast.parse(path.read_text())
        names = {name for node in tree.body if isinstance(node, ast.Assign)
                 for t in node.targets if isinstance(t, ast.Name) and t.id == "__all__"
                 for name in ast.literal_eval(node.value)}
        for line, module, imported in imports(path):
            home = by_module.get(module)
            if home is not None and home != path:
                found += [f"{path.relative_to(ROOT)}:{line} re-exports {module}.{n}"
                          for n in imported if n in names and n in module_settings(home)]
    assert not found, "\n".join(found)
    assert {"PIECE_BYTES", "CACHE_BLOCKS", "CHUNK_POSITIONS"} <= module_settings(
        STAGES / "core" / "statistics" / "blocks.py")


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

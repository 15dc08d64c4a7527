"""slime's modules form layers: no two import each other, directly or around a loop, and the ground floor
(``slime/utils``) imports nothing above it. Every import counts (a lazy one inside a function, or one under
``TYPE_CHECKING``, ties two modules as much as one at the top); ``from package import name`` counts the
submodule ``name`` when there is one, else the package."""

from __future__ import annotations

import ast
from pathlib import Path

import slime

SLIME = Path(slime.__file__).parent

#: public module paths of docs/INTERFACES.md whose code moved above the ground floor: each is only an alias
#: of its new home, the one import it may make upward
GROUND_FLOOR_ALIASES = {
    "slime.utils.arguments": "slime.arguments",
    "slime.utils.preflight": "slime.preflight",
    "slime.utils.ppo_utils": "slime.algorithms.functional",
}


def _module_names(root: Path, package: str) -> dict[str, Path]:
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join((package, *parts))] = path
    return names


def imported_modules(path: Path, module: str, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``module`` (at ``path``) imports anywhere in its body."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package upward
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
            candidates = submodules if len(submodules) == len(node.names) else [base, *submodules]
        else:
            continue
        found.update(name for name in candidates if name in known and name != module)
    return found


def find_cycles(root: Path, package: str) -> list[list[str]]:
    """Each loop of imports among the modules under ``root`` (the package ``package``), as the modules
    around it; one loop per strongly connected group."""
    known = _module_names(root, package)
    edges = {name: imported_modules(path, name, known) for name, path in known.items()}
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for name in sorted(known):
        if name not in index:
            visit(name)
    return groups


def upward_imports(root: Path, package: str, floor: str, aliases: dict[str, str]) -> list[str]:
    """``module -> target`` for each import from a module under ``floor`` of a module of ``package`` outside
    it, but an alias's one import of its new home."""
    known = _module_names(root, package)
    found = []
    for name, path in known.items():
        if name != floor and not name.startswith(floor + "."):
            continue
        for target in sorted(imported_modules(path, name, known)):
            outside = target != floor and not target.startswith(floor + ".")
            if outside and target != package and aliases.get(name) != target:
                found.append(f"{name} -> {target}")
    return found


def test_slime_has_no_import_cycle():
    assert find_cycles(SLIME, "slime") == []


def test_the_ground_floor_imports_nothing_above_it():
    assert upward_imports(SLIME, "slime", "slime.utils", GROUND_FLOOR_ALIASES) == []


def test_each_ground_floor_alias_is_its_new_home():
    import importlib

    for old, new in GROUND_FLOOR_ALIASES.items():
        assert importlib.import_module(old) is importlib.import_module(new), old


def test_a_lazy_import_back_is_found_as_a_cycle(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "top.py").write_text("from pkg.sub import low\n")
    (package / "sub" / "low.py").write_text("def f():\n    from .. import top\n")
    (package / "apart.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import top\n")
    assert find_cycles(package, "pkg") == [["pkg.sub.low", "pkg.top"]]


def test_an_upward_import_from_the_floor_is_found(tmp_path):
    package = tmp_path / "pkg"
    (package / "utils").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "top.py").write_text("from pkg.utils import low\n")
    (package / "utils" / "__init__.py").write_text("")
    (package / "utils" / "low.py").write_text("def f():\n    import pkg.top\n")
    (package / "utils" / "old.py").write_text("from pkg import top\n")
    assert upward_imports(package, "pkg", "pkg.utils", {"pkg.utils.old": "pkg.top"}) == ["pkg.utils.low -> pkg.top"]

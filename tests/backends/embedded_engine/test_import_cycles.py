"""No two modules of the engine package import each other, directly or around a loop: every import counts
(a lazy one inside a function, or one under ``TYPE_CHECKING``, ties two modules as much as one at the top),
so the package reads from the engine loop down to the kernels, FP8 and speculative decoding."""

from __future__ import annotations

import ast
from pathlib import Path

import slime.backends.embedded_engine as engine_package


def _module_names(root: Path, package: str) -> dict[str, Path]:
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join((package, *parts))] = path
    return names


def _imported(path: Path, module: str, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``module`` (at ``path``) imports anywhere in its body."""
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
            candidates = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(name for name in candidates if name in known and name != module)
    return found


def find_cycles(root: Path, package: str) -> list[list[str]]:
    """Each loop of imports among the modules under ``root`` (the package ``package``), as the modules
    around it; one loop per strongly connected group."""
    known = _module_names(root, package)
    edges = {name: _imported(path, name, known) for name, path in known.items()}
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


def test_the_engine_package_has_no_import_cycle():
    root = Path(engine_package.__file__).parent
    assert find_cycles(root, engine_package.__name__) == []


def test_a_lazy_import_back_is_found_as_a_cycle(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "top.py").write_text("from pkg.sub import low\n")
    (package / "sub" / "low.py").write_text("def f():\n    from .. import top\n")
    (package / "apart.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import top\n")
    assert find_cycles(package, "pkg") == [["pkg.sub.low", "pkg.top"]]

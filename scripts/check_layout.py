"""Check the source tree's shape: folder sizes, module sizes and the import graph.

The rules (issue 20, ../docs/architecture.md):

- no source folder holds more than ``MAX_MODULES`` modules directly (``__init__.py`` not counted);
- no module is longer than ``MAX_LINES`` lines (generated stubs excepted);
- no import cycle between modules. Every import counts, wherever it stands: at the top, inside
  a function, or under ``TYPE_CHECKING`` (a type-only import is the same coupling);
- the imports run one way between the parts (``FORBIDDEN``): the shared core imports neither
  the agent nor chunkfs, chunkfs does not import the agent, the recipe language does not import
  the mesh's state. Only the CLI, the face of the package, reaches into everything.

Run it as ``python scripts/check_layout.py``; it prints what breaks a rule and exits 1, or
prints nothing and exits 0. ``tests/test_layout.py`` runs it on the tree and on broken trees.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

MAX_MODULES = 20
MAX_LINES = 800

# Source folder -> the installed package it becomes (pyproject.toml's package-dir).
PACKAGES = {"hypermesh": "hypermesh", "agent": "hypermesh.agent", "chunkfs": "hypermesh.chunkfs"}
GENERATED = ("hypermesh/_proto",)

# (importer, imported, why): no module under the first prefix may import one under the second.
CORE = ("hypermesh.recipe", "hypermesh.state", "hypermesh.local", "hypermesh.config",
        "hypermesh.errors")
FORBIDDEN = [
    *((core, "hypermesh.agent", "the shared core does not import the agent") for core in CORE),
    *((core, "hypermesh.chunkfs", "the shared core does not import chunkfs") for core in CORE),
    ("hypermesh.chunkfs", "hypermesh.agent", "chunkfs talks to its agent over gRPC only"),
    ("hypermesh.recipe", "hypermesh.state", "the recipe language does not know the mesh's state"),
]


@dataclass(frozen=True)
class Module:
    """One source file: its installed dotted name and where it lives."""

    name: str
    path: Path
    is_package: bool


def find_modules(root: Path) -> dict[str, Module]:
    """Every module under the source folders, keyed by its installed name."""
    found: dict[str, Module] = {}
    for folder, package in PACKAGES.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(base).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            name = ".".join([package, *parts])
            found[name] = Module(name, path, is_package)
    return found


def imported_names(module: Module) -> Iterator[tuple[str, list[str]]]:
    """What a module imports: each import's module and, for ``from X import a, b``, the
    candidates ``X.a`` and ``X.b`` (submodules, if they are modules)."""
    tree = ast.parse(module.path.read_text(), str(module.path))
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            yield base, [f"{base}.{alias.name}" for alias in node.names]


def import_graph(modules: dict[str, Module]) -> dict[str, set[str]]:
    """Module -> the project modules it imports. ``from package import module`` is an edge to
    the module; an edge to a package's ``__init__`` only when a name is taken from it."""
    graph: dict[str, set[str]] = {}
    for name, module in modules.items():
        edges: set[str] = set()
        for base, candidates in imported_names(module):
            submodules = [c for c in candidates if c in modules]
            edges.update(submodules)
            if base in modules and (not candidates or len(submodules) < len(candidates)):
                edges.add(base)
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def wrong_way(graph: dict[str, set[str]]) -> list[str]:
    """Imports that run against ``FORBIDDEN``'s direction, one line each."""
    found = []
    for importer, imported in sorted((a, b) for a, targets in graph.items() for b in targets):
        for low, high, why in FORBIDDEN:
            if _under(importer, low) and _under(imported, high):
                found.append(f"wrong way: {importer} imports {imported} ({why})")
    return found


def crowded_folders(
    root: Path, modules: Iterable[Module], limit: int = MAX_MODULES
) -> list[str]:
    """Folders that hold more than ``limit`` modules directly."""
    counts: dict[Path, int] = {}
    for module in modules:
        if module.path.name != "__init__.py":
            counts[module.path.parent] = counts.get(module.path.parent, 0) + 1
    return [f"{folder.relative_to(root).as_posix()}: {n} modules (at most {limit})"
            for folder, n in sorted(counts.items()) if n > limit]


def long_modules(root: Path, modules: Iterable[Module], limit: int = MAX_LINES) -> list[str]:
    """Modules longer than ``limit`` lines, generated stubs excepted."""
    found = []
    for module in modules:
        relative = module.path.relative_to(root).as_posix()
        if relative.startswith(GENERATED):
            continue
        lines = len(module.path.read_text().splitlines())
        if lines > limit:
            found.append(f"{relative}: {lines} lines (at most {limit})")
    return sorted(found)


def problems(root: Path) -> list[str]:
    """Everything in the tree at ``root`` that breaks a layout rule, as lines to print."""
    modules = find_modules(root)
    found = crowded_folders(root, modules.values()) + long_modules(root, modules.values())
    graph = import_graph(modules)
    found += ["import cycle: " + " <-> ".join(c) for c in cycles(graph)]
    found += wrong_way(graph)
    test_root = root / "tests"
    if test_root.is_dir():
        tests = [Module(p.stem, p, False) for p in test_root.rglob("*.py")
                 if "__pycache__" not in p.parts]
        found += crowded_folders(root, tests)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args(argv)
    found = problems(args.root)
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

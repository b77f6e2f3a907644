"""The graph of ``after``: its checks (``DagChecker``: unknown names, an experiment after
itself, cycles), its cycles and a topological order (the scheduler's). All iterative: a
chain of a thousand experiments costs no recursion."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from hypermesh.recipe.located import _Entry, _Node, _NodeChecker

__all__ = ["DagChecker", "cycles", "topological_order"]


class DagChecker(_NodeChecker):
    """Reads each experiment's ``after`` (``after``), then checks the whole graph once every
    experiment is known (``dependencies``); problems are recorded, never raised."""

    def __init__(self, source: str) -> None:
        super().__init__(source)
        # experiment -> (line of its 'after' key, [(name, node, field path)])
        self._after: dict[str, tuple[int | None, list[tuple[str, _Node, str]]]] = {}

    def after(self, name: str, node: _Node | None, entry: _Entry | None, path: str) -> None:
        refs: list[tuple[str, _Node, str]] = []
        seen: set[str] = set()
        line = entry.key_line if entry is not None else None
        if node is not None:
            items = node.value if isinstance(node.value, list) else [node]
            for i, item in enumerate(items):
                where = f"{path}.after[{i}]" if isinstance(node.value, list) else f"{path}.after"
                dep = self.string(item, where)
                if dep is not None and dep in seen:
                    self.at(item, where, f"{dep!r} is listed twice")
                elif dep is not None:
                    seen.add(dep)
                    refs.append((dep, item, where))
        self._after[name] = (line, refs)

    def dependencies(self, names: list[str]) -> None:
        """Unknown names, self-dependencies and cycles in ``after``, each reported once."""
        graph: dict[str, list[str]] = {}
        known = set(names)
        for name, (_, refs) in self._after.items():
            graph[name] = []
            for dep, node, where in refs:
                if dep == name:
                    self.at(node, where, f"experiment {name!r} cannot run after itself")
                elif dep not in known:
                    self.at(node, where, f"unknown experiment {dep!r}"
                            f"{self.suggest(dep, names)}")
                else:
                    graph[name].append(dep)
        order = {name: i for i, name in enumerate(names)}
        reported: set[tuple[str, ...]] = set()
        for cycle in cycles(graph):
            start = min(range(len(cycle)), key=lambda i: order[cycle[i]])
            cycle = cycle[start:] + cycle[:start]
            if tuple(cycle) not in reported:
                reported.add(tuple(cycle))
                line = self._after[cycle[0]][0]
                text = " -> ".join([*cycle, cycle[0]])
                self.report(line, f"experiments.{cycle[0]}.after", f"dependency cycle: {text}")


def cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """One cycle for every back edge a depth-first search of ``graph`` meets.

    An explicit stack of (name, next edge) instead of recursion; ``position`` finds where a
    cycle starts on the current path in O(1)."""
    found: list[list[str]] = []
    finished: set[str] = set()
    position: dict[str, int] = {}  # name -> index on the current path
    for root in graph:
        if root in finished:
            continue
        path, edges = [root], [0]
        position[root] = 0
        while path:
            name, i = path[-1], edges[-1]
            deps = graph.get(name, [])
            if i == len(deps):
                path.pop()
                edges.pop()
                del position[name]
                finished.add(name)
                continue
            edges[-1] = i + 1
            dep = deps[i]
            if dep in position:
                found.append(path[position[dep]:])
            elif dep not in finished:
                position[dep] = len(path)
                path.append(dep)
                edges.append(0)
    return found


def topological_order(nodes: Sequence[tuple[str, Sequence[str]]]) -> list[str]:
    """The names of ``nodes`` ((name, names it comes after), in file order), every one
    after those it names, ties in file order: Kahn's algorithm with a heap of file
    positions, O(E log N). Raises ``ValueError`` naming the rest if they form a cycle."""
    index = {name: i for i, (name, _) in enumerate(nodes)}
    missing = {name: len(set(after)) for name, after in nodes}
    dependents: dict[str, list[str]] = {name: [] for name, _ in nodes}
    for name, after in nodes:
        for dep in set(after):
            dependents[dep].append(name)
    ready = [i for i, (name, _) in enumerate(nodes) if not missing[name]]
    heapq.heapify(ready)
    done: list[str] = []
    while ready:
        name = nodes[heapq.heappop(ready)][0]
        done.append(name)
        for later in dependents[name]:
            missing[later] -= 1
            if not missing[later]:
                heapq.heappush(ready, index[later])
    if len(done) < len(nodes):
        placed = set(done)
        raise ValueError(f"dependency cycle among {[n for n, _ in nodes if n not in placed]}")
    return done

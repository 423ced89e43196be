"""Import circles between the project's files: ``python -m tandem.devtools.circles``.

The graph has one node per ``.py`` file under the given folders and an edge for every import
statement anywhere in a file: at module level, inside functions, under ``if TYPE_CHECKING:``.
A late import still ties two files together, so it counts like any other. An import names a
module of the project when it resolves to a file of the tree: absolute names against the
repository root, relative ones (``from . import x``, ``from ..a import b``) against the
importing file's package, and, where that finds nothing, a bare name against the importing
file's own folder (a script run as ``python benchmarks/x.py`` has that folder as sys.path[0]).
``from a import b`` points at ``a/b.py`` when that is a module, else at ``a/__init__.py``.

A circle is a strongly connected part of the graph with two or more files; the output names
each one with a shortest cycle through it, so a reader sees which imports to untie. Exit
status 1 when there is any circle.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path

DEFAULT_FOLDERS = ("tandem", "services", "tests", "benchmarks")
Graph = Mapping[str, frozenset[str]]


def _python_files(root: Path, folders: Iterable[str]) -> list[Path]:
    files: list[Path] = []
    for folder in folders:
        files.extend(p for p in (root / folder).rglob("*.py") if "node_modules" not in p.parts)
    return sorted(files)


def _module_file(root: Path, dotted: str) -> Path | None:
    base = root.joinpath(*dotted.split(".")) if dotted else root
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _resolve(root: Path, here: Path, dotted: str, relative: bool) -> Path | None:
    found = _module_file(root, dotted)
    if found is None and not relative:
        found = _module_file(here.parent, dotted)
    return found


def _imports(root: Path, path: Path, tree: ast.Module) -> Iterable[Path | None]:
    """Yield the file each import in ``tree`` names (None for one outside the project)."""
    package = list(path.relative_to(root).parent.parts)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield _resolve(root, path, alias.name, relative=False)
        elif isinstance(node, ast.ImportFrom):
            relative = node.level > 0
            if relative:
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = _resolve(root, path, f"{base}.{alias.name}".lstrip("."), relative)
                yield submodule or (_resolve(root, path, base, relative) if base else None)


def import_graph(root: Path, folders: Iterable[str] = DEFAULT_FOLDERS) -> dict[str, frozenset[str]]:
    """Map each file (a path relative to ``root``) to the project files it imports."""
    graph: dict[str, frozenset[str]] = {}
    for path in _python_files(root, folders):
        tree = ast.parse(path.read_text(), filename=str(path))
        targets = {found.relative_to(root).as_posix()
                   for found in _imports(root, path, tree) if found is not None and found != path}
        graph[path.relative_to(root).as_posix()] = frozenset(targets)
    return graph


def strongly_connected(graph: Graph) -> list[list[str]]:
    """The parts of ``graph`` (Tarjan's algorithm, iterative) with two or more files, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    parts: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        part.append(member)
                        if member == node:
                            break
                    if len(part) > 1:
                        parts.append(sorted(part))
    return sorted(parts)


def shortest_cycle(graph: Graph, start: str) -> list[str]:
    """A shortest cycle from ``start`` back to itself (breadth first), or [] if none."""
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return path[::-1]
            if nxt not in came_from:
                came_from[nxt] = node
                queue.append(nxt)
    return []


def cycles(graph: Graph) -> list[list[str]]:
    """For each circle, a shortest cycle through each of its files, without repeats.

    Every file of a strongly connected part lies on some cycle, so untying each listed cycle
    unties the part; a part of two files is one cycle.
    """
    found: list[list[str]] = []
    seen: set[tuple[str, ...]] = set()
    for part in strongly_connected(graph):
        inside = {node: graph[node] & set(part) for node in part}
        for node in part:
            cycle = shortest_cycle(inside, node)
            turn = cycle.index(min(cycle))
            key = tuple(cycle[turn:] + cycle[:turn])
            if key not in seen:
                seen.add(key)
                found.append(list(key))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.devtools.circles",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="*", default=list(DEFAULT_FOLDERS),
                        help="folders under the root to read (default: %(default)s)")
    parser.add_argument("--root", type=Path, default=Path.cwd(),
                        help="the repository root (default: the current folder)")
    args = parser.parse_args(argv)
    graph = import_graph(args.root, args.folders)
    found = cycles(graph)
    for cycle in found:
        print(f"cycle of {len(cycle)} files: " + " -> ".join(cycle + cycle[:1]))
    print(f"{len(graph)} files read, {len(strongly_connected(graph))} circles, "
          f"{len(found)} cycles listed", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

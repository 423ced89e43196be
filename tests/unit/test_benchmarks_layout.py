"""benchmarks/ stays sorted: scripts a user runs at the top, diagnostics in probes/, each listed in
benchmarks/README.md, and no import circle between them (function-level imports count too)."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def _module(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _imports(path: pathlib.Path) -> set[str]:
    """The benchmarks.* modules `path` imports anywhere in its body."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("benchmarks"):
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)  # from pkg import mod
            elif node.level == 0 and (BENCH / f"{node.module}.py").exists():
                found.add(f"benchmarks.{node.module}")  # sys.path[0] imports: `from serve_load`
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("benchmarks"))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in BENCH.rglob("*.py") if p.name != "__init__.py"}
    return {name: _imports(path) & set(modules) for name, path in modules.items()}


def test_no_import_circle_between_benchmarks() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            assert state.get(nxt) != 1, "import circle: " + " -> ".join([*path, node, nxt])
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_the_circle_this_layout_removed_stays_removed() -> None:
    graph = _graph()
    assert "benchmarks.serve_gpu" not in graph["benchmarks.probes.mixed_gpu"]
    assert "benchmarks.serve_load" in graph["benchmarks.probes.mixed_gpu"]


def test_every_script_is_in_the_readme() -> None:
    readme = (BENCH / "README.md").read_text(encoding="utf-8")
    scripts = [p for p in [*BENCH.glob("*.py"), *BENCH.glob("*.sh"), *BENCH.glob("probes/*.py")]
               if not p.name.startswith("_")]
    names = [str(p.relative_to(BENCH)) for p in scripts]
    missing = [n for n in names if f"`{n}`" not in readme and f"benchmarks/{n}" not in readme]
    assert not missing, f"benchmarks/README.md does not list {missing}"

"""No import circles between the project's files (tandem.devtools.circles), of any length: every
import statement counts, late ones inside functions and those under TYPE_CHECKING too. Untie a
circle by moving the shared name where both files belong, not by importing late."""
from __future__ import annotations

import pathlib
import textwrap

import pytest

from tandem.devtools import circles

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _cycles_text(found: list[list[str]]) -> str:
    return "\n".join(" -> ".join(cycle + cycle[:1]) for cycle in found)


def test_tandem_services_and_tests_import_in_no_circle() -> None:
    graph = circles.import_graph(ROOT, ("tandem", "services", "tests"))
    assert len(graph) > 300  # the tree was read, not an empty folder
    found = circles.cycles(graph)
    assert not found, "import circles (python -m tandem.devtools.circles):\n" + _cycles_text(found)


def test_the_whole_tree_with_benchmarks_imports_in_no_circle() -> None:
    found = circles.cycles(circles.import_graph(ROOT))
    assert not found, "import circles (python -m tandem.devtools.circles):\n" + _cycles_text(found)


def _tree(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_every_kind_of_import_is_an_edge(tmp_path: pathlib.Path) -> None:
    root = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": """
            from typing import TYPE_CHECKING
            import json
            if TYPE_CHECKING:
                from pkg.b import B
            def late():
                from . import c
                from .sub.d import D
        """,
        "pkg/b.py": "from pkg import a, helper_name\n",
        "pkg/c.py": "import pkg.sub.d\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/d.py": "from ..c import x\nfrom .. import b\n",
        "scripts/run.py": "from sibling import f\nimport nowhere\n",
        "scripts/sibling.py": "",
    })
    graph = circles.import_graph(root, ("pkg", "scripts"))
    assert graph["pkg/a.py"] == {"pkg/b.py", "pkg/c.py", "pkg/sub/d.py"}
    # `from pkg import a` names the module a; `helper_name` is not one, so pkg/__init__.py
    assert graph["pkg/b.py"] == {"pkg/a.py", "pkg/__init__.py"}
    assert graph["pkg/c.py"] == {"pkg/sub/d.py"}
    assert graph["pkg/sub/d.py"] == {"pkg/c.py", "pkg/b.py"}
    # a script's own folder is on its sys.path; a module outside the tree is no edge
    assert graph["scripts/run.py"] == {"scripts/sibling.py"}


def test_cycles_of_two_and_three_files_are_found_and_named() -> None:
    graph = {"a.py": frozenset({"b.py"}), "b.py": frozenset({"a.py", "c.py"}),
             "c.py": frozenset({"d.py"}), "d.py": frozenset({"e.py"}),
             "e.py": frozenset({"c.py"}), "f.py": frozenset({"a.py"})}
    assert circles.strongly_connected(graph) == [["a.py", "b.py"], ["c.py", "d.py", "e.py"]]
    assert circles.cycles(graph) == [["a.py", "b.py"], ["c.py", "d.py", "e.py"]]
    assert circles.cycles({k: v - {"a.py"} for k, v in graph.items() if k != "e.py"}) == []


def test_the_command_prints_each_cycle_and_exits_1(tmp_path: pathlib.Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    root = _tree(tmp_path, {"p/__init__.py": "", "p/x.py": "from p import y\n",
                            "p/y.py": "def f():\n    import p.x\n"})
    assert circles.main(["p", "--root", str(root)]) == 1
    assert "p/x.py -> p/y.py -> p/x.py" in capsys.readouterr().out
    (root / "p/y.py").write_text("")
    assert circles.main(["p", "--root", str(root)]) == 0

"""benchmarks/ stays sorted: scripts a user runs at the top, diagnostics in probes/, each listed in
benchmarks/README.md. (No import circle between them: test_import_circles.py.)"""
from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def test_every_script_is_in_the_readme() -> None:
    readme = (BENCH / "README.md").read_text(encoding="utf-8")
    scripts = [p for p in [*BENCH.glob("*.py"), *BENCH.glob("*.sh"), *BENCH.glob("probes/*.py")]
               if not p.name.startswith("_")]
    names = [str(p.relative_to(BENCH)) for p in scripts]
    missing = [n for n in names if f"`{n}`" not in readme and f"benchmarks/{n}" not in readme]
    assert not missing, f"benchmarks/README.md does not list {missing}"

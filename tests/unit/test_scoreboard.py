"""benchmarks/RESULTS.md's scoreboard is generated (benchmarks/scoreboard.py) from
benchmarks/results/*.json: every row names its command, date, machine and the round that
records it, and the committed table equals the generated one."""
from __future__ import annotations

import json
import pathlib
import re

import pytest

from benchmarks import scoreboard

BENCH = pathlib.Path(scoreboard.__file__).resolve().parent


def test_every_result_names_its_command_date_and_round() -> None:
    results = scoreboard.load_results()
    assert len(results) >= 10
    for r in results:
        # A command a person can type: a script of this repository, make, or the recorded harness.
        assert re.search(r"benchmarks/|make |side_by_side\.py", r.command), (r.name, r.command)
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r.date), (r.name, r.date)
        history = BENCH / r.source_file
        assert history.is_file(), (r.name, r.source)
        headings = {line.lstrip("#").strip() for line in history.read_text().splitlines()
                    if line.startswith("#")}
        assert r.source_heading in headings, (r.name, r.source)
        # The command is recorded in the round it points to (the script's name, at least).
        script = re.search(r"benchmarks/(\w+\.py)|(side_by_side\.py)|(backbone)", r.command)
        assert script and script.group(0).split("/")[-1] in history.read_text(), r.name


def test_results_md_and_readme_tables_equal_the_generated_ones() -> None:
    text = scoreboard.RESULTS_MD.read_text(encoding="utf-8")
    assert scoreboard.current_block(text) == scoreboard.render_table(scoreboard.load_results()), (
        "benchmarks/RESULTS.md's scoreboard is stale: run python -m benchmarks.scoreboard")
    readme = scoreboard.README_MD.read_text(encoding="utf-8")
    assert scoreboard.current_block(readme) == scoreboard.render_readme_table(
        scoreboard.load_results()), "README.md's scoreboard is stale: run python -m benchmarks.scoreboard"
    for r in scoreboard.load_results():
        row = next(line for line in text.splitlines() if line.startswith(f"| {r.measure[:40]}"))
        assert r.date in row and r.command.split()[0] in row


def test_a_result_without_its_command_or_a_real_date_is_refused(tmp_path: pathlib.Path) -> None:
    good = json.loads((BENCH / "results" / "video.json").read_text())
    for key, value, message in (("command", "", "`command`"), ("date", "2026-13-01", "`date`"),
                                ("source", "RESULTS.md", "`source`"), ("figre", "x", "unknown")):
        broken = {**good, key: value}
        (tmp_path / "r.json").write_text(json.dumps(broken))
        with pytest.raises(scoreboard.ResultError, match=message):
            scoreboard.load_results(tmp_path)


def test_the_plots_render(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("matplotlib")  # the dev extra installs it
    written = scoreboard.plot(scoreboard.load_results(), tmp_path)
    assert sorted(p.name for p in written) == sorted(png for png, _ in scoreboard.PLOTS.values())
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000

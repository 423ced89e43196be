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


def test_the_gpu_grid_row_is_written_from_serve_gpus_output(tmp_path: pathlib.Path) -> None:
    # The keys serve_gpu.py writes (result["engine"][point]["closed"], result["served"][variant]).
    run = {"device": "NVIDIA H200",
           "engine": {"200/200/64": {"tps": 7527.0, "closed": {"tps": 7578.0, "ttft_p50": 214.1,
                                                                "request_itl_p50": 7.39}},
                      "200/200/128": {"tps": 10923.0, "closed": {"tps": 11077.0, "ttft_p50": 315.3,
                                                                  "request_itl_p50": 9.94}}},
           "served": {"default": {"200/200/64": {"tps": 7448.0, "ttft_p50": 238.4, "itl_p50": 7.46},
                                  "200/200/128": {"skipped": True}}}}
    (tmp_path / "serve_gpu.json").write_text(json.dumps(run))
    out = tmp_path / "gpu-grid.json"
    result = scoreboard.import_serve_gpu(
        tmp_path / "serve_gpu.json", "2026-11-30", "PYTHONPATH=. python3 benchmarks/serve_gpu.py",
        "history/gpu-serving.md#Serving on the GPU, round 9", out=out)
    assert not result.transcribed and result.machine == "NVIDIA H200"
    assert result.points == [{"isl_osl": "200/200", "streams": 64, "served_tok_s": 7448,
                              "engine_tok_s": 7578, "ttft_p50_ms": 238.4,
                              "engine_ttft_p50_ms": 214.1, "itl_p50_ms": 7.46,
                              "engine_itl_p50_ms": 7.39}]
    assert result.figure == ("throughput 98%-98% of the engine alone; TTFT p50 1.11-1.11x, "
                             "ITL p50 1.01-1.01x the engine's")

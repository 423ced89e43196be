"""docs/configuration.md is generated from the config classes (tandem.devtools.configdoc): the
committed page must equal what the generator prints now, so a flag cannot change without it."""
from __future__ import annotations

from tandem.devtools import configdoc


def test_committed_page_equals_the_generated_one() -> None:
    committed = configdoc.PAGE.read_text(encoding="utf-8")
    assert committed == configdoc.render(), (
        "docs/configuration.md is stale: run python -m tandem.devtools.configdoc")


def test_every_command_and_flag_is_on_the_page() -> None:
    page = configdoc.render()
    for command in configdoc.COMMANDS:
        assert f"## `{command.prog}`" in page
    # A few flags from different classes and sections, each with its default and variable.
    for row in ("`--engine` | `engine`", "`--model` | `engine_args.model`", "`--kv-host-cache-bytes`",
                "`--router-address`", "[env TANDEM_MAX_BATCH_SIZE]"):
        assert row in page, row


def test_check_mode_reports_a_stale_page(tmp_path) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text("# old\n", encoding="utf-8")
    assert configdoc.main(["--check", "--out", str(stale)]) == 1
    assert configdoc.main(["--out", str(stale)]) == 0
    assert configdoc.main(["--check", "--out", str(stale)]) == 0

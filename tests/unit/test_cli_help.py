"""Every flag of every command explains itself: what it does, its unit, its default, under a
section named after its concern."""
from __future__ import annotations

import argparse
import re

import pytest

from services.frontend.config import FrontendConfig
from tandem import cli
from tandem.engines.trtllm.check import CheckConfig
from tandem.launcher.deployment import Deployment
from tandem.launcher.status import StatusConfig
from tandem.planner.service_config import PlannerServiceConfig
from tandem.routing.config import RouterConfig
from tandem.runtime import config as config_lib
from tandem.runtime.flag_help import GROUPS, field_help
from tandem.runtime.worker_config import WorkerConfig

# Every command's config class, by the command line that parses it.
COMMANDS: dict[str, type] = {
    "up": Deployment,
    "serve frontend": FrontendConfig,
    "serve router": RouterConfig,
    "serve decode": WorkerConfig,
    "serve prefill": WorkerConfig,
    "serve encode": WorkerConfig,
    "serve planner": PlannerServiceConfig,
    "status": StatusConfig,
    "check-engine": CheckConfig,
}
# A flag named for a unit says that unit in its help.
UNITS = {"_ms": r"\bms\b|millisecond", "_s": r"second", "_bytes": r"\bbytes\b",
         "_mb": r"megabyte|\bMB\b", "_gbps": r"GB/s", "_fraction": r"fraction"}
_SUFFIX = re.compile(r"\(default: .*\)( \[env [A-Z_]+\])?$", re.S)


def run_cli(argv: list[str]) -> int:
    """`tandem ARGV` in this process; its exit status."""
    try:
        cli.main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def _flags(command: str) -> list[tuple[str, str, str]]:
    """(flag, help text, section) of each flag of `command`, --help and --config aside."""
    parser = config_lib.build_parser(COMMANDS[command], prog=f"tandem {command}")
    rows = []
    for group in parser._action_groups:
        for action in group._group_actions:
            if isinstance(action, argparse._HelpAction) or action.dest == "config":
                continue
            rows.append((action.option_strings[0], action.help or "", group.title or ""))
    return rows


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_flag_says_what_it_does_and_its_default(command: str) -> None:
    flags = _flags(command)
    assert len(flags) >= 3
    for flag, text, section in flags:
        assert _SUFFIX.search(text), f"{command} {flag}: no default in {text!r}"
        what = _SUFFIX.sub("", text).strip()
        # More than the default and the variable: at least a few words of its own.
        assert len(what.split()) >= 3, f"{command} {flag}: help says nothing: {text!r}"
        assert section in GROUPS, f"{command} {flag}: section {section!r}"
        for suffix, unit in UNITS.items():
            if flag.replace("-", "_").endswith(suffix):
                assert re.search(unit, what, re.I), f"{command} {flag}: no unit in {what!r}"


@pytest.mark.parametrize("command", ["up", "serve decode", "serve router", "serve frontend"])
def test_flags_are_grouped_by_concern(command: str) -> None:
    sections = {section for _, _, section in _flags(command)}
    assert {"network", "reliability", "security", "observability"} <= sections
    if command in ("up", "serve decode"):
        assert {"model and engine", "KV cache", "routing", "disaggregation"} <= sections


def test_every_field_of_a_command_config_is_documented_in_its_source() -> None:
    """The `#:` comment is the help text: a field with neither it nor help metadata fails."""
    seen: set[type] = set()

    def check(cls: type) -> None:
        if cls in seen:
            return
        seen.add(cls)
        docs = field_help(cls)
        for f, tp in config_lib._fields(cls):
            if config_lib._is_config_class(tp):
                check(tp)
            elif not config_lib._is_list_of_configs(config_lib._scalar_type(tp)):
                assert f.metadata.get("help") or docs[f.name].text, f"{cls.__name__}.{f.name}"

    for cls in COMMANDS.values():
        check(cls)


def test_an_unknown_section_heading_is_refused() -> None:
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Typo:
        # == netwrok ==
        #: A port.
        port: int = 1

    with pytest.raises(ValueError, match="netwrok"):
        field_help(Typo)


@pytest.mark.parametrize("argv", [["--help"], ["up", "--help"], ["serve", "--help"],
                                  ["serve", "decode", "--help"], ["status", "--help"],
                                  ["check-engine", "--help"], ["demo-model", "--help"],
                                  ["profile", "--help"]])
def test_help_exits_zero_and_prints_usage(argv: list[str],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(argv) == 0
    out = capsys.readouterr()
    assert "usage: tandem" in out.out + out.err


def test_tandem_help_lists_each_command_with_a_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("up", "serve", "status", "demo-model", "check-engine", "profile"):
        line = next(line for line in out.splitlines() if line.strip().startswith(command + " "))
        assert len(line.split()) >= 5, line


def test_an_unknown_command_exits_2_with_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["frobnicate"]) == 2 and "commands:" in capsys.readouterr().err

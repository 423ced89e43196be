"""Typed, layered configuration: dataclass defaults < YAML file (--config) < environment
(TANDEM_*) < CLI flags.

Every service describes its config as a frozen dataclass (nested dataclasses allowed). Flags are
derived from field names (`max_batch_size` -> `--max-batch-size`) unless a field's metadata names
another (`field(metadata={"flag": "--num-gpu-blocks-override"})`); help comes from `help`
metadata. Unknown YAML keys are rejected with the key named, so a typo never passes silently.
Fields with `secret` metadata (API keys) are redacted in `as_dict`, the start-up log line.

Each leaf field also reads the environment variable named after its flag: `--tls-cert-file` ->
`TANDEM_TLS_CERT_FILE` (booleans: true/false/1/0/yes/no/on/off; lists: comma- or space-separated;
empty: unset), so that Compose and Kubernetes can add settings without rewriting a command line.
A field whose metadata says `"env": False` reads no variable (it reads its own, with its own
meaning).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import yaml

from tandem.errors import InvalidRequest
from tandem.runtime import flag_help

T = TypeVar("T")
_SCALARS = (str, int, float, bool)
ENV_PREFIX = "TANDEM_"
_EPILOG = ("Each value comes from, last one winning: its default, the --config file, its "
           "TANDEM_* environment variable, the flag.")
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if f.init]


def _is_config_class(tp: Any) -> typing.TypeGuard[type]:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def env_var(f: dataclasses.Field) -> str | None:
    """The environment variable that sets field `f` (None: it reads none)."""
    if f.metadata.get("env") is False:
        return None
    return ENV_PREFIX + _flag(f)[2:].upper().replace("-", "_")


def _scalar_type(tp: Any) -> Any:
    """The element type argparse should convert to; Optional[X] -> X."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return args[0]
    return tp


def add_arguments(parser: argparse.ArgumentParser, cls: type, dest_prefix: str = "",
                  group: str = "") -> None:
    """Adds one flag per leaf field of `cls` (recursing into nested dataclasses), each under
    its section of --help (tandem.runtime.flag_help)."""
    sections = _help_sections(parser)
    docs = flag_help.field_help(cls)
    for f, tp in _fields(cls):
        dest = dest_prefix + f.name
        doc = docs.get(f.name)
        field_group = f.metadata.get("group") or (doc.group if doc else "") or group
        if _is_config_class(tp):
            add_arguments(parser, tp, dest + ".", field_group)
            continue
        base = _scalar_type(tp)
        if _is_list_of_configs(base):
            continue  # structured lists come from the YAML file only
        kwargs: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS,
                                  "help": flag_help.flag_help(f, doc, env_var(f))}
        if base is not bool:
            kwargs["metavar"] = f.name.upper()
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(base) in (list, tuple):
            kwargs["nargs"] = "*"
            kwargs["type"] = typing.get_args(base)[0]
        else:
            kwargs["type"] = base
        sections[field_group or "general"].add_argument(_flag(f), **kwargs)


def _help_sections(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """One argument group per flag_help.GROUPS entry, made once per parser in display order
    (argparse leaves empty groups out of --help)."""
    existing = {g.title: g for g in parser._action_groups}
    return {name: existing.get(name) or parser.add_argument_group(name)
            for name in flag_help.GROUPS}


def from_environ(cls: type, environ: Mapping[str, str]) -> dict[str, Any]:
    """The values of `cls` (nested like the YAML file) that TANDEM_* variables set."""
    values: dict[str, Any] = {}
    for f, tp in _fields(cls):
        if _is_config_class(tp):
            if nested := from_environ(tp, environ):
                values[f.name] = nested
            continue
        var = env_var(f)
        raw = environ.get(var, "").strip() if var else ""
        if var and raw and not _is_list_of_configs(_scalar_type(tp)):
            values[f.name] = _parse_env(var, raw, _scalar_type(tp))
    return values


def _parse_env(var: str, raw: str, base: Any) -> Any:
    if typing.get_origin(base) in (list, tuple):
        item = typing.get_args(base)[0]
        return [_parse_env(var, part, item) for part in re.split(r"[,\s]+", raw) if part]
    if base is bool:
        if raw.lower() not in _TRUE | _FALSE:
            raise InvalidRequest(f"${var} must be true or false, got {raw!r}", param=var)
        return raw.lower() in _TRUE
    if base in (int, float):
        try:
            return base(raw)
        except ValueError:
            raise InvalidRequest(f"${var} must be {base.__name__}, got {raw!r}",
                                 param=var) from None
    return raw


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for dotted, value in flat.items():
        node = nested
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def build(cls: type[T], values: dict[str, Any], where: str = "") -> T:
    """Constructs `cls` from a nested dict, rejecting unknown keys and wrong types by name."""
    known = {f.name: (f, tp) for f, tp in _fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise InvalidRequest(f"unknown config key {where}{unknown[0]} (known: {', '.join(known)})",
                             param=where + unknown[0])
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        f, tp = known[name]
        if _is_config_class(tp):
            if not isinstance(value, dict):
                raise InvalidRequest(f"config key {where}{name} must be a mapping")
            kwargs[name] = build(tp, value, f"{where}{name}.")
        else:
            kwargs[name] = _coerce(value, tp, where + name)
    return cls(**kwargs)


def _is_list_of_configs(tp: Any) -> bool:
    args = typing.get_args(tp)
    return typing.get_origin(tp) in (list, tuple) and bool(args) and _is_config_class(args[0])


def _coerce(value: Any, tp: Any, key: str) -> Any:
    base = _scalar_type(tp)
    if value is None and base is not tp:
        return None
    origin = typing.get_origin(base)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise InvalidRequest(f"config key {key} must be a list", param=key)
        item = typing.get_args(base)[0]
        if _is_config_class(item):
            for i, v in enumerate(value):
                if not isinstance(v, dict):
                    raise InvalidRequest(f"config key {key}[{i}] must be a mapping",
                                         param=f"{key}[{i}]")
            items = [build(item, v, f"{key}[{i}].") for i, v in enumerate(value)]
        else:
            items = [_coerce(v, item, key) for v in value]
        return tuple(items) if origin is tuple else items
    if base in _SCALARS:
        if base is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not isinstance(value, base) or (base is not bool and isinstance(value, bool)):
            raise InvalidRequest(
                f"config key {key} must be {base.__name__}, got {value!r}", param=key)
    return value


def build_parser(cls: type, prog: str, description: str = "") -> argparse.ArgumentParser:
    """The command line of `cls`: --config, then one flag per leaf field, by section."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=_EPILOG,
                                     usage="%(prog)s [--config FILE] [flags]")
    parser.add_argument("--config", type=pathlib.Path, default=None, metavar="FILE",
                        help="YAML file of config values, keys named as the flags with "
                             "underscores (TANDEM_* variables and flags override it)")
    add_arguments(parser, cls)
    return parser


def load(cls: type[T], argv: Sequence[str] | None, prog: str, description: str = "",
         environ: Mapping[str, str] | None = None) -> T:
    """Parses argv (with an optional `--config FILE.yaml`) and the TANDEM_* variables of
    `environ` (default: this process's) into a `cls` instance."""
    config, _ = load_known(cls, argv, prog, description, allow_extra=False, environ=environ)
    return config


def load_known(cls: type[T], argv: Sequence[str] | None, prog: str, description: str = "",
               allow_extra: bool = True,
               environ: Mapping[str, str] | None = None) -> tuple[T, list[str]]:
    """Like `load`, but returns the arguments `cls` does not know instead of failing on them."""
    parser = build_parser(cls, prog, description)
    if allow_extra:
        parsed, extra = parser.parse_known_args(argv)
    else:
        parsed, extra = parser.parse_args(argv), []
    ns = vars(parsed)
    config_file = ns.pop("config")
    values: dict[str, Any] = {}
    if config_file is not None:
        loaded = yaml.safe_load(config_file.read_text()) or {}
        if not isinstance(loaded, dict):
            raise InvalidRequest(f"{config_file} must hold a YAML mapping")
        values = loaded
    values = _merge(values, from_environ(cls, os.environ if environ is None else environ))
    return build(cls, _merge(values, _nest(ns))), extra


def as_dict(config: Any) -> dict[str, Any]:
    """The whole config as plain data, for the start-up log line (secrets redacted)."""
    values = dataclasses.asdict(config)
    _redact(type(config), values)
    return values


def _redact(cls: type, values: dict[str, Any]) -> None:
    for f, tp in _fields(cls):
        if f.metadata.get("secret") and values.get(f.name):
            values[f.name] = "<redacted>"
        elif _is_config_class(tp):
            _redact(tp, values[f.name])


def to_argv(config: Any) -> list[str]:
    """The flags that reproduce `config`'s non-default values (for launching child processes)."""
    argv: list[str] = []
    defaults = type(config)()
    for f, tp in _fields(type(config)):
        value, default = getattr(config, f.name), getattr(defaults, f.name)
        if _is_config_class(tp):
            argv += to_argv(value)
        elif value != default:
            flag = _flag(f)
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + flag[2:])
            elif isinstance(value, (list, tuple)):
                argv += [flag, *map(str, value)]
            else:
                argv += [flag, str(value)]
    return argv

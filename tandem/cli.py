"""The `tandem` command: `tandem up` runs a topology, `tandem serve <stage>` one service,
`tandem status` asks the router how its workers are (and the planner, where one runs)."""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn

from tandem.errors import TandemError
from tandem.runtime.termination_log import write_reason

# stage -> (module, function taking the remaining argv, one line for help); imported lazily.
_SERVE: dict[str, tuple[str, str, str]] = {
    "frontend": ("services.frontend.main", "main",
                 "the OpenAI REST and public gRPC APIs: tokenizes, routes, streams"),
    "router": ("services.router.main", "main",
               "picks pools (SLA grid) and workers (KV-aware, load) for each request"),
    "prefill": ("services.common.worker_main", "main",
                "runs prompts and hands their KV cache to decode workers over NIXL"),
    "decode": ("services.common.worker_main", "main",
               "generates tokens (prefilling itself in aggregated mode)"),
    "encode": ("services.common.worker_main", "main",
               "turns images into embeddings (vision tower and projector)"),
    "embed": ("services.common.worker_main", "main",
              "turns texts (token ids) into embeddings (an embedding model's pooled states)"),
    "video": ("services.video.main", "main",
              "generates videos from prompts (diffusion: Wan through diffusers or TensorRT-LLM)"),
    "planner": ("services.planner.main", "main",
                "sizes pools to their SLA targets from live metrics (tandem up --planner)"),
}
_WORKER_STAGES = {"decode", "prefill", "encode", "embed", "video"}


def _up(args: list[str]) -> int:
    # The launcher forks its children while gRPC threads of its own run (its health probes;
    # with --planner, its control API). gRPC's C-core fork handlers can do nothing for a
    # child then but log a line to the console per fork; Python's gRPC leaves fork support
    # off anyway. Set before gRPC initialises (the import below).
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from tandem.launcher.up import main as up_main
    up_main(args)
    return 0


def _status(args: list[str]) -> int:
    from tandem.launcher.status import main as status_main
    return status_main(args)


def _check_engine(args: list[str]) -> int:
    from tandem.engines.trtllm.check import main as check_main
    return check_main(args)


def _profile(args: list[str]) -> int:
    from tandem.planner.profiler import main as profile_main
    return profile_main(args)


def _demo_model(args: list[str]) -> int:
    if args:
        print("usage: tandem demo-model\n\nPrints the demo model's directory, creating it "
              "if needed.", file=sys.stderr)
        return 0 if args[0] in ("-h", "--help") else 2
    from tandem.model.demo import ensure_demo_model
    print(ensure_demo_model())
    return 0


def _serve(args: list[str]) -> int:
    if not args or args[0] not in _SERVE:
        print(_serve_usage(), file=sys.stderr)
        return 0 if args and args[0] in ("-h", "--help") else 2
    stage, rest = args[0], args[1:]
    module, func, _ = _SERVE[stage]
    entry = getattr(importlib.import_module(module), func)
    entry(stage, rest) if stage in _WORKER_STAGES else entry(rest)
    return 0


# command -> (what runs it, one line for `tandem --help`)
_COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "up": (_up, "start a whole topology here as processes; READY once every worker serves"),
    "serve": (_serve, "run one service: " + ", ".join(_SERVE)),
    "status": (_status, "the router's workers: candidate or not (and why), load, KV use"),
    "demo-model": (_demo_model, "print the demo model's directory, creating it if needed"),
    "check-engine": (_check_engine, "aggregated vs disaggregated tokens on a real engine"),
    "profile": (_profile, "measure one worker and write the capacity profile the planner reads"),
}


def _usage() -> str:
    lines = ["usage: tandem <command> [flags]", "",
             "Tandem: disaggregated LLM serving as gRPC services.", "", "commands:"]
    lines += [f"  {name:<14}{line}" for name, (_, line) in _COMMANDS.items()]
    lines += ["", "Each command takes --help; `tandem serve <stage> --help` lists a service's",
              "flags by concern.", f"tandem {_version()}"]
    return "\n".join(lines)


def _serve_usage() -> str:
    lines = ["usage: tandem serve <stage> [flags]", "", "stages:"]
    lines += [f"  {name:<10}{line}" for name, (_, _, line) in _SERVE.items()]
    lines += ["", "`tandem serve <stage> --help` lists the stage's flags."]
    return "\n".join(lines)


def _version() -> str:
    from tandem.runtime.build_info import version

    return version()


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _dispatch(args)
    except TandemError as exc:  # bad flags or config: a message, not a traceback
        _fail(_command(args), exc.message, 2)
    except Exception as exc:  # a crash: the traceback for its developer, a line for the operator
        traceback.print_exc()
        _fail(_command(args), f"{type(exc).__name__}: {exc}", 1)
    if code:
        sys.exit(code)


def _command(args: list[str]) -> str:
    """`tandem serve decode`, `tandem up`: who is failing, for its error line."""
    words = args[:2] if args[:1] == ["serve"] and args[1:2] and args[1] in _SERVE else args[:1]
    return " ".join(["tandem", *(w for w in words if not w.startswith("-"))])


def _fail(command: str, reason: str, code: int) -> NoReturn:
    """Says why in one line, on stderr and in $TANDEM_TERMINATION_LOG when set (as Kubernetes'
    terminationMessagePath: `tandem up` repeats that line for a service that did not start)."""
    line = " ".join(reason.split())
    print(f"{command}: error: {line}", file=sys.stderr, flush=True)
    write_reason(line)
    sys.exit(code)


def _dispatch(args: list[str]) -> int:
    command = args[0] if args else ""
    if command in _COMMANDS:
        run, _ = _COMMANDS[command]
        return run(args[1:])
    if command == "--version":
        print(f"tandem {_version()}")
        return 0
    print(_usage(), file=sys.stderr if command not in ("-h", "--help") else sys.stdout)
    return 0 if command in ("-h", "--help") else 2


if __name__ == "__main__":
    main()

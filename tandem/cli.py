"""The `tandem` command: `tandem serve <stage> [flags]` runs one service, `tandem up` a topology."""
from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from tandem.errors import TandemError

# stage -> (module, function taking the remaining argv); imported lazily per stage.
_SERVE: dict[str, tuple[str, str]] = {
    "frontend": ("services.frontend.main", "main"),
    "router": ("services.router.main", "main"),
    "decode": ("services.common.worker_main", "main"),
    "prefill": ("services.common.worker_main", "main"),
    "encode": ("services.common.worker_main", "main"),
}
_WORKER_STAGES = {"decode", "prefill", "encode"}
_USAGE = """usage: tandem serve <frontend|router|prefill|decode|encode> [flags]
       tandem up [--config FILE] [--engine mock] [--model PATH] [engine flags]
       tandem demo-model            (prints the demo model directory, creating it if needed)
       tandem check-engine --engine trtllm --model PATH [engine flags]
                                    (aggregated vs disaggregated tokens on a real engine)
Each command takes --help."""


def main(argv: Sequence[str] | None = None) -> None:
    try:
        _dispatch(list(sys.argv[1:] if argv is None else argv))
    except TandemError as exc:  # bad flags or config: a message, not a traceback
        print(f"tandem: error: {exc.message}", file=sys.stderr)
        sys.exit(2)


def _dispatch(args: list[str]) -> None:
    command = args[0] if args else ""
    if command == "serve" and len(args) > 1 and args[1] in _SERVE:
        stage, rest = args[1], args[2:]
        module, func = _SERVE[stage]
        entry = getattr(importlib.import_module(module), func)
        entry(stage, rest) if stage in _WORKER_STAGES else entry(rest)
    elif command == "up":
        from tandem.launcher.up import main as up_main
        up_main(args[1:])
    elif command == "check-engine":
        from tandem.engines.trtllm.check import main as check_main
        sys.exit(check_main(args[1:]))
    elif command == "demo-model":
        from tandem.model.demo import ensure_demo_model
        print(ensure_demo_model())
    else:
        print(_USAGE, file=sys.stderr)
        sys.exit(0 if command in ("-h", "--help") else 2)


if __name__ == "__main__":
    main()

"""Parsing a `tandem serve ...` command line with this version's real CLI, without serving: the
deployment tests (compose, Kubernetes) check every command they ship with it."""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any
from unittest import mock

from tandem import cli
from tandem.runtime import loop


def parse_serve(argv: Sequence[str], environ: Mapping[str, str] | None = None
                ) -> tuple[str, Any]:
    """Runs `tandem serve STAGE FLAGS...` through the real CLI (tandem.cli.main) up to the point
    where it would start serving, and returns the stage and the typed config it built. An
    unknown flag or a bad value makes the CLI exit (SystemExit 2), failing the caller.
    `environ`: variables the service's environment adds (TANDEM_* settings)."""
    assert list(argv[:2]) == ["tandem", "serve"], argv
    built: list[Any] = []

    def capture(main: Any) -> None:
        built.append(main.cr_frame.f_locals["config"])
        main.close()

    with mock.patch.object(loop, "run", capture), mock.patch.dict(os.environ, environ or {}):
        cli.main(list(argv[1:]))
    assert len(built) == 1, f"`{' '.join(argv)}` did not reach the point of serving"
    return argv[2], built[0]

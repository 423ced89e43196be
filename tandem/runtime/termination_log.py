"""A command's termination log: the file a failing command writes its one-line reason to, as
Kubernetes' terminationMessagePath. `tandem up` names one for each child and repeats its line
when that child did not start."""
from __future__ import annotations

import contextlib
import os
import pathlib

#: File a command writes its one-line reason to when it fails (unset: none).
TERMINATION_LOG_ENV = "TANDEM_TERMINATION_LOG"


def write_reason(line: str) -> None:
    """Writes `line` to $TANDEM_TERMINATION_LOG when it is set; a file that cannot be written
    is passed over (the line is on stderr too)."""
    if path := os.environ.get(TERMINATION_LOG_ENV):
        with contextlib.suppress(OSError):
            pathlib.Path(path).write_text(line + "\n")

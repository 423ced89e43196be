"""Runs a test script under Triton's interpreter on the CPU (TRITON_INTERPRET=1 is read when the
kernels are defined, hence a subprocess), with what every such script needs first: the NumPy
2.4 workaround for Triton 3.6's interpreter, `Tile` (an autotuned kernel launched with one of
its configs: autotuning needs a GPU) and `rel` (relative error in float64)."""
from __future__ import annotations

import os
import subprocess
import sys

PREAMBLE = r'''
import torch
from triton.runtime import interpreter

# NumPy 2.4 refuses int() of a one-element array, which the interpreter of Triton 3.6 takes
# of a loaded scalar (a loop bound): read it with .item() instead.
_patch_tensor = interpreter._patch_lang_tensor


def _patch_lang_tensor(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))


interpreter._patch_lang_tensor = _patch_lang_tensor


class Tile:
    """An autotuned kernel launched with its config `index` (autotuning needs a GPU)."""

    def __init__(self, tuner, index=0):
        self.tuner, self.config = tuner, tuner.configs[index]

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            meta = self.config.kwargs
            return self.tuner.fn[grid(meta) if callable(grid) else grid](*args, **kwargs, **meta)
        return launch


def rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()
'''


def run_interpreted(script: str) -> None:
    """Runs PREAMBLE + `script` in the interpreter; it must print "ok" last."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", PREAMBLE + script], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]

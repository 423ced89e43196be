"""The devices a worker computes on, as it sees them itself: what `CUDA_VISIBLE_DEVICES` gives
it (the launcher sets it per placed worker; compose and Kubernetes through the container
runtime) and, where its engine initialised CUDA anyway, the devices' names. Shown by `tandem
status` and Worker.Stats (WorkerDevice in kv_events.proto)."""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Device:
    #: As CUDA_VISIBLE_DEVICES names it (a host index, or a GPU or MIG UUID); without it, the
    #: CUDA ordinal; "cpu" for a worker without CUDA.
    id: str
    #: As CUDA reports it ("NVIDIA H200"); "" where the engine did not initialise CUDA.
    name: str = ""


CPU: tuple[Device, ...] = (Device("cpu"),)


def _visible_entries(value: str) -> list[str]:
    """CUDA_VISIBLE_DEVICES's devices: CUDA stops at the first entry it cannot take (an empty or
    negative one: "-1" hides every GPU)."""
    entries: list[str] = []
    for entry in (e.strip() for e in value.split(",")):
        if not entry or entry.startswith("-"):
            break
        entries.append(entry)
    return entries


def cuda_device_names() -> list[str]:
    """The names of the CUDA devices this process sees, in ordinal order, if its engine already
    initialised CUDA; [] otherwise. Never imports torch nor initialises CUDA: a worker whose
    engine does not use the GPU (the mock engine) must not pay for it."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return []
    return [str(torch.cuda.get_device_name(i)) for i in range(torch.cuda.device_count())]


def worker_devices(environ: Mapping[str, str] | None = None,
                   names: list[str] | None = None) -> tuple[Device, ...]:
    """The worker's devices: CUDA_VISIBLE_DEVICES's entries named by ordinal from `names` (by
    default `cuda_device_names()`), or, without the variable, the devices CUDA initialised;
    `CPU` when there are none. Call it after the engine started (it initialises CUDA)."""
    environ = os.environ if environ is None else environ
    names = cuda_device_names() if names is None else names
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    ids = [str(i) for i in range(len(names))] if visible is None else _visible_entries(visible)
    if not ids:
        return CPU
    return tuple(Device(d, names[i] if i < len(names) else "") for i, d in enumerate(ids))


def describe(devices: tuple[Device, ...]) -> str:
    """One short cell for people: "cpu", "3", "2,3 NVIDIA H200" (names said once when they are
    the same), "0 NVIDIA H200, 1 NVIDIA A100"; "-" for none (a worker that does not say)."""
    if not devices:
        return "-"
    ids = ",".join(d.id for d in devices)
    names = {d.name for d in devices}
    if len(names) == 1:
        (name,) = names
        return f"{ids} {name}" if name else ids
    return ", ".join(f"{d.id} {d.name}".rstrip() for d in devices)

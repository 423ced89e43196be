"""Which GPUs each worker of `tandem up` runs on, and the share of their memory it may hold.

A pool lists one entry per worker (per port, in order): a comma-separated list of GPU indices as
the host numbers them (nvidia-smi's order: "0", "1", "2,3"). The launcher hands each placed
worker `CUDA_VISIBLE_DEVICES` with its list and `CUDA_DEVICE_ORDER=PCI_BUS_ID` (CUDA's own
default order is fastest-first, which need not match nvidia-smi), so the worker sees only its
GPUs, renumbered from cuda:0. A pool without entries places nothing: its workers see what the
launcher sees.

Two workers share a GPU only when asked: every worker on a shared GPU must declare its share of
the GPU's memory (--gpu-memory-fraction, which the reference engine sizes its KV pool by), and the
shares on each GPU must sum to at most the whole GPU. A share without placement is passed on as
well (a worker next to a process Tandem does not start).
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.errors import InvalidRequest
from tandem.launcher.deployment import DeploymentPool

#: Engines that compute nothing on a GPU: placing their workers would only look meaningful.
CPU_ONLY_ENGINES = frozenset({"mock"})
#: The worker flag that carries a pool's share (EngineArgs.gpu_memory_fraction).
FRACTION_FLAG = "--gpu-memory-fraction"
#: Shares on one GPU may sum to 1.0 written as 0.34 + 0.56 + 0.1 (1.0000000000000002).
_SUM_TOLERANCE = 1e-9
_INDEX = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class PoolFields:
    """The config keys that set one pool's placement, named in errors (`param`)."""

    #: The key of the pool's GPU entries: "decode_gpus", "pools[1].gpus", ...
    gpus: str
    #: The key of its share: "decode_gpu_memory_fraction", "pools[1].gpu_memory_fraction", ...
    gpu_memory_fraction: str

    @classmethod
    def of_yaml(cls, path: str) -> PoolFields:
        """The fields of a pool written in YAML at `path` ("pools[0]", "models[1].pools[0]")."""
        return cls(f"{path}.gpus", f"{path}.gpu_memory_fraction")

    @classmethod
    def flat(cls, kind: str) -> PoolFields:
        """The fields of a pool the flat flags describe (--decode-gpus, ...)."""
        return cls(f"{kind}_gpus", f"{kind}_gpu_memory_fraction")


@dataclass(frozen=True)
class PlacedWorker:
    """One worker as the shared-GPU check sees it."""

    #: Its process name ("decode-0").
    name: str
    #: Host GPU indices it sees; (): not placed.
    gpus: tuple[int, ...]
    #: The share of its GPU's memory it may hold (the last --gpu-memory-fraction of its
    #: command line); 0: the whole GPU.
    memory_fraction: float
    fields: PoolFields
    #: Whether it can hold a share at all (video workers take no --gpu-memory-fraction).
    takes_share: bool = True


def parse_gpus(entry: str, param: str) -> tuple[int, ...]:
    """The GPU indices of one worker's entry ("2,3" -> (2, 3)).

    Raises:
        InvalidRequest: an empty entry, an index that is not a non-negative integer, or an
            index listed twice.
    """
    parts = [part.strip() for part in entry.split(",")]
    bad = [part for part in parts if not _INDEX.fullmatch(part)]
    if bad:
        raise InvalidRequest(f"{param} entry {entry!r}: GPU indices are non-negative integers "
                             f"separated by commas (as nvidia-smi numbers the GPUs), got "
                             f"{bad[0]!r}", param=param)
    gpus = tuple(int(part) for part in parts)
    twice = sorted({gpu for gpu in gpus if gpus.count(gpu) > 1})
    if twice:
        raise InvalidRequest(f"{param} entry {entry!r} lists GPU {twice[0]} twice", param=param)
    return gpus


def pool_gpus(pool: DeploymentPool, fields: PoolFields, engine: str, device: str,
              ranks: int = 1) -> list[tuple[int, ...]]:
    """The GPUs of each worker of `pool`, in port order; [] when the pool places nothing.
    `engine` and `device` are what its workers run (EngineArgs.device; video pools: ignored),
    `ranks` the GPUs each worker computes on (--tensor-parallel-size).

    Raises:
        InvalidRequest: a share outside [0, 1], or one on a video pool; GPU entries that do not
            number the pool's workers, or that parse_gpus refuses; placement with an engine or
            a device that uses no GPU, or a cuda:N a placed worker would not see; an entry
            of fewer GPUs than `ranks`.
    """
    fraction = pool.gpu_memory_fraction
    if not 0.0 <= fraction <= 1.0:  # NaN too
        raise InvalidRequest(f"{fields.gpu_memory_fraction} must be within [0, 1] (0: the "
                             f"whole GPU), got {fraction}", param=fields.gpu_memory_fraction)
    if fraction and pool.kind == "video":
        raise InvalidRequest(f"video workers take no {FRACTION_FLAG}: drop "
                             f"{fields.gpu_memory_fraction} and give each its own GPU",
                             param=fields.gpu_memory_fraction)
    if not pool.gpus:
        return []
    if len(pool.gpus) != len(pool.ports):
        raise InvalidRequest(f"{fields.gpus} lists {len(pool.gpus)} entries for "
                             f"{len(pool.ports)} workers (one entry per port, in order)",
                             param=fields.gpus)
    gpus = [parse_gpus(entry, fields.gpus) for entry in pool.gpus]
    if pool.kind == "video":
        return gpus  # the video engines (diffusers, TensorRT-LLM) run on CUDA
    if engine in CPU_ONLY_ENGINES:
        raise InvalidRequest(f"{fields.gpus} places workers on GPUs, but the {engine} engine "
                             "computes nothing on a GPU and would ignore it: drop "
                             f"{fields.gpus}, or use --engine reference", param=fields.gpus)
    if device == "cpu":
        raise InvalidRequest(f"{fields.gpus} places workers on GPUs, but --device is cpu: use "
                             "--device auto (or cuda)", param=fields.gpus)
    fewest = min(len(worker) for worker in gpus)
    if fewest < ranks:
        short = next(entry for entry, worker in zip(pool.gpus, gpus) if len(worker) == fewest)
        raise InvalidRequest(f"{fields.gpus} entry {short!r} lists {fewest} GPU(s) for a worker "
                             f"of --tensor-parallel-size {ranks}: list {ranks} GPUs per worker "
                             f"(e.g. \"{','.join(map(str, range(ranks)))}\")",
                             param=fields.gpus)
    if (ordinal := _cuda_ordinal(device)) is not None:
        if ordinal >= fewest:
            # CUDA_VISIBLE_DEVICES renumbers a worker's GPUs from 0.
            raise InvalidRequest(f"--device {device} names the worker's GPU {ordinal}, but a "
                                 f"placed worker sees only its own, numbered from 0, and an "
                                 f"entry of {fields.gpus} lists {fewest}: use --device auto",
                                 param=fields.gpus)
    return gpus


def _cuda_ordinal(device: str) -> int | None:
    prefix, _, index = device.partition(":")
    return int(index) if prefix == "cuda" and index.isdigit() else None


def gpu_env(gpus: Sequence[int]) -> dict[str, str]:
    """The environment that shows a worker only `gpus` (host indices); {} for none."""
    if not gpus:
        return {}
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": ",".join(str(gpu) for gpu in gpus)}


def fraction_flags(pool: DeploymentPool) -> list[str]:
    """The worker flags that pass `pool`'s share on; [] when it sets none."""
    return [FRACTION_FLAG, str(pool.gpu_memory_fraction)] if pool.gpu_memory_fraction else []


def argv_fraction(argv: Sequence[str]) -> float:
    """The share a worker's command line gives it: its last --gpu-memory-fraction (so the
    engine-wide flag, a pool's share and a pool's worker_flags all count, last one winning,
    as the worker's own parser takes them); 0.0 without one.

    Raises:
        InvalidRequest: a value that is not a number.
    """
    value = ""
    for i, arg in enumerate(argv):
        if arg == FRACTION_FLAG and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(FRACTION_FLAG + "="):
            value = arg.partition("=")[2]
    try:
        return float(value) if value else 0.0
    except ValueError:
        raise InvalidRequest(f"{FRACTION_FLAG} must be a number, got {value!r}",
                             param="worker_flags") from None


def check_shared_gpus(workers: Sequence[PlacedWorker]) -> None:
    """Refuses workers that would share a GPU without asking for it: on a GPU listed by
    several workers, every one of them must have a share > 0 (a video worker cannot have
    one), and their shares must sum to at most 1.0.

    Raises:
        InvalidRequest: naming the GPU, its workers and the field to set.
    """
    on_gpu: dict[int, list[PlacedWorker]] = {}
    for worker in workers:
        for gpu in worker.gpus:
            on_gpu.setdefault(gpu, []).append(worker)
    for gpu, sharing in sorted(on_gpu.items()):
        if len(sharing) < 2:
            continue
        names = _names(sharing)
        for worker in sharing:
            if not worker.takes_share:
                raise InvalidRequest(f"GPU {gpu} is listed for {names}, but {worker.name} is a "
                                     "video worker, which takes no memory share: give it a GPU "
                                     "of its own", param=worker.fields.gpus)
            if worker.memory_fraction <= 0:
                raise InvalidRequest(
                    f"GPU {gpu} is listed for {names}: workers share a GPU only with a "
                    f"gpu_memory_fraction > 0 each, summing to at most 1.0, and {worker.name} "
                    f"has none: set {worker.fields.gpu_memory_fraction} (or give it a GPU of "
                    "its own)", param=worker.fields.gpu_memory_fraction)
        total = sum(worker.memory_fraction for worker in sharing)
        if total > 1.0 + _SUM_TOLERANCE:
            shares = ", ".join(f"{w.name} {w.memory_fraction:g}" for w in sharing)
            raise InvalidRequest(
                f"GPU {gpu} is listed for {names}, whose gpu_memory_fraction values ({shares}) "
                f"sum to {total:g}, more than the whole GPU (1.0): lower them",
                param=sharing[0].fields.gpu_memory_fraction)


def _names(workers: Sequence[PlacedWorker]) -> str:
    names = [w.name for w in workers]
    return ", ".join(names[:-1]) + " and " + names[-1]

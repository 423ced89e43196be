"""What `tandem up` runs in each pool it can resize, as its control API (Launcher.ListPools,
tandem.runtime.launcher_control) and `tandem status` show it."""
from __future__ import annotations

import enum
from dataclasses import dataclass

#: Pools a planner may resize: those that serve tokens (the planner's prefill, decode and agg
#: roles). Encode, video and embedding pools keep the size they were given.
SCALABLE_KINDS = ("decode", "agg", "prefill")


class WorkerPhase(enum.Enum):
    #: Started; its health has not said SERVING yet.
    STARTING = "starting"
    #: Its health said SERVING (restarted if it exits).
    SERVING = "serving"
    #: Told to go: finishing what it runs, then exits; never restarted.
    DRAINING = "draining"


@dataclass(frozen=True)
class WorkerView:
    #: The router's id of the worker: its gRPC address, host:port.
    worker_id: str
    #: Its process name ("decode-2").
    name: str
    phase: WorkerPhase
    #: Host GPU indices it sees; (): not placed.
    gpus: tuple[int, ...] = ()
    #: Its process id; 0 when not known (waiting out a restart back-off).
    pid: int = 0


@dataclass(frozen=True)
class PoolView:
    name: str
    #: The router's pool kind (SCALABLE_KINDS).
    kind: str
    #: Oldest first, draining ones included.
    workers: tuple[WorkerView, ...]
    #: Most workers its GPU entries allow; 0: no limit (not placed).
    max_workers: int = 0

    @property
    def num_workers(self) -> int:
        """Workers it has, as a planner counts them: starting ones in, draining ones out."""
        return sum(w.phase is not WorkerPhase.DRAINING for w in self.workers)


@dataclass(frozen=True)
class ScaleResult:
    """What a ScalePool call left: the pool, and why it fell short of the target ("" if not)."""

    pool: PoolView
    shortfall: str = ""

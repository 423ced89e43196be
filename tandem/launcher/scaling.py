"""How `tandem up` resizes a pool when its planner asks (Launcher.ScalePool).

Growing starts workers as the pool's first ones were started (tandem.launcher.workers), on free
ports, each on a free GPU entry of the pool when it is placed (its `gpus` and `spare_gpus`), and
adds them to the router's pools at once: the router follows a starting worker and routes to it
once its health says SERVING and its event stream is up.

Shrinking loses nothing: a worker chosen to go is marked draining (no longer counted), taken off
the supervisor's restart list and sent SIGTERM; its health then says NOT_SERVING, so the router
and every frontend's local router stop routing to it, it refuses new requests with UNAVAILABLE
(which a frontend retries elsewhere, nothing having streamed) and finishes its in-flight streams
within its grace period (past it they are cut and the frontend migrates them). Only once it has
exited does it leave the router's pools, and with them the router's prefix index.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tandem.errors import InvalidRequest, NotFound, Unavailable
from tandem.launcher import placement
from tandem.launcher.deployment import DeploymentPool
from tandem.launcher.pool_view import (
    SCALABLE_KINDS,
    PoolView,
    ScaleResult,
    WorkerPhase,
    WorkerView,
)
from tandem.launcher.served_models import ModelTopology
from tandem.launcher.workers import ServiceProcess, SharedFlags, pool_worker
from tandem.runtime.tasks import spawn

if TYPE_CHECKING:
    from tandem.launcher.deployment import Deployment

log = logging.getLogger("tandem.up")


class Processes(Protocol):
    """What the scaler needs of the launcher's process management."""

    def start(self, spec: ServiceProcess) -> None:
        """Starts `spec` and supervises it (restarted if it exits)."""

    async def serving(self, spec: ServiceProcess) -> bool:
        """True once its health says SERVING, across restarts; False once it is stopped."""

    async def stop(self, name: str) -> None:
        """Stops it for good: never restarted, SIGTERM, returns once it exited (killed if it
        outlives its grace period)."""

    def pid(self, name: str) -> int:
        """Its process id now; 0 when none runs."""


@dataclass
class _Worker:
    spec: ServiceProcess
    port: int
    #: Index of its GPU entry in the pool's slots; None: not placed.
    slot: int | None
    phase: WorkerPhase = WorkerPhase.STARTING


@dataclass
class _Pool:
    config: DeploymentPool
    #: GPU entries of the pool (gpus, then spare_gpus); []: not placed.
    slots: list[tuple[int, ...]]
    workers: list[_Worker]
    #: Index of the next worker's name: never reused within a run.
    next_index: int

    def free_slot(self) -> int | None:
        held = {w.slot for w in self.workers}
        return next((i for i in range(len(self.slots)) if i not in held), None)


class PoolScaler:
    """The pools of one model that a planner may resize (SCALABLE_KINDS), and the workers each
    runs. Scaling is refused until `open` (the topology is ready and supervised).

    Args:
        initial: the topology's workers, as tandem.launcher.workers.model_workers made them.
        publish: told each pool's worker ports whenever members change (the router learns).
        free_port: a port nothing listens on, for a new worker (and its metrics, if workers
            have metrics ports).
    """

    def __init__(self, d: Deployment, model: ModelTopology, initial: Sequence[ServiceProcess],
                 processes: Processes, publish: Callable[[Mapping[str, list[int]]], None],
                 free_port: Callable[[], int]) -> None:
        self.d, self.model = d, model
        self.flags = SharedFlags.of(d)
        self.processes = processes
        self.publish = publish
        self.free_port = free_port
        self.is_open = False
        self._tasks: set[asyncio.Task[None]] = set()
        by_name = {spec.name: spec for spec in initial}
        self.pools: dict[str, _Pool] = {}
        for pool, fields in zip(model.pools, model.pool_fields, strict=True):
            if pool.kind not in SCALABLE_KINDS:
                continue
            slots = [_env_gpus(by_name[f"{pool.name}-{i}"]) for i in range(len(pool.ports))]
            if any(slots):
                slots += spare_slots(pool, fields, model.engine_args.tensor_parallel_size,
                                     initial)
            elif pool.spare_gpus:
                raise InvalidRequest(f"{fields.gpus.rsplit('.', 1)[0]}.spare_gpus lists GPUs "
                                     "for a pool whose workers are not placed: list `gpus` too",
                                     param=f"{pool.name}.spare_gpus")
            workers = [_Worker(by_name[f"{pool.name}-{i}"], port, i if any(slots) else None)
                       for i, port in enumerate(pool.ports)]
            self.pools[pool.name] = _Pool(pool, slots if any(slots) else [], workers,
                                          len(pool.ports))

    def start(self) -> None:
        """Follows the initial workers until they serve (call on the event loop)."""
        for pool in self.pools.values():
            for worker in pool.workers:
                spawn(self._follow(worker), self._tasks)

    def open(self) -> None:
        """The topology is ready and supervised: ScalePool acts from now on."""
        self.is_open = True

    def views(self) -> list[PoolView]:
        return [self._view(pool) for pool in self.pools.values()]

    def scale(self, name: str, target: int, remove: Sequence[str] = ()) -> ScaleResult:
        """Brings pool `name` to `target` workers (module docstring); returns once workers are
        started or told to drain. Raises NotFound (no such pool, or one it cannot resize),
        InvalidRequest (target < 1), Unavailable (the topology is still starting)."""
        pool = self.pools.get(name)
        if pool is None:
            raise NotFound(f"no pool '{name}' that the launcher can resize (its pools: "
                           f"{', '.join(self.pools) or 'none'})", param="pool")
        if target < 1:
            raise InvalidRequest(f"pool '{name}': target must be at least 1 (a pool of no "
                                 f"workers serves nothing), got {target}", param="target")
        if not self.is_open:
            raise Unavailable("the deployment is still starting; scale it once it is ready")
        live = [w for w in pool.workers if w.phase is not WorkerPhase.DRAINING]
        shortfall = ""
        if target > len(live):
            shortfall = self._grow(pool, target - len(live))
        elif target < len(live):
            self._shrink(pool, _victims(live, len(live) - target, remove))
        return ScaleResult(self._view(pool), shortfall)

    def _grow(self, pool: _Pool, count: int) -> str:
        for _ in range(count):
            slot = pool.free_slot() if pool.slots else None
            if pool.slots and slot is None:
                return (f"no free GPU entry for another worker (the pool has "
                        f"{len(pool.slots)}: gpus and spare_gpus)")
            port = self.free_port()
            spec = pool_worker(self.d, self.model, pool.config, self.flags,
                               f"{pool.config.name}-{pool.next_index}", port,
                               pool.slots[slot] if slot is not None else ())
            if self.d.worker_metrics_ports:
                spec.argv.extend(["--metrics-port", str(self.free_port())])
            pool.next_index += 1
            worker = _Worker(spec, port, slot)
            pool.workers.append(worker)
            self.processes.start(spec)
            log.info("worker added", extra={"pool": pool.config.name, "service": spec.name,
                                            "worker": spec.health_address})
            spawn(self._follow(worker), self._tasks)
        self._publish()
        return ""

    def _shrink(self, pool: _Pool, victims: Sequence[_Worker]) -> None:
        for worker in victims:
            worker.phase = WorkerPhase.DRAINING
            log.info("worker draining", extra={"pool": pool.config.name,
                                               "service": worker.spec.name,
                                               "worker": worker.spec.health_address})
            spawn(self._retire(pool, worker), self._tasks)

    async def _follow(self, worker: _Worker) -> None:
        if await self.processes.serving(worker.spec) and worker.phase is WorkerPhase.STARTING:
            worker.phase = WorkerPhase.SERVING

    async def _retire(self, pool: _Pool, worker: _Worker) -> None:
        await self.processes.stop(worker.spec.name)
        pool.workers.remove(worker)
        log.info("worker removed", extra={"pool": pool.config.name, "service": worker.spec.name,
                                          "worker": worker.spec.health_address})
        self._publish()

    def _publish(self) -> None:
        self.publish({name: [w.port for w in pool.workers] for name, pool in self.pools.items()})

    def _view(self, pool: _Pool) -> PoolView:
        return PoolView(pool.config.name, pool.config.kind, tuple(
            WorkerView(w.spec.health_address, w.spec.name, w.phase,
                       pool.slots[w.slot] if w.slot is not None else (),
                       self.processes.pid(w.spec.name)) for w in pool.workers),
            len(pool.slots))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _victims(live: Sequence[_Worker], count: int, remove: Sequence[str]) -> list[_Worker]:
    """`count` workers to remove: those `remove` names, in its order, then the newest."""
    by_id = {w.spec.health_address: w for w in live}
    chosen = [by_id[i] for i in dict.fromkeys(remove) if i in by_id][:count]
    for worker in reversed(live):
        if len(chosen) == count:
            break
        if worker not in chosen:
            chosen.append(worker)
    return chosen


def spare_slots(pool: DeploymentPool, fields: placement.PoolFields, ranks: int,
                initial: Sequence[ServiceProcess]) -> list[tuple[int, ...]]:
    """The pool's spare GPU entries, each checked as a worker placed there would be, against the
    `initial` workers: by placement.parse_gpus, at least `ranks` GPUs, and a GPU shared (with an
    initial worker or another entry) only with the pool's gpu_memory_fraction, all shares on it
    summing to at most 1 (placement.check_shared_gpus). Raises InvalidRequest."""
    param = fields.gpus.rsplit(".", 1)[0] + ".spare_gpus"
    spare_fields = placement.PoolFields(param, fields.gpu_memory_fraction)
    placed = [placement.PlacedWorker(spec.name, _env_gpus(spec),
                                     placement.argv_fraction(spec.argv), fields)
              for spec in initial if _env_gpus(spec)]
    slots: list[tuple[int, ...]] = []
    for i, entry in enumerate(pool.spare_gpus):
        gpus = placement.parse_gpus(entry, param)
        if len(gpus) < ranks:
            raise InvalidRequest(f"{param} entry {entry!r} lists {len(gpus)} GPU(s) for a "
                                 f"worker of --tensor-parallel-size {ranks}", param=param)
        slots.append(gpus)
        placed.append(placement.PlacedWorker(f"{pool.name} spare entry {i}", gpus,
                                             pool.gpu_memory_fraction, spare_fields))
    placement.check_shared_gpus(placed)
    return slots


def _env_gpus(spec: ServiceProcess) -> tuple[int, ...]:
    """The host GPUs a worker's environment shows it (placement.gpu_env); (): not placed."""
    visible = spec.env.get("CUDA_VISIBLE_DEVICES", "")
    return tuple(int(g) for g in visible.split(",")) if visible else ()

"""Rank 0's handle on the other ranks of a tensor-parallel reference engine: it starts them
(spawned processes, one per rank), waits for their shards, sizes their KV pools, watches them,
and stops them.

A rank that dies takes the worker with it: the ranks' collectives can never pair up again, so
the worker exits at once (`watch`), its streams end as a killed worker's do, the frontend
migrates them, and the supervisor starts a new worker.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import shutil
import tempfile
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from tandem.engines.args import EngineArgs
from tandem.engines.reference.parallel import follower
from tandem.engines.reference.parallel.follower import RankSpec
from tandem.errors import InvalidRequest

#: Seconds a follower gets to stop after ("stop",) before it is killed.
_STOP_GRACE_S = 10.0


class Followers:
    """Ranks 1..size-1, each a process with a pipe to rank 0."""

    def __init__(self, processes: list[BaseProcess], conns: list[Connection],
                 workdir: str) -> None:
        self.processes = processes
        self.conns = conns
        self._workdir = workdir
        self._closing = False

    @classmethod
    def start(cls, args: EngineArgs, devices: list[str], dtype: str) -> tuple[Followers, str]:
        """Spawns a follower for each device past the first (rank r on devices[r]); returns
        them and the group's meeting point, which rank 0 joins next (init_group)."""
        workdir = tempfile.mkdtemp(prefix="tandem-tp-")
        rendezvous = f"file://{workdir}/rendezvous"
        context = multiprocessing.get_context("spawn")
        processes: list[BaseProcess] = []
        conns: list[Connection] = []
        for rank in range(1, len(devices)):
            ours, theirs = context.Pipe()
            spec = RankSpec(args, rank, len(devices), rendezvous, devices[rank], dtype)
            process = context.Process(target=follower.main, args=(spec, theirs), daemon=True,
                                      name=f"tandem-rank-{rank}")
            process.start()
            theirs.close()
            processes.append(process)
            conns.append(ours)
        return cls(processes, conns, workdir), rendezvous

    def _receive(self, rank: int) -> tuple[object, ...]:
        """The next message of `rank`, or an error if its process ended first."""
        conn, process = self.conns[rank - 1], self.processes[rank - 1]
        wait([conn, process.sentinel])
        with contextlib.suppress(EOFError, OSError):
            if conn.poll():
                message: tuple[object, ...] = conn.recv()
                return message
        process.join(1.0)
        raise RuntimeError(f"tensor-parallel rank {rank} exited (code {process.exitcode}) "
                           "while starting; its log says why")

    def ready_blocks(self) -> list[int]:
        """Each follower's KV block count, once its shard is loaded.

        Raises:
            InvalidRequest: a follower refused its shard (the message is its own).
            RuntimeError: a follower exited.
        """
        counts = []
        for rank in range(1, len(self.processes) + 1):
            message = self._receive(rank)
            if message[0] == "error":
                raise InvalidRequest(str(message[1]), param=message[2])  # type: ignore[arg-type]
            counts.append(int(message[1]))  # type: ignore[call-overload]
        return counts

    def allocate(self, num_blocks: int, host_blocks: int) -> None:
        """Every follower allocates a KV pool of `num_blocks` (and a host tier of
        `host_blocks`, 0: none); returns once all did."""
        for conn in self.conns:
            conn.send(("blocks", num_blocks, host_blocks))
        for rank in range(1, len(self.processes) + 1):
            self._receive(rank)

    def watch(self, on_lost: Callable[[int, int | None], None]) -> None:
        """Calls on_lost(rank, exit code), on a thread of its own, when a follower ends while
        the engine is not closing."""
        def watch() -> None:
            ended = wait([p.sentinel for p in self.processes])
            if self._closing:
                return
            for rank, process in enumerate(self.processes, start=1):
                if process.sentinel in ended:
                    process.join(1.0)
                    on_lost(rank, process.exitcode)
                    return

        threading.Thread(target=watch, name="tandem-rank-watch", daemon=True).start()

    def close(self) -> None:
        """Stops every follower (killing those that do not stop within the grace)."""
        self._closing = True
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("stop",))
        for process in self.processes:
            process.join(_STOP_GRACE_S)
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self._workdir, ignore_errors=True)

"""A rank past the first of a tensor-parallel reference engine: its own process, its shard of
the weights and of the KV pool, and a loop that runs each call rank 0 sends (mirror.py).

Start-up talks over the rank's pipe: the follower joins the group, loads its shard, reports
("ready", KV blocks its memory holds) or ("error", message, param), and allocates the pool
size rank 0 then sends (the smallest of all ranks'). A follower never outlives rank 0: the
kernel kills it when its parent dies (PR_SET_PDEATHSIG), and an end of its pipe ends it too.
Any error in a call ends the process, which rank 0's watch (ranks.py) turns into the worker's
exit: a rank that missed a call can never pair its collectives again.
"""
from __future__ import annotations

import asyncio
import ctypes
import functools
import itertools
import logging
import signal
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from tandem.engines.args import EngineArgs
from tandem.engines.reference.batch import allocate_kv_cache
from tandem.engines.reference.build import kv_block_bytes, kv_cache_dtype, num_kv_blocks
from tandem.engines.reference.host_kv import HostKvStore
from tandem.engines.reference.loader import load_model
from tandem.engines.reference.model import DecoderModel
from tandem.engines.reference.parallel.group import TensorGroup, init_group
from tandem.engines.reference.parallel.mirror import packed_size, unpack_step
from tandem.engines.reference.transfer import create_nixl_transfer
from tandem.errors import InvalidRequest
from tandem.kv.transfer import KvTransfer, TransferError, TransferSource

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RankSpec:
    """What a follower process is started with (pickled to it)."""

    args: EngineArgs
    rank: int
    size: int
    #: The group's meeting point (a file:// URL).
    rendezvous: str
    device: str
    dtype: str


def die_with_parent() -> None:
    """Linux: the kernel sends SIGKILL when the parent process dies (even by kill -9)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def main(spec: RankSpec, conn: Connection) -> None:
    """The follower process's entry point."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the leader, which stops us
    device = torch.device(spec.device)
    tp = init_group(spec.rank, spec.size, spec.rendezvous, device)
    try:
        with torch.inference_mode():
            model, kv_cache, host_kv = _build(spec, device, tp, conn)
            if model is None:
                return
            rank = _Rank(conn, model, kv_cache, host_kv, device,
                         f"tandem-reference-rank{spec.rank}")
            asyncio.run(_serve(rank))
    except EOFError:  # rank 0 closed its end: the engine is gone
        return


def _build(spec: RankSpec, device: torch.device, tp: TensorGroup, conn: Connection
           ) -> tuple[DecoderModel | None, torch.Tensor, HostKvStore | None]:
    args = spec.args
    dtype = getattr(torch, spec.dtype)
    try:
        model, local = load_model(args.model, dtype, device, args.load_format, args.seed, tp,
                                  args.quantization, kv_scales=args.kv_cache_dtype == "fp8")
        kv_dtype = kv_cache_dtype(args, dtype)
        num_blocks = num_kv_blocks(args, kv_block_bytes(local, args.kv_block_size, kv_dtype),
                                   device)
    except InvalidRequest as exc:
        conn.send(("error", exc.message, exc.param))
        return None, torch.empty(0), None
    conn.send(("ready", num_blocks))
    message = conn.recv()
    if message[0] != "blocks":  # ("stop",): rank 0 failed to start
        return None, torch.empty(0), None
    _, num_blocks, host_blocks = message
    kv_cache = allocate_kv_cache(local.num_layers, num_blocks + 1, args.kv_block_size,
                                 local.num_kv_heads, local.head_size, kv_cache_dtype(args, dtype),
                                 device)
    host_kv = HostKvStore(kv_cache, host_blocks) if host_blocks else None
    conn.send(("allocated",))
    return model, kv_cache, host_kv


class _Rank:
    """A follower's state between commands: its model and pools, and its KV transfer."""

    def __init__(self, conn: Connection, model: DecoderModel, kv_cache: torch.Tensor,
                 host_kv: HostKvStore | None, device: torch.device, name: str) -> None:
        self.conn, self.model, self.kv_cache = conn, model, kv_cache
        self.host_kv, self.device, self.name = host_kv, device, name
        self.transfer: KvTransfer | None = None
        #: Sources handed out (their key -> the source), until ("end_source", key).
        self.sources: dict[int, TransferSource] = {}
        self.reads: dict[int, asyncio.Task[int]] = {}
        self._keys = itertools.count()

    def run(self, command: tuple[Any, ...]) -> bool:
        """Runs one command in order; False once told to stop."""
        kind = command[0]
        tp, model = self.model.tp, self.model
        if kind == "forward":
            header = command[1]
            flat = tp.broadcast(torch.empty(packed_size(header), dtype=torch.long,
                                            device=self.device))
            input_ids, positions, meta = unpack_step(header, flat)
            model(input_ids, positions, meta, self.kv_cache)
        elif kind == "logits":
            dtype = model.embed_tokens.weight.dtype
            model.compute_logits(tp.broadcast(torch.empty(command[1], dtype=dtype,
                                                          device=self.device)))
        elif kind == "copy":
            assert self.host_kv is not None, "host-tier copies on a rank without a host tier"
            self.host_kv.copy(command[1], command[2], command[3])
        elif kind == "transfer":
            self.transfer = create_nixl_transfer(self.kv_cache, self.name, command[1])
        elif kind == "source":
            self._source(command[1], command[2])
        elif kind == "end_source":
            assert self.transfer is not None
            self.transfer.end_source(self.sources.pop(command[1]))
        elif kind == "read":
            _, request_id, handle, block_ids, timeout_s = command
            assert self.transfer is not None
            task = asyncio.create_task(self.transfer.read(handle, block_ids, timeout_s))
            task.add_done_callback(functools.partial(self._read_ended, request_id))
            self.reads[request_id] = task
        elif kind == "cancel_read":
            reading = self.reads.get(command[1])
            if reading is not None:
                reading.cancel()
        elif kind == "stop":
            return False
        else:
            raise RuntimeError(f"unknown command {kind!r} from rank 0")
        return True

    def _source(self, request_id: int, block_ids: list[int]) -> None:
        assert self.transfer is not None
        source = self.transfer.source(block_ids)
        key = next(self._keys)
        self.sources[key] = source
        self.conn.send(("source", request_id, source.agent_name, source.agent_metadata,
                        source.descriptors, source.memory_type, source.copied, key))

    def _read_ended(self, request_id: int, task: asyncio.Task[int]) -> None:
        """Answers rank 0 once the read ended, however it did (a task cancelled before it
        started never runs its own code: this callback still does)."""
        self.reads.pop(request_id, None)
        error = ""
        if task.cancelled():  # rank 0's own read failed: ours ended, nothing writes
            error = "cancelled"
        elif (exc := task.exception()) is not None:
            if not isinstance(exc, TransferError):
                log.error("KV read %d failed", request_id, exc_info=exc)
            error = str(exc) or type(exc).__name__
        self.conn.send(("read", request_id, 0 if error else task.result(), error))

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.close()


async def _serve(rank: _Rank) -> None:
    """Runs rank 0's calls in the order sent (KV reads as tasks beside them), until ("stop",)
    or the pipe's end."""
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()
    conn = rank.conn

    def readable() -> None:
        try:
            while not ended.done() and conn.poll():
                if not rank.run(conn.recv()):
                    ended.set_result(None)
        except EOFError:  # rank 0 closed its end: the engine is gone
            ended.set_result(None)
        except BaseException as exc:  # a rank that missed a call cannot go on: exit
            ended.set_exception(exc)

    loop.add_reader(conn.fileno(), readable)
    try:
        await ended
    finally:
        loop.remove_reader(conn.fileno())
        rank.close()

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

import ctypes
import logging
import signal
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from tandem.engines.args import EngineArgs
from tandem.engines.reference.batch import allocate_kv_cache
from tandem.engines.reference.build import kv_block_bytes, num_kv_blocks
from tandem.engines.reference.host_kv import HostKvStore
from tandem.engines.reference.loader import load_model
from tandem.engines.reference.model import DecoderModel
from tandem.engines.reference.parallel.group import TensorGroup, init_group
from tandem.engines.reference.parallel.mirror import packed_size, unpack_step
from tandem.errors import InvalidRequest

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
            _serve(conn, model, kv_cache, host_kv, device)
    except EOFError:  # rank 0 closed its end: the engine is gone
        return


def _build(spec: RankSpec, device: torch.device, tp: TensorGroup, conn: Connection
           ) -> tuple[DecoderModel | None, torch.Tensor, HostKvStore | None]:
    args = spec.args
    dtype = getattr(torch, spec.dtype)
    try:
        model, local = load_model(args.model, dtype, device, args.load_format, args.seed, tp)
        num_blocks = num_kv_blocks(args, kv_block_bytes(local, args.kv_block_size, dtype),
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
                                 local.num_kv_heads, local.head_size, dtype, device)
    host_kv = HostKvStore(kv_cache, host_blocks) if host_blocks else None
    conn.send(("allocated",))
    return model, kv_cache, host_kv


def _serve(conn: Connection, model: DecoderModel, kv_cache: torch.Tensor,
           host_kv: HostKvStore | None, device: torch.device) -> None:
    """Runs rank 0's calls in the order sent, until ("stop",) or the pipe's end."""
    tp, dtype = model.tp, model.embed_tokens.weight.dtype
    while True:
        command = conn.recv()
        kind = command[0]
        if kind == "forward":
            header = command[1]
            flat = tp.broadcast(torch.empty(packed_size(header), dtype=torch.long,
                                            device=device))
            input_ids, positions, meta = unpack_step(header, flat)
            model(input_ids, positions, meta, kv_cache)
        elif kind == "logits":
            hidden = tp.broadcast(torch.empty(command[1], dtype=dtype, device=device))
            model.compute_logits(hidden)
        elif kind == "copy":
            assert host_kv is not None, "host-tier copies on a rank without a host tier"
            host_kv.copy(command[1], command[2], command[3])
        elif kind == "stop":
            return
        else:
            raise RuntimeError(f"unknown command {kind!r} from rank 0")

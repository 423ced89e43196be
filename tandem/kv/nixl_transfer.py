"""KvTransfer over NIXL (UCX backend): the decode worker pulls leased KV blocks out of the prefill
worker's pool with one READ; the prefill worker's engine takes no part.

The pool is ONE registered tensor, kv_cache[layer, K|V, block, offset, kv_head, head_dim]. A
block's bytes are 2 * num_layers regions of block_size * H * D elements each, one per (layer,
K|V). Descriptor order, on both sides: layer-major, then K before V, then the blocks in the order
given (region (l, kv, j) is descriptor (2 * l + kv) * num_blocks + j). In this order, blocks with
consecutive ids on BOTH sides are adjacent descriptors over adjacent memory, and `read` merges
them (`coalesce`): NIXL 1.5.1 does not merge descriptors in `initialize_xfer`, and fewer, larger
descriptors are what moves bytes fast.

Beside the pool, a transfer buffer (tandem.kv.transfer_buffer, registered too) holds prompts
copied contiguous in that same order: the source gathers a leased prompt into a slot and hands
out ONE descriptor over it; the reader reads into a slot of its own (one descriptor on both
sides after `coalesce`) and scatters it into its blocks. Either side without room in its buffer
falls back to the pool's regions, and `coalesce` pairs whatever the two sides have.

Failure semantics (NIXL 1.5.1 / its bundled UCX, verified by tests/unit/test_nixl_transfer.py and
by hand on loopback):
  - Handles are checked before NIXL sees them: descriptor count, every remote length equal to the
    local region length, local block ids inside the pool. NIXL itself rejects remote
    descriptors outside the peer's registered memory (at `initialize_xfer`), and garbage
    metadata makes `add_remote_agent` raise (it does not abort the process).
  - A peer that died before the read fails it within milliseconds: loading its metadata fails
    (no connection yet: nixlBackendError, ~60 ms here) or the READ reports
    NIXL_ERR_REMOTE_DISCONNECT (UCX peer error handling; also when it dies during a read over
    TCP). UCX has then failed the endpoint, which completes every operation on it: nothing
    writes into the local blocks any more.
  - Releasing an in-flight transfer does NOT stop it: UCX cannot cancel a GET, and bytes kept
    landing in the local buffer after `release()` (and after `remove_remote_agent`). The only
    way to stop one is to destroy the local UCX worker, i.e. the whole NIXL agent. So a read that
    times out first waits up to `cancel_grace_s` for its transfer to end by itself; if it does
    not, the agent is torn down (a new one, with a new name, is made on next use; reads in
    flight on the old one fail with TransferError). Tearing down an agent while a GET is in
    flight over UCX's TCP transport was seen to abort the SOURCE process in about 1 of 10 tries
    (UCX assertion in stubs.c); a reader killed outright (SIGKILL) did not do this in 12 tries.
  - Metadata that passes NIXL's connection-info stage but fails later (e.g. truncated) leaves
    its agent name unloadable in this agent (NIXL 1.5.1 keeps the UCX connection and
    `remove_remote_agent` does not clear it): later reads of that peer fail with TransferError.
    Names are unique per process instance, so only that peer is affected.

UCX notes: the source agent runs NIXL's progress thread (`enable_prog_thread`); over TCP the GET
is emulated with messages the source's worker must answer, and without that thread a read never
completes. Same-host CPU reads use CMA (process_vm_readv): the copy runs inside `transfer()`, on
the calling thread, at process_vm_readv speed (0.3-0.6 of memcpy on the 2-core dev VM; see
benchmarks/kv_transfer.py). Shared-memory-only settings (posix, sysv) are refused: NIXL asks for
UCX peer error handling, which they lack. UCX_TLS restricts transports (e.g. UCX_TLS=tcp); leave it
unset rather than empty (empty makes UCX refuse to start).
"""
from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import secrets
from collections.abc import Sequence

import numpy as np
import torch
from nixl import _bindings
from nixl._api import nixl_agent, nixl_agent_config, nixl_xfer_handle

from tandem.engines.types import KvHandle, MemoryDescriptor
from tandem.kv.transfer import KvTransfer, TransferError, TransferSource
from tandem.kv.transfer_buffer import Slot, TransferBuffer, slot_region_addresses

log = logging.getLogger(__name__)

#: Every exception the NIXL bindings raise (they share no base class but Exception).
NIXL_ERRORS: tuple[type[Exception], ...] = tuple(
    value for key, value in vars(_bindings).items()
    if key.startswith("nixl") and key.endswith("Error") and isinstance(value, type))
_DISCONNECTED = _bindings.nixlRemoteDisconnectError

#: Polling backoff while a transfer runs: yield at once, then double up to this.
_MAX_POLL_S = 1e-3
_MIN_POLL_S = 5e-5

_MEMORY_TYPES = frozenset({"DRAM", "VRAM"})


def coalesce(local: np.ndarray, remote: np.ndarray, remote_devices: np.ndarray, length: int,
             local_device: int) -> tuple[np.ndarray, np.ndarray]:
    """Pairs of equal-length regions (`local[i]` <- `remote[i]`, uint64 addresses) as Nx3
    (address, length, device) descriptor arrays, merging each region into the previous one
    where it follows it in memory on both sides (and on the same remote device)."""
    step = np.uint64(length)
    follows = ((local[1:] == local[:-1] + step) & (remote[1:] == remote[:-1] + step)
               & (remote_devices[1:] == remote_devices[:-1]))
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    lengths = np.diff(np.append(starts, len(local))).astype(np.uint64) * step
    local_descs = np.stack([local[starts], lengths,
                            np.full(len(starts), local_device, dtype=np.uint64)], axis=1)
    remote_descs = np.stack([remote[starts], lengths, remote_devices[starts]], axis=1)
    return local_descs, remote_descs


class _Agent:
    """One NIXL agent over the pool, with the peers it loaded and its transfers in flight.
    Replaced as a whole when torn down (see the module docstring)."""

    def __init__(self, name: str, tensors: Sequence[torch.Tensor], memory_type: str) -> None:
        self.name = name
        self.memory_type = memory_type
        # The progress thread answers peers' reads over TCP while this worker does nothing.
        self.nixl: nixl_agent | None = nixl_agent(
            name, nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
        self._registration = self.nixl.register_memory(list(tensors))
        self.metadata: bytes = self.nixl.get_agent_metadata()
        #: Remote agent name -> the metadata it was loaded from.
        self.peers: dict[str, bytes] = {}
        self.xfers: dict[int, nixl_xfer_handle] = {}
        self._keys = itertools.count()

    @property
    def live(self) -> nixl_agent:
        """The NIXL agent; TransferError once torn down."""
        if self.nixl is None:
            raise TransferError(f"NIXL agent '{self.name}' was torn down")
        return self.nixl

    def connect(self, peer: str, metadata: bytes) -> None:
        """Loads a peer's metadata once per name (again when it changed)."""
        agent = self.live
        known = self.peers.get(peer)
        if known == metadata:
            return
        if known is not None:
            self.forget(peer)
        try:
            loaded = agent.add_remote_agent(metadata)
        except NIXL_ERRORS as exc:
            # A partly loaded peer would keep stale sections; removing an unknown one is a no-op.
            self._remove(peer)
            raise TransferError(f"cannot load the NIXL metadata of agent '{peer}': "
                                f"{type(exc).__name__}") from exc
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded_name != peer:
            if loaded_name in self.peers:
                self.forget(loaded_name)
            else:
                self._remove(loaded_name)
            raise TransferError(f"the handle names NIXL agent '{peer}' but its metadata "
                                f"describes '{loaded_name}'")
        self.peers[peer] = metadata

    def forget(self, peer: str) -> None:
        del self.peers[peer]
        self._remove(peer)

    def _remove(self, peer: str) -> None:
        try:
            self.live.remove_remote_agent(peer)
        except NIXL_ERRORS:
            log.debug("removing NIXL peer '%s' failed", peer, exc_info=True)

    def post_read(self, local: np.ndarray, remote: np.ndarray, remote_memory_type: str,
                  peer: str) -> int:
        """Creates and posts one READ; returns its key in `xfers`. Raises TransferError when
        NIXL refuses it (nothing was posted then)."""
        agent = self.live
        try:
            xfer = agent.initialize_xfer(
                "READ", agent.get_xfer_descs(local, self.memory_type),
                agent.get_xfer_descs(remote, remote_memory_type), peer)
        except NIXL_ERRORS as exc:
            raise TransferError(f"NIXL refused the read from '{peer}' ({type(exc).__name__}); "
                                f"are the descriptors inside its registered memory?") from exc
        key = next(self._keys)
        self.xfers[key] = xfer
        return key

    def state(self, key: int, first: bool = False) -> str:
        """The transfer's state: DONE, PROC, GONE (the peer's endpoint failed, so nothing writes
        any more) or ERR (failed otherwise: writes cannot be ruled out)."""
        agent, xfer = self.live, self.xfers[key]
        try:
            state = agent.transfer(xfer) if first else agent.check_xfer_state(xfer)
        except _DISCONNECTED:
            return "GONE"
        except NIXL_ERRORS:
            log.warning("a transfer of NIXL agent '%s' failed", self.name, exc_info=True)
            return "ERR"
        return state if state in ("DONE", "PROC") else "ERR"

    def release(self, key: int) -> None:
        """Frees a transfer that is over. Raises TransferError if NIXL keeps it."""
        xfer = self.xfers.pop(key)
        try:
            xfer.release()
        except NIXL_ERRORS as exc:
            raise TransferError(f"NIXL could not release a transfer: {exc!r}") from exc

    def close(self) -> None:
        """Releases everything and destroys the agent (and its UCX worker: no transfer of
        this agent writes anything after this returns)."""
        if self.nixl is None:
            return
        for key in list(self.xfers):
            try:
                self.release(key)
            except TransferError:
                log.warning("NIXL transfer still active at agent teardown", exc_info=True)
        for peer in list(self.peers):
            self.forget(peer)
        try:
            self.nixl.deregister_memory(self._registration)
        except NIXL_ERRORS:
            log.warning("NIXL deregistration failed", exc_info=True)
        # The last reference: NIXL's destructor destroys the UCX worker here.
        self.nixl = None


class NixlTransfer(KvTransfer):
    """KV transfer over one pool tensor. Used from one asyncio event loop (not thread-safe);
    NIXL calls run on its thread: the first read from a peer loads it (about 50 ms here), and
    over shared memory the copy itself runs inside the call that posts it.

    Args:
        kv_cache: the pool, [num_layers, 2, num_blocks, block_size, H, D], contiguous, on CPU
            (registered as DRAM) or one CUDA device (VRAM).
        name: prefix of the NIXL agent name; the pid and a random suffix make it unique, so a
            restarted worker is a new peer.
        cancel_grace_s: how long a timed-out read waits for its transfer to end before tearing
            the agent down (the only way to stop a transfer, see the module docstring).
        buffer_blocks: blocks of the transfer buffer (0: none; every transfer then goes region
            by region). A buffer that cannot be allocated is logged and left out.
    """

    backend = "nixl"

    def __init__(self, kv_cache: torch.Tensor, name: str = "tandem", *,
                 cancel_grace_s: float = 2.0, buffer_blocks: int = 0) -> None:
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2 or not kv_cache.is_contiguous():
            raise ValueError("the KV cache must be one contiguous tensor "
                             "[layers, 2, blocks, block_size, kv_heads, head_dim], "
                             f"got shape {tuple(kv_cache.shape)}")
        self.kv_cache = kv_cache
        self.name = name
        self.cancel_grace_s = cancel_grace_s
        self.num_layers, _, self.num_blocks = kv_cache.shape[:3]
        #: Bytes of one (layer, K|V, block) region.
        self.region_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
        self.memory_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self.device_id = kv_cache.device.index or 0
        self.buffer = _buffer(kv_cache, buffer_blocks)
        #: Prompts read through the buffer / region by region (the pool's own descriptors).
        self.num_buffered_reads = 0
        self.num_region_reads = 0
        self._agent: _Agent | None = self._new_agent()

    def _new_agent(self) -> _Agent:
        name = f"{self.name}-{os.getpid()}-{secrets.token_hex(4)}"
        tensors = [self.kv_cache] + ([self.buffer.tensor] if self.buffer is not None else [])
        return _Agent(name, tensors, self.memory_type)

    def _live_agent(self) -> _Agent:
        """The current agent; a new one (new name) after a teardown."""
        if self._agent is None:
            self._agent = self._new_agent()
        return self._agent

    @property
    def block_bytes(self) -> int:
        return 2 * self.num_layers * self.region_bytes

    def _addresses(self, block_ids: Sequence[int]) -> np.ndarray:
        """Start addresses of the blocks' regions, in descriptor order (layer, K|V, block)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        planes = np.arange(2 * self.num_layers, dtype=np.int64)[:, None] * self.num_blocks
        offsets = (planes + ids[None, :]).ravel().astype(np.uint64) * np.uint64(self.region_bytes)
        return offsets + np.uint64(self.kv_cache.data_ptr())

    def _check_local(self, block_ids: Sequence[int]) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise TransferError(f"block ids {bad[:8]} are outside the pool of {self.num_blocks}")

    def source(self, block_ids: Sequence[int]) -> TransferSource:
        self._check_local(block_ids)
        agent = self._live_agent()
        buffer = self.buffer
        slot = buffer.take(len(block_ids)) if buffer is not None else None
        if buffer is not None and slot is not None:
            try:
                buffer.gather(slot, block_ids)
            except BaseException:
                buffer.give(slot)
                raise
            whole = MemoryDescriptor(buffer.address(slot), len(block_ids) * self.block_bytes,
                                     self.device_id)
            return TransferSource(agent.name, agent.metadata, (whole,), self.memory_type,
                                  copied=True, slot=slot)
        descriptors = tuple(MemoryDescriptor(int(address), self.region_bytes, self.device_id)
                            for address in self._addresses(block_ids))
        return TransferSource(agent.name, agent.metadata, descriptors, self.memory_type)

    def buffer_stats(self) -> dict[str, int]:
        buffer = self.buffer
        return {"kv_transfer_buffer_blocks_used": buffer.num_taken if buffer else 0,
                "kv_transfer_buffer_blocks_total": buffer.capacity if buffer else 0,
                "kv_reads_buffered": self.num_buffered_reads,
                "kv_reads_by_region": self.num_region_reads}

    def end_source(self, source: TransferSource) -> None:
        if isinstance(source.slot, Slot) and self.buffer is not None:
            self.buffer.give(source.slot)

    def _remote(self, handle: KvHandle, num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
        """The handle's (layer, K|V, block) regions as (addresses, devices) in descriptor
        order, from either form of handle (module docstring), after the checks that keep a
        forged handle from writing anything but whole local regions."""
        expected = num_blocks * 2 * self.num_layers
        descriptors = handle.descriptors
        if len(descriptors) == 1 and expected > 1:  # a transfer-buffer copy
            whole = descriptors[0]
            if whole.length != num_blocks * self.block_bytes:
                raise TransferError(
                    f"the handle's one descriptor is {whole.length} bytes long; {num_blocks} "
                    f"blocks of {self.block_bytes} bytes need {num_blocks * self.block_bytes}")
            self._check_handle_agent(handle)
            try:
                addresses = slot_region_addresses(whole.address, num_blocks, self.num_layers,
                                                  self.region_bytes)
            except (OverflowError, ValueError) as exc:
                raise TransferError(f"invalid descriptor in the handle: {exc}") from exc
            return addresses, np.full(len(addresses), whole.device_id, dtype=np.uint64)
        if len(descriptors) != expected:
            raise TransferError(
                f"the handle has {len(descriptors)} descriptors; {num_blocks} blocks of "
                f"{self.num_layers} layers need {expected} (or one over a transfer buffer)")
        wrong = next((d for d in descriptors if d.length != self.region_bytes), None)
        if wrong is not None:
            raise TransferError(f"a handle descriptor is {wrong.length} bytes long; this pool's "
                                f"(layer, K|V, block) regions are {self.region_bytes}")
        self._check_handle_agent(handle)
        try:
            addresses = np.array([d.address for d in descriptors], dtype=np.uint64)
            devices = np.array([d.device_id for d in descriptors], dtype=np.uint64)
        except (OverflowError, ValueError) as exc:
            raise TransferError(f"invalid descriptor in the handle: {exc}") from exc
        return addresses, devices

    @staticmethod
    def _check_handle_agent(handle: KvHandle) -> None:
        if handle.nixl_memory_type not in _MEMORY_TYPES:
            raise TransferError(f"unknown NIXL memory type '{handle.nixl_memory_type}'")
        if not handle.nixl_agent_name or not handle.nixl_agent_metadata:
            raise TransferError("the handle carries no NIXL agent name or metadata")

    async def read(self, handle: KvHandle, local_block_ids: Sequence[int],
                   timeout_s: float) -> int:
        num_blocks = len(handle.block_ids)
        if len(local_block_ids) != num_blocks:
            raise TransferError(f"the handle lists {num_blocks} blocks, "
                                f"{len(local_block_ids)} were allocated for them")
        if handle.ranks:
            raise TransferError(f"the prefill worker's KV comes in {len(handle.ranks) + 1} "
                                "tensor-parallel shards, this worker holds one: both sides "
                                "need the same --tensor-parallel-size")
        if num_blocks == 0:
            return 0
        self._check_local(local_block_ids)
        if len(set(local_block_ids)) != num_blocks:
            raise TransferError("the local block ids repeat")
        remote, remote_devices = self._remote(handle, num_blocks)
        buffer = self.buffer
        slot = buffer.take(num_blocks) if buffer is not None else None
        if buffer is None or slot is None:
            num_bytes = await self._read(handle, self._addresses(local_block_ids), remote,
                                         remote_devices, timeout_s)
            self.num_region_reads += 1
            return num_bytes
        try:
            num_bytes = await self._read(handle, buffer.region_addresses(slot), remote,
                                         remote_devices, timeout_s)
            await buffer.scatter(slot, local_block_ids)
        finally:
            # After a TransferError or a cancellation nothing writes into the slot any more
            # (the read ended or its agent was torn down), and a scatter ends before its await.
            buffer.give(slot)
        self.num_buffered_reads += 1
        return num_bytes

    async def _read(self, handle: KvHandle, local: np.ndarray, remote: np.ndarray,
                    remote_devices: np.ndarray, timeout_s: float) -> int:
        """One READ of the handle's regions into the local regions at `local` (addresses in
        descriptor order: the pool's blocks, or a transfer-buffer slot)."""
        num_blocks = len(local) // (2 * self.num_layers)
        local_descs, remote_descs = coalesce(local, remote, remote_devices, self.region_bytes,
                                             self.device_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        agent = self._live_agent()
        peer = handle.nixl_agent_name
        agent.connect(peer, handle.nixl_agent_metadata)
        key = agent.post_read(local_descs, remote_descs, handle.nixl_memory_type, peer)
        try:
            state = await self._wait(agent, key, agent.state(key, first=True), deadline)
            timed_out = state == "PROC"
            if timed_out:
                state = await self._wait(agent, key, state, loop.time() + self.cancel_grace_s)
        except asyncio.CancelledError:
            # The caller frees the blocks once this returns; only a teardown makes that safe.
            self._teardown(agent, "a read was cancelled in flight")
            raise
        if state == "PROC":
            self._teardown(agent, f"a read from '{peer}' outlived its timeout and "
                                  f"{self.cancel_grace_s} s more")
            raise TransferError(f"reading {num_blocks} blocks from '{peer}' took longer than "
                                f"{timeout_s:.3f} s; the NIXL agent was reset")
        self._finish(agent, key, peer, state)
        if timed_out:
            raise TransferError(f"reading {num_blocks} blocks from '{peer}' took longer than "
                                f"{timeout_s:.3f} s")
        return num_blocks * self.block_bytes

    @staticmethod
    async def _wait(agent: _Agent, key: int, state: str, deadline: float) -> str:
        """Polls a transfer until it is no longer in progress or the loop's clock passes
        `deadline`; its last state."""
        loop = asyncio.get_running_loop()
        delay = 0.0
        while state == "PROC" and loop.time() < deadline:
            await asyncio.sleep(delay)
            delay = min(max(2 * delay, _MIN_POLL_S), _MAX_POLL_S)
            state = agent.state(key)
        return state

    def _finish(self, agent: _Agent, key: int, peer: str, state: str) -> None:
        """Ends a transfer that is no longer in progress; raises TransferError unless DONE."""
        if agent.nixl is None:  # torn down while this read awaited
            raise TransferError(f"the NIXL agent was reset while reading from '{peer}'")
        if state == "ERR":
            self._teardown(agent, f"a read from '{peer}' failed in an unknown state")
            raise TransferError(f"reading from NIXL agent '{peer}' failed")
        try:
            agent.release(key)
        except TransferError:
            self._teardown(agent, "NIXL kept a finished transfer")
            raise
        if state == "GONE":
            agent.forget(peer)
            raise TransferError(f"NIXL agent '{peer}' disconnected (is the prefill worker gone?)")

    def _teardown(self, agent: _Agent, reason: str) -> None:
        if agent.nixl is None:
            return
        log.error("tearing down NIXL agent '%s' (%d transfers in flight): %s",
                  agent.name, len(agent.xfers), reason)
        agent.close()
        if self._agent is agent:
            self._agent = None

    def checksum(self, block_ids: Sequence[int]) -> str:
        """blake2b of kv_cache[:, :, block_ids] (layer-major, blocks in the given order)."""
        ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.kv_cache.device)
        data = self.kv_cache.index_select(2, ids).contiguous().cpu()
        return hashlib.blake2b(data.view(torch.uint8).numpy().tobytes()).hexdigest()

    def close(self) -> None:
        if self._agent is not None:
            self._agent.close()
            self._agent = None


def _buffer(kv_cache: torch.Tensor, num_blocks: int) -> TransferBuffer | None:
    """The transfer buffer of `num_blocks` blocks, or None (none asked for, or no memory for
    it: transfers then go region by region, slower but the same bytes)."""
    if num_blocks < 1:
        return None
    try:
        return TransferBuffer(kv_cache, num_blocks)
    except torch.OutOfMemoryError:
        log.warning("no memory for a KV transfer buffer of %d blocks; moving KV region by "
                    "region", num_blocks)
        return None

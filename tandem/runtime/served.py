"""What a worker served since it started, counted where requests cross its edge: a prefill
worker's Prefill and Release calls (prefills by outcome, the KV its handles made readable, how
long each lease was held), a decode worker's KV reads as its engine reports each one
(TransferRecord). Carried on its load reports (`tandem status`), Worker.Stats and Prometheus
(tandem.runtime.worker_metrics).

A prefill worker does not see its KV being read: decode workers read it with one-sided NIXL
READs. What it sees is the lease: handed out with the handle, ended by a Release call (the
decode worker calls it once its read is over) or by expiry. The time between is its view of the
transfer's time."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from tandem.engines.types import KvHandle, TransferRecord

#: How long after its expiry a lease that no Release ended counts as expired. The engine's own
#: expiry timer fires first (it was armed before the handle was handed out): past the grace, a
#: Release can no longer free the lease, so it is never counted as released and expired both.
EXPIRY_GRACE_S = 1.0

#: (how the lease ended: "released" | "expired", seconds from hand-out to that end).
HoldObserver = Callable[[str, float], None]


@dataclass(frozen=True, slots=True)
class ServedStats:
    """WorkerServed in kv_events.proto: counters since the worker started."""

    #: Prefill calls that handed out a KV handle; that finished on their first token (no
    #: handle); that failed (refused, cancelled or the engine failed).
    prefills_leased: int = 0
    prefills_finished: int = 0
    prefills_failed: int = 0
    #: KV the handed-out handles made readable, bytes and blocks.
    kv_bytes_leased: int = 0
    kv_blocks_leased: int = 0
    #: Leases ended by a Release call; leases that ended without one.
    kv_leases_released: int = 0
    kv_leases_expired: int = 0
    #: KV reads (decode side) that completed and failed; bytes and seconds of the completed.
    kv_reads_ok: int = 0
    kv_reads_failed: int = 0
    kv_bytes_read: int = 0
    kv_read_seconds: float = 0.0

    @property
    def num_prefills(self) -> int:
        """Prefills served: with a KV handle or finished on their first token."""
        return self.prefills_leased + self.prefills_finished

    @property
    def mean_read_s(self) -> float | None:
        """Mean time of a completed KV read; None before the first."""
        return self.kv_read_seconds / self.kv_reads_ok if self.kv_reads_ok else None


def leased_size(handle: KvHandle) -> tuple[int, int]:
    """(bytes, blocks) a KV handle makes readable: its descriptors' lengths (one per block or
    region, or one over a transfer-buffer copy); a handle without descriptors (the mock's, and
    TensorRT-LLM's, whose transceiver owns the blocks) by its blocks times the block bytes."""
    blocks = len(handle.block_ids) or -(-handle.num_tokens // handle.layout.block_size)
    num_bytes = sum(d.length for d in handle.descriptors) or blocks * handle.layout.block_bytes
    return num_bytes, blocks


@dataclass(slots=True)
class _Held:
    handed_at: float
    #: Seconds from hand-out to the lease's expiry.
    length_s: float
    timer: asyncio.TimerHandle


class ServedTally:
    """The counters of ServedStats, kept on the worker's event loop (every method but
    `snapshot` is called there; `snapshot` may be read from anywhere and sees each counter
    whole). `on_hold_end`, when set, hears of each lease's end: Prometheus's histogram."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 grace_s: float = EXPIRY_GRACE_S) -> None:
        self._clock, self._wall_clock, self._grace_s = clock, wall_clock, grace_s
        self._stats = ServedStats()
        self._held: dict[str, _Held] = {}
        self.on_hold_end: HoldObserver | None = None

    def snapshot(self) -> ServedStats:
        return self._stats

    def _add(self, **deltas: float) -> None:
        # One new frozen value per change: a reader on another thread never sees half of one.
        s = self._stats
        self._stats = ServedStats(**{f: getattr(s, f) + deltas.get(f, 0)
                                     for f in ServedStats.__slots__})

    # ---- prefill side -------------------------------------------------------------------------

    def prefill_failed(self) -> None:
        self._add(prefills_failed=1)

    def prefill_served(self, handle: KvHandle | None) -> None:
        """A Prefill call returned: with the handle it handed out, or None (it finished)."""
        if handle is None:
            self._add(prefills_finished=1)
            return
        num_bytes, blocks = leased_size(handle)
        self._add(prefills_leased=1, kv_bytes_leased=num_bytes, kv_blocks_leased=blocks)
        # A handle that lists no blocks is no Tandem lease (TensorRT-LLM's cache transceiver
        # owns those blocks and Release frees nothing): no hold to time.
        if handle.block_ids and handle.request_id not in self._held:
            length_s = max(handle.lease_expiry_unix_ms / 1000 - self._wall_clock(), 0.0)
            timer = asyncio.get_running_loop().call_later(
                length_s + self._grace_s, self._expired, handle.request_id)
            self._held[handle.request_id] = _Held(self._clock(), length_s, timer)

    def release_answered(self, request_id: str, released: bool) -> None:
        """A Release call for `request_id` was answered: `released` when it freed a live lease;
        otherwise a lease this worker handed out had already expired (or was released before)."""
        held = self._held.pop(request_id, None)
        if held is not None:
            held.timer.cancel()
        if released:
            self._add(kv_leases_released=1)
            if held is not None:
                self._hold_ended("released", self._clock() - held.handed_at)
        elif held is not None:
            self._add(kv_leases_expired=1)
            self._hold_ended("expired", held.length_s)

    def _expired(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is not None:
            self._add(kv_leases_expired=1)
            self._hold_ended("expired", held.length_s)

    def _hold_ended(self, ended: str, seconds: float) -> None:
        if self.on_hold_end is not None:
            self.on_hold_end(ended, seconds)

    @property
    def num_held(self) -> int:
        """Leases handed out whose end this tally has not seen yet."""
        return len(self._held)

    async def close(self) -> None:
        """Stops the expiry timers (the worker shuts down; its leases go with the engine)."""
        for held in self._held.values():
            held.timer.cancel()
        self._held.clear()

    # ---- decode side --------------------------------------------------------------------------

    def transfer_ended(self, record: TransferRecord) -> None:
        """A KV read ended (the engine's transfer observer)."""
        if record.error is None:
            self._add(kv_reads_ok=1, kv_bytes_read=record.num_bytes,
                      kv_read_seconds=record.duration_s)
        else:
            self._add(kv_reads_failed=1)

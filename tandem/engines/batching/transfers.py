"""The decode side of disaggregation: reading a prefill worker's KV into blocks the scheduler
allocated, then resuming the request from its first token (or applying the failure policy).

Blocks being written by a read are never freed under it: an abort during the read only marks
the request, and the read's end frees them. Whatever happens, the prefill worker is told to
release its lease once the read is over.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from tandem.engines.base import TransferObserver
from tandem.engines.batching.request import BatchRequest, RequestStatus
from tandem.engines.batching.scheduler import Scheduler
from tandem.engines.types import KvHandle, TransferRecord
from tandem.errors import FailedPrecondition, TandemError, UpstreamError
from tandem.kv.block_pool import BlockPool
from tandem.kv.transfer import KvTransfer, TransferError

log = logging.getLogger(__name__)

#: A read starts only with at least this much lease left: the prefill worker may reuse the
#: blocks the moment it expires, and a read racing that would copy someone else's KV.
LEASE_MARGIN_S = 0.05

#: Checksums kept per direction with --debug-kv-checksums.
MAX_CHECKSUMS = 256

#: Tells a prefill worker its lease is no longer needed (fire and forget).
LeaseReleaser = Callable[[KvHandle], None]


class KvLoads:
    """The KV reads in flight. It is handed only what it needs (the transfer, the pool, the
    scheduler, and callbacks into the engine to end a request and wake its loop), never the
    engine itself."""

    def __init__(self, transfer: Callable[[], KvTransfer], pool: BlockPool, scheduler: Scheduler,
                 *, recompute_on_failure: bool, keep_checksums: bool,
                 fail: Callable[[BatchRequest, TandemError], None],
                 wake: Callable[[], None]) -> None:
        #: The engine's transfer (created on first use, so asked for each time).
        self._transfer = transfer
        self._pool = pool
        self._scheduler = scheduler
        #: A failed read: compute the prompt here (True) or fail the request (False).
        self._recompute_on_failure = recompute_on_failure
        self._keep_checksums = keep_checksums
        #: Ends a request whose read failed (its blocks already freed) with that error.
        self._fail = fail
        #: Wakes the engine's loop: a read's end changes what it can schedule.
        self._wake = wake
        self._tasks: dict[str, asyncio.Task[None]] = {}
        #: Set by the worker process: releases leases on prefill workers (Prefill.Release).
        self.release_remote: LeaseReleaser | None = None
        #: Set by the worker process: hears of every read as it ends (metrics, traces).
        self.observer: TransferObserver | None = None
        self.num_bytes = 0
        self.num_ok = 0
        self.num_failed = 0
        #: With --debug-kv-checksums: ("leased" | "received", request id) -> hex digest.
        self.checksums: OrderedDict[tuple[str, str], str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, req: BatchRequest) -> None:
        req.status = RequestStatus.LOADING
        create = asyncio.get_running_loop().create_task
        load, name = self._load(req), f"kv-load-{req.request_id}"
        # In the admitting call's context (a task copies the current one): the read's logs and
        # trace span belong to its request, not to the engine loop.
        self._tasks[req.request_id] = (create(load, name=name) if req.context is None
                                       else req.context.run(create, load, name=name))

    async def _load(self, req: BatchRequest) -> None:
        handle = req.kv_handle
        assert handle is not None
        local = req.table.block_ids[:len(handle.block_ids)]
        error: Exception | None = None
        started_ns, started = time.time_ns(), time.perf_counter()
        num_bytes = 0
        try:
            left_s = handle.lease_expiry_unix_ms / 1000 - time.time() - LEASE_MARGIN_S
            if left_s <= 0:
                raise FailedPrecondition(
                    f"the KV lease of request '{handle.request_id}' on prefill worker "
                    f"'{handle.worker_id}' expired before it could be read")
            num_bytes = await self._transfer().read(handle, local, left_s)
            self.num_bytes += num_bytes
            self.num_ok += 1
            self.record_checksum("received", req.request_id, local)
        except (TransferError, FailedPrecondition) as exc:
            error = exc
        except asyncio.CancelledError:  # engine closing: the read was abandoned
            self._pool.free(req.table)
            raise
        except Exception as exc:  # a transfer bug must not strand the request or its blocks
            log.exception("KV read failed unexpectedly", extra={"request_id": req.request_id})
            error = exc
        finally:
            if req.status is RequestStatus.LOADING:  # else aborted meanwhile: FINISHED
                req.status = RequestStatus.RUNNING
            del self._tasks[req.request_id]
            if self.release_remote is not None:
                self.release_remote(handle)
        if self.observer is not None:
            record = TransferRecord(req.request_id, handle.worker_id, num_bytes, started_ns,
                                    time.perf_counter() - started,
                                    None if error is None else str(error))
            try:
                self.observer(record)
            except Exception:  # metrics or tracing must never strand the request's blocks
                log.exception("KV transfer observer failed", extra={"request_id": req.request_id})
        self._after(req, error)

    def _after(self, req: BatchRequest, error: Exception | None) -> None:
        if req.is_finished:  # aborted during the read; nothing writes the blocks now
            self._pool.free(req.table)
        elif error is None:
            req.kv_handle = None
            self._scheduler.resume_loaded(req)
        else:
            self.num_failed += 1
            self._pool.free(req.table)
            if self._recompute_on_failure:
                log.warning("KV read failed; computing the prompt locally",
                            extra={"request_id": req.request_id, "error": str(error)})
                req.kv_handle = None
                req.first_token = None
                self._scheduler.waiting.appendleft(req)
            else:
                self._fail(req, error if isinstance(error, FailedPrecondition) else
                           UpstreamError(f"reading the prompt's KV failed: {error}"))
        self._wake()

    def record_checksum(self, direction: str, request_id: str, block_ids: Sequence[int]) -> None:
        if not self._keep_checksums:
            return
        self.checksums[(direction, request_id)] = self._transfer().checksum(block_ids)
        while len(self.checksums) > MAX_CHECKSUMS:
            self.checksums.popitem(last=False)

    async def close(self) -> None:
        """Cancels reads in flight (each frees its blocks as it ends)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

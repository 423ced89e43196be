"""A continuous-batching engine over a BlockPool: everything the mock and reference engines
share (admission, validation, the step loop, finishing, aborting, stats). A backend supplies
only `_execute`: what computing one scheduled step means (sleeping for a modelled time, or
running a model and sampling); and `_launch` where it can start a decode step before the
previous step's tokens reach the host (overlap scheduling, tandem.engines.batching.ahead).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from abc import abstractmethod
from collections.abc import Callable, Mapping

from tandem.engines.args import EngineArgs
from tandem.engines.base import (
    Engine,
    PausePoint,
    Progress,
    StepObserver,
    StepRecord,
    TransferObserver,
)
from tandem.engines.batching.ahead import (
    PLACEHOLDER,
    Sampled,
    StepAhead,
    is_plain_decode,
    may_schedule_ahead,
    same_requests,
)
from tandem.engines.batching.batch_wait import BatchWait
from tandem.engines.batching.host_copies import CopyTiming, HostCopies
from tandem.engines.batching.request import BatchRequest, RequestStatus
from tandem.engines.batching.scheduler import Scheduler, StepPlan
from tandem.engines.batching.step_gate import StepGate
from tandem.engines.batching.transfers import KvLoads
from tandem.engines.batching.validation import (  # noqa: F401  (validate_args: re-exported)
    check_kv_handle,
    check_prompt_and_sampling,
    num_host_blocks,
    validate_args,
)
from tandem.engines.guided.matcher import Grammars, Guide
from tandem.engines.speculative.speculation import Speculation
from tandem.engines.stream import RequestStream
from tandem.engines.types import (
    EngineRequest,
    EngineStats,
    FinishReason,
    KvHandle,
    KvLayout,
    PrefillResult,
    RankSource,
    TokenLogprob,
    Usage,
)
from tandem.errors import (
    FailedPrecondition,
    InvalidRequest,
    Overloaded,
    TandemError,
    Unavailable,
)
from tandem.kv.block_pool import BlockPool, BlockTable
from tandem.kv.host_tier import BlockCopies
from tandem.kv.leases import LeaseTable
from tandem.kv.transfer import KvTransfer

log = logging.getLogger(__name__)



class BatchingEngine(Engine):
    """The Engine contract over a Scheduler and BlockPool.

    The step loop runs as one asyncio task from `start()` to `close()`. It waits on an event
    while idle and yields to the event loop at least once per step.
    """

    #: KV handle transfer backends this engine can resume from.
    accepted_backends: frozenset[str] = frozenset()

    def __init__(self, args: EngineArgs, layout: KvLayout, max_model_len: int, vocab_size: int,
                 eos_ids: frozenset[int], num_blocks: int) -> None:
        super().__init__()
        self.args = args
        self._layout = layout
        self._max_model_len = max_model_len
        self.vocab_size = vocab_size
        self._eos_ids = eos_ids
        self.pool = BlockPool(num_blocks, args.kv_block_size, args.enable_prefix_caching,
                              num_host_blocks(args, layout))
        self.scheduler = Scheduler(self.pool, args.max_batch_size, args.max_num_tokens)
        #: The host tier's copies and counters (idle without a host tier).
        self.host_copies = HostCopies(self.pool, self.scheduler, layout.block_bytes,
                                      self._copy_blocks)
        #: --batch-wait-timeout-ms: an idle engine holds a burst's first prompts for the rest.
        self._batch_wait = BatchWait(args.batch_wait_timeout_ms)
        #: Told of each step (set_step_observer: traces); None: nobody asked.
        self._step_observer: StepObserver | None = None
        self._requests: dict[str, BatchRequest] = {}
        self._wakeup = asyncio.Event()
        #: When the step loop last woke from waiting for work (time.monotonic()); a pass that
        #: follows the previous one without such a wait started when that one ended.
        self.woke_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._failure: BaseException | None = None
        self.num_steps = 0
        #: Steps launched ahead of the previous step's tokens (see `_launch`).
        self.num_steps_ahead = 0
        #: The debug hooks (pause_steps, pause_when): the loop waits on it before each step.
        self._gate = StepGate(self.name, self._settled_point)
        #: True while the loop waits for blocks held outside the batch (leases, KV reads):
        #: no step is due then, so no progress is owed.
        self._is_blocked_on_peers = False
        #: Prefill side: blocks of prefilled prompts, pinned for their decode workers.
        self.leases = LeaseTable(self.pool.free)
        self.leases.on_freed = self._wakeup.set
        #: Prefill side: handles of leases made this step, until `prefill` hands them out.
        self._handles_out: dict[str, KvHandle] = {}
        self._transfer: KvTransfer | None = None
        #: Decode side: reads of prefill workers' KV in flight.
        self.loads = KvLoads(
            lambda: self.transfer, self.pool, self.scheduler,
            recompute_on_failure=args.kv_load_failure_policy == "recompute",
            keep_checksums=args.debug_kv_checksums, fail=self._fail_loaded,
            wake=self._wakeup.set)
        #: Guided decoding: built from the model's tokenizer with the first guided request.
        self._grammars: Grammars | None = None
        #: The step launched ahead whose tokens are not applied yet (see `_launch`).
        self._ahead: StepAhead | None = None
        #: Speculative decoding (--speculative-config; set by a backend that verifies
        #: proposals): None when off.
        self.speculation: Speculation | None = None
        #: Whether the step being run speculates (decided once per step).
        self._speculating = False

    @property
    def layout(self) -> KvLayout:
        return self._layout

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    # ---- what a backend supplies ------------------------------------------------------------

    @abstractmethod
    def _request_key(self, request: EngineRequest) -> int:
        """The per-request value its sampling derives from (a seed or a stream key)."""

    def _create_transfer(self) -> KvTransfer:
        """The KV transfer over this engine's memory (created on first use)."""
        raise FailedPrecondition(f"the {self.name} engine cannot move KV between workers")

    @property
    def transfer(self) -> KvTransfer:
        if self._transfer is None:
            self._transfer = self._create_transfer()
        return self._transfer

    def _require_transfer(self) -> None:
        """Raises FailedPrecondition unless this engine can move KV between workers (creating
        its transfer on first use)."""
        self._transfer = self.transfer

    @abstractmethod
    async def _copy_blocks(self, copies: BlockCopies, sync: bool) -> list[CopyTiming]:
        """Copies evicted device blocks to their host slots, then host slots into their new
        device blocks (in that order), before this step's forward pass touches them; with
        `sync`, finished before returning (a KV read is about to write device blocks). Returns
        the timings of copies known to have finished. Raises if a copy failed."""

    @abstractmethod
    async def _execute(self, plan: StepPlan) -> list[Sampled]:
        """Computes the scheduled step; returns one sampled token per request in `plan.ready`
        (in that order). May await; requests aborted meanwhile are skipped by the caller."""

    def _launch(self, plan: StepPlan, after: StepAhead | None) -> StepAhead | None:
        """Starts computing `plan`, a plain decode step (ahead.is_plain_decode), without
        waiting for its tokens; `after`: the step launched before it, whose sampled tokens
        (still on the device) are the inputs of `plan`'s requests that are alive in it.
        Returns None where this backend computes `plan` in full instead (the default)."""
        return None

    # ---- admission --------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> RequestStream:
        return self._admit(request, None)

    def _admit(self, request: EngineRequest, lease_ms: int | None) -> RequestStream:
        if self._closed or self._failure is not None:
            raise Unavailable(f"the {self.name} engine is closed" if self._closed
                              else f"the {self.name} engine failed: {self._failure}")
        self._validate(request)
        if len(self.scheduler.waiting) >= self.args.max_queued_requests:
            raise Overloaded(f"the waiting queue is full ({self.args.max_queued_requests} "
                             "requests); retry later")
        guide = self._new_guide(request)
        stream = RequestStream(request.request_id)
        req = BatchRequest(request, stream, self._request_key(request), self._eos_ids,
                           self.args.kv_block_size, lease_ms, guide)
        self._requests[request.request_id] = req
        self.scheduler.add(req)
        self._wakeup.set()
        return stream

    def _validate(self, request: EngineRequest) -> None:
        if request.request_id in self._requests:
            raise InvalidRequest(f"request id '{request.request_id}' is already in flight",
                                 param="request_id")
        check_prompt_and_sampling(request, self.vocab_size, self._max_model_len, self.pool)
        if request.kv_handle is not None:
            check_kv_handle(request, self._layout, self.accepted_backends, self.name, self.pool)
            self._require_transfer()  # a backend that cannot move KV refuses here, not later

    def _new_guide(self, request: EngineRequest) -> Guide | None:
        """The request's grammar guide (None when unconstrained). Compiling happens here, on the
        loop, once per constraint (the grammars are cached)."""
        guided = request.sampling.guided
        if guided is None:
            return None
        if self.args.guided_decoding_backend == "none":
            raise FailedPrecondition("guided decoding is off on this worker "
                                     "(--guided-decoding-backend none)",
                                     param="sampling.guided_decoding")
        if self._grammars is None:
            self._grammars = Grammars.from_model_dir(self.args.model, self.vocab_size,
                                                     self._eos_ids)
        return self._grammars.guide(guided, request.prompt_token_ids)

    # ---- disaggregation: the prefill side -----------------------------------------------------

    async def prefill(self, request: EngineRequest, lease_ms: int) -> PrefillResult:
        if request.kv_handle is not None:
            raise InvalidRequest("a prefill request cannot carry a KV handle", param="kv_handle")
        if lease_ms < 1:
            raise InvalidRequest(f"lease_ms must be at least 1, got {lease_ms}",
                                 param="lease_ms")
        self._require_transfer()  # refuse before computing anything
        if request.request_id in self.leases:
            raise InvalidRequest(f"request id '{request.request_id}' still holds the KV lease "
                                 "of an earlier prefill: release it, or use another id",
                                 param="request_id")
        stream = self._admit(request, lease_ms)
        first: TokenLogprob | None = None
        cached, finish = 0, None
        try:
            async for chunk in stream:
                if chunk.cached_tokens is not None:
                    cached = chunk.cached_tokens
                if chunk.token_ids and first is None:
                    first = (chunk.logprobs[0] if chunk.logprobs
                             else TokenLogprob(chunk.token_ids[0], 0.0))
                finish = chunk.finish_reason
            handle = self._handles_out.pop(request.request_id, None)
        except BaseException:
            # The caller went away (or the engine failed): nothing may stay pinned for it.
            self.abort(request.request_id)
            self._handles_out.pop(request.request_id, None)
            self.leases.release(request.request_id)
            raise
        if first is None:
            raise Unavailable(f"prefill of '{request.request_id}' ended without a token "
                              f"({finish.value if finish else 'no reason'})")
        if handle is not None:
            return PrefillResult(first, handle, cached)
        return PrefillResult(first, None, cached, finish)

    async def release(self, request_id: str) -> bool:
        return self.leases.release(request_id)

    def prepare_kv_transfer(self) -> None:
        self._require_transfer()

    def set_lease_releaser(self, releaser: Callable[[KvHandle], None]) -> None:
        self.loads.release_remote = releaser

    def set_transfer_observer(self, observer: TransferObserver) -> None:
        self.loads.observer = observer

    def debug_checksums(self) -> Mapping[tuple[str, str], str]:
        return self.loads.checksums

    def _lease(self, req: BatchRequest) -> None:
        """A prefill-only request sampled its first token: its blocks go under a lease and the
        handle waits for `prefill` to hand it out."""
        assert req.lease_ms is not None
        if req.request_id in self.leases:  # taken since admission (prefill refuses it before)
            self._fail(req, FailedPrecondition(f"request id '{req.request_id}' already holds a "
                                               "KV lease", param="request_id"))
            return
        self._end(req)
        table, req.table = req.table, BlockTable()
        bs = self.pool.block_size
        hashes = tuple(req.block_hashes(req.num_prompt // bs, bs))
        transfer = self.transfer
        source = transfer.source(table.block_ids)
        block_ids = tuple(table.block_ids)
        self.loads.record_checksum("leased", req.request_id, block_ids)
        if source.copied:  # the lease holds the copy; the blocks stay as prefix cache
            self.pool.free(table)
            self._wakeup.set()
        expiry = self.leases.add(req.request_id, table, req.lease_ms,
                                 functools.partial(transfer.end_source, source))
        self._handles_out[req.request_id] = KvHandle(
            worker_id="", worker_address="", request_id=req.request_id,
            backend=transfer.backend, layout=self._layout, num_tokens=req.num_prompt,
            block_ids=block_ids, block_hashes=hashes,
            nixl_agent_name=source.agent_name, nixl_agent_metadata=source.agent_metadata,
            descriptors=source.descriptors, nixl_memory_type=source.memory_type,
            lease_expiry_unix_ms=expiry,
            ranks=tuple(RankSource(rank.agent_name, rank.agent_metadata, rank.descriptors)
                        for rank in source.ranks))
        req.stream.finish(FinishReason.LENGTH, self._usage(req))

    # ---- ending requests --------------------------------------------------------------------

    def abort(self, request_id: str) -> bool:
        req = self._requests.get(request_id)
        if req is None or req.is_finished:
            return False
        loading = req.is_loading
        self._end(req)
        if not loading:  # a read still writing its blocks frees them when it ends
            self.scheduler.drop(req)
        req.stream.finish(FinishReason.CANCELLED, self._usage(req))
        return True

    def _end(self, req: BatchRequest) -> None:
        """Every way a request ends goes through here (finished, aborted, failed, leased, a
        failed KV read): FINISHED, and no longer the engine's. The caller releases its blocks
        (or leases them) and ends its stream."""
        req.status = RequestStatus.FINISHED
        self._requests.pop(req.request_id, None)

    def _usage(self, req: BatchRequest) -> Usage:
        return Usage(req.num_prompt, req.num_output, req.num_cached, req.num_accepted,
                     req.num_proposed - req.num_accepted)

    def _finish(self, req: BatchRequest, reason: FinishReason) -> None:
        self._end(req)
        self.scheduler.release(req)
        req.stream.finish(reason, self._usage(req))

    def _fail(self, req: BatchRequest, error: TandemError) -> None:
        """Ends one request with an error mid-step (as abort does, with the error)."""
        self._end(req)
        self.scheduler.drop(req)
        req.stream.fail(error)

    def _fail_loaded(self, req: BatchRequest, error: TandemError) -> None:
        """Ends a request whose KV read failed (its blocks are already free)."""
        self._end(req)
        req.stream.fail(error)

    async def close(self) -> None:
        self._closed = True
        for request_id in list(self._requests):
            self.abort(request_id)
        task, self._task = self._task, None
        if task is not None:
            # Let the step in flight finish (a forward pass in a worker thread cannot be
            # cancelled: it would go on writing the KV cache after close returned); the loop
            # sees _closed and ends.
            self._wakeup.set()
            self._gate.release()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.loads.close()
        self.leases.close()
        if self._transfer is not None:
            self._transfer.close()
        self._publish(self.pool.take_events())

    # ---- the step loop ----------------------------------------------------------------------

    async def _run(self) -> None:
        """Steps while there is work; every wait of the loop is here."""
        plan: StepPlan | None = None
        try:
            while not self._closed:
                if self._ahead is not None and (not self.scheduler.has_work
                                                or self._gate.is_armed):
                    await self._settle()  # nothing to run ahead of, or a hook may pause
                elif not self.scheduler.has_work:
                    await self._wait_for_wakeup()
                elif hold := self._batch_wait.hold_s(self.scheduler):
                    await self._wait_for_wakeup(hold)  # a new request looks again
                else:
                    await self._gate.wait()
                    if self._closed:
                        break
                    observed = self._step_observer is not None
                    started_ns = time.time_ns() if observed else 0
                    plan = await self._step()
                    if plan is not None and observed:
                        self._observe_step(plan, started_ns)
                    if plan is None:
                        await self._wait_for_peers()
            if self._ahead is not None:  # its device work ends before close() returns
                await self._settle()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: fail every stream loudly instead of hanging them
            log.exception("%s engine step loop failed at step %d (last plan: %s)", self.name,
                          self.num_steps, plan.describe() if plan is not None else "none")
            self._failure = exc
            for req in list(self._requests.values()):
                req.stream.fail(exc)
            self._requests.clear()

    async def _step(self) -> StepPlan | None:
        """schedule -> copies -> loads -> execute -> apply -> publish (a plain decode step is
        launched ahead instead, and applied when the next step settles it). Returns the plan,
        or None when nothing could run: blocks held outside the batch must come back first."""
        ahead = self._ahead
        speculating = self._speculating = self._is_speculating()
        if ahead is not None:
            await ahead.host_done()
            if speculating or not may_schedule_ahead(self.scheduler, ahead):
                await self._settle()  # proposals need every token on the host
                ahead = None
                if not self.scheduler.has_work:  # its tokens finished the last requests
                    self._publish(self.pool.take_events())
                    return StepPlan()
        if speculating:
            assert self.speculation is not None
            await self.speculation.propose(self.scheduler.running, self.pool, self.vocab_size)
        plan = self.scheduler.schedule()
        self.num_steps += 1
        if not await self._run_ahead(plan, ahead):
            if not (plan.scheduled or plan.first_tokens or plan.num_preempted or plan.loads
                    or self.scheduler.running):
                return None
            if self.pool.host is not None:  # before anything writes the step's blocks
                await self.host_copies.run(plan)
            for req in plan.loads:
                self.loads.start(req)
            self._apply(plan, await self._execute(plan))
        self._publish(self.pool.take_events())
        self._gate.after_step()
        return plan

    def set_step_observer(self, observer: StepObserver) -> None:
        self._step_observer = observer

    def _observe_step(self, plan: StepPlan, started_ns: int) -> None:
        assert self._step_observer is not None
        self._step_observer(StepRecord(
            started_ns, time.time_ns(), len(plan.scheduled), plan.prefill_tokens,
            plan.num_admitted, len(plan.first_tokens) + sum(
                1 for r in plan.ready if r.num_computed == r.num_prompt),
            len(self.scheduler.waiting), len(self.scheduler.running), self._ahead is not None))

    async def _wait_for_wakeup(self, timeout_s: float | None = None) -> None:
        self._wakeup.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wakeup.wait(), timeout_s)
        self.woke_at = time.monotonic()

    async def _wait_for_peers(self) -> None:
        """Waits for blocks held outside the batch (leases, KV reads): a release, an expiry or
        the end of a read wakes the loop."""
        if not (self.leases or self.loads):
            # Admission validates that any request fits an empty pool, so this is a bug; fail
            # loudly rather than spin.
            raise RuntimeError(f"the {self.name} scheduler made no progress with an idle batch")
        self._is_blocked_on_peers = True
        try:
            await self._wait_for_wakeup()
        finally:
            self._is_blocked_on_peers = False

    async def _run_ahead(self, plan: StepPlan, ahead: StepAhead | None) -> bool:
        """Launches `plan` ahead of its tokens where it can (then True); `ahead`, the step
        launched before it (if any), is settled either way, and `plan` then holds only the
        requests still alive."""
        launched = None
        if (is_plain_decode(plan) and not self.pool.has_copies and not self._gate.is_armed
                and not self._speculating
                and (ahead is None or same_requests(plan, [r for r in ahead.reqs
                                                            if not r.is_finished]))):
            launched = self._launch(plan, ahead)
        if ahead is not None:
            ahead.taken = launched is not None
            await self._settle()
            if launched is None and any(r.is_finished for r, _ in plan.scheduled):
                plan.scheduled = [(r, n) for r, n in plan.scheduled if not r.is_finished]
                plan.ready = [r for r in plan.ready if not r.is_finished]
        if launched is None:
            return False
        self._ahead = launched
        self.num_steps_ahead += 1
        for req in launched.reqs:
            if not req.is_finished:  # those the settled step finished compute a dropped row
                req.token_ids.append(PLACEHOLDER)
                req.num_pending = 1
        return True

    async def _settle(self) -> None:
        """Waits for the step launched ahead and applies its tokens."""
        ahead, self._ahead = self._ahead, None
        assert ahead is not None
        sampled = await ahead.sampled()
        finished_any = False
        for req, (token, logprob) in zip(ahead.reqs, sampled, strict=True):
            if req.is_finished or not req.num_pending:
                continue
            req.token_ids.pop()  # the placeholder
            req.num_pending = 0
            finished_any |= self._emit(req, token, logprob, sampled=True, taken=ahead.taken)
        if finished_any:
            self.scheduler.compact()

    def _apply(self, plan: StepPlan, sampled: list[Sampled]) -> None:
        """Emits the step's tokens: the first tokens of transferred requests, then what each
        ready request sampled (one row, or 1 + its proposals' rows: Speculation.verify)."""
        finished_any = False
        for req in plan.first_tokens:
            if req.is_finished:  # aborted while the step ran
                continue
            first = req.first_token
            assert first is not None
            req.first_token = None
            finished_any |= self._emit(req, first.token_id, first)
        row = 0
        for req in plan.ready:
            rows = 1 + req.num_draft
            if req.is_finished:
                pass
            elif rows > 1:
                assert self.speculation is not None
                finished_any |= self.speculation.verify(req, sampled[row:row + rows],
                                                        self._emit_sampled, self.pool)
            else:
                token, logprob = sampled[row]
                finished_any |= self._emit(req, token, logprob, sampled=True)
            row += rows
        if row != len(sampled):
            raise RuntimeError(f"the step sampled {len(sampled)} rows for {row} positions")
        if finished_any:
            self.scheduler.compact()

    # ---- speculative decoding (tandem.engines.speculative.speculation) ------------------------

    def _is_speculating(self) -> bool:
        """Whether the next step speculates (once per step: the policies count steps)."""
        spec = self.speculation
        return spec is not None and spec.is_active(len(self.scheduler.running))

    def _emit_sampled(self, req: BatchRequest, token: int, logprob: TokenLogprob | None) -> bool:
        return self._emit(req, token, logprob, sampled=True)

    def _emit(self, req: BatchRequest, token: int, logprob: TokenLogprob | None,
              sampled: bool = False, taken: bool = False) -> bool:
        """Appends one output token; True when it finished the request.

        A guided request's token first advances its grammar: one the grammar forbids (only a
        prefill worker's first token can be one: the engine masks what it samples) fails the
        request; one that completes the grammar (its stop token) finishes it, STOP. A token
        this engine `sampled` under the grammar's mask is taken by the grammar later, with the
        next step's mask, off the event loop (Guide.defer), unless the step launched ahead of
        it has `taken` it already: its thread may still be moving the grammar, so only what the
        token itself says is read then (a stop token ends the grammar; only one does)."""
        guide = req.guide
        if guide is not None and not _grammar_takes(guide, token, sampled, taken):
            self._fail(req, FailedPrecondition(
                f"token {token} at output position {req.num_output} breaks the request's "
                f"{req.sampling.guided.kind.value if req.sampling.guided else ''} constraint",
                param="first_token" if req.num_output == 0 else "sampling.guided_decoding"))
            return True
        req.token_ids.append(token)
        req.num_output += 1
        req.stream.push(token, logprob if req.sampling.top_logprobs is not None else None)
        if ((token in req.stop_ids and req.num_output >= req.min_tokens)
                or (guide is not None and (token in guide.stop_ids if taken
                                           else guide.is_terminated))):
            self._finish(req, FinishReason.STOP)
            return True
        if req.num_output >= req.sampling.max_tokens:
            self._finish(req, FinishReason.LENGTH)
            return True
        if req.lease_ms is not None:
            self._lease(req)
            return True
        return False

    # ---- health -----------------------------------------------------------------------------

    def progress(self) -> Progress:
        has_work = (self.scheduler.has_work and not self._is_blocked_on_peers
                    and not self._closed and self._failure is None)
        return Progress(has_work, self.num_steps)

    def pause_steps(self) -> None:
        self._gate.pause()

    def resume_steps(self) -> None:
        self._gate.resume()

    def pause_when(self, min_output_tokens: int) -> asyncio.Future[PausePoint]:
        return self._gate.pause_when(min_output_tokens)

    def _settled_point(self) -> PausePoint | None:
        """(running, their fewest output tokens) when nothing waits, loads or is loaded."""
        running = [r for r in self.scheduler.running if not r.is_finished]
        if self.scheduler.waiting or self.scheduler.loaded or self.loads or not running:
            return None
        return PausePoint(len(running), min(r.num_output for r in running))

    # ---- observability ----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        sched = self.scheduler
        pending = sum(len(r.token_ids) - r.num_computed for r in sched.waiting)
        pending += sum(len(r.token_ids) - r.num_computed for r in sched.running
                       if r.is_prefilling and not r.is_finished)
        loads = self.loads
        stats = EngineStats(
            num_running=sum(1 for r in sched.running if not r.is_finished),
            num_waiting=len(sched.waiting) + len(loads),
            kv_blocks_used=self.pool.num_used,
            kv_blocks_total=self.pool.total,
            pending_prefill_tokens=pending,
            active_decode_blocks=self.pool.num_used,
            prefix_cache_hit_rate=self.pool.prefix_hit_rate,
            kv_leases=len(self.leases),
            num_loading=len(loads),
            kv_lease_expiries=self.leases.num_expired,
            kv_bytes_received=loads.num_bytes,
            kv_transfers_ok=loads.num_ok,
            kv_transfers_failed=loads.num_failed,
            **self.host_copies.stats_fields(),  # type: ignore[arg-type]
            # Not self.transfer: stats must not create the transfer (and its NIXL agent).
            **(self._transfer.buffer_stats() if self._transfer is not None else {}),  # type: ignore[arg-type]
        )
        if self.speculation is None:
            return stats
        c = self.speculation.counters
        return dataclasses.replace(
            stats, spec_verify_passes=c.verify_passes, spec_proposed_tokens=c.proposed_tokens,
            spec_accepted_tokens=c.accepted_tokens,
            spec_accepted_by_position=tuple(c.accepted_by_position))


def _grammar_takes(guide: Guide, token: int, sampled: bool, taken: bool) -> bool:
    """Whether `guide`'s grammar allows `token`, moving it over the token: already done by the
    step launched ahead (`taken`), later for a token sampled under its mask (`sampled`), now
    otherwise."""
    if taken:
        return guide.rejected is None
    return guide.defer(token) if sampled else guide.accept(token)

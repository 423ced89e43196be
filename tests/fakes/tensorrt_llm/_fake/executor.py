"""The fake's executor: one asyncio task stepping every request (context phase, KV transfer,
one token per generation step), emitting upstream-shaped responses, KV events and
iteration stats."""
from __future__ import annotations

import asyncio
import collections
import json
from typing import Any

from tensorrt_llm._fake import model
from tensorrt_llm._fake.guided import FakeGuidedDecoder
from tensorrt_llm._fake.kv_cache import BlockManager, NoFreeBlocks
from tensorrt_llm._fake.request import DONE, QUEUED, RUNNING, TRANSFER, FakeRequest
from tensorrt_llm._fake.settings import knobs
from tensorrt_llm._fake.stats import iteration_stats
from tensorrt_llm._fake.transceiver import Sender, receive
from tensorrt_llm._utils import KVCacheEvent, KVCacheEventSerializer
from tensorrt_llm.executor.result import IterationResult


class FakeExecutor:
    def __init__(self, args: Any, vocab_size: int, max_seq_len: int,
                 guided: FakeGuidedDecoder | None = None) -> None:
        kv = args.kv_cache_config
        self.args, self.vocab_size = args, vocab_size
        self.guided = guided
        tpb = kv.tokens_per_block
        self.windows = sorted(set(kv.max_attention_window or [max_seq_len]))
        self._event_id = 0
        self._events: collections.deque[str] = collections.deque(
            maxlen=kv.event_buffer_max_size or 1)
        self.kv_events: IterationResult | None = None
        self.stats: IterationResult | None = None
        # A secondary (host) pool only with onboarding on (upstream's mOnboardBlocks).
        num_secondary = (kv.host_cache_size // knobs.block_bytes
                         if kv.host_cache_size and kv.onboard_blocks else 0)
        self.blocks = BlockManager(kv.max_tokens // tpb if kv.max_tokens else knobs.num_blocks,
                                   tpb, kv.enable_block_reuse, kv.enable_partial_reuse,
                                   self._emit, num_secondary)
        ctc = args.cache_transceiver_config
        self.sender = Sender(ctc.kv_transfer_timeout_ms, self._sent) if ctc else None
        self.requests: dict[int, FakeRequest] = {}
        self._held: dict[int, FakeRequest] = {}
        self._cancelled: set[int] = set()
        self.leaked_blocks = 0
        self.iteration = 0
        self._next_id = 1
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None

    # ---- API used by LLM ---------------------------------------------------------------------

    def next_request_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def submit(self, req: FakeRequest) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id} is already in flight")
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())
        if self.kv_events is None:  # upstream: _maybe_initialize_iteration_results
            self.kv_events = IterationResult(self._events.maxlen)
            self.stats = IterationResult(self.args.max_stats_len)
        else:
            self.kv_events.mark_undone()
            assert self.stats is not None
            self.stats.mark_undone()
        self.requests[req.request_id] = req
        self._kick()

    def abort_request(self, request_id: int) -> None:
        if request_id in self.requests:
            self._cancelled.add(request_id)
            self._kick()

    def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for req in self.requests.values():
            if req.transfer is not None:
                req.transfer.cancel()
        if self.sender is not None:
            self.sender.close()

    # ---- the step loop -----------------------------------------------------------------------

    def _kick(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        assert self._wake is not None
        if self.sender is not None:
            await self.sender.start()
        while True:
            busy = any(r.state in (QUEUED, RUNNING) for r in self.requests.values())
            if not busy and not self._cancelled:
                self._wake.clear()
                await self._wake.wait()
                continue
            await asyncio.sleep(knobs.step_s)
            self._step()

    def _step(self) -> None:
        self.iteration += 1
        for request_id in sorted(self._cancelled):
            self._cancel(self.requests.get(request_id))
        self._cancelled.clear()
        active = sum(1 for r in self.requests.values() if r.state in (TRANSFER, RUNNING))
        for req in list(self.requests.values()):
            if req.state == RUNNING:
                self._generate(req)
            elif req.state == QUEUED and active < (self.args.max_batch_size or 2048):
                active += 1
                self._admit(req)
        for request_id in [i for i, r in self.requests.items() if r.state == DONE]:
            del self.requests[request_id]
        if self.args.enable_iter_perf_stats and self.stats is not None:
            self.stats.aqueue.put(json.dumps(iteration_stats(self)))
        self._flush_events()

    def _admit(self, req: FakeRequest) -> None:
        if self.guided is not None and req.params.guided_decoding is not None:
            req.matcher = self.guided.matcher(req.params.guided_decoding)
        try:
            if req.kind == "generation_only":
                req.blocks = self.blocks.allocate(req.prompt, reuse=False)
                req.state = TRANSFER
                req.transfer = asyncio.get_running_loop().create_task(receive(
                    req.disagg.opaque_state, req.disagg.ctx_request_id, knobs.transfer_delay_s))
                req.transfer.add_done_callback(lambda _t, r=req: self._received(r))
                return
            req.blocks = self.blocks.allocate(req.prompt)
        except NoFreeBlocks as exc:
            req.respond(error=str(exc))
            return
        self.blocks.store_full(req.blocks)
        req.model_state = model.fold(req.prompt)
        req.state = RUNNING
        self._sample(req)

    def _received(self, req: FakeRequest) -> None:
        assert req.transfer is not None
        if req.state != TRANSFER or req.transfer.cancelled():
            return
        exc = req.transfer.exception()
        if exc is not None:
            self.blocks.release(req.blocks, store=False)
            req.respond(error=f"KV cache transfer failed: {exc}")
            self.requests.pop(req.request_id, None)
            return
        self.blocks.store_full(req.blocks)
        first = list(req.disagg.first_gen_tokens)
        req.model_state = model.fold(req.prompt + first[:-1])
        req.tokens = req.prompt + first
        req.num_generated = len(first)
        if req.matcher is not None:
            for token in first:
                req.matcher.accept_token(token)
        req.carried = first
        req.decoding_iter = 1  # the context server's step
        req.state = RUNNING
        self._kick()

    def _generate(self, req: FakeRequest) -> None:
        if req.carried:
            req.pending, req.carried = req.carried, []
            if req.num_generated >= req.params.max_tokens:
                self._finish(req, "length")
                return
        try:
            self.blocks.append(req.blocks, req.tokens[-1])
        except NoFreeBlocks as exc:
            self.blocks.release(req.blocks, store=False)
            req.respond(error=str(exc))
            return
        req.model_state = model.advance(req.model_state, req.tokens[-1])
        self._sample(req)

    def _sample(self, req: FakeRequest) -> None:
        token = model.sample(req.model_state, self.vocab_size)
        if req.matcher is not None and self.guided is not None:
            token = self.guided.pick(req.matcher, token, req.model_state)
            req.matcher.accept_token(token)
        req.tokens.append(token)
        req.num_generated += 1
        req.pending.append(token)
        if req.params.logprobs:
            req.pending_logprobs.append(
                model.logprobs(req.model_state, token, req.params.logprobs, self.vocab_size))
        finish = req.finish_reason(token)
        if req.kind == "context_only":
            self._finish_context(req, finish or "length")
        elif finish is not None:
            self._finish(req, finish)
        else:
            req.respond()

    def _finish_context(self, req: FakeRequest, finish: str) -> None:
        if finish != "length" or self.sender is None:  # only length-finished context is sent
            self._finish(req, finish)
            return
        ctx = {"first_gen_tokens": req.tokens[len(req.prompt):], "ctx_request_id": req.request_id,
               "opaque_state": self.sender.opaque_state(req.request_id), "draft_tokens": None}
        self._held[req.request_id] = req
        self.sender.hold(req.request_id, req.prompt)
        req.respond(finish, ctx_params=ctx)

    def _sent(self, ctx_request_id: int) -> None:
        req = self._held.pop(ctx_request_id)
        self.blocks.release(req.blocks)
        self._flush_events()

    def _finish(self, req: FakeRequest, finish: str) -> None:
        self.blocks.release(req.blocks)
        req.respond(finish)

    def _cancel(self, req: FakeRequest | None) -> None:
        if req is None or req.state == DONE:
            return  # includes a context request whose KV is with the transceiver: a no-op
        if req.state == TRANSFER:
            # The hazard Dynamo hit (ai-dynamo/dynamo#7489): cancelling a generation-only
            # request mid-transfer interrupts the transfer, and the blocks it holds are never
            # freed; the context side keeps its blocks until kv_transfer_timeout_ms.
            assert req.transfer is not None
            req.transfer.cancel()
            self.leaked_blocks += len(req.blocks)
        elif req.state == RUNNING:
            self.blocks.release(req.blocks)
        req.respond("cancelled")

    # ---- KV events ---------------------------------------------------------------------------

    def _emit(self, data: Any) -> None:
        if not self.args.kv_cache_config.event_buffer_max_size:
            return
        rank = 0 if self.args.enable_attention_dp else None
        for window in self.windows:  # variable sliding window attention: one event per window
            event = KVCacheEvent(self._event_id, data, window, rank)
            self._event_id += 1
            self._events.append(json.dumps(KVCacheEventSerializer.to_json_str(event)))

    def _flush_events(self) -> None:
        if self.kv_events is not None:
            while self._events:
                self.kv_events.aqueue.put(self._events.popleft())

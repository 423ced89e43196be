"""The mock engine: Dynamo-mocker-compatible simulation of a paged-KV engine, no weights.

It reads only the model's config.json (and tokenizer.json's special tokens), schedules like
vLLM v1 over a real BlockPool (prefix caching, eviction, preemption, KV events, the host tier),
sleeps for the time Dynamo's polynomial perf model gives each step (plus the step's host-tier
copies at --mock-kv-host-gbps), and emits deterministic tokens. A guided
request's tokens are drawn among those its grammar allows (tandem.engines.mock.guided), so its
output satisfies its constraint.
"""
from __future__ import annotations

import asyncio
import time

from tandem.engines.args import EngineArgs
from tandem.engines.batching.engine import BatchingEngine, Sampled, validate_args
from tandem.engines.batching.host_copies import CopyTiming
from tandem.engines.batching.scheduler import StepPlan
from tandem.engines.mock import timing
from tandem.engines.mock.guided import GuidedDraws
from tandem.engines.mock.sampler import TokenSampler, special_token_ids, stream_key
from tandem.engines.types import EngineRequest, KvLayout
from tandem.errors import InvalidRequest
from tandem.kv.host_tier import BlockCopies
from tandem.kv.transfer import KvTransfer, SimulatedTransfer
from tandem.model.config import ModelConfig

#: KV capacity in tokens when --num-gpu-blocks-override is not given (the mock has no memory to
#: measure): Dynamo 1.6.1's mocker default, 16384 blocks of 64 tokens. A pass's decode time
#: depends on the share of it in use, so the pool holds these tokens whatever the block size
#: (32768 blocks of Tandem's default 32; 16384 of 32 made decode passes at 128 streams of
#: 200/200 cost 9.5 ms where Dynamo's cost 7.7).
DEFAULT_CAPACITY_TOKENS = 16384 * 64
#: The last part of a pass's wait, slept precisely on the loop's thread (see _sleep_until).
PRECISE_MARGIN_S = 1.5e-3


class MockEngine(BatchingEngine):
    """A simulated engine (see module docstring); the Engine contract holds in full."""

    name = "mock"
    accepted_backends = frozenset({"mock"})

    def __init__(self, args: EngineArgs, model: ModelConfig, special_ids: set[int]) -> None:
        eos_ids = frozenset(model.eos_token_ids)
        super().__init__(
            args,
            KvLayout(model.dtype, model.num_layers, model.num_kv_heads, model.head_size,
                     args.kv_block_size),
            args.max_seq_len or model.max_position_embeddings, model.vocab_size, eos_ids,
            args.num_gpu_blocks or max(1, DEFAULT_CAPACITY_TOKENS // args.kv_block_size))
        self.model = model
        self.sampler = TokenSampler(model.vocab_size, eos_ids | special_ids)
        self._guided_draws: GuidedDraws | None = None
        #: How late a short nanosleep wakes here, lately (see _sleep_until), seconds.
        self._nanosleep_late = 0.0
        #: When the last pass's modelled time ended (time.monotonic()).
        self._pass_end = 0.0

    def _validate(self, request: EngineRequest) -> None:
        super()._validate(request)
        if request.sampling.prompt_logprobs is not None:
            raise InvalidRequest("the mock engine has no model, so no prompt logprobs",
                                 param="prompt_logprobs")

    def _create_transfer(self) -> KvTransfer:
        return SimulatedTransfer(self.layout.block_bytes, self.args.mock_kv_transfer_gbps)

    async def _copy_blocks(self, copies: BlockCopies, sync: bool) -> list[CopyTiming]:
        """No bytes: the copies take bytes / --mock-kv-host-gbps (offloads, then onboards, on
        one link), before the step's compute. Like --mock-kv-transfer-gbps, not scaled by the
        speedup ratio."""
        gbps = self.args.mock_kv_host_gbps
        per_block = self.layout.block_bytes / (gbps * 1e9) if gbps > 0 else 0.0
        offload_s = len(copies.offloads) * per_block
        onboard_s = len(copies.onboards) * per_block
        await asyncio.sleep(offload_s + onboard_s)
        return [("offload", len(copies.offloads), offload_s),
                ("onboard", len(copies.onboards), onboard_s)]

    async def _sleep_until(self, deadline: float) -> None:
        """Returns at `deadline` (time.monotonic()), a pass's end, within about 0.1 ms.

        asyncio's timers wake on epoll's millisecond ticks, rounded up, plus the loop's own
        latency: a 5.75 ms decode pass lasted 6.3 ms (measured; Dynamo sleeps on a timerfd). So
        the loop sleeps until `PRECISE_MARGIN_S` before the deadline, serving other tasks (the
        tokens of the last pass go out then), and the rest is one nanosleep on the loop's
        thread, asked that much shorter than needed as it has lately woken late."""
        remaining = deadline - time.monotonic()
        await asyncio.sleep(remaining - PRECISE_MARGIN_S if remaining > PRECISE_MARGIN_S else 0)
        asked = deadline - time.monotonic() - self._nanosleep_late
        if asked > 0:
            before = time.monotonic()
            time.sleep(asked)
            late = time.monotonic() - before - asked
            self._nanosleep_late += 0.1 * (min(late, PRECISE_MARGIN_S) - self._nanosleep_late)

    def _draw_guided(self, plan: StepPlan) -> dict[int, int]:
        if self._grammars is None:  # no guided request came yet
            return {}
        if self._guided_draws is None:
            self._guided_draws = GuidedDraws(self._grammars, self._eos_ids)
        return self._guided_draws.draw(plan.ready)

    def _request_key(self, request: EngineRequest) -> int:
        return stream_key(request.prompt_token_ids, request.sampling.seed)

    async def _execute(self, plan: StepPlan) -> list[Sampled]:
        # As Dynamo's pass: from its start, the last pass's end when the loop went straight on
        # (the tokens' bookkeeping and this pass's scheduling are inside the modelled time, as
        # in Dynamo's loop), else when work woke the loop.
        started = max(self._pass_end, self.woke_at)
        # Decoding: one token computed for a request that already has output (a prefill that
        # completes in the pass emits its first token without a decode charge, as in Dynamo).
        decoding = [len(req.token_ids) for req, num in plan.scheduled
                    if num == 1 and req.num_output > 0]
        delay = timing.step_seconds(plan.prefill_tokens, sum(decoding) if decoding else None,
                                    self.pool.total * self.pool.block_size,
                                    self.args.speedup_ratio)
        # As Dynamo's sleep_until_precise: the pass lasts `delay` from its start, bookkeeping
        # included; with no delay still yield so consumers and new requests get to run.
        await self._sleep_until(started + delay)
        self._pass_end = time.monotonic()
        sampler = self.sampler
        sampled: list[Sampled] = []
        guided = self._draw_guided(plan)
        drawn = sampler.draw_many([req.key for req in plan.ready],
                                  [req.num_output for req in plan.ready])
        for row, req in enumerate(plan.ready):
            token = guided.get(row, drawn[row])
            k = req.sampling.top_logprobs
            sampled.append((token, None if k is None else
                            sampler.logprob(req.key, req.num_output, token, k)))
        return sampled


def create_mock_engine(args: EngineArgs) -> MockEngine:
    """Builds a MockEngine from the model directory's config.json (no weights are read)."""
    validate_args(args)
    if args.encode_only:
        # Refused at start rather than answering every Encode with UNIMPLEMENTED.
        raise InvalidRequest("the mock engine has no vision encoder, so it cannot run an encode "
                             "worker; use --engine reference (or trtllm) with a vision model",
                             param="engine")
    if args.embed_only:
        # Made-up vectors would look like embeddings to every check downstream.
        raise InvalidRequest("the mock engine computes no embeddings, so it cannot run an "
                             "embedding worker; use --engine reference with an embedding model",
                             param="engine")
    if args.speculative_config:
        # Its tokens are drawn, not computed: there is nothing a proposal could be checked by.
        raise InvalidRequest("the mock engine does not speculate; --speculative-config needs "
                             "--engine reference (or trtllm)", param="speculative_config")
    if args.speedup_ratio < 0:
        raise InvalidRequest(f"speedup_ratio must be >= 0, got {args.speedup_ratio}",
                             param="speedup_ratio")
    if args.mock_kv_host_gbps < 0:
        raise InvalidRequest(f"mock_kv_host_gbps must be >= 0, got {args.mock_kv_host_gbps}",
                             param="mock_kv_host_gbps")
    model = ModelConfig.from_dir(args.model)
    return MockEngine(args, model, special_token_ids(args.model))

"""The continuous-batching scheduler alone, over a real BlockPool, with requests from a factory:
running requests first, a token budget that chunks prompts, FCFS admission that stops at the
first request that does not fit, preemption of the newest running request, prefix hits, and the
two rules overlap scheduling relies on (a block holding a placeholder is not hashed; a request
that finished while preempted is never admitted)."""
from __future__ import annotations

import itertools

from tandem.engines.batching.ahead import PLACEHOLDER
from tandem.engines.batching.request import BatchRequest, RequestStatus
from tandem.engines.batching.scheduler import Scheduler
from tandem.engines.stream import RequestStream
from tandem.engines.types import EngineRequest, SamplingParams
from tandem.kv.block_pool import BlockPool

BS = 4
_ids = itertools.count(1)


def request(prompt: list[int] | int, max_tokens: int = 8) -> BatchRequest:
    """A request of `prompt` tokens (or that many tokens no other request shares)."""
    k = next(_ids)
    tokens = prompt if isinstance(prompt, list) else [1000 * k + i for i in range(prompt)]
    rid = f"r{k}"
    return BatchRequest(EngineRequest(rid, tuple(tokens), SamplingParams(max_tokens=max_tokens)),
                        RequestStream(rid), key=0, eos_ids=frozenset(), block_size=BS)


def scheduler(num_blocks: int = 64, max_batch: int = 8, budget: int = 16,
              prefix_caching: bool = True) -> Scheduler:
    return Scheduler(BlockPool(num_blocks, BS, prefix_caching), max_batch, budget)


def decode(req: BatchRequest, token: int = 7) -> None:
    """What the engine does when a ready request samples: its token joins token_ids."""
    req.token_ids.append(token)
    req.num_output += 1


def test_prompts_are_chunked_by_the_budget_and_running_requests_go_first() -> None:
    s = scheduler(budget=16)
    a, b = request(10), request(12)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert [(r, n) for r, n in plan.scheduled] == [(a, 10), (b, 6)]  # b's prompt is cut
    assert plan.ready == [a] and plan.prefill_tokens == 16 and plan.num_admitted == 2
    decode(a)
    plan = s.schedule()
    assert [(r, n) for r, n in plan.scheduled] == [(a, 1), (b, 6)]  # running first, in order
    assert plan.ready == [a, b]


def test_admission_stops_at_the_first_request_that_does_not_fit() -> None:
    s = scheduler(num_blocks=6, budget=64)
    big, small = request(20), request(2)  # 5 blocks, then 1: the second still fits
    too_big, after = request(8), request(1)
    for r in (big, small, too_big, after):
        s.add(r)
    plan = s.schedule()
    assert [r for r, _ in plan.scheduled] == [big, small]
    assert list(s.waiting) == [too_big, after]  # FCFS: `after` would fit but waits its turn


def test_a_request_that_cannot_grow_preempts_the_newest_running_one() -> None:
    s = scheduler(num_blocks=4, budget=64)
    old, new = request(8), request(7)  # two blocks each: the pool is full
    s.add(old)
    s.add(new)
    s.schedule()
    decode(old)
    decode(new)
    plan = s.schedule()  # old's 9th token needs a third block
    assert plan.num_preempted == 1
    assert [r for r, _ in plan.scheduled] == [old]
    assert list(s.waiting) == [new] and new.num_computed == 0 and not new.table.block_ids
    assert s.num_preemptions == 1


def test_a_shared_prefix_is_served_from_the_cache() -> None:
    s = scheduler()
    prefix = [100 + i for i in range(8)]
    first = request(prefix + [1, 2])
    s.add(first)
    s.schedule()
    s.release(first)
    first.status = RequestStatus.FINISHED
    s.compact()
    second = request(prefix + [3, 4, 5])
    s.add(second)
    plan = s.schedule()
    assert second.num_cached == 8 and plan.scheduled == [(second, 3)]


def test_a_block_holding_a_placeholder_is_hashed_once_its_token_is_known() -> None:
    s = scheduler()
    req = request(7)  # one token short of two full blocks
    s.add(req)
    s.schedule()
    assert req.table.num_committed == 1
    # A step ahead: the sampled token is still on the device.
    req.token_ids.append(PLACEHOLDER)
    req.num_pending = 1
    s.schedule()  # computes the placeholder's position: the second block is full
    assert req.table.num_committed == 1 and PLACEHOLDER not in req.token_ids[:4]
    req.token_ids[-1] = 42  # the token arrives
    req.num_pending = 0
    req.num_output += 1
    decode(req)
    s.schedule()
    assert req.table.num_committed == 2
    assert s.pool.hashes() == set(req.block_hashes(2, BS))


def test_a_request_that_finished_while_preempted_is_never_admitted() -> None:
    s = scheduler()
    gone, next_one = request(3), request(3)
    gone.status = RequestStatus.FINISHED  # its last token (sampled ahead) finished it in the waiting queue
    s.waiting.extend([gone, next_one])
    plan = s.schedule()
    assert [r for r, _ in plan.scheduled] == [next_one]
    assert not s.waiting and gone not in s.running

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from tandem.engines.types import BlockStored
from tandem.errors import InvalidRequest
from tandem.kv.hashing import block_hashes
from tandem.routing.policies import KvPolicy, create_policy
from tandem.routing.prefix_index import PrefixIndex
from tandem.routing.workers import RouteContext, WorkerRef, WorkerState

BS = 16


def workers(n: int) -> list[WorkerState]:
    return [WorkerState(WorkerRef(f"w{i}", f"127.0.0.1:{9300 + i}", "pool"), block_size=BS)
            for i in range(n)]


def ctx(hashes: list[int] | tuple[int, ...] = (), isl: int | None = None) -> RouteContext:
    return RouteContext("r", tuple(hashes), len(hashes) * BS if isl is None else isl, 64)


def first(policy: object, ws: list[WorkerState], c: RouteContext | None = None) -> str:
    return policy.rank(ws, c or ctx())[0][0].worker_id  # type: ignore[attr-defined]


def store(index: PrefixIndex, worker: WorkerState, hashes: list[int]) -> None:
    index.apply(worker.worker_id, [BlockStored(tuple(hashes), None, (), BS)])


def test_registry_and_config_errors() -> None:
    with pytest.raises(InvalidRequest, match="supported: kv, least_loaded, power_of_two, "
                                             "random, round_robin"):
        create_policy("fastest")
    with pytest.raises(InvalidRequest, match="colour"):
        create_policy("random", colour="red")
    with pytest.raises(InvalidRequest, match="index"):
        create_policy("kv")
    with pytest.raises(InvalidRequest, match="temperature"):
        create_policy("kv", index=PrefixIndex(), temperature=-1.0)
    assert isinstance(create_policy("kv", index=PrefixIndex(), seed=1), KvPolicy)


@pytest.mark.parametrize("name", ["round_robin", "random", "least_loaded", "power_of_two", "kv"])
def test_every_policy_ranks_each_healthy_worker_once(name: str) -> None:
    config = {"index": PrefixIndex()} if name == "kv" else {}
    policy = create_policy(name, **config)
    ws = workers(5)
    ws[1].healthy = ws[3].healthy = False
    for _ in range(10):
        ranked = policy.rank(ws, ctx([1, 2]))
        assert sorted(w.worker_id for w, _ in ranked) == ["w0", "w2", "w4"]
    assert policy.rank([ws[1]], ctx()) == []


def test_round_robin_cycles() -> None:
    policy, ws = create_policy("round_robin"), workers(3)
    assert [first(policy, ws) for _ in range(4)] == ["w0", "w1", "w2", "w0"]
    assert [w.worker_id for w, _ in policy.rank(ws, ctx())] == ["w1", "w2", "w0"]


def test_random_is_seedable() -> None:
    ws = workers(4)
    picks = [[first(p, ws) for _ in range(30)]
             for p in (create_policy("random", seed=7), create_policy("random", seed=7))]
    assert picks[0] == picks[1] and set(picks[0]) == {"w0", "w1", "w2", "w3"}


def test_least_loaded_counts_hand_outs_and_reports() -> None:
    policy, ws = create_policy("least_loaded", seed=0), workers(3)
    ws[0].report(prefill_blocks=0, decode_blocks=50, requests=1)
    ws[1].report(prefill_blocks=0, decode_blocks=10, requests=1)
    ws[2].report(prefill_blocks=0, decode_blocks=0, requests=2)
    # Requests first, then blocks.
    assert [w.worker_id for w, _ in policy.rank(ws, ctx())] == ["w1", "w0", "w2"]
    ws[1].hand_out(prefill_blocks=4, decode_blocks=4)  # w1 now has 2 requests, 18 blocks
    assert first(policy, ws) == "w0"
    ws[0].hand_out(4, 4)
    ws[0].hand_out(4, 4)
    assert first(policy, ws) == "w2"
    ws[0].report(0, 0, 0)  # the report replaces what was counted
    assert first(policy, ws) == "w0"


def test_least_loaded_breaks_exact_ties_at_random() -> None:
    policy, ws = create_policy("least_loaded", seed=3), workers(3)
    assert Counter(first(policy, ws) for _ in range(300)).keys() == {"w0", "w1", "w2"}


def test_power_of_two_never_picks_the_more_loaded() -> None:
    policy = create_policy("power_of_two", seed=11)
    two = workers(2)
    two[0].report(0, 0, 5)
    assert {first(policy, two) for _ in range(200)} == {"w1"}
    three = workers(3)
    for load, w in enumerate(three):
        w.report(0, 0, load)
    picks = Counter(first(policy, three) for _ in range(3000))
    # Pairs are uniform: w0 wins 2 of 3 pairs, w1 one, w2 none.
    assert picks["w2"] == 0
    assert abs(picks["w0"] / 3000 - 2 / 3) < 0.04


def test_kv_prefers_the_worker_holding_the_prefix() -> None:
    index, ws = PrefixIndex(), workers(3)
    long_prompt = block_hashes(list(range(10 * BS)), BS)
    store(index, ws[2], long_prompt)  # w2 served the long prompt earlier
    policy = create_policy("kv", index=index, seed=0)
    follow_up = block_hashes(list(range(10 * BS)) + list(range(50_000, 50_000 + 2 * BS)), BS)
    ranked = policy.rank(ws, ctx(follow_up))
    assert (ranked[0][0].worker_id, ranked[0][1]) == ("w2", 10)
    assert [overlap for _, overlap in ranked[1:]] == [0, 0]


def test_kv_a_far_more_loaded_worker_loses_despite_its_overlap() -> None:
    # Request of 10 blocks; A holds 8 of them but decodes 100 blocks, B is idle:
    #   cost(A) = 1.0 * max(0 + 10 - 8, 0) + 100 = 102
    #   cost(B) = 1.0 * max(0 + 10 - 0, 0) +   0 =  10   -> B first.
    # With A idle too, cost(A) = 2 < 10 -> A first.
    index, (a, b) = PrefixIndex(), workers(2)
    hashes = list(range(1, 11))
    store(index, a, hashes[:8])
    policy = KvPolicy(index, seed=0)
    a.report(prefill_blocks=0, decode_blocks=100, requests=4)
    assert [(w.worker_id, o) for w, o in policy.rank([a, b], ctx(hashes))] == [("w1", 0), ("w0", 8)]
    assert policy.cost(a, ctx(hashes), 8) == 102 and policy.cost(b, ctx(hashes), 0) == 10
    a.report(0, 0, 0)
    assert first(policy, [a, b], ctx(hashes)) == "w0"


def test_kv_counts_a_partial_last_block_and_scales_prefill() -> None:
    (w,) = workers(1)
    w.report(prefill_blocks=3, decode_blocks=5, requests=1)
    policy = KvPolicy(PrefixIndex(), prefill_load_scale=2.0)
    # 2 full blocks + 1 token: 3 new blocks; 2 * (3 + 3 - 1) + 5 = 15
    assert policy.cost(w, ctx([1, 2], isl=2 * BS + 1), overlap_blocks=1) == 15
    assert policy.cost(w, ctx([], isl=0), overlap_blocks=0) == 2 * 3 + 5


def test_kv_ties_by_load_then_at_random() -> None:
    index, ws = PrefixIndex(), workers(3)
    for w, requests in zip(ws, (3, 1, 1)):
        w.report(prefill_blocks=0, decode_blocks=5, requests=requests)  # equal costs
    policy = KvPolicy(index, seed=5)
    ranks = [[w.worker_id for w, _ in policy.rank(ws, ctx([1]))] for _ in range(200)]
    assert all(r[2] == "w0" for r in ranks)  # most requests: last
    assert Counter(r[0] for r in ranks).keys() == {"w1", "w2"}


def _costs(ws: list[WorkerState], decode: list[int]) -> None:
    for w, blocks in zip(ws, decode):
        w.report(prefill_blocks=0, decode_blocks=blocks, requests=0)


def test_kv_softmax_sampling_distribution() -> None:
    ws = workers(3)
    _costs(ws, [0, 5, 10])  # normalised costs 0, 0.5, 1
    policy, n = KvPolicy(PrefixIndex(), temperature=1.0, seed=2), 6000
    ranks = [policy.rank(ws, ctx()) for _ in range(n)]
    weights = [math.exp(-c) for c in (0.0, 0.5, 1.0)]
    picks = Counter(r[0][0].worker_id for r in ranks)
    for i, weight in enumerate(weights):
        assert abs(picks[f"w{i}"] / n - weight / sum(weights)) < 0.03
    for r in ranks:  # after the sampled first choice, the rest by cost
        rest = [policy.cost(w, ctx(), 0) for w, _ in r[1:]]
        assert rest == sorted(rest)
    cold = KvPolicy(PrefixIndex(), temperature=0.05, seed=2)
    assert Counter(first(cold, ws) for _ in range(500))["w0"] > 490
    _costs(ws, [7, 7, 7])  # equal costs: uniform
    picks = Counter(first(policy, ws) for _ in range(n))
    assert all(abs(picks[f"w{i}"] / n - 1 / 3) < 0.03 for i in range(3))


def test_kv_shared_system_prompt_still_spreads_load() -> None:
    """Every user shares a 2-block system prompt: the prefix alone must not pull every request
    onto the worker that cached it first (the failure users report most about KV routers)."""
    index, ws = PrefixIndex(), workers(4)
    policy, rng = KvPolicy(index, seed=0), random.Random(0)
    system = list(range(2 * BS))
    picks: Counter[str] = Counter()
    for i in range(100):
        tokens = system + [rng.randrange(32_000) for _ in range(rng.randint(2, 6) * BS + 5)]
        hashes = block_hashes(tokens, BS)
        c = RouteContext(f"r{i}", tuple(hashes), len(tokens), 128)
        worker, overlap = policy.rank(ws, c)[0]
        new_blocks = -(-len(tokens) // BS)
        worker.hand_out(prefill_blocks=new_blocks - overlap, decode_blocks=new_blocks)
        store(index, worker, hashes)  # the worker's KV events arrive
        picks[worker.worker_id] += 1
        if i % 10 == 9:  # workers report: finished prefills leave only decode load
            for w in ws:
                w.report(0, w.active_decode_blocks, w.active_requests)
    assert max(picks.values()) <= 40, picks
    assert len(picks) == 4
    # The prefix was still reused: every worker ends up holding it.
    assert index.overlaps(block_hashes(system, BS)) == {w.worker_id: 2 for w in ws}

from __future__ import annotations

import random

import pytest

from tandem.engines.types import AllBlocksCleared, BlockRemoved, BlockStored
from tandem.kv.event_log import EventLog
from tandem.kv.hashing import block_hashes
from tandem.routing.prefix_index import PrefixIndex

BS = 16


def stored(hashes: list[int] | tuple[int, ...], parent: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=tuple(hashes), parent_hash=parent,
                       token_ids=tuple(range(len(hashes) * BS)), block_size=BS)


def test_stored_removed_cleared() -> None:
    index = PrefixIndex()
    index.apply("w0", [stored([1, 2, 3]), stored([4], parent=3)])
    index.apply("w1", [stored([1, 2])])
    assert index.blocks_of("w0") == {1, 2, 3, 4}
    assert index.num_blocks == 6 and index.num_unique_blocks == 4
    assert index.overlaps([1, 2, 3, 4]) == {"w0": 4, "w1": 2}

    index.apply("w0", [BlockRemoved((4, 99))])  # 99 was never stored: ignored
    assert index.overlaps([1, 2, 3, 4]) == {"w0": 3, "w1": 2}
    index.apply("w0", [AllBlocksCleared()])
    assert index.blocks_of("w0") == set()
    assert index.overlaps([1, 2, 3, 4]) == {"w1": 2}
    assert index.num_blocks == 2 and index.num_unique_blocks == 2
    assert "w0" in index.worker_ids  # known, holding nothing


def test_events_are_idempotent_per_block() -> None:
    index = PrefixIndex()
    index.apply("w0", [stored([1, 2]), stored([1, 2])])
    index.apply("w0", [BlockRemoved((2,)), BlockRemoved((2,))])
    assert index.blocks_of("w0") == {1}
    assert index.num_blocks == 1


def test_prefix_match_stops_at_the_first_miss() -> None:
    index = PrefixIndex()
    index.apply("holes", [stored([1, 2, 4, 5])])  # block 3 evicted, its children kept
    index.apply("tail_only", [stored([2, 3, 4])])  # lacks the first block
    index.apply("full", [stored([1, 2, 3, 4, 5])])
    assert index.overlaps([1, 2, 3, 4, 5]) == {"holes": 2, "full": 5}
    assert index.overlaps([9, 2, 3]) == {}
    assert index.overlaps([]) == {}
    assert index.overlaps([1]) == {"holes": 1, "full": 1}


def test_chained_hashes_of_real_token_sequences() -> None:
    system = list(range(1000, 1000 + 2 * BS))  # a 2-block shared system prompt
    alice = system + list(range(5000, 5000 + 3 * BS)) + [7, 8, 9]  # partial block: unhashed
    bob = system + list(range(6000, 6000 + 2 * BS))
    index = PrefixIndex()
    alice_hashes = block_hashes(alice, BS)
    assert len(alice_hashes) == 5
    index.apply("w0", [stored(alice_hashes)])
    assert index.overlaps(block_hashes(bob, BS)) == {"w0": 2}
    assert index.overlaps(block_hashes(alice + [1] * BS, BS)) == {"w0": 5}
    # The same tokens after a different prefix hash differently: no false match.
    moved = list(range(6000, 6000 + 2 * BS)) + alice[2 * BS:]
    assert index.overlaps(block_hashes(moved, BS)) == {}


def test_reset_replaces_a_workers_content() -> None:
    index = PrefixIndex()
    index.apply("w0", [stored([1, 2, 3])])
    index.apply("w1", [stored([1, 2, 3])])
    index.reset("w0", [stored([7]), stored([8], parent=7)])
    assert index.blocks_of("w0") == {7, 8}
    assert index.overlaps([1, 2, 3]) == {"w1": 3}
    assert index.overlaps([7, 8]) == {"w0": 2}
    index.reset("new", [stored([1])])  # a reset can introduce a worker
    assert index.overlaps([1, 2]) == {"w1": 2, "new": 1}


def test_reset_from_a_worker_event_log_snapshot() -> None:
    log = EventLog(capacity=2)
    tokens = list(range(100, 100 + 6 * BS))
    hashes = block_hashes(tokens, BS)
    log.append([BlockStored(tuple(hashes[:4]), None, tuple(tokens[:4 * BS]), BS)])
    log.append([BlockRemoved((hashes[3],))])
    log.append([BlockStored(tuple(hashes[3:6]), hashes[2], tuple(tokens[3 * BS:]), BS)])
    log.append([BlockRemoved((hashes[1],))])
    index = PrefixIndex()
    index.apply("w0", [stored([42])])  # stale content from before the resync
    _, snapshot = log.snapshot()
    index.reset("w0", snapshot)
    assert index.blocks_of("w0") == set(hashes) - {hashes[1]}
    assert index.overlaps(hashes) == {"w0": 1}


def test_remove_worker_and_slot_reuse() -> None:
    index = PrefixIndex()
    index.apply("a", [stored([1, 2])])
    index.apply("b", [stored([1])])
    index.remove_worker("a")
    index.remove_worker("never-seen")
    assert index.worker_ids == ["b"]
    assert index.blocks_of("a") == set()
    index.apply("c", [stored([3])])  # takes a's freed slot; must not inherit a's blocks
    assert index.overlaps([1, 2]) == {"b": 1}
    assert index.overlaps([3]) == {"c": 1}
    assert index.num_blocks == 2


def test_rejects_what_is_not_an_event() -> None:
    index = PrefixIndex()
    with pytest.raises(TypeError, match="not a KV event"):
        index.apply("w0", [stored([1]), "oops"])  # type: ignore[list-item]
    assert index.blocks_of("w0") == {1}


def _reference_overlaps(model: dict[str, set[int]], query: list[int]) -> dict[str, int]:
    result = {}
    for worker, held in model.items():
        n = 0
        while n < len(query) and query[n] in held:
            n += 1
        if n:
            result[worker] = n
    return result


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_a_brute_force_model_under_random_events(seed: int) -> None:
    rng = random.Random(seed)
    # Prompts as paths in a random tree of chained hashes (a few shared prefixes).
    paths: list[list[int]] = []
    for _ in range(40):
        base = rng.choice(paths)[:rng.randint(0, 6)] if paths and rng.random() < 0.7 else []
        tokens = [rng.randrange(50_000) for _ in range(rng.randint(1, 8) * BS)]
        paths.append(base + block_hashes(tokens, BS, parent_hash=base[-1] if base else None))
    workers = [f"w{i}" for i in range(6)]
    index = PrefixIndex()
    model: dict[str, set[int]] = {w: set() for w in workers}

    for step in range(600):
        w = rng.choice(workers)
        path = rng.choice(paths)
        op = rng.random()
        if op < 0.5:
            lo = rng.randrange(len(path))
            chunk = path[lo:rng.randint(lo + 1, len(path))]
            index.apply(w, [stored(chunk, parent=path[lo - 1] if lo else None)])
            model[w].update(chunk)
        elif op < 0.85:
            victims = rng.sample(path, rng.randint(1, len(path)))
            index.apply(w, [BlockRemoved(tuple(victims))])
            model[w].difference_update(victims)
        elif op < 0.9:
            index.apply(w, [AllBlocksCleared()])
            model[w].clear()
        elif op < 0.95:
            keep = rng.sample(path, rng.randint(0, len(path)))
            index.reset(w, [stored([h]) for h in keep])
            model[w] = set(keep)
        else:
            index.remove_worker(w)
            model[w] = set()
        for query in rng.sample(paths, 3):
            assert index.overlaps(query) == _reference_overlaps(model, query), step
    for w in workers:
        assert index.blocks_of(w) == model[w]
    assert index.num_blocks == sum(len(s) for s in model.values())
    assert index.num_unique_blocks == len(set().union(*model.values()))

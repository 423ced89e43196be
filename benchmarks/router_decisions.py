"""Router micro-benchmark: KV-aware routing decision latency and KV event ingest rate.

Builds a PrefixIndex over 64 workers holding about 1,000,000 (worker, block) entries shaped like a
prefix-heavy deployment, from real chained hashes (tandem.kv.hashing over random token ids):
  - a global 16-block system prompt cached on every worker;
  - 512 groups (documents, agent prompts), each a 32-block prefix, half of them continuing the
    global prompt, each group's traffic concentrated on 4 home workers (as a KV router does);
  - conversations: a group prefix plus a unique 32-224 block suffix, on a home worker, added
    until the index holds 1M entries.
Decisions: `KvPolicy.rank()` (which calls `PrefixIndex.overlaps()`) over the 64 workers with
random reported loads, for four request kinds: follow-ups of a cached conversation plus 8 new
blocks, new users of a group, cold prompts, and prompts of 256 blocks whose first 16 are held by
every worker. Prompt hashing is timed separately (it happens once per request, before ranking).
Ingest: `PrefixIndex.apply()` with one event per call on the full index: BlockStored events of 16
blocks (new chains), then the same load with each store followed by a BlockRemoved of 16 blocks
(steady state, the index size stays constant).

Usage (from the repository root):
    .venv/bin/python benchmarks/router_decisions.py               # defaults as above
    .venv/bin/python benchmarks/router_decisions.py --decisions 5000 --ingest-events 20000
"""
from __future__ import annotations

import argparse
import pathlib
import random
import resource
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.serve_load import pct  # noqa: E402
from tandem.engines.types import BlockRemoved, BlockStored, KvEvent  # noqa: E402
from tandem.kv.hashing import block_hashes  # noqa: E402
from tandem.routing.policies import KvPolicy  # noqa: E402
from tandem.routing.prefix_index import PrefixIndex  # noqa: E402
from tandem.routing.workers import RouteContext, WorkerRef, WorkerState  # noqa: E402

BS = 16
NUM_WORKERS = 64
TARGET_BLOCKS = 1_000_000
NUM_GROUPS = 512


def chain(rng: random.Random, num_blocks: int, parent: int | None) -> list[int]:
    return block_hashes([rng.randrange(32_000) for _ in range(num_blocks * BS)], BS, parent)


def stored(hashes: list[int], parent: int | None) -> BlockStored:
    return BlockStored(tuple(hashes), parent, (), BS)


def build(rng: random.Random) -> tuple[PrefixIndex, list[int], list[list[int]],
                                       list[list[int]], list[str]]:
    index = PrefixIndex()
    ids = [f"worker-{i:02d}" for i in range(NUM_WORKERS)]
    system = chain(rng, 16, None)
    for w in ids:
        index.apply(w, [stored(system, None)])
    groups, homes = [], []
    for g in range(NUM_GROUPS):
        base = system if g % 2 else []
        groups.append(base + chain(rng, 32, base[-1] if base else None))
        homes.append(rng.sample(ids, 4))
    conversations = []
    while index.num_blocks < TARGET_BLOCKS:
        g = rng.randrange(NUM_GROUPS)
        prefix = groups[g]
        convo = prefix + chain(rng, rng.randint(32, 224), prefix[-1])
        index.apply(rng.choice(homes[g]), [stored(convo, None)])
        conversations.append(convo)
    return index, system, groups, conversations, ids


def time_decisions(policy: KvPolicy, workers: list[WorkerState],
                   prompts: list[list[int]]) -> tuple[list[float], float]:
    """Milliseconds per rank() call, and the mean of the longest overlap found (the depth that
    overlaps() walked)."""
    times, overlaps = [], 0
    for i, hashes in enumerate(prompts):
        ctx = RouteContext(f"r{i}", tuple(hashes), len(hashes) * BS, 200)
        t0 = time.perf_counter_ns()
        ranked = policy.rank(workers, ctx)
        times.append((time.perf_counter_ns() - t0) / 1e6)
        overlaps += max(overlap for _, overlap in ranked)
    return times, overlaps / len(prompts)


def ingest_events(rng: random.Random, ids: list[str], n: int,
                  with_removal: bool) -> list[tuple[str, list[KvEvent]]]:
    """n BlockStored batches of 16 new blocks (chains of 8 events per worker); with_removal adds
    a BlockRemoved of the 16 blocks stored 4 events earlier on the same worker."""
    out: list[tuple[str, list[KvEvent]]] = []
    history: dict[str, list[list[int]]] = {w: [] for w in ids}
    parent: int | None = None
    worker = ids[0]
    for i in range(n):
        if i % 8 == 0:
            worker, parent = rng.choice(ids), None
        hashes = [rng.getrandbits(64) for _ in range(16)]  # as opaque to the index as blake2b's
        out.append((worker, [stored(hashes, parent)]))
        parent = hashes[-1]
        past = history[worker]
        past.append(hashes)
        if with_removal and len(past) > 4:
            out.append((worker, [BlockRemoved(tuple(past[-5]))]))
    return out


def time_ingest(index: PrefixIndex, batches: list[tuple[str, list[KvEvent]]]) -> tuple[float, int]:
    """(seconds, block events) for applying every batch."""
    blocks = sum(len(e.block_hashes) for _, events in batches for e in events
                 if isinstance(e, BlockStored | BlockRemoved))
    t0 = time.perf_counter()
    for worker, events in batches:
        index.apply(worker, events)
    return time.perf_counter() - t0, blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=5000, help="per request kind")
    parser.add_argument("--ingest-events", type=int, default=50_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)

    t0 = time.perf_counter()
    index, system, groups, conversations, ids = build(rng)
    build_s = time.perf_counter() - t0
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"index: {index.num_blocks:,} (worker, block) entries, {index.num_unique_blocks:,} "
          f"distinct hashes, {len(conversations):,} conversations, {NUM_WORKERS} workers; "
          f"built in {build_s:.1f} s; max RSS {rss_mib:,.0f} MiB")

    workers = [WorkerState(WorkerRef(w, f"10.0.0.{i}:9000", "pool"), block_size=BS)
               for i, w in enumerate(ids)]
    for w in workers:
        w.report(rng.randrange(0, 400), rng.randrange(0, 4000), rng.randrange(0, 64))
    policy = KvPolicy(index, seed=args.seed)
    n = args.decisions
    kinds = {
        "follow-up (cached conversation + 8 new blocks)":
            [c + chain(rng, 8, c[-1]) for c in rng.choices(conversations, k=n)],
        "new user of a group (prefix hit, new suffix)":
            [g + chain(rng, rng.randint(32, 224), g[-1]) for g in rng.choices(groups, k=n)],
        "cold prompt (128 blocks, no hit)": [chain(rng, 128, None) for _ in range(n)],
        "256 blocks, first 16 held by all 64 workers":
            [system + chain(rng, 240, system[-1]) for _ in range(n)],
    }
    time_decisions(policy, workers, kinds["cold prompt (128 blocks, no hit)"][:200])  # warm-up
    print()
    print("| request kind | mean prompt blocks | mean longest overlap | rank() p50 | rank() p99 |"
          " max |")
    print("|---|---:|---:|---:|---:|---:|")
    every: list[float] = []
    for kind, prompts in kinds.items():
        times, overlap = time_decisions(policy, workers, prompts)
        every += times
        blocks = statistics.mean(len(p) for p in prompts)
        print(f"| {kind} | {blocks:.0f} | {overlap:.1f} | {pct(times, 50):.3f} ms | "
              f"{pct(times, 99):.3f} ms | {max(times):.3f} ms |")
    print(f"| **all kinds** | | | **{pct(every, 50):.3f} ms** | "
          f"**{pct(every, 99):.3f} ms** | {max(every):.3f} ms |")

    tokens = [rng.randrange(32_000) for _ in range(128 * BS)]
    t0 = time.perf_counter()
    for _ in range(200):
        block_hashes(tokens, BS)
    print(f"\nprompt hashing (tandem.kv.hashing, 128 blocks of {BS}): "
          f"{(time.perf_counter() - t0) / 200 * 1e3:.3f} ms per prompt")

    print("\n| ingest (one event per apply(), on the 1M-entry index) | block events/s |"
          " events/s |")
    print("|---|---:|---:|")
    for label, removal in (("BlockStored x 16 blocks", False),
                           ("BlockStored x 16 + BlockRemoved x 16 (steady state)", True)):
        batches = ingest_events(rng, ids, args.ingest_events, removal)
        seconds, blocks = time_ingest(index, batches)
        num_events = sum(len(events) for _, events in batches)
        print(f"| {label} | {blocks / seconds:,.0f} | {num_events / seconds:,.0f} |")
    print(f"\nindex after ingest: {index.num_blocks:,} entries")


if __name__ == "__main__":
    main()

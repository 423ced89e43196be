"""The host KV tier on the reference engine against Hugging Face transformers (float32, CPU):
greedy tokens are exact when every prompt block comes back from host memory (a device pool too
small to keep them), with chunked prefill, with preemption and with requests arriving while
others run; after every step both tiers are consistent, and at the end every block and host
slot is free again."""
from __future__ import annotations

import pathlib
import random

import pytest
import torch

from tandem.engines.args import EngineArgs
from tandem.engines.reference.engine import ReferenceEngine, create_reference_engine
from tandem.engines.stream import RequestStream
from tandem.engines.types import EngineRequest, SamplingParams, Usage
from tandem.kv.hashing import block_hashes
from tandem.model.tiny import write_tiny_model
from tests.unit.test_reference_engine import NEW_TOKENS, hf_greedy

BS = 8
HOST_BYTES = 8 << 20  # far more than these tests fill: the host tier only loses what it drops


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("tiny-host")
    return {f: write_tiny_model(root / f, f, seed=4) for f in ("llama", "qwen3")}


def engine_for(model_dir: pathlib.Path, num_blocks: int, **overrides: object) -> ReferenceEngine:
    engine = create_reference_engine(EngineArgs(
        model=str(model_dir), device="cpu", kv_block_size=BS, num_gpu_blocks=num_blocks,
        kv_host_cache_bytes=HOST_BYTES, **overrides))
    assert isinstance(engine, ReferenceEngine)
    return engine


def tokens(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(5, vocab) for _ in range(n)]


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, min_tokens=NEW_TOKENS)


async def drain(stream: RequestStream) -> tuple[list[int], Usage]:
    out: list[int] = []
    usage = None
    async for chunk in stream:
        out.extend(chunk.token_ids)
        usage = chunk.usage or usage
    assert usage is not None
    return out, usage


async def step_until_idle(engine: ReferenceEngine,
                          arrivals: dict[int, list[tuple[str, list[int]]]] | None = None
                          ) -> dict[str, RequestStream]:
    """Steps the engine by hand, admitting `arrivals[step]` before that step, checking both
    tiers after every step; returns every admitted request's stream."""
    arrivals = dict(arrivals or {})
    streams: dict[str, RequestStream] = {}
    step = 0
    while arrivals or engine.scheduler.has_work:
        for rid, prompt in arrivals.pop(step, []):
            streams[rid] = engine.add_request(EngineRequest(rid, tuple(prompt), GREEDY))
        if engine.scheduler.has_work:
            await engine._step()
        engine.pool.check_invariants([r.table for r in engine._requests.values()])
        step += 1
    return streams


def check_all_free(engine: ReferenceEngine) -> None:
    assert engine.pool.num_used == 0
    host = engine.pool.host
    assert host is not None
    host.check_invariants([])  # no pin left


@pytest.mark.parametrize("family", ["llama", "qwen3"])
async def test_every_prompt_block_from_the_host_tier_gives_the_same_tokens(
        family: str, model_dirs: dict[str, pathlib.Path]) -> None:
    model_dir = model_dirs[family]
    # 10 device blocks hold one 40-token prompt and its output; a chunk is at most 12 tokens.
    engine = engine_for(model_dir, 10, max_num_tokens=12)
    rng = random.Random(11)
    first = tokens(rng, engine.vocab_size, 5 * BS)
    fillers = [tokens(rng, engine.vocab_size, 5 * BS) for _ in range(2)]
    for i, prompt in enumerate([first, *fillers]):
        streams = await step_until_idle(engine, {0: [(f"warm{i}", prompt)]})
        out, _ = await drain(streams[f"warm{i}"])
        assert out == hf_greedy(model_dir, prompt)
    hashes = block_hashes(first, BS)
    host = engine.pool.host
    assert host is not None
    assert not set(hashes) & engine.pool.hashes(), "the fillers should evict every block"
    assert set(hashes) <= host.hashes()

    # The next turn: the whole first prompt is a host hit, 20 new tokens are chunked.
    follow = first + tokens(rng, engine.vocab_size, 20)
    onboarded = engine.host_copies.num_onboard_blocks
    streams = await step_until_idle(engine, {0: [("turn2", follow)]})
    out, usage = await drain(streams["turn2"])
    assert engine.host_copies.num_onboard_blocks - onboarded == len(hashes)
    assert usage.cached_tokens == len(first)
    assert out == hf_greedy(model_dir, follow)
    assert engine.stats().kv_host_hit_rate > 0
    check_all_free(engine)
    await engine.close()


async def test_host_hits_with_preemption_and_concurrent_arrivals(
        model_dirs: dict[str, pathlib.Path]) -> None:
    model_dir = model_dirs["llama"]
    # 13 blocks: four 3-block histories and their outputs do not fit at once, nor do two
    # second turns (6 blocks each at admission, a 7th as they decode): both phases preempt,
    # and the second turns find most of their history in the host tier only.
    engine = engine_for(model_dir, 13, max_num_tokens=20)
    rng = random.Random(12)
    histories = [tokens(rng, engine.vocab_size, 3 * BS) for _ in range(4)]
    streams = await step_until_idle(engine, {i: [(f"t1-{i}", h)] for i, h in
                                             enumerate(histories)})
    outputs = []
    for i, history in enumerate(histories):
        out, _ = await drain(streams[f"t1-{i}"])
        assert out == hf_greedy(model_dir, history)
        outputs.append(out)
    preempted = engine.scheduler.num_preemptions
    assert preempted > 0

    # Turn 2 of every conversation, arriving one step apart while the others run.
    second = [h + o + tokens(rng, engine.vocab_size, BS + 3)
              for h, o in zip(histories, outputs, strict=True)]
    onboarded = engine.host_copies.num_onboard_blocks
    streams = await step_until_idle(engine, {i: [(f"t2-{i}", p)] for i, p in
                                             enumerate(second)})
    cached = 0
    for i, prompt in enumerate(second):
        out, usage = await drain(streams[f"t2-{i}"])
        assert out == hf_greedy(model_dir, prompt)
        cached += usage.cached_tokens
    assert engine.host_copies.num_onboard_blocks > onboarded
    assert cached > 0
    assert engine.scheduler.num_preemptions > preempted
    check_all_free(engine)
    await engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
async def test_on_cuda_blocks_come_back_bit_exact_through_pinned_memory(
        model_dirs: dict[str, pathlib.Path]) -> None:
    # CUDA path: copy stream, copy kernel, pinned host tier; tokens as on CPU, and the
    # onboarded device blocks hold exactly the bytes that were offloaded.
    model_dir = model_dirs["llama"]
    engine = create_reference_engine(EngineArgs(
        model=str(model_dir), device="cuda", dtype="float32", kv_block_size=BS,
        num_gpu_blocks=10, kv_host_cache_bytes=HOST_BYTES, enforce_eager=True))
    assert isinstance(engine, ReferenceEngine) and engine.host_kv is not None
    assert engine.host_kv.host.is_pinned()
    rng = random.Random(13)
    first = tokens(rng, engine.vocab_size, 5 * BS)
    streams = await step_until_idle(engine, {0: [("a", first)]})
    await drain(streams["a"])
    saved = {h: engine.kv_cache[:, :, b].clone()
             for h, b in engine.pool._hash_to_block.items()}
    for i in range(2):
        streams = await step_until_idle(engine, {0: [(f"f{i}", tokens(rng, engine.vocab_size,
                                                                       5 * BS))]})
        await drain(streams[f"f{i}"])
    follow = first + tokens(rng, engine.vocab_size, 9)
    streams = await step_until_idle(engine, {0: [("b", follow)]})
    out, usage = await drain(streams["b"])
    assert usage.cached_tokens == len(first)
    assert out == hf_greedy(model_dir, follow)
    torch.cuda.synchronize()
    for h in block_hashes(first, BS):
        block = engine.pool._hash_to_block[h]
        assert torch.equal(engine.kv_cache[:, :, block], saved[h])
    timings = engine.host_kv.finished()
    engine.host_copies.record(timings)
    assert engine.stats().kv_onboard_seconds > 0
    check_all_free(engine)
    await engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_cuda_the_store_moves_blocks_bit_exact_both_ways(dtype: torch.dtype) -> None:
    # The copy kernel alone, on random bytes: rows of 2.5 or 5 KiB (not a whole number of the
    # kernel's programs), blocks and slots in random order; untouched blocks stay as they were.
    from tandem.engines.reference.host_kv import HostKvStore

    kv = torch.randn((3, 2, 12, 16, 5, 16), device="cuda").to(dtype)
    before = kv.clone()
    store = HostKvStore(kv, 20)
    blocks, slots = [7, 2, 11, 0, 5], [19, 3, 8, 0, 12]
    timings = store.copy(list(zip(blocks, slots, strict=True)), [], sync=True)
    assert [(kind, n) for kind, n, _ in timings] == [("offload", 5)]
    assert torch.equal(store.host[slots], kv[:, :, blocks].permute(2, 0, 1, 3, 4, 5).cpu())
    targets = [1, 9, 4, 10, 6]
    kv[:, :, targets] = 0
    timings = store.copy([], list(zip(slots, targets, strict=True)), sync=False)
    torch.cuda.current_stream().synchronize()  # the compute stream waited for the copy
    assert torch.equal(kv[:, :, targets], before[:, :, blocks])
    others = [b for b in range(12) if b not in targets]
    assert torch.equal(kv[:, :, others], before[:, :, others])
    timings += store.finished()
    assert [(kind, n) for kind, n, _ in timings] == [("onboard", 5)]
    assert timings[0][2] > 0

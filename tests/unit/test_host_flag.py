"""A CUDA stream waiting on a word in pinned host memory (tandem.engines.reference.host_flag), and
guided decode steps whose masks the mask thread fills behind that wait (overlap.StepMasks).
Skipped without a GPU; run on the GPU machine."""
from __future__ import annotations

import asyncio
import json
import pathlib
import time

import pytest
import torch
from transformers import AutoTokenizer

from tandem.engines.args import EngineArgs
from tandem.engines.reference import host_flag
from tandem.engines.reference.engine import ReferenceEngine, create_reference_engine
from tandem.engines.types import EngineRequest, GuidedDecoding, GuidedKind, SamplingParams
from tandem.model.tiny import write_tiny_model

pytestmark = pytest.mark.skipif(not host_flag.available(), reason="needs CUDA and Triton")


def test_the_stream_waits_until_the_host_writes_the_value() -> None:
    flag = host_flag.HostFlag()
    x = torch.zeros(4, device="cuda")
    stream = torch.cuda.Stream()
    # Every kernel loaded before a wait is pending: this thread writes the value, and a first
    # launch behind the wait would wait for the device (CUDA's lazy loading).
    flag.set(flag.next_value())
    flag.wait(flag.value)
    x.add_(0)
    torch.cuda.synchronize()
    for _ in range(3):
        value = flag.next_value()
        with torch.cuda.stream(stream):
            flag.wait(value)
            x.add_(1)
            done = torch.cuda.Event()
            done.record()
        time.sleep(0.05)
        assert not done.query(), "the stream went on before the value was written"
        flag.set(value)
        done.synchronize()
    assert x.tolist() == [3.0] * 4
    assert flag.value == value == 4


def test_values_wrap_around_and_stay_distinct() -> None:
    flag = host_flag.HostFlag()
    flag._last = host_flag.WRAP - 1
    assert [flag.next_value() for _ in range(3)] == [host_flag.WRAP, 1, 2]
    flag.set(flag.next_value())  # a wait already met ends at once
    flag.wait(3)
    torch.cuda.synchronize()


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3}},
    "required": ["name", "tags"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=5)


async def test_guided_steps_ahead_on_cuda_keep_their_grammar(model_dir: pathlib.Path) -> None:
    """Guided and free requests together, launched ahead on CUDA: every guided output is valid
    JSON of the schema and ends with its grammar, the masks came from the mask thread, and the
    pool is whole afterwards."""
    args = EngineArgs(model=str(model_dir), device="cuda", kv_block_size=4, num_gpu_blocks=256)
    engine = create_reference_engine(args)
    assert isinstance(engine, ReferenceEngine)
    assert engine.overlap is not None and engine.overlap.masks is not None
    guided = GuidedDecoding(GuidedKind.JSON_SCHEMA, json.dumps(SCHEMA))
    fills = 0
    fill = engine.overlap.masks._fill

    def counted(*a: object) -> None:
        nonlocal fills
        fills += 1
        fill(*a)  # type: ignore[arg-type]

    engine.overlap.masks._fill = counted  # type: ignore[method-assign]
    await engine.start()
    try:
        batch = [EngineRequest(f"g{i}", tuple(range(5 + i, 9 + 2 * i)), SamplingParams(
            max_tokens=120, temperature=0.8, seed=i, guided=guided if i % 3 else None))
            for i in range(12)]

        async def collect(request: EngineRequest) -> tuple[list[int], str | None]:
            tokens: list[int] = []
            reason = None
            async for chunk in engine.add_request(request):
                tokens.extend(chunk.token_ids)
                if chunk.finish_reason is not None:
                    reason = chunk.finish_reason.value
            return tokens, reason

        outcomes = await asyncio.gather(*(collect(r) for r in batch))
        assert engine.num_steps_ahead > 10 and fills > 10
        assert engine.pool.num_used == 0
    finally:
        await engine.close()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for i, (tokens, reason) in enumerate(outcomes):
        if i % 3:
            assert reason == "stop"
            value = json.loads(tokenizer.decode(tokens, skip_special_tokens=True))
            assert {"name", "tags"} <= set(value), value  # the GPU image has no jsonschema
            assert isinstance(value["name"], str) and len(value["name"]) <= 8, value
            assert set(value["tags"]) <= {"a", "bb", "ccc"} and len(value["tags"]) <= 3, value

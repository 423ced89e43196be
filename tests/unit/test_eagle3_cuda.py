"""EAGLE-3 on CUDA (skipped without a GPU; run on the GPU machine): the target's hidden states
are captured inside its CUDA graphs (decode graphs, and the prefill graphs in half precision):
greedy tokens equal plain decoding's, and states equal the eager path's."""
from __future__ import annotations

import asyncio
import json
import pathlib
from typing import Any

import pytest
import torch

from tandem.engines.args import EngineArgs
from tandem.engines.reference.engine import ReferenceEngine, create_reference_engine
from tandem.engines.types import EngineRequest, SamplingParams
from tandem.model.tiny import write_tiny_model
from tandem.model.tiny_eagle3 import write_tiny_eagle3

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _engine(model: pathlib.Path, head: pathlib.Path | None, dtype: str, block: int,
            eager: bool = False) -> ReferenceEngine:
    spec = json.dumps({"method": "eagle3", "num_speculative_tokens": 3, "model": str(head),
                       "disable_by_batch_size": 0}) if head else ""
    return create_reference_engine(EngineArgs(  # type: ignore[return-value]
        model=str(model), device="cuda", dtype=dtype, kv_block_size=block,
        num_gpu_blocks=256, enforce_eager=eager, speculative_config=spec))


def _run(engine: ReferenceEngine, prompts: list[list[int]],
         seen: dict[tuple[str, int], torch.Tensor] | None = None) -> list[list[int]]:
    if seen is not None:
        assert engine.speculation is not None
        proposer = engine.speculation.proposer
        observe = proposer.observe

        def recording(spans: Any, states: torch.Tensor, keep_all: bool) -> None:
            for req, row, start, count in spans:
                for i in range(count):
                    seen[(req.request_id, start + i)] = states[row + i].float().cpu()
            observe(spans, states, keep_all)

        proposer.observe = recording  # type: ignore[method-assign]

    async def go() -> list[list[int]]:
        await engine.start()
        try:
            params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
            streams = [engine.add_request(EngineRequest(f"c{i}", tuple(p), params))
                       for i, p in enumerate(prompts)]

            async def collect(stream: Any) -> list[int]:
                return [t async for chunk in stream for t in chunk.token_ids]

            return list(await asyncio.gather(*(collect(s) for s in streams)))
        finally:
            await engine.close()
    return asyncio.run(go())


@pytest.mark.parametrize("dtype, block", [("float32", 4), ("bfloat16", 16)])
def test_eagle3_under_cuda_graphs_equals_plain(dtype: str, block: int,
                                               tmp_path: pathlib.Path) -> None:
    model = write_tiny_model(tmp_path / "llama", "llama", seed=3)
    head = write_tiny_eagle3(tmp_path / "head", model, seed=4, draft_vocab_size=1000)
    prompts = [[(i * 31 + j * 7) % 3000 + 5 for j in range(n)] for i, n in enumerate((6, 19, 33))]
    plain = _run(_engine(model, None, dtype, block), prompts)  # graphs, no speculation
    graphed_seen: dict[tuple[str, int], torch.Tensor] = {}
    engine = _engine(model, head, dtype, block)
    graphed = _run(engine, prompts, graphed_seen)
    assert engine.graphs is not None and engine.graphs.graphs
    if dtype == "bfloat16":
        assert engine.prefill_graphs is not None and engine.prefill_graphs.graphs
    assert engine.speculation is not None and engine.speculation.counters.proposed_tokens > 0
    eager_seen: dict[tuple[str, int], torch.Tensor] = {}
    eager = _run(_engine(model, head, dtype, block, eager=True), prompts, eager_seen)
    if dtype == "float32":
        assert graphed == plain == eager
        keys = sorted(set(graphed_seen) & set(eager_seen))
        tol = 1e-4
    else:  # half precision may round a near tie the other way: compare the prompts' states
        keys = [(f"c{i}", p) for i, prompt in enumerate(prompts) for p in range(len(prompt))]
        tol = 5e-2
    assert len(keys) > 50
    for key in keys:
        torch.testing.assert_close(graphed_seen[key], eager_seen[key], atol=tol, rtol=tol)

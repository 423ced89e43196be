"""The reference engine on CUDA (skipped without a GPU; run on the GPU machine): greedy tokens
equal transformers' and the eager path's with CUDA graphs on, across batch and width buckets."""
from __future__ import annotations

import asyncio
import pathlib

import pytest
import torch
import transformers

from tandem.engines.args import EngineArgs
from tandem.engines.reference.engine import create_reference_engine
from tandem.engines.types import EngineRequest, SamplingParams
from tandem.model.tiny import write_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NEW = 40  # enough growth to cross block-table width buckets (block size 4 below)


def engine_tokens(model_dir: pathlib.Path, prompts: list[list[int]], eager: bool) -> list[list[int]]:
    async def go() -> list[list[int]]:
        engine = create_reference_engine(EngineArgs(
            model=str(model_dir), device="cuda", dtype="float32", kv_block_size=4,
            num_gpu_blocks=256, enforce_eager=eager))
        await engine.start()
        try:
            params = SamplingParams(max_tokens=NEW, temperature=0.0, min_tokens=NEW)
            streams = [engine.add_request(EngineRequest(f"c{i}", tuple(p), params))
                       for i, p in enumerate(prompts)]

            async def collect(stream) -> list[int]:
                return [t async for chunk in stream for t in chunk.token_ids]

            out = await asyncio.gather(*(collect(s) for s in streams))
            assert engine.pool.num_used == 0
            if not eager:
                assert engine.graphs is not None and engine.graphs.graphs  # graphs were used
            return out
        finally:
            await engine.close()
    return asyncio.run(go())


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_cuda_graphs_match_eager_and_transformers(family: str, tmp_path: pathlib.Path) -> None:
    model_dir = write_tiny_model(tmp_path / family, family, seed=3)
    prompts = [[(i * 31 + j * 7) % 3000 + 5 for j in range(n)] for i, n in enumerate((6, 19, 33))]
    graphed = engine_tokens(model_dir, prompts, eager=False)
    eager = engine_tokens(model_dir, prompts, eager=True)
    assert graphed == eager
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf = hf.to("cuda").eval()
    for prompt, tokens in zip(prompts, graphed):
        ids = torch.tensor([prompt], device="cuda")
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=NEW, min_new_tokens=NEW)
        assert out[0, len(prompt):].tolist() == tokens

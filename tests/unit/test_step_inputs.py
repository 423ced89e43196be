"""The index tensors of a step (tandem.engines.reference.step_inputs): views of one copy, each
starting 16 bytes into it whatever the token counts, so that Triton compiles no variant of a
kernel per pointer alignment on a request's step (issue 25, item 4)."""
from __future__ import annotations

import pathlib

import pytest
import torch

from tandem.engines.args import EngineArgs
from tandem.engines.reference.engine import ReferenceEngine, create_reference_engine
from tandem.engines.reference.step_inputs import build_step_inputs
from tandem.engines.types import EngineRequest, SamplingParams
from tandem.model.tiny import write_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=5)


@pytest.mark.parametrize("lengths", [(7,), (3, 5, 9), (4, 6), (1, 2, 11)])
def test_every_index_tensor_starts_16_byte_aligned(model_dir: pathlib.Path,
                                                   lengths: tuple[int, ...]) -> None:
    args = EngineArgs(model=str(model_dir), device="cpu", kv_block_size=4, num_gpu_blocks=64)
    engine = create_reference_engine(args)
    assert isinstance(engine, ReferenceEngine)
    for i, n in enumerate(lengths):
        engine.add_request(EngineRequest(f"r{i}", tuple(range(5 + 20 * i, 5 + 20 * i + n)),
                                         SamplingParams(max_tokens=2)))
    plan = engine.scheduler.schedule()
    inputs = build_step_inputs(plan, args.kv_block_size, torch.device("cpu"))
    meta = inputs.meta
    views = {"input_ids": inputs.input_ids, "positions": inputs.positions,
             "slot_mapping": meta.slot_mapping, "context_lens": meta.context_lens_t,
             "sample_rows": inputs.sample_rows, "block_tables": meta.block_tables}
    assert inputs.input_ids.tolist() == [t for i, n in enumerate(lengths)
                                         for t in range(5 + 20 * i, 5 + 20 * i + n)]
    assert inputs.positions.tolist() == [p for n in lengths for p in range(n)]
    assert meta.context_lens_t.tolist() == list(lengths)
    assert inputs.sample_rows.tolist() == [sum(lengths[:i + 1]) - 1
                                           for i in range(len(lengths))]
    for name, view in views.items():
        assert view.data_ptr() % 16 == 0, (name, view.data_ptr() % 16)

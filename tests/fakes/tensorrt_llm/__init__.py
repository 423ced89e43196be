"""A fake of the `tensorrt_llm` package for Tandem's tests (see tests/fakes/README.md).

Only the surface Tandem's trtllm backend uses, with upstream's names, signatures, dataclass
fields, event dict shapes and async behaviour. Behind it runs a tiny deterministic "model" and a
paged KV block manager (tensorrt_llm._fake), not a GPU.
"""
from __future__ import annotations

from tensorrt_llm.disaggregated_params import DisaggregatedParams
from tensorrt_llm.llmapi import LLM, MultimodalEncoder
from tensorrt_llm.sampling_params import SamplingParams

__version__ = "0.0.0+tandem.fake"
IS_TANDEM_FAKE = True

__all__ = ["LLM", "MultimodalEncoder", "SamplingParams", "DisaggregatedParams", "__version__"]

"""The TensorRT-LLM names the backend uses, imported lazily, with a clear error when
TensorRT-LLM is not installed.

Import paths are upstream's (NVIDIA/TensorRT-LLM): `tensorrt_llm.LLM` and
`tensorrt_llm.MultimodalEncoder` (as Dynamo imports them, components/src/dynamo/trtllm/
engine.py), `tensorrt_llm.sampling_params.SamplingParams`,
`tensorrt_llm.disaggregated_params.DisaggregatedParams`,
`tensorrt_llm.llmapi.llm_args.TorchLlmArgs` (the pydantic schema of the LLM's keyword
arguments), `tensorrt_llm.sampling_params.GuidedDecodingParams` (structured outputs). The
encode path's helpers (`tensorrt_llm.inputs`, `tensorrt_llm._torch.
shared_tensor`) are imported by tandem.engines.trtllm.encode when first used.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from tandem.errors import Unavailable

INSTALL_HINT = (
    "the trtllm engine needs TensorRT-LLM, which is not installed in this environment. "
    "On a GPU host install Tandem's optional extra (pip install 'tandem[trtllm]') or run "
    "inside NVIDIA's TensorRT-LLM release container; elsewhere use --engine reference or mock")


@dataclass(frozen=True)
class TrtllmApi:
    """The classes of one TensorRT-LLM installation (typed Any: TensorRT-LLM has no stubs)."""

    LLM: Any
    MultimodalEncoder: Any
    SamplingParams: Any
    GuidedDecodingParams: Any
    DisaggregatedParams: Any
    TorchLlmArgs: Any
    version: str

    def module(self, name: str) -> Any:
        """Imports a further TensorRT-LLM module, e.g. "tensorrt_llm.inputs"."""
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            raise Unavailable(f"TensorRT-LLM {self.version} has no module {name}: {exc}") from exc


def load_api() -> TrtllmApi:
    """Imports TensorRT-LLM.

    Raises:
        Unavailable: TensorRT-LLM is not installed (the message says how to install it).
    """
    try:
        trtllm = importlib.import_module("tensorrt_llm")
        sampling = importlib.import_module("tensorrt_llm.sampling_params")
        disagg = importlib.import_module("tensorrt_llm.disaggregated_params")
        llm_args = importlib.import_module("tensorrt_llm.llmapi.llm_args")
    except ImportError as exc:
        raise Unavailable(f"{INSTALL_HINT} ({exc})", param="engine") from exc
    return TrtllmApi(
        LLM=trtllm.LLM, MultimodalEncoder=trtllm.MultimodalEncoder,
        SamplingParams=sampling.SamplingParams,
        GuidedDecodingParams=sampling.GuidedDecodingParams,
        DisaggregatedParams=disagg.DisaggregatedParams, TorchLlmArgs=llm_args.TorchLlmArgs,
        version=str(getattr(trtllm, "__version__", "unknown")))

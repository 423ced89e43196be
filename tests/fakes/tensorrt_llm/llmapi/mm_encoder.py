"""Fake of tensorrt_llm/llmapi/mm_encoder.py (NVIDIA/TensorRT-LLM @ 1d5f0417).

`MultimodalEncoder(model, trust_remote_code=False, tensor_parallel_size=1, dtype="auto",
**kwargs)` runs only the vision encoder (max_num_tokens defaults to 16384);
`generate_async(inputs, sampling_params=None)` returns a RequestOutput whose
`disaggregated_params.multimodal_embedding_handles` holds one SharedTensorContainer dict per
image. Upstream those are CUDA IPC handles, usable on the same node only; the fake's handles
are only usable in the process that made them.
"""
from __future__ import annotations

import hashlib
import pathlib
from typing import Any

from tensorrt_llm._torch.shared_tensor import SharedTensorContainer
from tensorrt_llm.disaggregated_params import DisaggregatedParams
from tensorrt_llm.executor.result import Response
from tensorrt_llm.llmapi.llm import LLM, RequestOutput
from tensorrt_llm.sampling_params import SamplingParams

#: Embedding rows per image in the fake (upstream: the model's image token count).
TOKENS_PER_IMAGE = 4


class MultimodalEncoder(LLM):
    def __init__(self, model: str | pathlib.Path, trust_remote_code: bool = False,
                 tensor_parallel_size: int = 1, dtype: str = "auto", **kwargs: Any) -> None:
        if kwargs.get("max_num_tokens") is None:
            kwargs["max_num_tokens"] = 16384
        super().__init__(model, trust_remote_code=trust_remote_code,
                         tensor_parallel_size=tensor_parallel_size, dtype=dtype, **kwargs)
        self.args.mm_encoder_only = True
        self._next_id = 1

    def generate_async(self, inputs: Any,  # type: ignore[override]
                       sampling_params: SamplingParams | None = None) -> RequestOutput:
        images = inputs.get("multi_modal_data", {}).get("image") if isinstance(inputs, dict) \
            else None
        if not images:
            raise ValueError("MultimodalEncoder needs inputs with multi_modal_data['image']")
        handles = [SharedTensorContainer.from_tensor(self._embed(img)).dump_to_dict()
                   for img in images]
        hashes = [[int.from_bytes(hashlib.blake2b(img, digest_size=32).digest()[i:i + 4],
                                  "little", signed=True) for i in range(0, 32, 4)]
                  for img in images]
        params = DisaggregatedParams(multimodal_embedding_handles=handles,
                                     multimodal_hashes=hashes)
        result = RequestOutput(self._next_id, SamplingParams(end_id=0), self, False, params, [])
        self._next_id += 1
        result.aqueue.put_nowait(Response([], [], "length", 1))
        return result

    def abort_request(self, request_id: int) -> None:
        pass

    def _embed(self, image: bytes) -> Any:
        import torch

        seed = int.from_bytes(hashlib.blake2b(image, digest_size=8).digest(), "little")
        gen = torch.Generator().manual_seed(seed)
        hidden = self._model["hidden_size"]
        return torch.randn(TOKENS_PER_IMAGE, hidden, generator=gen).to(torch.bfloat16)

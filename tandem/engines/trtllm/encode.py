"""The encode stage on TensorRT-LLM's MultimodalEncoder.

The encoder returns, per image, a SharedTensorContainer dict in
`disaggregated_params.multimodal_embedding_handles` (tensorrt_llm/llmapi/mm_encoder.py). Those
are CUDA IPC handles: valid on the producing node only. Tandem's prefill workers may run on
other nodes, so the encode worker materializes each embedding (as Dynamo's cuda_ipc.py does:
SharedTensorContainer.from_dict(h).get_local_view().clone().cpu()) and ships its bytes.

Images reach the encoder as base64 `data:` URLs through TensorRT-LLM's own input loader
(tensorrt_llm/inputs/utils.py default_multimodal_input_loader / load_image accept them), which
also applies the model's image placeholders.
"""
from __future__ import annotations

import base64
import json
import pathlib
from collections.abc import Sequence
from typing import Any

from tandem.engines.trtllm.api import TrtllmApi
from tandem.engines.types import Embedding
from tandem.errors import InvalidRequest, Unavailable
from tandem.multimodal.image import content_hash

_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"),
          (b"RIFF", "image/webp"), (b"BM", "image/bmp"))


def data_url(image: bytes) -> str:
    media = next((kind for magic, kind in _MAGIC if image.startswith(magic)), "image/png")
    return f"data:{media};base64,{base64.b64encode(image).decode()}"


def model_type(model_dir: str) -> str:
    """The Hugging Face `model_type` TensorRT-LLM's input loader keys its placeholders on."""
    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    return str(config.get("model_type", ""))


def tensor_bytes(tensor: Any) -> bytes:
    """A CPU tensor's raw bytes, dtype kept (bfloat16 included, which numpy lacks)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    return bytes(flat.view(torch.uint8).numpy().tobytes())


async def encode_images(api: TrtllmApi, encoder: Any, model_dir: str,
                        images: Sequence[bytes]) -> list[Embedding]:
    """One Embedding (bytes) per image, in order."""
    if not images:
        return []
    inputs_mod = api.module("tensorrt_llm.inputs")
    shared = api.module("tensorrt_llm._torch.shared_tensor")
    kind = model_type(model_dir)
    out: list[Embedding] = []
    for image in images:
        if not image:
            raise InvalidRequest("an image is empty", param="images")
        inputs = inputs_mod.default_multimodal_input_loader(
            tokenizer=getattr(encoder, "tokenizer", None), model_dir=model_dir,
            model_type=kind, modality="image", prompts=[""], media=[data_url(image)])
        result = await encoder.generate_async(inputs[0])
        params = result.disaggregated_params
        handles = getattr(params, "multimodal_embedding_handles", None) if params else None
        if not handles or len(handles) != 1:
            raise Unavailable(f"TensorRT-LLM's MultimodalEncoder returned "
                              f"{len(handles or [])} embedding handles for one image")
        view = shared.SharedTensorContainer.from_dict(handles[0]).get_local_view()
        tensor = view.clone().cpu()  # off the IPC handle before the producer frees it
        out.append(Embedding(
            content_hash=content_hash(image),
            shape=tuple(int(d) for d in tensor.shape),
            dtype=str(tensor.dtype).removeprefix("torch."),
            data=tensor_bytes(tensor)))
    return out

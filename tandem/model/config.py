"""What Tandem needs to know about a Hugging Face model directory, read from config.json."""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

from tandem.errors import InvalidRequest

_REQUIRED = ("num_attention_heads", "hidden_size", "vocab_size", "num_hidden_layers")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    path: str
    architecture: str
    vocab_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_size: int
    hidden_size: int
    max_position_embeddings: int
    dtype: str
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, path: str | pathlib.Path) -> ModelConfig:
        root = pathlib.Path(path)
        config_file = root / "config.json"
        if not config_file.is_file():
            raise InvalidRequest(f"model directory {root} has no config.json", param="model")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"{config_file} is not JSON: {exc}", param="model") from None
        text = raw.get("text_config", raw)  # LLaVA-style configs nest the language model
        missing = [key for key in _REQUIRED if key not in text]
        if missing:
            raise InvalidRequest(
                f"{config_file} lacks {', '.join(missing)} (architecture "
                f"{(raw.get('architectures') or ['unknown'])[0]}; supported: decoder-only "
                "Llama-style models)", param="model")
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        return cls(
            path=str(root),
            architecture=(raw.get("architectures") or ["unknown"])[0],
            vocab_size=int(text["vocab_size"]),
            num_layers=int(text["num_hidden_layers"]),
            num_attention_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_size=int(text.get("head_dim") or hidden // heads),
            hidden_size=hidden,
            max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
            dtype=str(text.get("torch_dtype") or text.get("dtype") or raw.get("torch_dtype")
                      or raw.get("dtype") or "bfloat16"),
            eos_token_ids=_eos_ids(root, raw, text),
        )


def _eos_ids(root: pathlib.Path, raw: dict, text: dict) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [text.get("eos_token_id"), raw.get("eos_token_id")]
    gen_file = root / "generation_config.json"
    if gen_file.is_file():
        sources.append(json.loads(gen_file.read_text()).get("eos_token_id"))
    for value in sources:
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, int) and item not in ids:
                ids.append(item)
    return tuple(ids)

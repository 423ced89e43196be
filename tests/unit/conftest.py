"""Shared fixtures: a tiny model directory (config.json + tokenizer.json, no weights)."""
from __future__ import annotations

import json
import pathlib

import pytest

#: Special token ids written into the fixture's tokenizer.json; 2 is also the EOS id.
SPECIAL_IDS = (0, 1, 2, 3)
EOS_ID = 2
VOCAB_SIZE = 1000


@pytest.fixture
def tiny_model(tmp_path: pathlib.Path) -> str:
    """A Llama-shaped model directory small enough for unit tests."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": VOCAB_SIZE,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 64,
        "max_position_embeddings": 2048,
        "eos_token_id": EOS_ID,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    added = [{"id": i, "content": f"<special_{i}>", "special": True} for i in SPECIAL_IDS]
    added.append({"id": 999, "content": "word", "special": False})
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": added}))
    return str(tmp_path)

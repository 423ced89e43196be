"""The topology the tool-calling API tests share (Chat Completions tools, Responses, Anthropic
Messages): `tandem up --engine reference --tool-call-parser hermes` on the CPU over a tiny
random-weights Llama whose chat template (Qwen2.5's) renders tools."""
from __future__ import annotations

import pathlib

from tests.chat_templates import QWEN_TOOLS, use_template
from tests.e2e.topology import Topology, start_topology


def write_tools_model(model_dir: pathlib.Path) -> pathlib.Path:
    """The tiny Llama with Qwen2.5's chat template, written into `model_dir`; 2,048 positions,
    since the tools' JSON in a prompt takes ~400 tokens of the demo tokenizer."""
    from tandem.model.tiny import write_tiny_model

    model: pathlib.Path = write_tiny_model(model_dir, "llama", seed=0,
                                           max_position_embeddings=2048)
    use_template(model, QWEN_TOOLS)
    return model


def start_tools_topology(model_dir: pathlib.Path) -> Topology:
    """Writes the model into `model_dir` and starts the topology over it."""
    model = write_tools_model(model_dir)
    return start_topology("--engine", "reference", "--model", str(model), "--device", "cpu",
                          "--kv-block-size", "32", "--num-gpu-blocks-override", "256",
                          "--tool-call-parser", "hermes")

"""Checkpoints saved by the installed transformers' own `save_pretrained` load and serve.

Each supported family is built with transformers, loaded back and saved again the way a user
saves a model: `model.save_pretrained`, then `tokenizer.save_pretrained` (text) or
`AutoProcessor.save_pretrained` (LLaVA), into a fresh directory. transformers 5 writes the chat
template to chat_template.jinja (not tokenizer_config.json) and nests the image processor config
in processor_config.json (no preprocessor_config.json), so these directories differ from the
hand-written ones of tandem.model.tiny_llava.

LLaVA and one text family are served end to end by `tandem up` (frontend, router and a reference
decode worker as real processes) and asked through the official `openai` client. A topology
serves one model and starting one costs three processes importing torch, so the other text
families are checked in process instead, through the same loaders the services use (ModelConfig
and the frontend's Tokenizer, the reference engine). Every check compares greedy tokens with
transformers' `generate` on the saved files.
"""
from __future__ import annotations

import base64
import contextlib
import json
import pathlib
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch

from tandem.engines.args import EngineArgs
from tandem.engines.reference.engine import create_reference_engine
from tandem.engines.types import EngineRequest, SamplingParams
from tandem.frontend.tokenizer import Tokenizer
from tandem.model.config import ModelConfig
from tandem.model.tiny import FAMILIES, write_tiny_model
from tandem.model.tiny_llava import write_tiny_llava
from tests.e2e.topology import Topology, start_topology
from tests.unit.test_llava_reference import IMAGES, Llava

NEW_TOKENS = 12
#: The text family served end to end (the others are checked in process).
SERVED_FAMILY = "qwen3"
MESSAGES: list[dict[str, Any]] = [{"role": "user",
                                   "content": "Tell me about the quick brown fox."}]
IMAGE_TEXT = "Describe this, please."


def save_text_model(family: str, root: pathlib.Path) -> pathlib.Path:
    """`root/family`, written by transformers' own save_pretrained (model and tokenizer)."""
    import transformers

    built = write_tiny_model(root / f"{family}-built", family, seed=1)
    out = root / family
    transformers.AutoModelForCausalLM.from_pretrained(built).save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(built).save_pretrained(out)
    assert (out / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
    return out


def save_llava(root: pathlib.Path) -> pathlib.Path:
    """`root/llava`, written by transformers' own save_pretrained (model and AutoProcessor)."""
    import transformers

    built = write_tiny_llava(root / "llava-built", seed=0)
    out = root / "llava"
    transformers.LlavaForConditionalGeneration.from_pretrained(built).save_pretrained(out)
    transformers.AutoProcessor.from_pretrained(built).save_pretrained(out)
    # The layout this test is about: the image processor nested, no file of its own.
    assert not (out / "preprocessor_config.json").exists()
    assert "image_processor" in json.loads((out / "processor_config.json").read_text())
    return out


@pytest.fixture(scope="module")
def saved_root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("saved")


class TextReference:
    """transformers on the saved files: the chat prompt and its greedy continuation."""

    def __init__(self, model_dir: pathlib.Path) -> None:
        import transformers

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
        chat: Any = self.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                       return_dict=True)
        self.prompt_ids: list[int] = list(chat["input_ids"])

    def greedy(self) -> list[int]:
        ids = torch.tensor([self.prompt_ids])
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        return list(out[0, len(self.prompt_ids):].tolist())

    def token_texts(self, ids: list[int]) -> list[str]:
        return [str(self.tokenizer.decode([i])) for i in ids]


@contextlib.contextmanager
def serving(model_dir: pathlib.Path) -> Iterator[tuple[Topology, openai.OpenAI]]:
    """`tandem up` with the reference engine on CPU serving `model_dir`, for one test (so two
    topologies never compete for the CPU)."""
    topo = start_topology("--engine", "reference", "--device", "cpu", "--model", str(model_dir),
                          "--kv-block-size", "4", "--num-gpu-blocks-override", "256")
    try:
        yield topo, openai.OpenAI(base_url=topo.http_url + "/v1", api_key="unused",
                                  max_retries=0)
    finally:
        assert topo.stop() == 0


def ask(client: openai.OpenAI, topo: Topology, messages: Any) -> Any:
    return client.chat.completions.create(
        model=topo.model, messages=messages, max_tokens=NEW_TOKENS, temperature=0,
        logprobs=True, extra_body={"min_tokens": NEW_TOKENS, "skip_special_tokens": False})


def test_text_model_saved_by_transformers_serves_end_to_end(saved_root: pathlib.Path) -> None:
    model_dir = save_text_model(SERVED_FAMILY, saved_root)
    reference = TextReference(model_dir)
    want = reference.greedy()
    assert len(set(want)) > 3, "the test model must not just repeat one token"
    with serving(model_dir) as (topo, client):
        reply = ask(client, topo, MESSAGES)
    assert [e.token for e in reply.choices[0].logprobs.content] == reference.token_texts(want)
    assert reply.usage.prompt_tokens == len(reference.prompt_ids)


def test_llava_saved_by_transformers_serves_end_to_end(saved_root: pathlib.Path) -> None:
    model_dir = save_llava(saved_root)
    llava = Llava(model_dir)  # AutoProcessor and the model, read back from the saved files
    images = IMAGES[:2]
    want = llava.greedy(IMAGE_TEXT, images)
    assert want != llava.greedy(IMAGE_TEXT, IMAGES[1:]), "the answer must depend on the image"
    urls = [f"data:image/png;base64,{base64.b64encode(d).decode()}" for d in images]
    content = [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
               {"type": "text", "text": IMAGE_TEXT}]
    with serving(model_dir) as (topo, client):
        reply = ask(client, topo, [{"role": "user", "content": content}])
    tokenizer = llava.processor.tokenizer
    assert [e.token for e in reply.choices[0].logprobs.content] == \
        [tokenizer.decode([i]) for i in want]
    assert reply.usage.prompt_tokens == len(llava.prompt(IMAGE_TEXT, images).token_ids)


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_text_model_saved_by_transformers_loads_in_process(
        family: str, saved_root: pathlib.Path) -> None:
    model_dir = save_text_model(family, saved_root / "in-process")
    reference = TextReference(model_dir)
    # What the frontend reads: the chat template (from chat_template.jinja) and the stop ids.
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer.apply_chat_template(MESSAGES) == reference.prompt_ids
    assert set(ModelConfig.from_dir(model_dir).eos_token_ids) <= set(tokenizer.eos_token_ids)
    engine = create_reference_engine(EngineArgs(model=str(model_dir), device="cpu",
                                                kv_block_size=4, num_gpu_blocks=256))
    await engine.start()
    try:
        sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, min_tokens=NEW_TOKENS)
        tokens = [t async for chunk in engine.add_request(
            EngineRequest(f"saved-{family}", tuple(reference.prompt_ids), sampling))
            for t in chunk.token_ids]
    finally:
        await engine.close()
    assert tokens == reference.greedy()

"""gpt-oss end to end: a tiny random-weight gpt_oss whose tokenizer knows harmony's special tokens,
with a harmony chat template (tests/chat_templates.py), served disaggregated by `tandem up`
(prefill worker -> KV over NIXL -> decode worker) with `--reasoning-parser gpt_oss
--tool-call-parser harmony`, through the official `openai` client.

What these tests show: the server renders the harmony prompt (reasoning effort, tools, a tool
result) exactly as transformers does; its greedy tokens on that prompt equal transformers', over
the sliding-window and full layers, disaggregated and on the decode worker alone; a forced
tool_choice (named or "required") comes back as a well-formed call, streamed and not, that the
model wrote as a harmony call message (not bare JSON); and the chat answer is the
parsers applied to the served model's own token stream. What they cannot show: a random model
never writes a real analysis message, so reasoning_content from channels is shown on a scripted
harmony answer, tokenized by the same tokenizer and fed to the parsers token by token
(test_scripted_harmony_answer_splits_on_tiny_tokenizer).
"""
from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.chat_templates import HARMONY, use_template
from tests.e2e.disagg_probe import generate, wait_idle
from tests.e2e.topology import Topology, start_topology

BLOCK_SIZE = 16
#: Logprobs of the engine and transformers agree this closely (float32, different kernels).
LOGPROB_TOLERANCE = 1e-3
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                  "<|return|>", "<|call|>")
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "description": "City name",
                                   "maxLength": 12},
                          "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time.",
                                      "parameters": {"type": "object", "properties": {
                                          "zone": {"type": "string"}}, "required": ["zone"]}}},
]
#: A chat with a system prompt, tools, a past call and its result.
MESSAGES: list[Any] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
]


def write_harmony_model(path: pathlib.Path) -> pathlib.Path:
    """The tiny gpt_oss with harmony's markers as added special tokens (vocab_size grown to
    fit), `<|return|>` and `<|call|>` as its EOS ids (as gpt-oss ships them), and the harmony
    chat template."""
    from transformers import AutoTokenizer

    from tandem.model.demo import ensure_demo_model
    from tandem.model.tiny import write_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_demo_model()))
    tokenizer.add_tokens(list(HARMONY_TOKENS), special_tokens=True)
    eos = tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    write_tiny_model(path, "gpt_oss", seed=3, vocab_size=len(tokenizer), eos_token_id=eos)
    tokenizer.save_pretrained(str(path))
    use_template(path, HARMONY)
    return path


class Reference:
    """transformers on the very files the engine serves."""

    def __init__(self, model_dir: pathlib.Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()

    def chat_ids(self, messages: list[Any], **kwargs: Any) -> list[int]:
        """The prompt as transformers renders it (tool-call arguments decoded to objects, as
        Hugging Face templates take them)."""
        decoded = [{**m, "tool_calls": [{**c, "function": {
            **c["function"], "arguments": json.loads(c["function"]["arguments"])}}
            for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
        decoded = [{k: v for k, v in m.items() if v is not None} for m in decoded]
        return list(self.tokenizer.apply_chat_template(
            decoded, add_generation_prompt=True, return_dict=True, **kwargs)["input_ids"])

    def greedy(self, prompt_ids: list[int], num_tokens: int, stop_at_eos: bool = True
               ) -> tuple[list[int], list[float]]:
        """Greedy ids (through an EOS when `stop_at_eos`) and each one's logprob."""
        import torch

        ids, out, logprobs = list(prompt_ids), [], []
        eos = set(self.model.generation_config.eos_token_id)
        with torch.inference_mode():
            for _ in range(num_tokens):
                logits = self.model(torch.tensor([ids])).logits[0, -1].float()
                token = int(logits.argmax())
                out.append(token)
                logprobs.append(torch.log_softmax(logits, -1)[token].item())
                ids.append(token)
                if stop_at_eos and token in eos:
                    break
        return out, logprobs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_harmony_model(tmp_path_factory.mktemp("gpt-oss") / "tiny-gpt-oss")


@pytest.fixture(scope="module")
def reference(model_dir: pathlib.Path) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def topo(model_dir: pathlib.Path) -> Iterator[Topology]:
    topo = start_topology("--engine", "reference", "--device", "cpu", "--model", str(model_dir),
                          "--kv-block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", "256",
                          "--reasoning-parser", "gpt_oss", "--tool-call-parser", "harmony",
                          num_prefill=1)
    try:
        yield topo
    finally:
        assert topo.stop() == 0


@pytest.fixture(scope="module")
def client(topo: Topology) -> openai.OpenAI:
    return openai.OpenAI(base_url=topo.http_url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def test_tokenizer_knows_harmony_markers(reference: Reference) -> None:
    ids = reference.tokenizer.convert_tokens_to_ids(list(HARMONY_TOKENS))
    assert len(set(ids)) == len(ids) and min(ids) >= 4096
    assert max(ids) < reference.model.config.vocab_size
    text = "<|start|>assistant<|channel|>final<|message|>hi<|return|>"
    encoded = reference.tokenizer.encode(text, add_special_tokens=False)
    assert {ids[0], ids[3], ids[2], ids[5]} <= set(encoded)
    assert reference.tokenizer.decode(encoded, skip_special_tokens=True) == "assistantfinalhi"


def test_served_prompt_is_transformers_harmony_render(
        client: openai.OpenAI, topo: Topology, reference: Reference) -> None:
    """Reasoning effort, tools and a tool result reach the template as transformers passes them:
    same prompt length, and the first greedy tokens' logprobs (which depend on every prompt
    token) equal transformers' on its own render."""
    expected = reference.chat_ids(MESSAGES, tools=TOOLS, reasoning_effort="high")
    text = reference.tokenizer.decode(expected, skip_special_tokens=False)
    assert "Reasoning: high" in text and "type get_weather = (_: {" in text
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>" in text
    assert expected != reference.chat_ids(MESSAGES, tools=TOOLS)  # the effort matters
    answer = client.chat.completions.create(
        model=topo.model, messages=MESSAGES, tools=TOOLS, tool_choice="none",
        reasoning_effort="high", max_tokens=4, temperature=0, logprobs=True,
        extra_body={"ignore_eos": True})
    assert answer.usage is not None and answer.usage.prompt_tokens == len(expected)
    want_ids, want_logprobs = reference.greedy(expected, 4, stop_at_eos=False)
    got = [t.logprob for t in answer.choices[0].logprobs.content]  # type: ignore[union-attr]
    assert got == pytest.approx(want_logprobs, abs=LOGPROB_TOLERANCE), want_ids


def test_greedy_tokens_equal_transformers_disaggregated_and_aggregated(
        client: openai.OpenAI, topo: Topology, reference: Reference) -> None:
    """Completions on the rendered prompt's ids (longer than the window of 8, several KV blocks)
    equal transformers' greedy tokens, through prefill -> NIXL -> decode and on the decode worker
    alone."""
    prompt = reference.chat_ids(MESSAGES, tools=TOOLS, reasoning_effort="low")
    assert len(prompt) > 4 * BLOCK_SIZE
    num_tokens = 12
    want, _ = reference.greedy(prompt, num_tokens, stop_at_eos=False)
    answer = client.completions.create(model=topo.model, prompt=prompt, max_tokens=num_tokens,
                                       temperature=0, logprobs=0,
                                       extra_body={"ignore_eos": True,
                                                   "skip_special_tokens": False})
    assert answer.usage is not None and answer.usage.completion_tokens == num_tokens
    got_text = answer.choices[0].text
    assert got_text == reference.tokenizer.decode(want, skip_special_tokens=False)
    (decode,), (prefill,) = topo.decode_addresses, topo.prefill_addresses
    aggregated, _ = generate(decode, "gpt-oss-agg", prompt, num_tokens)
    want_stopping, _ = reference.greedy(prompt, num_tokens)
    assert aggregated == want_stopping
    wait_idle(decode, prefill)


#: tool_choice -> the functions it forces (name -> parameters schema).
FORCED: dict[str, tuple[Any, dict[str, Any]]] = {
    "named": ({"type": "function", "function": {"name": "get_weather"}},
              {"get_weather": WEATHER}),
    "required": ("required", {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("forced", list(FORCED))
def test_forced_tool_choice_makes_a_well_formed_harmony_call(
        client: openai.OpenAI, topo: Topology, reference: Reference, forced: str,
        stream: bool) -> None:
    """The call comes back whole, its arguments valid for its function; the model wrote it as a
    harmony call message (the grammar of tandem.frontend.parsers.harmony_grammar), not as bare
    JSON: the raw text is a completion of the same prompt under the same grammar (greedy, so the
    same tokens), special tokens kept, and the parsers make the same call of it."""
    from tandem.frontend.parsers import reasoning_parser, tool_parser
    from tandem.frontend.parsers.harmony import HarmonyFormat

    choice, functions = FORCED[forced]
    # The grammar lets the model open an analysis message first. A random model that does
    # never ends it (random text), so this prompt is one on which its greedy choice after
    # `<|channel|>` is commentary: on "Weather in Paris?" it is analysis, and the answer is cut
    # by max_tokens ("length"). The analysis path is covered by tests/unit/test_harmony_grammar.
    messages = [{"role": "user", "content": "How warm is it in Rome?"}]
    kwargs: dict[str, Any] = dict(model=topo.model, messages=messages, tools=TOOLS,
                                  tool_choice=choice, max_tokens=200, temperature=0)
    if stream:
        calls: dict[int, dict[str, str]] = {}
        finish, content, usage = None, "", None
        for chunk in client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **kwargs):
            usage = chunk.usage or usage
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                if call.function is not None:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        found = [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
    else:
        answer = client.chat.completions.create(**kwargs)
        finish, usage = answer.choices[0].finish_reason, answer.usage
        content = answer.choices[0].message.content or ""
        found = [(c.function.name, c.function.arguments)  # type: ignore[union-attr]
                 for c in answer.choices[0].message.tool_calls or []]
    assert finish == "tool_calls" and not content
    ((name, arguments),) = found  # one call: gpt-oss makes one per turn
    assert name in functions
    jsonschema.validate(json.loads(arguments), functions[name])

    completion = client.completions.create(
        model=topo.model, prompt=reference.chat_ids(messages, tools=TOOLS), max_tokens=200,
        temperature=0, extra_body={"guided_grammar": HarmonyFormat().forced_grammar(functions, 0),
                                   "skip_special_tokens": False})
    assert usage is not None and completion.usage is not None
    assert usage.completion_tokens == completion.usage.completion_tokens
    raw = completion.choices[0].text
    assert raw.startswith("<|channel|>") and not raw.lstrip().startswith("{")
    assert f"<|channel|>commentary to=functions.{name}" in raw and "<|message|>" in raw
    parsed = tool_parser("harmony").parse(reasoning_parser("gpt_oss").parse(raw).content)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        (name, json.loads(arguments))]


def test_chat_answer_is_the_parsers_on_the_served_tokens(
        client: openai.OpenAI, topo: Topology, reference: Reference) -> None:
    """A random model writes no harmony channels, but whatever it writes reaches the client as
    the gpt_oss and harmony parsers make of its own tokens (special tokens kept for them)."""
    from tandem.frontend.chat_output import ChatOutput
    from tandem.frontend.parsers import reasoning_parser, tool_parser

    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    num_tokens = 16
    prompt = reference.chat_ids(messages, tools=TOOLS)
    want, _ = reference.greedy(prompt, num_tokens)
    answer = client.chat.completions.create(model=topo.model, messages=messages, tools=TOOLS,
                                            max_tokens=num_tokens, temperature=0)
    assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt)
    eos = set(reference.model.generation_config.eos_token_id)
    output = ChatOutput(reasoning=reasoning_parser("gpt_oss").stream(),
                        tools=tool_parser("harmony").stream())
    # The frontend drops the non-harmony special tokens, and EOS ends the text unseen.
    others = {"<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"}
    text = "".join(t for t in (reference.tokenizer.decode([i], skip_special_tokens=False)
                               for i in want if i not in eos) if t not in others)
    expected = output.feed(text)
    expected.extend(output.finish())
    message = answer.choices[0].message
    assert (message.content or "") == expected.content
    assert getattr(message, "reasoning_content", None) in (None, expected.reasoning or None)
    assert len(message.tool_calls or []) == output.num_calls


def test_scripted_harmony_answer_splits_on_tiny_tokenizer(reference: Reference) -> None:
    """An analysis message, a preamble and a call, as the tiny tokenizer tokenizes them, fed one
    token's text at a time: the analysis body is reasoning, the preamble content, the call a
    call (what a served gpt-oss writing channels would get back)."""
    from tandem.frontend.chat_output import ChatOutput
    from tandem.frontend.parsers import (
        ToolCallArguments,
        ToolCallStart,
        reasoning_parser,
        tool_parser,
    )

    script = ("<|channel|>analysis<|message|>Need the weather for Paris.<|end|>"
              "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
              "<|start|>assistant<|channel|>commentary to=functions.get_weather "
              '<|constrain|>json<|message|>{"city": "Paris", "unit": "c"}')  # <|call|>: EOS
    ids = reference.tokenizer.encode(script, add_special_tokens=False)
    assert reference.tokenizer.convert_tokens_to_ids("<|channel|>") in ids
    output = ChatOutput(reasoning=reasoning_parser("gpt_oss").stream(),
                        tools=tool_parser("harmony").stream())
    total = output.feed("")
    for i in ids:
        total.extend(output.feed(reference.tokenizer.decode([i], skip_special_tokens=False)))
    total.extend(output.finish())
    assert total.reasoning == "Need the weather for Paris."
    assert total.content == "Checking."
    assert output.found_reasoning and output.num_calls == 1
    names = [e.name for e in total.calls if isinstance(e, ToolCallStart)]
    arguments = "".join(e.fragment for e in total.calls if isinstance(e, ToolCallArguments))
    assert names == ["get_weather"] and json.loads(arguments) == {"city": "Paris", "unit": "c"}

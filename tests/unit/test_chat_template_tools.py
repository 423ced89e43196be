"""Tools, tool messages and template variables reach the chat template as transformers'
apply_chat_template passes them; what a model's template would drop is refused; the gRPC API
maps its tool fields onto the same OpenAI body; `tandem up` passes the parser flags on."""
from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any, cast

import pytest

from services.frontend.inference import _chunk, openai_body
from tandem.engines.types import FinishReason, GuidedDecoding, GuidedKind, Usage
from tandem.errors import InvalidRequest
from tandem.frontend.frontend import Frontend, ModelInfo
from tandem.frontend.openai_request import parse_request
from tandem.frontend.output_parsers import OutputParsers
from tandem.frontend.parsers import tool_parser
from tandem.frontend.parsers.harmony import HarmonyFormat
from tandem.frontend.pipeline import Delta, Pipeline
from tandem.frontend.tokenizer import Tokenizer
from tandem.launcher.deployment import Deployment
from tandem.launcher.processes import processes
from tandem.model.demo import ensure_demo_model
from tandem.v1 import common_pb2
from tandem.v1 import inference_pb2 as pb
from tests.chat_templates import QWEN_TOOLS, use_template

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]


def model_dir(tmp_path: pathlib.Path, template: str | None) -> pathlib.Path:
    root = tmp_path / "model"
    root.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copyfile(ensure_demo_model() / name, root / name)
    if template is not None:
        use_template(root, template)
    return root


def frontend(tmp_path: pathlib.Path, template: str | None = QWEN_TOOLS,
             parsers: OutputParsers | None = None, json_whitespace: int = 0) -> Frontend:
    tokenizer = Tokenizer.from_dir(model_dir(tmp_path, template))
    return Frontend(ModelInfo("m", 4096), tokenizer, cast(Pipeline, None), parsers=parsers,
                    json_whitespace=json_whitespace)


def chat(**fields: Any) -> Any:
    return parse_request({"model": "m", "messages": CONVERSATION, **fields}, "chat")


async def test_tools_and_tool_messages_render_as_transformers_renders_them(
        tmp_path: pathlib.Path) -> None:
    fe = frontend(tmp_path, parsers=OutputParsers(tool_parser("hermes")))
    request = chat(tools=[WEATHER], chat_template_kwargs={"enable_thinking": False})
    prepared = await fe.prepare(request)
    text = fe.tokenizer.decode(prepared.prompt_token_ids, skip_special_tokens=False)
    # transformers itself, given the messages in the shape its documentation asks for
    hf_messages = json.loads(json.dumps(CONVERSATION))
    hf_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    expected = fe.tokenizer.hf.apply_chat_template(hf_messages, tools=[WEATHER], tokenize=False,
                                                   add_generation_prompt=True,
                                                   enable_thinking=False)
    assert text == expected
    assert json.dumps(WEATHER) in text  # the tool, in the system turn
    # arguments as an object, not a JSON string quoted a second time
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\n18 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prepared.skip_special_tokens


async def test_what_the_template_or_deployment_would_drop_is_refused(
        tmp_path: pathlib.Path) -> None:
    demo = frontend(tmp_path, template=None)  # the demo template renders no tools
    with pytest.raises(InvalidRequest, match="does not render tools") as info:
        await demo.prepare(chat(tools=[WEATHER], tool_choice="required"))
    assert info.value.param == "tools"
    await demo.prepare(chat(tools=[WEATHER], tool_choice="none"))
    with pytest.raises(InvalidRequest, match="does not read reasoning_effort") as info:
        await demo.prepare(chat(reasoning_effort="low"))
    assert info.value.param == "reasoning_effort"
    no_parser = frontend(tmp_path / "b")
    for fields in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"}):
        with pytest.raises(InvalidRequest, match="no tool-call parser") as info:
            await no_parser.prepare(chat(**fields))
        assert info.value.param == "tool_choice"
    # a forced choice needs no parser: the grammar enforces it
    prepared = await no_parser.prepare(chat(tools=[WEATHER], tool_choice="required"))
    assert prepared.sampling.guided is not None


async def test_a_forced_choice_is_enforced_in_the_tool_parsers_own_grammar(
        tmp_path: pathlib.Path) -> None:
    """Harmony's forced-call grammar (its arguments under --json-whitespace) replaces the
    bare-JSON schema; other parsers keep the schema."""
    parameters = WEATHER["function"]["parameters"]  # type: ignore[index]
    request = chat(tools=[WEATHER], tool_choice="required")
    harmony = frontend(tmp_path / "a", parsers=OutputParsers(tool_parser("harmony")),
                       json_whitespace=2)
    prepared = await harmony.prepare(request)
    assert prepared.sampling.guided == GuidedDecoding(
        GuidedKind.GRAMMAR, HarmonyFormat().forced_grammar({"get_weather": parameters}, 2))
    hermes = frontend(tmp_path / "b", parsers=OutputParsers(tool_parser("hermes")),
                      json_whitespace=2)
    prepared = await hermes.prepare(request)
    assert prepared.sampling.guided == GuidedDecoding(
        GuidedKind.JSON_SCHEMA, request.guided.spec, json_whitespace=2)


async def test_reasoning_effort_reaches_a_template_that_reads_it(tmp_path: pathlib.Path) -> None:
    template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                "Reasoning: {{ reasoning_effort | default('medium') }}")
    fe = frontend(tmp_path, template=template)
    prepared = await fe.prepare(parse_request({"model": "m", "reasoning_effort": "high",
                                               "messages": [{"role": "user", "content": "x"}]},
                                              "chat"))
    assert fe.tokenizer.decode(prepared.prompt_token_ids) == "xReasoning: high"


def test_grpc_tool_fields_map_to_the_openai_body() -> None:
    request = pb.InferenceRequest(
        model="m", chat=pb.ChatInput(messages=[
            pb.ChatMessage(role="user", content="Weather?"),
            pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(
                id="call_1", name="get_weather", arguments='{"city": "Paris"}')]),
            pb.ChatMessage(role="tool", tool_call_id="call_1", content="18 C")]),
        tools=[pb.Tool(name="get_weather", description="Current weather",
                       parameters=json.dumps(WEATHER["function"]["parameters"]))],  # type: ignore[index]
        tool_choice=pb.ToolChoice(function_name="get_weather"), parallel_tool_calls=False,
        chat_template_kwargs='{"enable_thinking": false}', reasoning_effort="low")
    body, kind = openai_body(request)
    assert kind == "chat"
    assert body["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather",
        "parameters": WEATHER["function"]["parameters"]}}]  # type: ignore[index]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert (body["parallel_tool_calls"], body["chat_template_kwargs"],
            body["reasoning_effort"]) == (False, {"enable_thinking": False}, "low")
    parsed = parse_request(body, kind)
    assert parsed.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert parsed.messages[2]["tool_call_id"] == "call_1"
    assert parsed.tools is not None and parsed.tools.choice == "function"
    assert "tools" not in openai_body(pb.InferenceRequest(model="m", prompt="p"))[0]
    with pytest.raises(InvalidRequest) as info:
        openai_body(pb.InferenceRequest(model="m", prompt="p",
                                        tools=[pb.Tool(name="f", parameters="{x")]))
    assert info.value.param == "tools[0].function.parameters"
    mode = pb.InferenceRequest(model="m", chat=request.chat,
                               tool_choice=pb.ToolChoice(mode="none"))
    assert openai_body(mode)[0]["tool_choice"] == "none"


def test_grpc_chunks_carry_reasoning_and_tool_call_deltas() -> None:
    parsers = OutputParsers(tool_parser("hermes"))
    parsed = parse_request({"model": "m", "messages": CONVERSATION, "tools": [WEATHER]}, "chat")
    output = parsers.new_output(parsed)
    text = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    first = _chunk("r", Delta(text, [1, 2], []), output)
    last = _chunk("r", Delta("</tool_call>", [3], [], FinishReason.STOP, Usage(5, 3)), output)
    assert first.text == "Checking." and not first.tool_calls
    assert [(d.index, d.name, d.arguments) for d in last.tool_calls] == [
        (0, "get_weather", ""), (0, "", '{"city": "Oslo"}')]
    assert last.tool_calls[0].id.startswith("call_") and not last.tool_calls[1].id
    assert last.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    plain = _chunk("r", Delta("hi", [1], [], FinishReason.STOP),
                   parsers.new_output(parse_request({"model": "m", "prompt": "p"},
                                                    "completion")))
    assert (plain.text, plain.finish_reason) == ("hi", common_pb2.FINISH_REASON_STOP)


def test_tandem_up_passes_the_parser_flags_to_the_frontend(tmp_path: pathlib.Path) -> None:
    frontend_argv = processes(Deployment(tool_call_parser="hermes",
                                         reasoning_parser="qwen3"), tmp_path)[-1].argv
    flags = " ".join(frontend_argv)
    assert "--tool-call-parser hermes" in flags and "--reasoning-parser qwen3" in flags
    assert "--tool-call-parser" not in " ".join(processes(Deployment(), tmp_path)[-1].argv)


SYSTEM_FIRST = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message "
                "must come first') }}{% endif %}{% for m in messages %}<|{{ m['role'] }}|>"
                "{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<|assistant|>"
                "{% endif %}")


def test_warming_up_leaves_a_template_that_refuses_a_lone_user_message_to_the_request(
        tmp_path: pathlib.Path) -> None:
    # What build_frontend runs at start must never stop a frontend whose template has rules.
    tokenizer = Tokenizer.from_dir(model_dir(tmp_path, SYSTEM_FIRST))
    tokenizer.warm()
    with pytest.raises(InvalidRequest, match="system message must come first"):
        tokenizer.render_chat([{"role": "user", "content": "Hi"}])
    assert tokenizer.render_chat([{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Hi"}]) == (
        "<|system|>Be brief.<|user|>Hi<|assistant|>")

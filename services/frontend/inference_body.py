"""The public gRPC Inference API's request as an OpenAI body, so that it goes through the very
validation and semantics of the REST API (tandem.frontend.openai_request.parse_request); a
field at fault is named as the REST API would name it (e.g. "tools[0].parameters" becomes
"tools[0].function.parameters")."""
from __future__ import annotations

from typing import Any

from tandem.errors import InvalidRequest
from tandem.frontend import json_body
from tandem.frontend.openai_request import Kind
from tandem.v1 import common_pb2
from tandem.v1 import inference_pb2 as pb

_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                    "repetition_penalty", "frequency_penalty", "presence_penalty")


def openai_body(request: pb.InferenceRequest) -> tuple[dict[str, Any], Kind]:
    """The equivalent OpenAI body and endpoint kind ("chat" or "completion")."""
    body: dict[str, Any] = {"model": request.model, "stop": list(request.stop) or None}
    s = request.sampling
    for name in _SAMPLING_FIELDS:
        if s.HasField(name):
            body[name] = getattr(s, name)
    if s.stop_token_ids:
        body["stop_token_ids"] = list(s.stop_token_ids)
    body["min_tokens"], body["ignore_eos"] = s.min_tokens, s.ignore_eos
    if s.disable_speculation:
        body["speculative_decoding"] = False
    if s.HasField("guided_decoding"):
        body.update(_guided_body(s.guided_decoding))
    if s.HasField("top_logprobs"):
        body["logprobs"] = True if request.WhichOneof("input") == "chat" else s.top_logprobs
        if request.WhichOneof("input") == "chat":
            body["top_logprobs"] = s.top_logprobs
    router: dict[str, float] = {}
    if request.sla.HasField("ttft_ms"):
        router["ttft_target"] = request.sla.ttft_ms
    if request.sla.HasField("itl_ms"):
        router["itl_target"] = request.sla.itl_ms
    if router:
        body["nvext"] = {"router": router}
    body.update(_chat_options(request))
    if request.HasField("n"):
        body["n"] = request.n
    which = request.WhichOneof("input")
    if which == "chat":
        body["messages"] = [_message(m) for m in request.chat.messages]
        return body, "chat"
    if which == "prompt":
        body["prompt"] = request.prompt
    elif which == "tokens":
        body["prompt"] = list(request.tokens.token_ids)
    else:
        raise InvalidRequest("one of chat, prompt or tokens is required", param="input")
    return body, "completion"


def _message(msg: pb.ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": msg.role, "content": msg.content}
    if msg.parts:
        out["content"] = [{"type": "text", "text": p.text} if p.WhichOneof("part") == "text"
                          else {"type": "image_url", "image_url": {"url": p.image_url}}
                          for p in msg.parts]
    if msg.tool_call_id:
        out["tool_call_id"] = msg.tool_call_id
    if msg.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.name, "arguments": c.arguments or "{}"}} for c in msg.tool_calls]
    return out


def _chat_options(request: pb.InferenceRequest) -> dict[str, Any]:
    """tools, tool_choice, parallel_tool_calls, chat_template_kwargs, reasoning_effort (the
    REST API refuses them for a prompt, and so does this one)."""
    body: dict[str, Any] = {}
    if request.tools:
        body["tools"] = [_tool(tool, i) for i, tool in enumerate(request.tools)]
    which = request.tool_choice.WhichOneof("choice")
    if which == "mode":
        body["tool_choice"] = request.tool_choice.mode
    elif which == "function_name":
        body["tool_choice"] = {"type": "function",
                               "function": {"name": request.tool_choice.function_name}}
    if request.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = request.parallel_tool_calls
    if request.chat_template_kwargs:
        body["chat_template_kwargs"] = _json(request.chat_template_kwargs,
                                             "chat_template_kwargs")
    if request.reasoning_effort:
        body["reasoning_effort"] = request.reasoning_effort
    return body


def _tool(tool: pb.Tool, index: int) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters:
        function["parameters"] = _json(tool.parameters, f"tools[{index}].function.parameters")
    return {"type": "function", "function": function}


def _json(text: str, param: str) -> Any:
    return json_body.loads(text, f"'{param}'", param)


def _guided_body(guided: common_pb2.GuidedDecoding) -> dict[str, Any]:
    """The OpenAI/vLLM body field of a constraint (checked there like any HTTP request's);
    num_output_tokens_in_prompt is the frontend's own business, never a client's."""
    which = guided.WhichOneof("constraint")
    if which is None or (which == "json_object" and not guided.json_object):
        raise InvalidRequest("sampling.guided_decoding sets no constraint (json_object must be "
                             "true when set)", param="sampling.guided_decoding")
    if which == "json_object":
        return {"response_format": {"type": "json_object"}}
    if which == "choice":
        return {"guided_choice": list(guided.choice.choices)}
    key = {"json_schema": "guided_json", "regex": "guided_regex", "grammar": "guided_grammar"}
    return {key[which]: getattr(guided, which)}

"""The public gRPC Inference API: same semantics as the REST API, through the same validation
(the request becomes an OpenAI body and goes through parse_request)."""
from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import grpc

from tandem.errors import InvalidRequest, Unavailable
from tandem.frontend.auth import ApiKeys
from tandem.frontend.errors import http_error
from tandem.frontend.frontend import Frontend
from tandem.frontend.metrics import CLIENT_CLOSED, RequestTracker
from tandem.frontend.openai_request import Kind, parse_request
from tandem.runtime import convert
from tandem.runtime.server import Draining
from tandem.v1 import common_pb2, inference_pb2_grpc
from tandem.v1 import inference_pb2 as pb

_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                    "repetition_penalty", "frequency_penalty", "presence_penalty")


def _message(msg: pb.ChatMessage) -> dict[str, Any]:
    if not msg.parts:
        return {"role": msg.role, "content": msg.content}
    parts = [{"type": "text", "text": p.text} if p.WhichOneof("part") == "text"
             else {"type": "image_url", "image_url": {"url": p.image_url}} for p in msg.parts]
    return {"role": msg.role, "content": parts}


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


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, frontend: Frontend, draining: Draining,
                 api_keys: ApiKeys | None = None) -> None:
        self.frontend = frontend
        self.draining = draining
        self.api_keys = api_keys or ApiKeys(())

    def _authenticate(self, context: grpc.aio.ServicerContext) -> None:
        """Raises Unauthenticated (UNAUTHENTICATED) without a valid `authorization` key."""
        values = [str(v) for k, v in context.invocation_metadata() or () if k == "authorization"]
        self.api_keys.check(values[0] if values else None)

    async def Generate(self, request: pb.InferenceRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncGenerator[pb.InferenceChunk, None]:
        tracker = self.frontend.pipeline.metrics.track("grpc_generate")
        status, usage = CLIENT_CLOSED, None  # until it ends otherwise
        try:
            async with aclosing(self._generate(request, context, tracker)) as chunks:
                async for chunk in chunks:
                    usage = chunk.usage if chunk.HasField("usage") else usage
                    yield chunk
            status = "200"
        except Exception as exc:
            status = str(http_error(exc)[0])  # as the REST API would answer
            raise
        finally:
            tracker.finish(status, convert.usage_from_pb(usage) if usage is not None else None)

    async def _generate(self, request: pb.InferenceRequest, context: grpc.aio.ServicerContext,
                        tracker: RequestTracker) -> AsyncGenerator[pb.InferenceChunk, None]:
        self._authenticate(context)
        if self.draining.active:
            raise Unavailable("the frontend is draining")
        body, kind = openai_body(request)
        parsed = parse_request(body, kind)
        priority = request.priority if request.HasField("priority") else None
        gen = await self.frontend.prepare(parsed, context.time_remaining(), priority)
        echo_id = request.request_id or gen.request_id
        deltas = self.frontend.generate(gen)
        sent_metadata = False
        try:
            async for delta in deltas:
                tracker.first_token()
                if not sent_metadata and delta.worker is not None:
                    await context.send_initial_metadata((
                        ("x-tandem-decode-worker", delta.worker.worker_id),
                        ("x-tandem-pool", delta.worker.pool)))
                    sent_metadata = True
                chunk = pb.InferenceChunk(request_id=echo_id, text=delta.text,
                                          token_ids=delta.token_ids)
                if delta.logprobs:
                    chunk.logprobs.extend(convert.logprob_to_pb(lp) for lp in delta.logprobs)
                if delta.finish_reason is not None:
                    chunk.finish_reason = convert.finish_to_pb(delta.finish_reason)
                    if delta.usage is not None:
                        chunk.usage.CopyFrom(convert.usage_to_pb(delta.usage))
                yield chunk
        finally:
            await deltas.aclose()

    async def ListModels(self, request: pb.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        self._authenticate(context)
        model = self.frontend.model
        return pb.ListModelsResponse(models=[pb.ModelCard(id=model.name,
                                                          max_model_len=model.max_model_len)])

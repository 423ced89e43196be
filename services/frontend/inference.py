"""The public gRPC Inference API: same semantics as the REST API, through the same validation
(the request becomes an OpenAI body and goes through parse_request, see inference_body) and the
same output parsers (reasoning and tool calls split out of a chat answer's text)."""
from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

import grpc

from services.frontend.first_delta import marking_first
from services.frontend.inference_body import openai_body
from tandem.engines.types import FinishReason, Usage
from tandem.errors import Unavailable
from tandem.frontend.auth import ApiKeys
from tandem.frontend.chat_output import ChatOutput
from tandem.frontend.choices import total_usage
from tandem.frontend.errors import http_error
from tandem.frontend.metrics import CLIENT_CLOSED, RequestTracker
from tandem.frontend.openai_request import parse_request
from tandem.frontend.parsers import ToolCallStart
from tandem.frontend.pipeline import Delta
from tandem.frontend.served_models import ServedModels
from tandem.runtime import convert
from tandem.runtime.draining import Draining
from tandem.v1 import common_pb2, inference_pb2_grpc
from tandem.v1 import inference_pb2 as pb

__all__ = ["InferenceServicer", "openai_body"]

class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, models: ServedModels, draining: Draining,
                 api_keys: ApiKeys | None = None) -> None:
        self.models = models
        self.draining = draining
        self.api_keys = api_keys or ApiKeys(())

    def _authenticate(self, context: grpc.aio.ServicerContext) -> None:
        """Raises Unauthenticated (UNAUTHENTICATED) without a valid `authorization` key."""
        values = [str(v) for k, v in context.invocation_metadata() or () if k == "authorization"]
        self.api_keys.check(values[0] if values else None)

    async def Generate(self, request: pb.InferenceRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncGenerator[pb.InferenceChunk, None]:
        tracker = self.models.default.pipeline.metrics.track("grpc_generate")
        status = CLIENT_CLOSED  # until it ends otherwise
        usage: dict[int, Usage] = {}  # of each answer that finished
        try:
            async with aclosing(self._generate(request, context, tracker)) as chunks:
                async for chunk in chunks:
                    if chunk.HasField("usage"):
                        usage[chunk.index] = convert.usage_from_pb(chunk.usage)
                    yield chunk
            status = "200"
        except Exception as exc:
            status = str(http_error(exc)[0])  # as the REST API would answer
            raise
        finally:
            tracker.finish(status, total_usage(usage))

    async def _generate(self, request: pb.InferenceRequest, context: grpc.aio.ServicerContext,
                        tracker: RequestTracker) -> AsyncGenerator[pb.InferenceChunk, None]:
        self._authenticate(context)
        if self.draining.active:
            raise Unavailable("the frontend is draining")
        body, kind = openai_body(request)
        parsed = parse_request(body, kind)
        frontend = self.models.get(parsed.model)
        tracker.relabel(frontend.pipeline.metrics)
        priority = request.priority if request.HasField("priority") else None
        gen = await frontend.prepare(parsed, context.time_remaining(), priority)
        echo_id = request.request_id or gen.request_id
        outputs = [frontend.chat_output(parsed) for _ in range(parsed.num_generated)]
        deltas = frontend.generate_choices(gen, parsed.num_generated)
        sent_metadata = False
        try:
            async for delta in marking_first(deltas, tracker):
                if not sent_metadata and delta.worker is not None:
                    await context.send_initial_metadata((
                        ("x-tandem-decode-worker", delta.worker.worker_id),
                        ("x-tandem-pool", delta.worker.pool)))
                    sent_metadata = True
                yield _chunk(echo_id, delta, outputs[delta.index])
        finally:
            await deltas.aclose()

    async def ListModels(self, request: pb.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        self._authenticate(context)
        return pb.ListModelsResponse(models=[
            pb.ModelCard(id=f.model.name, max_model_len=f.model.max_model_len)
            for f in self.models])


def _chunk(request_id: str, delta: Delta, output: ChatOutput) -> pb.InferenceChunk:
    """The chunk of one delta; the last one flushes what the output parsers held back."""
    chunk = pb.InferenceChunk(request_id=request_id, token_ids=delta.token_ids,
                              index=delta.index)
    if output.is_plain:
        chunk.text = delta.text
    else:
        out = output.feed(delta.text)
        if delta.finish_reason is not None:
            out.extend(output.finish())
        chunk.text, chunk.reasoning_text = out.content, out.reasoning
        chunk.tool_calls.extend(
            pb.ToolCallDelta(index=e.index, id=e.id, name=e.name)
            if isinstance(e, ToolCallStart) else pb.ToolCallDelta(index=e.index,
                                                                  arguments=e.fragment)
            for e in out.calls)
    if delta.logprobs:
        chunk.logprobs.extend(convert.logprob_to_pb(lp) for lp in delta.logprobs)
    if delta.finish_reason is not None:
        chunk.finish_reason = convert.finish_to_pb(delta.finish_reason)
        if output.num_calls and delta.finish_reason is not FinishReason.LENGTH:
            chunk.finish_reason = common_pb2.FINISH_REASON_TOOL_CALLS
        if delta.usage is not None:
            chunk.usage.CopyFrom(convert.usage_to_pb(delta.usage))
    return chunk

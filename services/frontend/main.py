"""`tandem serve frontend`: the OpenAI REST API and the public gRPC Inference API in one process."""
from __future__ import annotations

import logging
import os
import pathlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import start_http_server

from services.frontend.anthropic_routes import AnthropicRoutes
from services.frontend.config import MODEL_KINDS, FrontendConfig, ServedModelConfig
from services.frontend.embedding_routes import EmbeddingRoutes
from services.frontend.http_app import OpenAIRoutes, api_key_auth, json_errors
from services.frontend.inference import InferenceServicer
from services.frontend.responses_routes import ResponsesRoutes
from services.frontend.supervisor import supervise
from services.frontend.video_routes import VideoRoutes
from tandem.engines.guided.grammar import MAX_JSON_WHITESPACE
from tandem.engines.reference.pooling import Pooler
from tandem.errors import InvalidRequest
from tandem.frontend.admission import Admission
from tandem.frontend.auth import ApiKeys
from tandem.frontend.detokenizer import IncrementalDetokenizer
from tandem.frontend.embeddings import Embedder
from tandem.frontend.frontend import Frontend, ImageSupport, ModelInfo
from tandem.frontend.metrics import FrontendMetrics
from tandem.frontend.output_parsers import OutputParsers
from tandem.frontend.parsers import REASONING_PARSER_NAMES, TOOL_PARSER_NAMES
from tandem.frontend.pipeline import Pipeline
from tandem.frontend.prefill_gate import PrefillGate
from tandem.frontend.responses_store import ResponseStore
from tandem.frontend.served_models import ServedModels
from tandem.frontend.tokenizer import Tokenizer
from tandem.model.config import ModelConfig
from tandem.model.demo import ensure_demo_model
from tandem.multimodal.fetch import MediaFetcher
from tandem.multimodal.placeholders import ImagePlaceholders
from tandem.runtime import build_info, logs, loop, tracing
from tandem.runtime import config as config_lib
from tandem.runtime.clients import DecodeClients, EmbedClients, EncodeClients, PrefillClients
from tandem.runtime.router_client import RouterClient
from tandem.runtime.server import GrpcService, ServerOptions
from tandem.runtime.tls import http_ssl_context
from tandem.runtime.video_client import VideoWorkerClients
from tandem.v1 import inference_pb2_grpc
from tandem.video.frontend import VideoFrontend
from tandem.video.metrics import VideoFrontendMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrontendClients:
    """The frontend's connections, closed in this order at shutdown."""

    router: RouterClient
    decode: DecodeClients
    prefill: PrefillClients
    encode: EncodeClients
    #: None for a text-only model.
    media: MediaFetcher | None
    #: An embedding model's workers; None for a text model.
    embed: EmbedClients | None = None

    async def close(self) -> None:
        await self.router.close()  # flushes the last completion reports
        await self.decode.close()
        await self.prefill.close()
        await self.encode.close()
        if self.media is not None:
            await self.media.close()
        if self.embed is not None:
            await self.embed.close()


def output_parsers(served: ServedModelConfig, tokenizer: Tokenizer) -> OutputParsers:
    """--tool-call-parser and --reasoning-parser; InvalidRequest naming the flag for an
    unknown parser."""
    for param, name, known in (("tool_call_parser", served.tool_call_parser, TOOL_PARSER_NAMES),
                               ("reasoning_parser", served.reasoning_parser,
                                REASONING_PARSER_NAMES)):
        if name and name not in known:
            raise InvalidRequest(f"--{param.replace('_', '-')} {name!r} is not a parser; valid "
                                 f"names: {', '.join(known)}", param=param)
    return OutputParsers.build(served.tool_call_parser, served.reasoning_parser,
                               tokenizer.special_texts)


def served_models(config: FrontendConfig) -> list[ServedModelConfig]:
    """The models to serve: `models`, or the one the single-model flags describe.

    Raises:
        InvalidRequest: a listed model without a name or router address, or a name twice.
    """
    if not config.models:
        models = [ServedModelConfig(config.served_model_name, config.model, config.max_seq_len,
                                    config.router_address, config.tool_call_parser,
                                    config.reasoning_parser, config.model_kind)]
    else:
        models = list(config.models)
    if config.embedding_model:
        if not config.embedding_model_path:
            raise InvalidRequest("--embedding-model needs --embedding-model-path (its "
                                 "tokenizer)", param="embedding_model_path")
        models.append(ServedModelConfig(config.embedding_model, config.embedding_model_path,
                                        router_address=config.router_address,
                                        kind="embedding"))
    names: set[str] = set()
    for i, served in enumerate(config.models):
        for key in ("name", "router_address"):
            if not getattr(served, key):
                raise InvalidRequest(f"models[{i}].{key} must be set", param=f"models[{i}].{key}")
        if served.name in names:
            raise InvalidRequest(f"models[{i}].name {served.name!r} is listed twice",
                                 param=f"models[{i}].name")
        names.add(served.name)
    for i, served in enumerate(models):
        if served.kind not in MODEL_KINDS:
            where = f"models[{i}].kind" if config.models else "model_kind"
            raise InvalidRequest(f"{where} must be one of {', '.join(MODEL_KINDS)}, got "
                                 f"{served.kind!r}", param=where)
    return models


def build_frontends(config: FrontendConfig) -> tuple[ServedModels, list[FrontendClients]]:
    """Every served model's Frontend and connections. The models share one metrics registry
    (each its `model` label) and one admission budget. Call on the event loop."""
    if not 0 <= config.json_whitespace <= MAX_JSON_WHITESPACE:
        raise InvalidRequest(f"--json-whitespace must be 0 to {MAX_JSON_WHITESPACE}, got "
                             f"{config.json_whitespace}", param="json_whitespace")
    admission = Admission(config.max_inflight_requests, config.max_queued_requests)
    frontends: list[Frontend] = []
    clients: list[FrontendClients] = []
    for served in served_models(config):
        root = frontends[0].pipeline.metrics if frontends else None
        frontend, connections = build_frontend(config, served, admission, root)
        frontends.append(frontend)
        clients.append(connections)
    return ServedModels(frontends), clients


def build_frontend(config: FrontendConfig, served: ServedModelConfig, admission: Admission,
                   root_metrics: FrontendMetrics | None = None
                   ) -> tuple[Frontend, FrontendClients]:
    """One model's Frontend and connections (the media fetcher's HTTP session belongs to the
    running event loop). `root_metrics`: the metrics of another model of this process."""
    model_dir = pathlib.Path(served.model) if served.model else ensure_demo_model()
    model_config = ModelConfig.from_dir(model_dir)
    model = ModelInfo(served.name or model_dir.name,
                      served.max_seq_len or model_config.max_position_embeddings, served.kind)
    tokenizer = Tokenizer.from_dir(model_dir)
    tokenizer.warm()
    placeholders = ImagePlaceholders.from_dir(model_dir)
    media = MediaFetcher(config.media) if placeholders is not None else None
    metrics = (FrontendMetrics(model.name) if root_metrics is None
               else root_metrics.for_model(model.name))
    clients = FrontendClients(
        RouterClient(served.router_address, timeout_s=config.router_timeout_s,
                     max_local_prefill_length=config.max_local_prefill_length, tls=config.tls,
                     block_size=config.kv_block_size,
                     on_fallback=metrics.set_router_fallback,
                     on_fallback_route=metrics.count_fallback_route,
                     local_routing=config.local_routing,
                     on_local_route=metrics.count_local_route,
                     on_local_candidates=metrics.set_local_candidates),
        DecodeClients(config.tls, config.decode_sessions, metrics.observe_batch_hops),
        PrefillClients(config.tls),
        EncodeClients(model.name, config.tls), media,
        EmbedClients(model.name, config.tls) if served.kind == "embedding" else None)
    pipeline = Pipeline(clients.router, clients.decode,
                        lambda req: IncrementalDetokenizer(
                            tokenizer, req.prompt_token_ids, stop=req.stop,
                            skip_special_tokens=req.skip_special_tokens),
                        metrics, clients.prefill, clients.encode,
                        migration_limit=config.migration_limit,
                        prefill_gate=(PrefillGate(config.prefill_queue_tokens)
                                      if config.prefill_queue_tokens else None))
    images = (ImageSupport(placeholders, media, config.kv_block_size)
              if placeholders is not None and media is not None else None)
    frontend = Frontend(model, tokenizer, pipeline, config.request_timeout_s or None, images,
                        max_messages=config.max_messages, admission=admission,
                        parsers=output_parsers(served, tokenizer),
                        json_whitespace=config.json_whitespace,
                        embedder=None if clients.embed is None else Embedder(
                            tokenizer, model.max_model_len, clients.router, clients.embed,
                            Pooler.from_dir(model_dir, model_config.hidden_size)
                            .check_dimensions))
    return frontend, clients


async def serve(config: FrontendConfig) -> None:
    # Several processes share the ports: the pid tells their lines apart on a console.
    logs.setup("frontend", config.log_level, config.log_format,
               instance=str(os.getpid()) if config.reuse_port else "")
    tracing.setup("frontend")
    logs.log_config(log, config_lib.as_dict(config))
    api_keys = ApiKeys.load(config.api_keys, config.api_keys_file)
    ssl_context = http_ssl_context(config.tls, not config.http_no_client_cert)
    log.info("security", extra={"api_keys": api_keys.num_keys, "tls": config.tls.enabled,
                                "mtls": config.tls.require_client_cert,
                                "http_mtls": config.tls.require_client_cert
                                and not config.http_no_client_cert})
    models, connections = build_frontends(config)
    frontend = models.default  # its router also serves the video pool
    for clients in connections:
        clients.router.start()
    build_info.register(frontend.pipeline.metrics.registry, "frontend")
    if config.metrics_port:
        start_http_server(config.metrics_port, config.host,
                          registry=frontend.pipeline.metrics.registry)
    grpc_service = GrpcService(ServerOptions(config.host, config.grpc_port, config.grace_period_s,
                                             config.max_message_bytes, config.tls,
                                             config.reuse_port, config.own_grpc_port),
                               ["tandem.v1.Inference"])
    inference_pb2_grpc.add_InferenceServicer_to_server(
        InferenceServicer(models, grpc_service.draining, api_keys), grpc_service.server)

    app = web.Application(client_max_size=config.max_request_bytes,
                          middlewares=[json_errors, api_key_auth(api_keys)])
    routes = OpenAIRoutes(models, grpc_service.draining)
    routes.add_to(app)
    # Further APIs over the same models (each adds its routes):
    AnthropicRoutes(models, grpc_service.draining).add_to(app)
    EmbeddingRoutes(models, grpc_service.draining).add_to(app)
    ResponsesRoutes(models, grpc_service.draining,
                    ResponseStore(config.responses_store_size, config.reuse_port)).add_to(app)
    if config.video_model:
        video_routes = video_api(config, connections[0].router, grpc_service, frontend)
        video_routes.add_to(app)
        routes.extra_models.append(video_routes.model_entry())
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=config.grace_period_s)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.http_port, ssl_context=ssl_context,
                       reuse_port=config.reuse_port)
    await site.start()

    # runner.cleanup refuses new connections and waits for in-flight responses up to the grace
    # period, while the gRPC API drains too.
    grpc_service.on_drain(runner.cleanup)
    for clients in connections:
        grpc_service.on_close(clients.close)
    scheme = "https" if ssl_context is not None else "http"
    log.info("http listening", extra={"url": f"{scheme}://{config.host}:{config.http_port}"})
    await grpc_service.run()


def video_api(config: FrontendConfig, router: RouterClient, grpc_service: GrpcService,
              frontend: Frontend) -> VideoRoutes:
    """/v1/videos over the router's video pool; its connections close with the service."""
    workers = VideoWorkerClients(router.list_workers, config.tls)
    metrics = VideoFrontendMetrics(frontend.pipeline.metrics.registry)
    videos = VideoFrontend(config.video_model, router, workers, metrics)
    grpc_service.on_close(videos.close)
    grpc_service.on_close(workers.close)
    return VideoRoutes(videos, grpc_service.draining, metrics)


def main(argv: Sequence[str]) -> None:
    config = config_lib.load(FrontendConfig, argv, prog="tandem serve frontend",
                             description="Run the Tandem frontend (OpenAI REST + gRPC API).")
    if config.processes > 1:
        sys.exit(supervise(config, argv))
    loop.run(serve(config))

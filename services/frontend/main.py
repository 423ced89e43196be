"""`tandem serve frontend`: the OpenAI REST API and the public gRPC Inference API in one process."""
from __future__ import annotations

import logging
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web

from services.frontend.http_app import OpenAIRoutes, json_errors
from services.frontend.inference import InferenceServicer
from tandem.frontend.detokenizer import IncrementalDetokenizer
from tandem.frontend.frontend import Frontend, ModelInfo
from tandem.frontend.metrics import FrontendMetrics
from tandem.frontend.pipeline import Pipeline
from tandem.frontend.tokenizer import Tokenizer
from tandem.model.config import ModelConfig
from tandem.model.demo import ensure_demo_model
from tandem.runtime import build_info, logs, loop, tracing
from tandem.runtime import config as config_lib
from tandem.runtime.clients import DecodeClients, PrefillClients, RouterClient
from tandem.runtime.server import GrpcService, ServerOptions
from tandem.v1 import inference_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrontendConfig:
    host: str = "127.0.0.1"
    #: OpenAI REST API port.
    http_port: int = 8000
    #: Public gRPC Inference API port.
    grpc_port: int = 8001
    router_address: str = "127.0.0.1:9100"
    #: Model directory (tokenizer and config.json); empty: the generated demo model.
    model: str = ""
    #: Name clients pass as `model`; default: the model directory's name.
    served_model_name: str = ""
    #: Context length; 0: the model's max_position_embeddings.
    max_seq_len: int = 0
    #: Largest accepted HTTP request body, bytes.
    max_request_bytes: int = 32 * 1024 * 1024
    #: Longest a request may take end to end, seconds (then 504 / DEADLINE_EXCEEDED); 0: none.
    request_timeout_s: float = 0.0
    #: Longest wait for the router's answer, seconds.
    router_timeout_s: float = 10.0
    #: Conditional disaggregation (as TensorRT-LLM's disaggregated server): prompts whose part
    #: not cached on the decode worker is at most this many tokens skip the prefill worker.
    max_local_prefill_length: int = 0
    grace_period_s: float = 30.0
    log_level: str = "info"


def build_frontend(config: FrontendConfig
                   ) -> tuple[Frontend, RouterClient, DecodeClients, PrefillClients]:
    model_dir = pathlib.Path(config.model) if config.model else ensure_demo_model()
    model_config = ModelConfig.from_dir(model_dir)
    model = ModelInfo(config.served_model_name or model_dir.name,
                      config.max_seq_len or model_config.max_position_embeddings)
    tokenizer = Tokenizer.from_dir(model_dir)
    router = RouterClient(config.router_address, timeout_s=config.router_timeout_s,
                          max_local_prefill_length=config.max_local_prefill_length)
    decode = DecodeClients()
    prefill = PrefillClients()
    pipeline = Pipeline(router, decode,
                        lambda req: IncrementalDetokenizer(
                            tokenizer, req.prompt_token_ids, stop=req.stop,
                            skip_special_tokens=req.skip_special_tokens),
                        FrontendMetrics(model.name), prefill)
    frontend = Frontend(model, tokenizer, pipeline, config.request_timeout_s or None)
    return frontend, router, decode, prefill


async def serve(config: FrontendConfig) -> None:
    logs.setup("frontend", config.log_level)
    tracing.setup("frontend")
    log.info("config", extra={"config": config_lib.as_dict(config)})
    frontend, router, decode, prefill = build_frontend(config)
    build_info.register(frontend.pipeline.metrics.registry, "frontend")
    grpc_service = GrpcService(ServerOptions(config.host, config.grpc_port, config.grace_period_s),
                               ["tandem.v1.Inference"])
    inference_pb2_grpc.add_InferenceServicer_to_server(
        InferenceServicer(frontend, grpc_service.draining), grpc_service.server)

    app = web.Application(client_max_size=config.max_request_bytes, middlewares=[json_errors])
    OpenAIRoutes(frontend, grpc_service.draining).add_to(app)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=config.grace_period_s)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.http_port)
    await site.start()

    async def close_clients() -> None:
        await router.close()  # flushes the last completion reports
        await decode.close()
        await prefill.close()

    # runner.cleanup refuses new connections and waits for in-flight responses up to the grace
    # period, while the gRPC API drains too.
    grpc_service.on_drain(runner.cleanup)
    grpc_service.on_close(close_clients)
    log.info("http listening", extra={"url": f"http://{config.host}:{config.http_port}"})
    await grpc_service.run()


def main(argv: Sequence[str]) -> None:
    config = config_lib.load(FrontendConfig, argv, prog="tandem serve frontend",
                             description="Run the Tandem frontend (OpenAI REST + gRPC API).")
    loop.run(serve(config))

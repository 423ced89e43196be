"""The trtllm engine: TensorRT-LLM's LLM (PyTorch backend) behind Tandem's Engine interface.

Aggregated requests are plain streaming `generate_async`; `prefill` runs a context-only
request and returns TensorRT-LLM's DisaggregatedParams inside a KV handle (backend "trtllm");
a request with such a handle resumes as generation-only on the decode worker, TensorRT-LLM's
cache transceiver moving the KV (cache_transceiver_config must be set on both workers). KV
events and load come from polling the LLM (see poller.py). Encode workers (--encode-only) hold
a MultimodalEncoder instead.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from tandem.engines.args import EngineArgs
from tandem.engines.base import Engine, EventSink
from tandem.engines.stream import RequestStream
from tandem.engines.trtllm import disagg
from tandem.engines.trtllm.api import TrtllmApi, load_api
from tandem.engines.trtllm.args import LlmKwargs, build_llm_kwargs, with_kv_events
from tandem.engines.trtllm.canary import await_canary, bos_token
from tandem.engines.trtllm.checks import check_request
from tandem.engines.trtllm.encode import encode_images
from tandem.engines.trtllm.flight import Flight
from tandem.engines.trtllm.prefill import prefill_result
from tandem.engines.trtllm.sampling import guided_kwargs, sampling_kwargs
from tandem.engines.trtllm.telemetry import Telemetry
from tandem.engines.types import (
    Embedding,
    EngineRequest,
    EngineStats,
    KvLayout,
    PrefillResult,
    SamplingParams,
)
from tandem.errors import (
    FailedPrecondition,
    InvalidRequest,
    Overloaded,
    Unavailable,
    Unimplemented,
)
from tandem.model.config import ModelConfig
from tandem.runtime.tasks import spawn

log = logging.getLogger(__name__)

#: --guided-decoding-backend values the trtllm engine takes (TorchLlmArgs' Literal, plus none).
GUIDED_BACKENDS = ("xgrammar", "llguidance", "none")


class TrtllmEngine(Engine):
    """See the module docstring. All methods run on the worker's event loop."""

    name = "trtllm"

    def __init__(self, args: EngineArgs, api: TrtllmApi, llm_kwargs: LlmKwargs,
                 model: ModelConfig) -> None:
        super().__init__()
        self.args, self.api, self.model, self.llm_kwargs = args, api, model, llm_kwargs
        kv: Mapping[str, Any] = llm_kwargs.get("kv_cache_config") or {}
        dtype = next((d for d in (kv.get("dtype"), llm_kwargs.get("dtype"), model.dtype)
                      if d and d != "auto"), model.dtype)
        self._layout = KvLayout(str(dtype), model.num_layers, model.num_kv_heads,
                                model.head_size, int(kv.get("tokens_per_block", 32)))
        self._max_model_len = int(llm_kwargs.get("max_seq_len") or model.max_position_embeddings)
        transceiver = llm_kwargs.get("cache_transceiver_config") or {}
        self._transfer_timeout_ms = transceiver.get("kv_transfer_timeout_ms")
        self._has_transceiver = bool(llm_kwargs.get("cache_transceiver_config"))
        #: Requests admitted at once: TensorRT-LLM's batch plus Tandem's waiting allowance.
        self._max_in_flight = (int(llm_kwargs.get("max_batch_size") or args.max_batch_size)
                               + args.max_queued_requests)
        self.telemetry = Telemetry(self._layout.block_size, self._publish)
        self._llm: Any = None
        self._events_on = False
        self._closed = False
        self._flights: dict[str, Flight] = {}
        self._prefills: dict[str, Any] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._num_encoded_images = 0

    @property
    def layout(self) -> KvLayout:
        return self._layout

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    async def start(self) -> None:
        """Builds the LLM (or MultimodalEncoder). KV events are turned on when an event sink is
        set before start: TensorRT-LLM fixes its event buffer when the LLM is built."""
        if self._llm is not None:
            return
        kwargs = dict(self.llm_kwargs)
        ctor = self.api.MultimodalEncoder if self.args.encode_only else self.api.LLM
        if self.args.encode_only:
            kwargs["skip_tokenizer_init"] = False  # its input processor applies placeholders
        elif self._event_sink is not None:
            self._events_on = True
            kwargs = with_kv_events(kwargs)
        model = kwargs.pop("model", self.args.model)
        log.info("starting TensorRT-LLM %s %s", self.api.version, ctor.__name__,
                 extra={"llm_args": kwargs})
        try:
            self._llm = ctor(model=model, **kwargs)
        except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
            raise InvalidRequest(f"TensorRT-LLM rejected the engine args: {exc}",
                                 param="engine") from exc

    def set_event_sink(self, sink: EventSink | None) -> None:
        super().set_event_sink(sink)
        if sink is not None and self._llm is not None and not self._events_on:
            log.warning("trtllm engine: an event sink was set after start(); TensorRT-LLM was "
                        "built without a KV event buffer and will publish no KV events")

    # ---- requests ----------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> RequestStream:
        self._admit(request)
        params = None
        if request.kv_handle is not None:
            self._require_transceiver()
            assert request.kv_handle.trtllm_params is not None  # check_request made sure
            params = disagg.generation_only(self.api, request.kv_handle.trtllm_params)
        result = self._submit(list(request.prompt_token_ids), request.sampling, True, params)
        flight = Flight(request, result, defer_abort=params is not None)
        self._flights[request.request_id] = flight
        spawn(self._run_flight(flight), self._tasks)
        return flight.stream

    async def _run_flight(self, flight: Flight) -> None:
        try:
            await flight.drive()
        finally:
            self._flights.pop(flight.request.request_id, None)

    def abort(self, request_id: str) -> bool:
        """Ends the request's stream CANCELLED at once. TensorRT-LLM frees its blocks after
        the abort reaches its executor; for a decode request still receiving KV the abort is
        deferred until the transfer completed (see flight.py)."""
        flight = self._flights.get(request_id)
        if flight is not None:
            return flight.cancel()
        result = self._prefills.get(request_id)
        if result is not None:
            result.abort()
            return True
        return False

    def stats(self) -> EngineStats:
        stats = self.telemetry.stats(len(self._flights) + len(self._prefills))
        return dataclasses.replace(stats, num_encoded_images=self._num_encoded_images)

    async def prefill(self, request: EngineRequest, lease_ms: int) -> PrefillResult:
        """Runs the prompt as a context-only request. The KV handle carries TensorRT-LLM's
        DisaggregatedParams; the result has a finish_reason and no handle when the first token
        ended the request: EOS or a stop token (TensorRT-LLM then sends no KV), or max_tokens 1
        (then run as a whole request, so that no KV waits for a decode leg that will not come).
        `lease_ms` is not used: TensorRT-LLM keeps the blocks until the decode worker pulls
        them, or for cache_transceiver_config.kv_transfer_timeout_ms."""
        if request.kv_handle is not None:
            raise InvalidRequest("a prefill request carries no KV handle", param="kv_handle")
        self._admit(request)
        self._require_transceiver()
        whole = request.sampling.max_tokens == 1
        disagg_id = None if whole else disagg.new_disagg_request_id()
        params = (disagg.whole_request(self.api) if disagg_id is None
                  else disagg.context_only(self.api, disagg_id))
        result = self._submit(list(request.prompt_token_ids), request.sampling, False, params)
        self._prefills[request.request_id] = result
        try:
            await self._wait(result)
        except asyncio.CancelledError:
            result.abort()
            raise
        except Exception as exc:  # RequestError: this request failed in TensorRT-LLM
            raise Unavailable(f"TensorRT-LLM failed to prefill '{request.request_id}': "
                              f"{exc}") from exc
        finally:
            self._prefills.pop(request.request_id, None)
        return prefill_result(result, request, self._layout, disagg_id,
                              self._transfer_timeout_ms)

    async def release(self, request_id: str) -> bool:
        """Always False: Tandem holds no lease on a TensorRT-LLM prefill. The cache transceiver
        owns the blocks until the decode worker pulls them or kv_transfer_timeout_ms passes,
        and aborting a context request whose KV is committed is a no-op upstream."""
        return False

    async def encode(self, images: Sequence[bytes]) -> list[Embedding]:
        if not self.args.encode_only:
            raise Unimplemented("this trtllm worker holds the LLM, not the multimodal encoder "
                                "(start encode workers with --encode-only)")
        embeddings = await encode_images(self.api, self._require_llm(), self.args.model, images)
        self._num_encoded_images += len(embeddings)
        return embeddings

    async def health_canary(self, timeout_s: float = 30.0) -> None:
        """Proves forward progress: a one-token greedy request run whole on this worker
        (request_type "context_and_generation" where a cache transceiver is configured, so a
        prefill or decode worker needs no peer). A no-op on encode workers.

        Raises:
            Unavailable: the engine failed the request, or produced no token in time.
        """
        if self.args.encode_only:
            return
        result = self._submit([bos_token(self.args.model)],
                              SamplingParams(max_tokens=1, temperature=0.0), False,
                              disagg.whole_request(self.api) if self._has_transceiver else None)
        await await_canary(result, timeout_s)

    async def close(self) -> None:
        self._closed = True
        for flight in list(self._flights.values()):
            flight.cancel()
        for result in list(self._prefills.values()):
            result.abort()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.telemetry.close()
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    # ---- helpers -----------------------------------------------------------------------------

    def _require_llm(self) -> Any:
        if self._closed or self._llm is None:
            raise Unavailable("the trtllm engine is " + ("closed" if self._closed
                                                         else "not started"))
        return self._llm

    def _require_transceiver(self) -> None:
        if not self._has_transceiver:
            raise FailedPrecondition(
                "disaggregated prefill/decode on TensorRT-LLM needs its cache transceiver: set "
                "cache_transceiver_config (e.g. {backend: DEFAULT}) in --extra-engine-args on "
                "prefill and decode workers", param="engine")

    def _admit(self, request: EngineRequest) -> None:
        self._require_llm()
        if self.args.encode_only:
            raise Unimplemented("this trtllm worker holds only the multimodal encoder")
        rid = request.request_id
        if rid in self._flights or rid in self._prefills:
            raise InvalidRequest(f"request id '{rid}' is already in flight", param="request_id")
        check_request(request, self._layout, self._max_model_len, self.model.vocab_size,
                      self.args.guided_decoding_backend)
        if len(self._flights) + len(self._prefills) >= self._max_in_flight:
            raise Overloaded(f"{self._max_in_flight} requests are in flight on this worker; "
                             "retry later")

    def _submit(self, prompt: list[int], sampling: SamplingParams, streaming: bool,
                params: Any) -> Any:
        llm = self._require_llm()
        kwargs = sampling_kwargs(sampling, self.model.eos_token_ids)
        try:
            if sampling.guided is not None:
                kwargs["guided_decoding"] = self.api.GuidedDecodingParams(
                    **guided_kwargs(sampling.guided))
            result = llm.generate_async(prompt, self.api.SamplingParams(**kwargs),
                                        streaming=streaming, disaggregated_params=params)
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(f"TensorRT-LLM rejected the request: {exc}") from exc
        except RuntimeError as exc:  # "LLM is shutting down"
            raise Unavailable(f"TensorRT-LLM cannot take requests: {exc}") from exc
        self.telemetry.start(llm, self._events_on)
        return result

    @staticmethod
    async def _wait(result: Any) -> None:
        await result



def create_trtllm_engine(args: EngineArgs) -> TrtllmEngine:
    """Imports TensorRT-LLM, merges and checks the engine args (before anything starts).

    Raises:
        Unavailable: TensorRT-LLM is not installed.
        InvalidRequest: a bad flag, YAML file or JSON override, naming the key.
    """
    if args.guided_decoding_backend not in GUIDED_BACKENDS:
        raise InvalidRequest(f"guided_decoding_backend must be one of "
                             f"{', '.join(GUIDED_BACKENDS)} for the trtllm engine, got "
                             f"'{args.guided_decoding_backend}'",
                             param="guided_decoding_backend")
    api = load_api()
    model = ModelConfig.from_dir(args.model)
    kwargs = build_llm_kwargs(args, api.TorchLlmArgs)
    for name in ("max_batch_size", "max_num_tokens", "max_queued_requests"):
        if getattr(args, name) < 1:
            raise InvalidRequest(f"{name} must be at least 1, got {getattr(args, name)}",
                                 param=name)
    return TrtllmEngine(args, api, kwargs, model)

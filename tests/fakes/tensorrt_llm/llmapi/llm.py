"""Fake of tensorrt_llm/llmapi/llm.py (NVIDIA/TensorRT-LLM @ 4c05a748): `LLM` is the PyTorch
backend LLM (`class LLM(_TorchLLM)`).

Kept from upstream: the constructor signature; unknown keyword arguments raise
`ValueError("LLM got invalid argument: <key>")` before the pydantic TorchLlmArgs validates the
rest (nested dicts such as kv_cache_config are validated by their StrictBaseModel, unknown
nested keys rejected); `generate_async(inputs, sampling_params=None, lora_request=None,
prompt_adapter_request=None, streaming=False, kv_cache_retention_config=None,
disaggregated_params=None, _postproc_params=None, scheduling_params=None, cache_salt=None)`
returns a RequestOutput at once; a context-only request has its max_tokens forced to 1; end_id
must be given when the tokenizer is skipped; on the PyTorch backend a prompt longer than
max_num_tokens is rejected unless chunked prefill is on (generation-only requests exempt);
`get_stats_async(timeout=2)` / `get_kv_cache_events_async(timeout=2)` return IterationResults
that exist only once a request was submitted (stats: an empty iterable before; KV events: an
AssertionError before); `shutdown()`. With `guided_decoding_backend` set the LLM needs its
tokenizer (upstream's create_py_executor asserts one, so `skip_tokenizer_init=True` fails with
an AssertionError) and builds a guided decoder (tensorrt_llm._fake.guided).
"""
from __future__ import annotations

import json
import pathlib
from typing import Any

from tensorrt_llm._fake.executor import FakeExecutor
from tensorrt_llm._fake.guided import FakeGuidedDecoder
from tensorrt_llm._fake.request import FakeRequest
from tensorrt_llm.disaggregated_params import DisaggregatedParams
from tensorrt_llm.executor.result import EmptyAsyncIterable, GenerationResult, IterationResult
from tensorrt_llm.llmapi.disagg_utils import MAX_GLOBAL_ID, MIN_GLOBAL_ID
from tensorrt_llm.llmapi.llm_args import TorchLlmArgs
from tensorrt_llm.sampling_params import SamplingParams


class RequestOutput(GenerationResult):
    @property
    def prompt(self) -> str | None:
        return None


class _FakeTokenizer:
    def __init__(self, eos_token_id: int) -> None:
        self.eos_token_id = eos_token_id


def _read_model(path: str) -> dict[str, Any]:
    config_file = pathlib.Path(path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"the fake LLM needs a local model directory with config.json: {path}")
    raw = json.loads(config_file.read_text())
    text: dict[str, Any] = raw.get("text_config", raw)
    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    return {"vocab_size": int(text["vocab_size"]),
            "eos": eos[0] if isinstance(eos, list) else eos,
            "max_position_embeddings": int(text.get("max_position_embeddings", 4096)),
            "hidden_size": int(text.get("hidden_size", 64)),
            "model_type": raw.get("model_type", "llama")}


class LLM:
    def __init__(self, model: str | pathlib.Path, tokenizer: Any = None,
                 tokenizer_mode: str = "auto", skip_tokenizer_init: bool = False,
                 trust_remote_code: bool = False, tensor_parallel_size: int = 1,
                 dtype: str = "auto", revision: str | None = None,
                 tokenizer_revision: str | None = None, **kwargs: Any) -> None:
        kwargs.pop("backend", "pytorch")
        valid = set(TorchLlmArgs.model_fields) | {"_mpi_session", "backend"}
        for key in kwargs:
            if key not in valid:
                raise ValueError(f"{self.__class__.__name__} got invalid argument: {key}")
        self.args = TorchLlmArgs(
            model=model, tokenizer=tokenizer, tokenizer_mode=tokenizer_mode,
            skip_tokenizer_init=skip_tokenizer_init, trust_remote_code=trust_remote_code,
            tensor_parallel_size=tensor_parallel_size, dtype=dtype, revision=revision,
            tokenizer_revision=tokenizer_revision, **kwargs)
        self._model = _read_model(str(model))
        self._tokenizer = None if skip_tokenizer_init else _FakeTokenizer(self._model["eos"])
        guided = None
        if self.args.guided_decoding_backend is not None:
            assert self._tokenizer is not None  # upstream: get_guided_decoding_config
            guided = FakeGuidedDecoder(str(model), self._model["vocab_size"], self._model["eos"])
        self._executor: FakeExecutor | None = FakeExecutor(
            self.args, self._model["vocab_size"],
            self.args.max_seq_len or self._model["max_position_embeddings"], guided)

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def generate_async(self, inputs: Any, sampling_params: SamplingParams | None = None,
                       lora_request: Any = None, prompt_adapter_request: Any = None,
                       streaming: bool = False, kv_cache_retention_config: Any = None,
                       disaggregated_params: DisaggregatedParams | None = None,
                       _postproc_params: Any = None, scheduling_params: Any = None,
                       cache_salt: str | None = None) -> RequestOutput:
        if self._executor is None:
            raise RuntimeError("LLM is shutting down")
        sampling_params = self._prepare_sampling_params(sampling_params)
        kind = (disaggregated_params.request_type if disaggregated_params is not None
                and disaggregated_params.request_type else "context_and_generation")
        if kind == "context_only":
            sampling_params.max_tokens = 1
        prompt = self._prompt_token_ids(inputs)
        self._check_arguments(len(prompt), sampling_params, kind == "generation_only")
        request_id = self._executor.next_request_id()
        if disaggregated_params is not None:
            request_id = self._check_disagg(kind, disaggregated_params, request_id)
        result = RequestOutput(request_id, sampling_params, self._executor, streaming,
                               disaggregated_params, prompt)
        self._executor.submit(FakeRequest(request_id, kind, prompt, sampling_params, result,
                                          streaming, disaggregated_params, tokens=list(prompt)))
        return result

    def get_stats_async(self, timeout: float | None = 2) -> IterationResult | EmptyAsyncIterable:
        assert self._executor is not None
        if self._executor.stats is None:
            return EmptyAsyncIterable()
        self._executor.stats.set_timeout(timeout)
        return self._executor.stats

    def get_kv_cache_events_async(self, timeout: float | None = 2) -> IterationResult:
        assert self._executor is not None
        events = self._executor.kv_events
        assert events is not None, "KV Event IterationResult is not properly instantiated."
        events.set_timeout(timeout)
        return events

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> bool:
        self.shutdown()
        return False

    # ---- helpers (upstream names) ------------------------------------------------------------

    def _prepare_sampling_params(self, sampling_params: SamplingParams | None) -> SamplingParams:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError("The sampling_params must be type SamplingParams or None, but got "
                            f"{type(sampling_params)}")
        if sampling_params.end_id is None:
            if self._tokenizer is None:
                raise ValueError("tokenizer is required to reset end_id if it is None, or you "
                                 "can explicitly specify the end_id for sampling_params")
            sampling_params.end_id = sampling_params.pad_id = self._tokenizer.eos_token_id
        return sampling_params

    @staticmethod
    def _prompt_token_ids(inputs: Any) -> list[int]:
        if isinstance(inputs, dict) and "prompt_token_ids" in inputs:
            inputs = inputs["prompt_token_ids"]
        if isinstance(inputs, list) and all(isinstance(t, int) for t in inputs):
            return list(inputs)
        raise TypeError(f"The inputs must be type str or list of int, but got {type(inputs)} "
                        "(and the fake has no tokenizer for text prompts)")

    def _check_arguments(self, prompt_len: int, sampling_params: SamplingParams,
                         is_gen_only: bool) -> None:
        max_num_tokens = self.args.max_num_tokens
        if (not self.args.enable_chunked_prefill and not is_gen_only and max_num_tokens
                and prompt_len > max_num_tokens):
            raise ValueError(f"The sum of prompt length ({prompt_len}), query length (0) should "
                             f"not exceed max_num_tokens ({max_num_tokens})")

    def _check_disagg(self, kind: str, params: DisaggregatedParams, local_id: int) -> int:
        if kind != "context_and_generation" and self.args.cache_transceiver_config is None:
            raise ValueError(f"a {kind} request needs cache_transceiver_config (no KV cache "
                             "transceiver was created)")
        if kind == "generation_only" and (not params.first_gen_tokens or not params.opaque_state
                                          or params.ctx_request_id is None):
            raise ValueError("a generation_only request needs first_gen_tokens, opaque_state "
                             "and ctx_request_id from the context response")
        request_id = params.disagg_request_id
        if request_id is None:
            return local_id
        if not MIN_GLOBAL_ID <= request_id <= MAX_GLOBAL_ID:
            raise ValueError(f"disagg_request_id {request_id} is outside the global id range "
                             f"[{MIN_GLOBAL_ID}, 2^63)")
        return request_id

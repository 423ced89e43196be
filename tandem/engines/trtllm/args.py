"""TensorRT-LLM engine arguments: Tandem's flags, then `--extra-engine-args FILE.yaml`, then
`--override-engine-args JSON`, merged deeply, every key checked against TensorRT-LLM's own
schema before the engine starts.

Layering follows Dynamo's worker (components/src/dynamo/trtllm/main.py: flags, then
update_llm_args_with_extra_options, then deep_update with the JSON override), except that the
YAML layer merges deeply too: upstream's update_llm_args_with_extra_dict merges only
kv_cache_config key by key (tensorrt_llm/llmapi/llm_args.py) and replaces every other nested
config whole.
"""
from __future__ import annotations

import copy
import difflib
import json
import logging
import pathlib
import types
import typing
from collections.abc import Mapping
from typing import Any

import yaml

from tandem.engines.args import EngineArgs
from tandem.engines.trtllm.speculative import to_llm_speculative_config
from tandem.errors import InvalidRequest

log = logging.getLogger(__name__)

#: KV event buffer when the worker publishes events and the user set none (Dynamo's
#: DEFAULT_KV_EVENT_BUFFER_MAX_SIZE). Upstream's default, 0, turns events off.
DEFAULT_EVENT_BUFFER_MAX_SIZE = 1024

#: How long a prefill worker's KV waits for its decode worker when the user set no
#: cache_transceiver_config.kv_transfer_timeout_ms: Tandem's default --kv-lease-ms. Upstream's
#: default (None) waits forever, and Tandem cannot free a committed context request's KV
#: otherwise (aborting it is a no-op upstream: ai-dynamo/dynamo#14507).
DEFAULT_KV_TRANSFER_TIMEOUT_MS = 30_000

LlmKwargs = dict[str, Any]


def from_flags(args: EngineArgs) -> LlmKwargs:
    """The LLM keyword arguments Tandem's own flags stand for."""
    kv: dict[str, Any] = {
        "tokens_per_block": args.kv_block_size,
        "free_gpu_memory_fraction": args.free_gpu_memory_fraction,
        "enable_block_reuse": args.enable_prefix_caching,
    }
    if args.num_gpu_blocks:
        kv["max_tokens"] = args.num_gpu_blocks * args.kv_block_size
    if args.kv_cache_dtype != "auto":  # KvCacheConfig.dtype: "auto" or "fp8", as ours
        kv["dtype"] = args.kv_cache_dtype
    if args.quantization != "auto":
        raise InvalidRequest("--quantization fp8 quantizes while loading in the reference "
                             "engine only; TensorRT-LLM reads a checkpoint's own "
                             "quantization (hf_quant_config.json, quantization_config): serve "
                             "an FP8 checkpoint", param="quantization")
    if args.kv_host_cache_bytes:
        # TensorRT-LLM's own host tier (a secondary block pool; onboard_blocks, True by
        # default, brings hits back to the GPU): the same bytes, the same meaning.
        kv["host_cache_size"] = args.kv_host_cache_bytes
    out: LlmKwargs = {
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "enable_attention_dp": args.enable_attention_dp,
        "max_batch_size": args.max_batch_size,
        "max_num_tokens": args.max_num_tokens,
        "max_beam_width": args.max_beam_width,
        "load_format": args.load_format,
        "dtype": args.dtype,
        "kv_cache_config": kv,
        # Workers are token-in, token-out: the frontend tokenizes (as Dynamo's worker does).
        "skip_tokenizer_init": True,
        # Load reports come from iteration stats, which the PyTorch backend only collects on ask.
        "enable_iter_perf_stats": True,
    }
    if args.expert_parallel_size:
        out["moe_expert_parallel_size"] = args.expert_parallel_size
    if args.max_seq_len:
        out["max_seq_len"] = args.max_seq_len
    if args.enforce_eager:
        out["cuda_graph_config"] = None
    if args.disable_overlap_scheduler:
        out["disable_overlap_scheduler"] = True
    if args.batch_wait_timeout_ms > 0:
        out["batch_wait_timeout_ms"] = args.batch_wait_timeout_ms
    if args.guided_decoding_backend != "none":
        out["guided_decoding_backend"] = args.guided_decoding_backend
        # Upstream builds its grammar backend from the LLM's tokenizer (create_py_executor
        # asserts one), so the tokenizer is loaded; Tandem still sends token ids and asks for
        # no detokenization.
        out["skip_tokenizer_init"] = False
    if args.speculative_config:
        out["speculative_config"] = to_llm_speculative_config(args.speculative_config)
    return out


def load_yaml(path: str) -> LlmKwargs:
    file = pathlib.Path(path)
    if not file.is_file():
        raise InvalidRequest(f"--extra-engine-args: no such file {path}", param="extra_engine_args")
    try:
        values = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        raise InvalidRequest(f"--extra-engine-args {path} is not valid YAML: {exc}",
                             param="extra_engine_args") from exc
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise InvalidRequest(f"--extra-engine-args {path} must hold a mapping of LLM API "
                             "options", param="extra_engine_args")
    return values


def parse_override(text: str) -> LlmKwargs:
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"--override-engine-args is not valid JSON: {exc}",
                             param="override_engine_args") from exc
    if not isinstance(values, dict):
        raise InvalidRequest("--override-engine-args must be a JSON object",
                             param="override_engine_args")
    return values


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> LlmKwargs:
    """`override` over `base`; dicts under the same key merge recursively, the rest replaces."""
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def check_keys(values: Mapping[str, Any], schema: Any, source: str, param: str,
               prefix: str = "") -> None:
    """Rejects a key the pydantic model `schema` (TorchLlmArgs) does not know, recursing into
    nested config models (kv_cache_config, cache_transceiver_config, ...).

    Raises:
        InvalidRequest: naming the dotted key, where it came from, and the nearest known keys.
    """
    fields: Mapping[str, Any] = schema.model_fields
    known = set(fields) | {f.alias for f in fields.values() if getattr(f, "alias", None)}
    for key, value in values.items():
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            raise InvalidRequest(f"unknown TensorRT-LLM engine arg '{prefix}{key}' in {source} "
                                 f"(TensorRT-LLM's {schema.__name__} has no such field){hint}",
                                 param=param)
        nested = _nested_model(fields[key].annotation) if key in fields else None
        if nested is not None and isinstance(value, Mapping):
            check_keys(value, nested, source, param, f"{prefix}{key}.")


def _nested_model(annotation: Any) -> Any:
    """The one pydantic model class an annotation (Optional, Union, Annotated) allows, else
    None (discriminated unions such as speculative_config: see `_nested_models`)."""
    found = _nested_models(annotation)
    return found[0] if len(found) == 1 else None


def _nested_models(annotation: Any) -> list[Any]:
    """Every pydantic model class an annotation (Optional, Union, Annotated) allows."""
    found: list[Any] = []

    def visit(tp: Any) -> None:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            visit(typing.get_args(tp)[0])
        elif origin in (typing.Union, types.UnionType):
            for arg in typing.get_args(tp):
                visit(arg)
        elif isinstance(tp, type) and hasattr(tp, "model_fields"):
            found.append(tp)

    visit(annotation)
    return found


def check_nested_values(values: Mapping[str, Any], schema: Any) -> None:
    """Validates each nested config dict (kv_cache_config, ...) with its own pydantic model (a
    union's, such as speculative_config's, by its discriminator), so that a wrong value fails
    here rather than when the LLM is built. The top-level model is not
    built here: its validators look at the GPU.

    Raises:
        InvalidRequest: naming the config and pydantic's complaint.
    """
    for key, value in values.items():
        if key not in schema.model_fields or not isinstance(value, Mapping):
            continue
        annotation = schema.model_fields[key].annotation
        models = _nested_models(annotation)
        try:
            if len(models) == 1:
                models[0].model_validate(dict(value))
            elif models:
                # A union of configs (speculative_config: one per decoding_type): pydantic
                # picks the member by its discriminator, as the LLM will.
                from pydantic import TypeAdapter

                TypeAdapter(annotation).validate_python(dict(value))
        except ValueError as exc:  # pydantic.ValidationError
            errors = exc.errors() if hasattr(exc, "errors") else []
            detail = "; ".join(
                f"'{'.'.join([key, *map(str, e.get('loc', ()))])}': {e.get('msg')} "
                f"(got {e.get('input')!r})" for e in errors) or f"'{key}': {exc}"
            raise InvalidRequest(f"bad TensorRT-LLM engine arg {detail}",
                                 param="engine") from exc


def build_llm_kwargs(args: EngineArgs, schema: Any) -> LlmKwargs:
    """Flags, then the YAML file, then the JSON override, each layer's keys checked, then the
    nested configs of the result validated."""
    layers: list[tuple[LlmKwargs, str, str]] = [
        (from_flags(args), "Tandem's engine flags (the installed TensorRT-LLM is too old?)",
         "engine")]
    if args.extra_engine_args:
        layers.append((load_yaml(args.extra_engine_args),
                       f"--extra-engine-args {args.extra_engine_args}", "extra_engine_args"))
    if args.override_engine_args:
        layers.append((parse_override(args.override_engine_args), "--override-engine-args",
                       "override_engine_args"))
    merged: LlmKwargs = {}
    for values, source, param in layers:
        check_keys(values, schema, source, param)
        if args.speculative_config and param != "engine" and "speculative_config" in values:
            # Merged key by key, the two would make one config of two methods' settings.
            raise InvalidRequest(f"speculative decoding is set twice: by --speculative-config "
                                 f"and by speculative_config in {source}; give one of them",
                                 param="speculative_config")
        merged = deep_merge(merged, values)
    check_nested_values(merged, schema)
    _default_transfer_timeout(merged, schema)
    for key in ("max_seq_len", "max_batch_size", "max_num_tokens"):
        if merged.get(key) is not None and not isinstance(merged[key], int):
            raise InvalidRequest(f"TensorRT-LLM engine arg '{key}' must be an integer, got "
                                 f"{merged[key]!r}", param="engine")
    return merged


def _default_transfer_timeout(merged: LlmKwargs, schema: Any) -> None:
    transceiver = merged.get("cache_transceiver_config")
    if not isinstance(transceiver, dict) or transceiver.get("kv_transfer_timeout_ms"):
        return
    model = _nested_model(schema.model_fields["cache_transceiver_config"].annotation)
    if model is not None and "kv_transfer_timeout_ms" in model.model_fields:
        transceiver["kv_transfer_timeout_ms"] = DEFAULT_KV_TRANSFER_TIMEOUT_MS


def with_kv_events(kwargs: Mapping[str, Any]) -> LlmKwargs:
    """Turns TensorRT-LLM's KV events on (as llm.py's get_kv_cache_events docstring asks:
    event_buffer_max_size > 0 and enable_block_reuse), keeping a buffer size the user chose."""
    out = deep_merge(kwargs, {})
    kv = out.get("kv_cache_config")
    if not isinstance(kv, dict):
        kv = out["kv_cache_config"] = {}
    if not kv.get("event_buffer_max_size"):
        kv["event_buffer_max_size"] = DEFAULT_EVENT_BUFFER_MAX_SIZE
    if kv.get("enable_block_reuse") is False:
        log.warning("kv_cache_config.enable_block_reuse is false: TensorRT-LLM publishes no "
                    "stored/removed KV events without block reuse, so KV-aware routing sees "
                    "no prefixes on this worker")
    else:
        kv["enable_block_reuse"] = True
    return out

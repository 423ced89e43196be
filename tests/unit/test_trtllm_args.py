"""trtllm engine args: flags -> --extra-engine-args YAML -> --override-engine-args JSON, merged
deeply, unknown keys rejected by name before the engine starts; KV-event settings; the error
when TensorRT-LLM is missing. Runs against the fake TensorRT-LLM (tests/fakes)."""
from __future__ import annotations

import json
import logging
import pathlib
import sys

import pytest

from tandem.engines.args import EngineArgs
from tandem.errors import InvalidRequest, Unavailable
from tests.unit.fake_packages import fake_trtllm  # noqa: F401 (autouse: tensorrt_llm is the fake)


def _schema():  # noqa: ANN202 - the fake's pydantic TorchLlmArgs
    from tensorrt_llm.llmapi.llm_args import TorchLlmArgs

    return TorchLlmArgs


def _yaml(tmp_path: pathlib.Path, text: str) -> str:
    path = tmp_path / "extra.yaml"
    path.write_text(text)
    return str(path)


def test_flags_map_to_llm_args() -> None:
    from tandem.engines.trtllm.args import from_flags

    kwargs = from_flags(EngineArgs(
        kv_block_size=64, tensor_parallel_size=4, pipeline_parallel_size=2,
        expert_parallel_size=8, enable_attention_dp=True, max_batch_size=32,
        max_num_tokens=4096, max_seq_len=8192, max_beam_width=2,
        free_gpu_memory_fraction=0.75, load_format="dummy", num_gpu_blocks=100,
        enforce_eager=True, batch_wait_timeout_ms=20))
    assert kwargs["tensor_parallel_size"] == 4 and kwargs["pipeline_parallel_size"] == 2
    assert kwargs["moe_expert_parallel_size"] == 8 and kwargs["enable_attention_dp"] is True
    assert (kwargs["max_batch_size"], kwargs["max_num_tokens"], kwargs["max_seq_len"],
            kwargs["max_beam_width"]) == (32, 4096, 8192, 2)
    assert kwargs["load_format"] == "dummy" and kwargs["cuda_graph_config"] is None
    assert kwargs["batch_wait_timeout_ms"] == 20
    assert kwargs["kv_cache_config"] == {"tokens_per_block": 64, "free_gpu_memory_fraction": 0.75,
                                         "enable_block_reuse": True, "max_tokens": 6400}
    # Unset optional flags stay out so that TensorRT-LLM's own defaults apply.
    defaults = from_flags(EngineArgs())
    assert "moe_expert_parallel_size" not in defaults and "max_seq_len" not in defaults
    assert "cuda_graph_config" not in defaults and "batch_wait_timeout_ms" not in defaults


def test_yaml_then_json_merge_deeply(tmp_path: pathlib.Path) -> None:
    from tandem.engines.trtllm.args import build_llm_kwargs

    extra = _yaml(tmp_path, """
max_batch_size: 16
kv_cache_config:
  free_gpu_memory_fraction: 0.5
  event_buffer_max_size: 64
cache_transceiver_config:
  backend: UCX
  kv_transfer_timeout_ms: 5000
cuda_graph_config:
  enable_padding: true
  max_batch_size: 16
scheduler_config:
  capacity_scheduler_policy: MAX_UTILIZATION
""")
    override = json.dumps({"max_batch_size": 8, "kv_cache_config": {"event_buffer_max_size": 128},
                           "cache_transceiver_config": {"backend": "NIXL"}})
    kwargs = build_llm_kwargs(EngineArgs(kv_block_size=16, extra_engine_args=extra,
                                         override_engine_args=override), _schema())
    assert kwargs["max_batch_size"] == 8  # JSON over YAML over flags
    assert kwargs["kv_cache_config"] == {
        "tokens_per_block": 16,              # from the flags, kept under the YAML's dict
        "free_gpu_memory_fraction": 0.5,     # from the YAML
        "enable_block_reuse": True,
        "event_buffer_max_size": 128,        # from the JSON
    }
    assert kwargs["cache_transceiver_config"] == {"backend": "NIXL",
                                                  "kv_transfer_timeout_ms": 5000}
    assert kwargs["cuda_graph_config"] == {"enable_padding": True, "max_batch_size": 16}
    assert kwargs["scheduler_config"] == {"capacity_scheduler_policy": "MAX_UTILIZATION"}


@pytest.mark.parametrize(("yaml_text", "override", "named", "param"), [
    ("max_batch_sise: 4\n", "", "'max_batch_sise'", "extra_engine_args"),
    ("kv_cache_config:\n  tokens_per_blok: 8\n", "", "'kv_cache_config.tokens_per_blok'",
     "extra_engine_args"),
    ("", '{"cache_transceiver_config": {"backnd": "UCX"}}', "'cache_transceiver_config.backnd'",
     "override_engine_args"),
    ("", '{"scheduler_config": {"policy": "x"}}', "'scheduler_config.policy'",
     "override_engine_args"),
    ("cuda_graph_config:\n  padding: true\n", "", "'cuda_graph_config.padding'",
     "extra_engine_args"),
])
def test_unknown_keys_are_rejected_by_name(tmp_path: pathlib.Path, yaml_text: str,
                                           override: str, named: str, param: str) -> None:
    from tandem.engines.trtllm.engine import create_trtllm_engine

    args = EngineArgs(model=str(tmp_path), extra_engine_args=_yaml(tmp_path, yaml_text),
                      override_engine_args=override)
    (tmp_path / "config.json").write_text(json.dumps({
        "vocab_size": 100, "num_hidden_layers": 1, "num_attention_heads": 1,
        "hidden_size": 8}))
    with pytest.raises(InvalidRequest) as err:
        create_trtllm_engine(args)  # before any LLM is built
    assert named in err.value.message
    assert err.value.param == param
    source = "--extra-engine-args" if param == "extra_engine_args" else "--override-engine-args"
    assert source in err.value.message


def test_transceiver_gets_a_transfer_timeout() -> None:
    from tandem.engines.trtllm.args import DEFAULT_KV_TRANSFER_TIMEOUT_MS, build_llm_kwargs

    kwargs = build_llm_kwargs(EngineArgs(
        override_engine_args='{"cache_transceiver_config": {"backend": "DEFAULT"}}'), _schema())
    assert kwargs["cache_transceiver_config"] == {
        "backend": "DEFAULT", "kv_transfer_timeout_ms": DEFAULT_KV_TRANSFER_TIMEOUT_MS}
    assert "cache_transceiver_config" not in build_llm_kwargs(EngineArgs(), _schema())


def test_unknown_key_suggests_the_nearest(tmp_path: pathlib.Path) -> None:
    from tandem.engines.trtllm.args import build_llm_kwargs

    with pytest.raises(InvalidRequest, match="did you mean max_batch_size"):
        build_llm_kwargs(EngineArgs(extra_engine_args=_yaml(tmp_path, "max_batch_sise: 4\n")),
                         _schema())


@pytest.mark.parametrize(("yaml_text", "override", "match"), [
    ("- a list\n", "", "must hold a mapping"),
    ("key: [unclosed\n", "", "not valid YAML"),
    ("", "{not json", "not valid JSON"),
    ("", "[1, 2]", "must be a JSON object"),
])
def test_malformed_layers_are_rejected(tmp_path: pathlib.Path, yaml_text: str, override: str,
                                       match: str) -> None:
    from tandem.engines.trtllm.args import build_llm_kwargs

    args = EngineArgs(extra_engine_args=_yaml(tmp_path, yaml_text) if yaml_text else "",
                      override_engine_args=override)
    with pytest.raises(InvalidRequest, match=match):
        build_llm_kwargs(args, _schema())


def test_missing_yaml_file_is_named(tmp_path: pathlib.Path) -> None:
    from tandem.engines.trtllm.args import build_llm_kwargs

    with pytest.raises(InvalidRequest, match="no such file .*nope.yaml"):
        build_llm_kwargs(EngineArgs(extra_engine_args=str(tmp_path / "nope.yaml")), _schema())


def test_kv_events_set_buffer_and_block_reuse(caplog: pytest.LogCaptureFixture) -> None:
    from tandem.engines.trtllm.args import DEFAULT_EVENT_BUFFER_MAX_SIZE, with_kv_events

    on = with_kv_events({"kv_cache_config": {"tokens_per_block": 32}})
    assert on["kv_cache_config"] == {"tokens_per_block": 32, "enable_block_reuse": True,
                                     "event_buffer_max_size": DEFAULT_EVENT_BUFFER_MAX_SIZE}
    kept = with_kv_events({"kv_cache_config": {"event_buffer_max_size": 64}})
    assert kept["kv_cache_config"]["event_buffer_max_size"] == 64
    with caplog.at_level(logging.WARNING):
        off = with_kv_events({"kv_cache_config": {"enable_block_reuse": False}})
    assert off["kv_cache_config"]["enable_block_reuse"] is False  # the user's choice stands
    assert "enable_block_reuse is false" in caplog.text


async def test_start_builds_the_llm_with_the_merged_args(tiny_model: str) -> None:
    from tandem.engines.trtllm.engine import create_trtllm_engine

    engine = create_trtllm_engine(EngineArgs(
        model=tiny_model, kv_block_size=8,
        override_engine_args='{"kv_cache_config": {"free_gpu_memory_fraction": 0.3}}'))
    engine.set_event_sink(lambda events: None)
    await engine.start()
    try:
        llm_args = engine._llm.args
        assert llm_args.kv_cache_config.tokens_per_block == 8
        assert llm_args.kv_cache_config.free_gpu_memory_fraction == 0.3
        assert llm_args.kv_cache_config.event_buffer_max_size > 0  # a sink was set
        assert llm_args.enable_iter_perf_stats
        # Guided decoding (on by default) needs TensorRT-LLM to hold the tokenizer.
        assert llm_args.guided_decoding_backend == "xgrammar"
        assert not llm_args.skip_tokenizer_init
        assert engine.layout.block_size == 8 and engine.layout.dtype == "bfloat16"
        assert engine.max_model_len == 2048
    finally:
        await engine.close()


async def test_no_event_sink_no_event_buffer(tiny_model: str) -> None:
    from tandem.engines.trtllm.engine import create_trtllm_engine

    engine = create_trtllm_engine(EngineArgs(model=tiny_model))
    await engine.start()
    try:
        assert engine._llm.args.kv_cache_config.event_buffer_max_size == 0
    finally:
        await engine.close()


@pytest.mark.parametrize(("override", "match"), [
    ('{"kv_cache_config": {"tokens_per_block": "x"}}',
     "'kv_cache_config.tokens_per_block': Input should be a valid integer.*got 'x'"),
    ('{"cache_transceiver_config": {"backend": "PIGEON"}}', "'cache_transceiver_config.backend'"),
    ('{"max_seq_len": "long"}', "'max_seq_len' must be an integer"),
])
def test_bad_values_are_rejected_before_start(tiny_model: str, override: str,
                                              match: str) -> None:
    from tandem.engines.trtllm.engine import create_trtllm_engine

    with pytest.raises(InvalidRequest, match=match):
        create_trtllm_engine(EngineArgs(model=tiny_model, override_engine_args=override))


async def test_values_only_the_llm_checks_fail_at_start(tiny_model: str) -> None:
    from tandem.engines.trtllm.engine import create_trtllm_engine

    engine = create_trtllm_engine(EngineArgs(model=tiny_model,
                                             override_engine_args='{"dtype": ["a", "list"]}'))
    with pytest.raises(InvalidRequest, match="TensorRT-LLM rejected the engine args"):
        await engine.start()


def test_registry_knows_trtllm(tiny_model: str) -> None:
    from tandem.engines.registry import backend_names, create_engine

    assert "trtllm" in backend_names()
    assert create_engine("trtllm", EngineArgs(model=tiny_model)).name == "trtllm"


def test_missing_tensorrt_llm_says_how_to_install(monkeypatch: pytest.MonkeyPatch,
                                                  tiny_model: str) -> None:
    from tandem.engines.trtllm.engine import create_trtllm_engine

    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # what `import` sees when absent
    with pytest.raises(Unavailable, match=r"pip install 'tandem\[trtllm\]'"):
        create_trtllm_engine(EngineArgs(model=tiny_model))


def test_fp8_kv_cache_maps_to_kv_cache_config_and_online_fp8_is_refused() -> None:
    from tandem.engines.trtllm.args import from_flags

    kwargs = from_flags(EngineArgs(kv_cache_dtype="fp8"))
    assert kwargs["kv_cache_config"]["dtype"] == "fp8"
    assert "dtype" not in from_flags(EngineArgs())["kv_cache_config"]
    with pytest.raises(InvalidRequest, match="reference engine only"):
        from_flags(EngineArgs(quantization="fp8"))


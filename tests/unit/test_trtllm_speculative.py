"""--speculative-config on the trtllm engine: each method becomes the TensorRT-LLM decoding
config upstream defines for it (checked on the LLM the fake builds, whose classes, fields and
validators are upstream's), settings TensorRT-LLM cannot honour and a second speculative_config
from --extra-engine-args / --override-engine-args are refused. Runs against the fake TensorRT-LLM
(tests/fakes)."""
from __future__ import annotations

import json
import logging
import pathlib
from typing import Any

import pytest

from tandem.engines.args import EngineArgs
from tandem.errors import InvalidRequest
from tests.unit.fake_packages import fake_trtllm  # noqa: F401 (autouse: tensorrt_llm is the fake)


async def _llm_speculative_config(args: EngineArgs) -> Any:
    """The speculative config of the LLM the engine builds from `args` (pydantic-validated)."""
    from tandem.engines.trtllm.engine import create_trtllm_engine

    engine = create_trtllm_engine(args)
    await engine.start()
    try:
        return engine._llm.args.speculative_config
    finally:
        await engine.close()


def _spec(**values: Any) -> str:
    return json.dumps(values)


async def test_ngram_maps_to_ngram_decoding_config(tiny_model: str) -> None:
    config = await _llm_speculative_config(EngineArgs(model=tiny_model, speculative_config=_spec(
        method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)))
    assert type(config).__name__ == "NGramDecodingConfig"
    assert config.decoding_type == "NGram"
    assert (config.max_draft_len, config.max_matching_ngram_size) == (4, 3)
    # Prompt lookup within the request, as Tandem's proposer; upstream's default is shared.
    assert config.is_public_pool is False
    assert config.is_keep_all and config.is_use_oldest  # upstream's defaults, untouched
    assert config.max_concurrency == 8  # Tandem's default disable_by_batch_size


@pytest.mark.parametrize(("method", "class_name", "decoding_type"), [
    ("draft_model", "DraftTargetDecodingConfig", "Draft_Target"),
    ("eagle3", "Eagle3DecodingConfig", "Eagle3"),
])
async def test_draft_methods_map_to_their_decoding_config(tiny_model: str, method: str,
                                                          class_name: str,
                                                          decoding_type: str) -> None:
    config = await _llm_speculative_config(EngineArgs(model=tiny_model, speculative_config=_spec(
        method=method, num_speculative_tokens=3, model="/models/draft",
        disable_by_batch_size=16)))
    assert type(config).__name__ == class_name and config.decoding_type == decoding_type
    assert config.max_draft_len == 3 and config.max_total_draft_tokens == 3
    assert str(config.speculative_model) == "/models/draft"
    assert config.max_concurrency == 16
    if method == "eagle3":
        assert config.eagle3_one_model is True


def test_disable_by_batch_size_zero_leaves_speculation_always_on() -> None:
    from tandem.engines.trtllm.speculative import to_llm_speculative_config

    out = to_llm_speculative_config(_spec(method="ngram", num_speculative_tokens=2,
                                          disable_by_batch_size=0))
    assert "max_concurrency" not in out
    assert out == {"decoding_type": "NGram", "max_draft_len": 2, "max_matching_ngram_size": 5,
                   "is_public_pool": False}


def test_no_flag_no_speculative_config() -> None:
    from tandem.engines.trtllm.args import from_flags

    assert "speculative_config" not in from_flags(EngineArgs())


def test_prompt_lookup_min_above_one_is_refused_when_set() -> None:
    from tandem.engines.trtllm.args import from_flags

    with pytest.raises(InvalidRequest, match="prompt_lookup_min 2 has no counterpart") as info:
        from_flags(EngineArgs(speculative_config=_spec(
            method="ngram", num_speculative_tokens=4, prompt_lookup_min=2,
            prompt_lookup_max=4)))
    assert info.value.param == "speculative_config"


def test_default_prompt_lookup_min_is_noted_not_refused(
        caplog: pytest.LogCaptureFixture) -> None:
    from tandem.engines.trtllm.speculative import to_llm_speculative_config

    with caplog.at_level(logging.INFO, logger="tandem.engines.trtllm.speculative"):
        out = to_llm_speculative_config(_spec(method="ngram", num_speculative_tokens=4,
                                              prompt_lookup_max=4))
    assert out["max_matching_ngram_size"] == 4
    assert "no prompt_lookup_min" in caplog.text


@pytest.mark.parametrize("layer", ["yaml", "override"])
def test_speculative_config_given_twice_is_refused(tmp_path: pathlib.Path, layer: str) -> None:
    from tensorrt_llm.llmapi.llm_args import TorchLlmArgs

    from tandem.engines.trtllm.args import build_llm_kwargs

    raw = {"decoding_type": "NGram", "max_draft_len": 2}
    if layer == "yaml":
        path = tmp_path / "extra.yaml"
        path.write_text(f"speculative_config: {json.dumps(raw)}\n")
        extra = {"extra_engine_args": str(path)}
        where = f"--extra-engine-args {path}"
    else:
        extra = {"override_engine_args": json.dumps({"speculative_config": raw})}
        where = "--override-engine-args"
    args = EngineArgs(speculative_config=_spec(method="ngram", num_speculative_tokens=4),
                      **extra)
    with pytest.raises(InvalidRequest) as info:
        build_llm_kwargs(args, TorchLlmArgs)
    assert info.value.param == "speculative_config"
    assert "--speculative-config" in str(info.value) and where in str(info.value)


async def test_yaml_speculative_config_alone_reaches_the_llm(tiny_model: str,
                                                            tmp_path: pathlib.Path) -> None:
    path = tmp_path / "extra.yaml"
    path.write_text("speculative_config:\n  decoding_type: Eagle\n  max_draft_len: 3\n"
                    "  speculative_model_dir: /models/eagle\n")
    config = await _llm_speculative_config(EngineArgs(model=tiny_model,
                                                      extra_engine_args=str(path)))
    assert type(config).__name__ == "EagleDecodingConfig"
    assert str(config.speculative_model) == "/models/eagle"  # upstream's alias


@pytest.mark.parametrize(("raw", "match"), [
    ({"decoding_type": "Draft_Target", "max_draft_len": 3},
     "'speculative_config.Draft_Target'.*speculative_model must be specified"),
    ({"decoding_type": "Medusa", "max_draft_len": 3}, "'speculative_config'.*'Medusa'"),
    ({"decoding_type": "NGram", "max_draft_len": 3, "max_concurrency": 4,
      "draft_len_schedule": {"1": 3}}, "mutually exclusive"),
])
def test_bad_raw_speculative_config_is_refused_before_start(tiny_model: str,
                                                            raw: dict[str, Any],
                                                            match: str) -> None:
    from tandem.engines.trtllm.engine import create_trtllm_engine

    with pytest.raises(InvalidRequest, match=match):
        create_trtllm_engine(EngineArgs(model=tiny_model, override_engine_args=json.dumps(
            {"speculative_config": raw})))


def test_unknown_method_is_refused(tiny_model: str) -> None:
    from tandem.engines.trtllm.engine import create_trtllm_engine

    with pytest.raises(InvalidRequest, match="method must be one of") as info:
        create_trtllm_engine(EngineArgs(model=tiny_model, speculative_config=_spec(
            method="medusa", num_speculative_tokens=2)))
    assert info.value.param == "speculative_config"

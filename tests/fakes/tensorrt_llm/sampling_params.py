"""Fake of tensorrt_llm/sampling_params.py (NVIDIA/TensorRT-LLM @ 000a01de).

SamplingParams is a slots + kw_only dataclass upstream, so an unknown keyword is a TypeError;
the fields below are upstream's names and defaults (max_tokens defaults to 32). Fields that only
feed the C++ runtime (embedding_bias, logits processors, lookahead, ...) are omitted.

GuidedDecodingParams is upstream's slots + kw_only dataclass with its five guides (json: str,
dict or pydantic model; regex; grammar: EBNF; json_object; structural_tag) and its `_validate`
("Only one guide can be used for a request, but got N."), which SamplingParams.__post_init__
runs through its own `_validate` when `guided_decoding` is set.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(slots=True, kw_only=True)
class GuidedDecodingParams:
    json: str | dict[str, Any] | Any | None = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def _validate(self) -> None:
        num_guides = 0
        for _field in fields(self):
            num_guides += bool(getattr(self, _field.name))
        if num_guides > 1:
            raise ValueError(f"Only one guide can be used for a request, but got {num_guides}.")


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    end_id: int | None = None
    pad_id: int | None = None
    max_tokens: int = 32
    bad: str | list[str] | None = None
    bad_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    top_p: float | None = None
    top_p_min: float | None = None
    top_p_reset_ids: int | None = None
    top_p_decay: float | None = None
    seed: int | None = None
    temperature: float | None = None
    min_tokens: int | None = None
    beam_search_diversity_rate: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    length_penalty: float | None = None
    early_stopping: int | None = None
    no_repeat_ngram_size: int | None = None
    min_p: float | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = True
    return_encoder_output: bool = False
    return_perf_metrics: bool = False
    guided_decoding: GuidedDecodingParams | None = None
    ignore_eos: bool = False
    detokenize: bool = True
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.best_of is None:
            self.best_of = self.n
        if self.guided_decoding is not None:
            self.guided_decoding._validate()

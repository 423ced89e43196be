"""`--speculative-config` in TensorRT-LLM's terms: the LLM API's `speculative_config`.

Read from NVIDIA/TensorRT-LLM `tensorrt_llm/llmapi/llm_args.py` at 00043967 (0004396720054fd8e
205cbf616f21f0b57c6b412): `BaseLlmArgs.speculative_config: Optional[SpeculativeConfig]`, where
`SpeculativeConfig` is a pydantic union of the `*DecodingConfig` classes discriminated by their
`decoding_type` field. The LLM therefore takes the dict form built here as it takes a YAML
`speculative_config:` mapping, and validates it with the same classes. Dynamo's trtllm worker
has no flag of its own for it: the mapping reaches the LLM only through `--extra-engine-args`
(ai-dynamo/dynamo `components/src/dynamo/trtllm/main.py` at 00810a7b,
`update_llm_args_with_extra_options`).

Tandem's methods map as follows (k = num_speculative_tokens):

    ngram        NGramDecodingConfig        max_draft_len = k,
                                            max_matching_ngram_size = prompt_lookup_max,
                                            is_public_pool = False
    draft_model  DraftTargetDecodingConfig  max_draft_len = k, speculative_model = model
    eagle3       Eagle3DecodingConfig       max_draft_len = k, speculative_model = model
                                            (one-model: upstream's eagle3_one_model, which it
                                            always forces on)

and, for every method, `disable_by_batch_size` N > 0 to DecodingBaseConfig's `max_concurrency`
N ("speculation will be disabled at batch sizes above this value", our "a step speculates only
while at most N requests run"); 0 (never turned down) leaves `max_concurrency` unset, upstream's
"always on".
"""
from __future__ import annotations

import json
import logging
from typing import Any

from tandem.engines.speculative.config import SpeculativeConfig
from tandem.errors import InvalidRequest

log = logging.getLogger(__name__)

_PARAM = "speculative_config"

#: `decoding_type`, the union's discriminator, per Tandem method.
DECODING_TYPES = {"ngram": "NGram", "draft_model": "Draft_Target", "eagle3": "Eagle3"}


def to_llm_speculative_config(text: str) -> dict[str, Any]:
    """The LLM API's `speculative_config` mapping for the flag's JSON object.

    Raises:
        InvalidRequest (param "speculative_config"): `SpeculativeConfig.parse` refuses the
            text, or it sets prompt_lookup_min to something TensorRT-LLM cannot honour.
    """
    config = SpeculativeConfig.parse(text)
    out: dict[str, Any] = {
        "decoding_type": DECODING_TYPES[config.method],
        "max_draft_len": config.num_speculative_tokens,
    }
    if config.method == "ngram":
        _check_prompt_lookup_min(config, given="prompt_lookup_min" in json.loads(text))
        out["max_matching_ngram_size"] = config.prompt_lookup_max
        # Tandem's ngram proposes from the request's own tokens (prompt lookup, as vLLM's);
        # upstream's default pool is shared by all requests, so a request would be offered
        # continuations seen in other requests' text.
        out["is_public_pool"] = False
    else:
        out["speculative_model"] = config.model
    if config.disable_by_batch_size > 0:
        out["max_concurrency"] = config.disable_by_batch_size
    return out


def _check_prompt_lookup_min(config: SpeculativeConfig, *, given: bool) -> None:
    """TensorRT-LLM has no shortest match: its n-gram pool (`_torch/speculative/ngram.py`,
    NGramPoolManager) tries suffixes from max_matching_ngram_size down to one token. A
    prompt_lookup_min the user set above 1 asks for fewer, surer proposals than TensorRT-LLM
    would make, so it is refused rather than dropped (the same rule as an unknown key); the one
    Tandem fills in by default is only noted."""
    if config.prompt_lookup_min == 1:
        return
    if given:
        raise InvalidRequest(
            f"speculative config: prompt_lookup_min {config.prompt_lookup_min} has no "
            "counterpart in TensorRT-LLM, whose n-gram drafter matches suffixes from "
            "prompt_lookup_max (max_matching_ngram_size) down to one token; set "
            "prompt_lookup_min to 1 or leave it out for --engine trtllm", param=_PARAM)
    log.info("speculative config: TensorRT-LLM's n-gram drafter matches suffixes of "
             "%d down to 1 token (it has no prompt_lookup_min; Tandem's default would be %d)",
             config.prompt_lookup_max, config.prompt_lookup_min)

"""`--speculative-config`: which proposer, how many tokens it proposes, and its own settings.

The flag takes one JSON object, in vLLM's and TensorRT-LLM's spirit:

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    {"method": "draft_model", "num_speculative_tokens": 4, "model": "/models/llama-1b"}
    {"method": "eagle3", "num_speculative_tokens": 3, "model": "/models/eagle3-llama-8b"}

Unknown keys and settings of another method are refused rather than ignored, so a typo cannot
silently turn a setting off.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NoReturn, cast

from tandem.errors import InvalidRequest

Method = Literal["ngram", "draft_model", "eagle3"]

#: The supported methods, in the order error messages list them.
METHODS: tuple[Method, ...] = ("ngram", "draft_model", "eagle3")

#: A verify pass costs more per position as k grows and acceptance decays geometrically, so
#: beyond this many positions a proposal is almost surely wasted work.
MAX_SPECULATIVE_TOKENS = 16

#: vLLM's defaults when neither bound is given: match 5-grams only.
DEFAULT_PROMPT_LOOKUP = 5

#: Requests running past which no step speculates (the default policy): a verify pass
#: computes k + 1 positions per request, which costs little while a step is bound by reading
#: the weights and more than it saves once the batch makes it compute-bound. Measured on the
#: H200 (benchmarks/spec_gpu.py; benchmarks/history/engine.md, "Speculative decoding").
DEFAULT_DISABLE_BY_BATCH_SIZE = 8

_PARAM = "speculative_config"
_KEYS = frozenset(
    {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
     "disable_by_batch_size"}
)
_NGRAM_ONLY = ("prompt_lookup_min", "prompt_lookup_max")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """One deployment's speculative decoding settings (validated: build with `parse`)."""

    method: Method
    #: Tokens proposed per step (k); a verify pass scores k + 1 positions.
    num_speculative_tokens: int
    #: ngram only: the shortest and longest context suffix matched (1 <= min <= max).
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    #: draft_model / eagle3 only: the path or name of the draft weights.
    model: str | None = None
    #: A step speculates only while at most this many requests run (0: never turned down).
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """Parses the flag's JSON object.

        Raises:
            InvalidRequest (param "speculative_config"): the text is not a JSON object, or
                `from_dict` refuses it.
        """
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidRequest(
                f"speculative config is not valid JSON ({e.msg} at position {e.pos}): {text!r}",
                param=_PARAM,
            ) from e
        if not isinstance(obj, dict):
            raise InvalidRequest(
                f"speculative config must be a JSON object, got {type(obj).__name__}",
                param=_PARAM,
            )
        return cls.from_dict(obj)

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> SpeculativeConfig:
        """Validates a decoded object and fills the ngram bounds' defaults (vLLM's rule: none
        given -> both 5; one given -> the other equals it).

        Raises:
            InvalidRequest (param "speculative_config"): an unknown key, a missing or unknown
                method, a count that is not an integer in [1, MAX_SPECULATIVE_TOKENS], ngram
                bounds out of order, a draft model missing, or a setting of another method.
        """
        unknown = sorted(set(obj) - _KEYS)
        if unknown:
            _fail(f"unknown key(s) {unknown}; known keys are {sorted(_KEYS)}")
        method = obj.get("method")
        if method not in METHODS:
            _fail(f"method must be one of {list(METHODS)}, got {method!r}")
        k = _int(obj, "num_speculative_tokens", required=True)
        assert k is not None  # required=True raised otherwise
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            _fail(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}")
        limit = _int(obj, "disable_by_batch_size", required=False)
        if limit is not None and limit < 0:
            _fail(f"disable_by_batch_size must be >= 0 (0: never), got {limit}")
        config = cls._ngram(obj, k) if method == "ngram" else cls._draft(obj, method, k)
        if limit is None:
            return config
        return dataclasses.replace(config, disable_by_batch_size=limit)

    @classmethod
    def _draft(cls, obj: Mapping[str, Any], method: str, k: int) -> SpeculativeConfig:
        given = [key for key in _NGRAM_ONLY if key in obj]
        if given:
            _fail(f"{given} apply to method 'ngram' only, not {method!r}")
        model = obj.get("model")
        if not isinstance(model, str) or not model.strip():
            _fail(f"method {method!r} needs 'model': the draft weights' path or name")
        return cls(method=cast(Method, method), num_speculative_tokens=k, model=model)

    @classmethod
    def _ngram(cls, obj: Mapping[str, Any], k: int) -> SpeculativeConfig:
        if "model" in obj:
            _fail("method 'ngram' takes no 'model' (it proposes from the context alone)")
        lo = _int(obj, "prompt_lookup_min", required=False)
        hi = _int(obj, "prompt_lookup_max", required=False)
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        assert lo is not None and hi is not None
        if lo < 1:
            _fail(f"prompt_lookup_min must be >= 1, got {lo}")
        if hi < lo:
            _fail(f"prompt_lookup_max ({hi}) must be >= prompt_lookup_min ({lo})")
        return cls(
            method="ngram", num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi
        )

    def to_dict(self) -> dict[str, Any]:
        """The settings that apply to this method, as `from_dict` takes them (for the start
        log and round trips)."""
        out: dict[str, Any] = {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "disable_by_batch_size": self.disable_by_batch_size,
        }
        if self.method == "ngram":
            out["prompt_lookup_min"] = self.prompt_lookup_min
            out["prompt_lookup_max"] = self.prompt_lookup_max
        else:
            out["model"] = self.model
        return out


def _int(obj: Mapping[str, Any], key: str, *, required: bool) -> int | None:
    value = obj.get(key)
    if value is None:
        if required:
            _fail(f"{key!r} is required")
        return None
    # bool is an int subclass; `true` as a count is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(f"{key} must be an integer, got {value!r}")
    return value


def _fail(message: str) -> NoReturn:
    raise InvalidRequest(f"speculative config: {message}", param=_PARAM)

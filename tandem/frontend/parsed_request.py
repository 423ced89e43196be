"""A validated OpenAI request, as tandem.frontend.openai_request.parse_request returns it."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tandem.engines.types import GuidedDecoding, SamplingParams
from tandem.frontend.request_fields import Kind
from tandem.frontend.tool_request import ToolRequest
from tandem.multimodal.chat import ImageRef


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated OpenAI request. None means "absent: use the default" (see `sampling`)."""

    kind: Kind
    model: str
    #: chat only: the messages as the chat template takes them (tandem.frontend.chat_messages).
    messages: tuple[dict[str, Any], ...] = ()
    #: chat only: the images, in the order their parts appear in `messages`.
    images: tuple[ImageRef, ...] = ()
    #: completion only: text, or token ids.
    prompt: str | tuple[int, ...] | None = None
    #: max_completion_tokens / max_tokens; None: the frontend picks from the context length.
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    #: 0 disables (vLLM's -1 is normalised to 0).
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    #: None: no logprobs; k: the sampled token's logprob plus k alternatives.
    logprobs: int | None = None
    stream: bool = False
    #: Choices returned (tandem.frontend.choices).
    n: int = 1
    #: Choices generated (completions' best_of, >= n): the n with the highest mean token
    #: logprob are returned.
    best_of: int = 1
    #: stream_options.include_usage: send a final chunk with usage and no choices.
    include_usage: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    skip_special_tokens: bool = True
    #: Latency targets for the router, milliseconds.
    ttft_target_ms: float | None = None
    itl_target_ms: float | None = None
    #: The client's own deadline for the whole request, seconds (`timeout` in the body, else the
    #: `x-request-timeout-ms` header); capped by the frontend's --request-timeout-s.
    timeout_s: float | None = None
    #: The output constraint (response_format, guided_*, or a forced tool_choice's schema);
    #: None: unconstrained.
    guided: GuidedDecoding | None = None
    #: chat only: tools, tool_choice and parallel_tool_calls; None: no tools.
    tools: ToolRequest | None = None
    #: chat only: chat_template_kwargs, extra variables for the chat template.
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    #: chat only: reasoning_effort, for templates that read it (gpt-oss).
    reasoning_effort: str | None = None
    #: speculative_decoding (or nvext.speculative_decoding): False keeps the engine from
    #: speculating for this request.
    speculative: bool = True

    @property
    def num_generated(self) -> int:
        """Choices to generate: best_of, at least n."""
        return max(self.n, self.best_of)

    def template_variables(self) -> dict[str, Any]:
        """Extra variables of the chat template: chat_template_kwargs and reasoning_effort."""
        variables = dict(self.template_kwargs)
        if self.reasoning_effort is not None:
            variables["reasoning_effort"] = self.reasoning_effort
        return variables

    def sampling(self, max_tokens: int) -> SamplingParams:
        """Engine sampling parameters, with `max_tokens` already decided by the frontend.

        Absent values take SamplingParams' defaults (temperature 1, top_p 1, top_k 0, min_p 0,
        repetition_penalty 1).
        """
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            stop_token_ids=self.stop_token_ids,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            # best_of ranks choices by their tokens' logprobs: asked for even when not shown.
            top_logprobs=0 if self.logprobs is None and self.best_of > self.n else self.logprobs,
            guided=self.guided,
            speculative=self.speculative,
        )

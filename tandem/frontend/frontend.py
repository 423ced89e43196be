"""The frontend's request logic, shared by the OpenAI REST API and the public gRPC API:
model check, image fetching, tokenization (image placeholders expanded, tools and template
variables rendered by the chat template), context-length limits, the output parsers, and the
request pipeline."""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

from tandem.engines.types import Embedding, GuidedDecoding, GuidedKind
from tandem.errors import InvalidRequest, ModelNotFound
from tandem.frontend.admission import Admission
from tandem.frontend.chat_output import ChatOutput
from tandem.frontend.choices import choice_requests, generate_choices
from tandem.frontend.embeddings import Embedder
from tandem.frontend.openai_request import ParsedRequest
from tandem.frontend.output_parsers import OutputParsers
from tandem.frontend.pipeline import Delta, GenerationRequest, Pipeline
from tandem.frontend.tokenizer import Tokenizer
from tandem.multimodal.fetch import MediaFetcher
from tandem.multimodal.placeholders import ImagePlaceholders
from tandem.multimodal.prompt import build_prompt
from tandem.routing.workers import SlaHints
from tandem.runtime import tracing

#: Constraints whose JSON text --json-whitespace loosens.
_JSON_KINDS = (GuidedKind.JSON_SCHEMA, GuidedKind.JSON_OBJECT)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    max_model_len: int
    #: "text" (chat and completions) or "embedding" (/v1/embeddings only).
    kind: str = "text"


@dataclass(frozen=True, slots=True)
class ImageSupport:
    """What the frontend needs to accept images: present only for a vision-language model."""

    placeholders: ImagePlaceholders
    fetcher: MediaFetcher
    #: The workers' --kv-block-size: the router's prefix hashes of a prompt with images are
    #: computed here (the router cannot see the images).
    block_size: int


class Frontend:
    def __init__(self, model: ModelInfo, tokenizer: Tokenizer, pipeline: Pipeline,
                 request_timeout_s: float | None = None,
                 images: ImageSupport | None = None, max_messages: int = 1000,
                 admission: Admission | None = None,
                 parsers: OutputParsers | None = None, json_whitespace: int = 0,
                 embedder: Embedder | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.pipeline = pipeline
        #: Longest a request may take end to end; None: no limit of the frontend's own.
        self.request_timeout_s = request_timeout_s
        #: None: a text-only model, requests with images are refused.
        self.images = images
        #: Bounds the requests sent on to workers and waiting to be (429 past it).
        self.admission = admission or Admission()
        #: Most messages in one chat request: bounds the template and tokenizer work.
        self.max_messages = max_messages
        #: --json-whitespace: whitespace characters a JSON constraint (json_schema, json_object,
        #: a forced tool call's arguments) allows between two tokens; 0: compact JSON.
        self.json_whitespace = json_whitespace
        #: --tool-call-parser and --reasoning-parser; none by default. They build a forced
        #: call's grammar where their format has one, its arguments under the same whitespace.
        self.parsers = dataclasses.replace(
            parsers or OutputParsers(special_texts=tokenizer.special_texts),
            json_whitespace=json_whitespace)
        #: An embedding model's /v1/embeddings; None for a text model.
        self.embedder = embedder

    def chat_output(self, parsed: ParsedRequest) -> ChatOutput:
        """The splitter of `parsed`'s answer into reasoning, content and tool calls."""
        return self.parsers.new_output(parsed)

    def token_text(self, token_id: int) -> str:
        """The text of one token, as logprobs report it."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def prompt_token_ids(self, parsed: ParsedRequest) -> list[int]:
        """The request's prompt tokens; long texts are encoded off the event loop."""
        if parsed.kind == "chat":
            # As Tokenizer.apply_chat_template: the template writes its own special tokens.
            tools = parsed.tools.template_tools if parsed.tools is not None else None
            text = self.tokenizer.render_chat(list(parsed.messages), tools=tools,
                                              variables=parsed.template_variables())
            return await self.tokenizer.encode_off_loop(text, add_special_tokens=False)
        if isinstance(parsed.prompt, str):
            if not parsed.prompt:
                raise InvalidRequest("'prompt' must not be empty", param="prompt")
            return await self.tokenizer.encode_off_loop(parsed.prompt, add_special_tokens=True)
        ids = list(parsed.prompt or ())
        if not ids:
            raise InvalidRequest("'prompt' must not be empty", param="prompt")
        vocab = self.tokenizer.vocab_size
        bad = next((i for i in ids if i >= vocab), None)
        if bad is not None:
            raise InvalidRequest(f"prompt token id {bad} is outside the vocabulary (size {vocab})",
                                 param="prompt")
        return ids

    def _check_chat_features(self, parsed: ParsedRequest) -> None:
        """Refuses what this model and deployment would drop without a word: tools the model's
        chat template never renders (unless tool_choice is "none"), a reasoning_effort it never
        reads, tool_choice "auto" without a tool-call parser."""
        self.parsers.check(parsed)
        tools = parsed.tools
        if (tools is not None and tools.choice != "none" and self.tokenizer.has_chat_template
                and not self.tokenizer.template_reads("tools")):
            raise InvalidRequest(f"model {self.model.name}'s chat template does not render "
                                 "tools, so the model would never see them", param="tools")
        if (parsed.reasoning_effort is not None and self.tokenizer.has_chat_template
                and not self.tokenizer.template_reads("reasoning_effort")):
            raise InvalidRequest(f"model {self.model.name}'s chat template does not read "
                                 "reasoning_effort", param="reasoning_effort")

    @staticmethod
    async def _with_images(support: ImageSupport, parsed: ParsedRequest, token_ids: list[int]
                           ) -> tuple[list[int], tuple[Embedding, ...], tuple[int, ...]]:
        """(prompt with placeholders expanded, one item per image, block hashes for the router)
        of a chat with images; every image is fetched and checked to decode, concurrently."""
        with tracing.span("fetch_images"):
            fetched = await asyncio.gather(*(support.fetcher.fetch_image(ref.url, param=ref.param)
                                             for ref in parsed.images))
        prompt = build_prompt(token_ids, fetched, support.placeholders)
        return (list(prompt.token_ids), prompt.items,
                tuple(prompt.block_hashes(support.block_size)))

    async def prepare(self, parsed: ParsedRequest, timeout_s: float | None = None,
                      priority: int | None = None) -> GenerationRequest:
        """Validates the request against the served model, fetches its images and tokenizes it.

        The request gets a fresh internal id: a client's id is for its logs only, never a key
        the router or an engine could see collide. `timeout_s` (the client's deadline) is capped
        by the frontend's own request timeout.

        Raises:
            ModelNotFound: the request names another model.
            InvalidRequest: too many messages, the prompt does not fit the context, the
                template fails, or an image cannot be fetched or decoded (or the model takes
                none).
        """
        if parsed.model != self.model.name:
            raise ModelNotFound(f"model '{parsed.model}' does not exist; this deployment serves "
                                f"'{self.model.name}'", param="model")
        if self.model.kind == "embedding":
            raise InvalidRequest(f"model '{self.model.name}' is an embedding model: send its "
                                 "requests to /v1/embeddings", param="model")
        if len(parsed.messages) > self.max_messages:
            raise InvalidRequest(f"'messages' may hold at most {self.max_messages} messages, got "
                                 f"{len(parsed.messages)}", param="messages")
        self._check_chat_features(parsed)
        support = self.images
        if parsed.images and support is None:
            raise InvalidRequest(f"model '{self.model.name}' does not accept images",
                                 param=parsed.images[0].param)
        tracing.annotate({tracing.MODEL: parsed.model, tracing.OPERATION:
                          "chat" if parsed.kind == "chat" else "text_completion"})
        with tracing.span("tokenize") as span:
            prompt = await self.prompt_token_ids(parsed)
            span.set_attribute(tracing.INPUT_TOKENS, len(prompt))
        items: tuple[Embedding, ...] = ()
        block_hashes: tuple[int, ...] = ()
        if parsed.images and support is not None:
            prompt, items, block_hashes = await self._with_images(support, parsed, prompt)
        limit = self.model.max_model_len
        if len(prompt) >= limit:
            raise InvalidRequest(f"the prompt has {len(prompt)} tokens; this model's context is "
                                 f"{limit} tokens, leaving no room for output", param="messages"
                                 if parsed.kind == "chat" else "prompt")
        max_tokens = parsed.max_tokens if parsed.max_tokens is not None else limit - len(prompt)
        if len(prompt) + max_tokens > limit:
            raise InvalidRequest(
                f"max_tokens {max_tokens} + prompt {len(prompt)} tokens exceeds this model's "
                f"context of {limit} tokens", param="max_tokens")
        limits = [t for t in (timeout_s, self.request_timeout_s) if t is not None]
        sampling = dataclasses.replace(parsed.sampling(max_tokens), guided=self._constraint(parsed))
        return GenerationRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=prompt,
            sampling=sampling,
            stop=parsed.stop,
            skip_special_tokens=self.parsers.skip_special_tokens(parsed),
            sla=SlaHints(parsed.ttft_target_ms, parsed.itl_target_ms, priority),
            deadline=time.monotonic() + min(limits) if limits else None,
            embeddings=items,
            block_hashes=block_hashes,
        )

    def _constraint(self, parsed: ParsedRequest) -> GuidedDecoding | None:
        """The output constraint the engine enforces: a forced tool_choice in the tool parser's
        own markup where it has a grammar for one, else the request's (JSON under
        --json-whitespace)."""
        forced = self.parsers.forced_guided(parsed)
        if forced is not None:
            return forced
        guided = parsed.guided
        if guided is not None and guided.kind in _JSON_KINDS and self.json_whitespace:
            return dataclasses.replace(guided, json_whitespace=self.json_whitespace)
        return guided

    def generate_choices(self, req: GenerationRequest, n: int) -> AsyncGenerator[Delta, None]:
        """`generate` for a request of `n` choices: their deltas merged, each tagged with its
        Delta.index (tandem.frontend.choices). Each choice takes its own admission slot."""
        if n == 1:
            return self.generate(req)
        return generate_choices(self.generate, choice_requests(req, n))

    async def generate(self, req: GenerationRequest) -> AsyncGenerator[Delta, None]:
        """The pipeline's answer to a prepared request, inside an admission slot: the first
        iteration raises Overloaded (429) when the frontend is at capacity, or DeadlineExceeded
        when the request's deadline passes while it waits for a slot. Closing the iterator early
        cancels the request downstream and frees its slot."""
        async with self.admission.slot(req.deadline):
            async with aclosing(self.pipeline.generate(req)) as deltas:
                async for delta in deltas:
                    yield delta

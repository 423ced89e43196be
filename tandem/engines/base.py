"""The engine interface every backend implements (reference, trtllm, mock).

Everything above it (services, router, frontend) is backend-blind. All methods are called from
the one asyncio event loop of the worker process.
"""
from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tandem.engines.stream import RequestStream
from tandem.engines.types import (
    Embedding,
    EngineRequest,
    EngineStats,
    KvEvent,
    KvHandle,
    KvLayout,
    PrefillResult,
    TransferRecord,
)
from tandem.errors import Unimplemented

EventSink = Callable[[Sequence[KvEvent]], object]
#: Told of every KV read as it ends, inside the reading request's context (contextvars).
TransferObserver = Callable[[TransferRecord], None]


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step of an engine's loop, for traces: when the loop scheduled it and when it was
    done with it (for a step launched ahead: launched, its tokens still on the device)."""

    start_unix_ns: int
    end_unix_ns: int
    num_scheduled: int
    #: Uncached prompt (or recomputed) tokens computed in it.
    num_prefill_tokens: int
    num_admitted: int
    #: Requests whose first token it produced (prompts finished, KV reads landed).
    num_first_tokens: int
    #: Requests left waiting, and running, after it was scheduled.
    num_waiting: int
    num_running: int
    launched_ahead: bool


StepObserver = Callable[[StepRecord], None]


@dataclass(frozen=True, slots=True)
class Progress:
    """What a health watchdog needs to tell a stuck engine from an idle one."""

    #: Requests the step loop should be advancing now (waiting or running, not blocked on a
    #: peer such as a KV read in flight).
    has_work: bool
    #: Steps started since the engine started; it grows while the engine makes progress.
    num_steps: int


@dataclass(frozen=True, slots=True)
class PausePoint:
    """Where a `pause_when` pause stopped the batch."""

    num_running: int
    #: The fewest output tokens among the running requests.
    min_output_tokens: int


class Engine(ABC):
    """A token-in, token-out inference engine with a paged KV cache.

    Contract:
      - `add_request` validates and admits a request and returns its stream at once; the tokens
        arrive as the engine's loop produces them. A request with `kv_handle` resumes from KV
        computed elsewhere (its `first_token` is emitted first) instead of prefilling locally.
      - `abort` ends a request immediately: its stream finishes with CANCELLED and its KV blocks
        return to the pool before `abort` returns (blocks a transfer may still write into are
        freed when that transfer completes).
      - KV events (stored/removed/cleared) are delivered to the sink set by `set_event_sink`, one
        call per engine step, in order.
      - `close` aborts everything in flight and releases the engine's resources.
    """

    #: Registry name of the backend, e.g. "mock".
    name: str = ""

    def __init__(self) -> None:
        self._event_sink: EventSink | None = None

    @property
    @abstractmethod
    def layout(self) -> KvLayout:
        """Shape of this engine's KV cache (compared against incoming KV handles)."""

    @property
    @abstractmethod
    def max_model_len(self) -> int:
        """Longest prompt + output this engine accepts, tokens."""

    @abstractmethod
    async def start(self) -> None:
        """Allocates resources and starts the step loop. Called once before any request."""

    @abstractmethod
    def add_request(self, request: EngineRequest) -> RequestStream:
        """Admits a request.

        Raises:
            InvalidRequest: empty prompt, prompt + max_tokens beyond max_model_len, bad sampling.
            Overloaded: the waiting queue is full.
            FailedPrecondition: kv_handle's layout does not match `layout`.
        """

    @abstractmethod
    def abort(self, request_id: str) -> bool:
        """Cancels a request; True when it was still running or waiting."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """A snapshot of the engine's load and KV usage."""

    def set_event_sink(self, sink: EventSink | None) -> None:
        """Where KV events go; None turns publishing off."""
        self._event_sink = sink

    def _publish(self, events: Sequence[KvEvent]) -> None:
        if events and self._event_sink is not None:
            self._event_sink(events)

    async def prefill(self, request: EngineRequest, lease_ms: int) -> PrefillResult:
        """Runs the prompt only and samples its first token. Unless the request finished on it
        (finish_reason set, no handle), its blocks stay leased for `lease_ms` and the result
        carries a KV handle (worker_id and worker_address left for the service to fill in).
        Cancelling the call aborts the prompt, or frees the lease if it was already made.

        Raises:
            Unimplemented: the backend has no disaggregated prefill.
            FailedPrecondition: the backend cannot move KV on this host (e.g. no NIXL).
        """
        raise Unimplemented(f"engine '{self.name}' has no prefill-only mode")

    async def release(self, request_id: str) -> bool:
        """Frees a prefill lease early; False when no live lease has that id."""
        raise Unimplemented(f"engine '{self.name}' holds no KV leases")

    async def encode(self, images: Sequence[bytes]) -> list[Embedding]:
        """Runs the vision encoder over images.

        Raises:
            Unimplemented: the backend (or this build) has no vision encoder.
        """
        raise Unimplemented(
            f"engine '{self.name}' has no vision encoder (the encode stage is a later stage of "
            "Tandem)")

    async def embed(self, inputs: Sequence[Sequence[int]],
                    dimensions: int | None = None) -> list[list[float]]:
        """One embedding per input (token ids): the model's final hidden states pooled and
        normalised as its sentence-transformers configuration says, truncated to `dimensions`
        (a Matryoshka model only; then normalised again).

        Raises:
            Unimplemented: the backend (or this worker) computes no embeddings.
            InvalidRequest: an input too long or empty, or `dimensions` the model cannot give.
        """
        raise Unimplemented(f"engine '{self.name}' computes no embeddings (run an embedding "
                            "worker: `tandem serve embed`)")

    def prepare_kv_transfer(self) -> None:  # noqa: B027  (most backends need no set-up)
        """Sets up KV transfer now (e.g. registers the KV pool with NIXL) so that the first
        disaggregated request does not pay for it."""

    def set_lease_releaser(self, releaser: Callable[[KvHandle], None]) -> None:  # noqa: B027
        """How this engine tells a prefill worker it is done with a lease (Prefill.Release);
        backends whose transfers free the peer's blocks themselves ignore it."""

    def set_transfer_observer(self, observer: TransferObserver) -> None:  # noqa: B027
        """Who hears of each KV read this engine makes (metrics, traces). The observer runs in
        the context (contextvars) of the call that admitted the request. Backends whose reads
        happen out of sight (TensorRT-LLM's cache transceiver) ignore it."""

    def set_step_observer(self, observer: StepObserver) -> None:  # noqa: B027
        """Who hears of each step of the engine's loop (traces); engines without a step loop
        of their own (TensorRT-LLM) ignore it."""

    def debug_checksums(self) -> Mapping[tuple[str, str], str]:
        """(direction, request id) -> checksum of KV blocks leased or received, oldest first;
        empty unless the engine records them (--debug-kv-checksums)."""
        return {}

    def progress(self) -> Progress | None:
        """The step loop's progress, or None when this backend cannot tell (its health then
        rests on `health_canary`)."""
        return None

    async def health_canary(self, timeout_s: float) -> None:
        """Runs one tiny request whole to prove the engine makes progress.

        Raises:
            Unavailable: the engine failed it or produced no token within `timeout_s`.
            Unimplemented: the backend has no canary (its `progress` is enough).
        """
        raise Unimplemented(f"engine '{self.name}' has no health canary")

    def pause_steps(self) -> None:
        """Test hook (--debug-hooks): the step loop stops before its next step, as a stuck
        engine would, until `resume_steps`.

        Raises:
            Unimplemented: the backend has no step loop of its own.
        """
        raise Unimplemented(f"engine '{self.name}' cannot pause its step loop")

    def resume_steps(self) -> None:
        """Test hook: undoes `pause_steps`."""
        raise Unimplemented(f"engine '{self.name}' cannot pause its step loop")

    def pause_when(self, min_output_tokens: int) -> asyncio.Future[PausePoint]:
        """Test hook (--debug-hooks): arms a pause that the step loop takes itself, at the end
        of the first step after which nothing waits for admission and every running request
        has produced at least `min_output_tokens` tokens (a fault test's "mid-answer", chosen
        by the engine instead of by a poll racing it). `resume_steps` undoes it. A second call
        replaces the condition; the first call's future is cancelled.

        Returns:
            A future set when the loop has paused.
        Raises:
            Unimplemented: the backend has no step loop of its own.
        """
        raise Unimplemented(f"engine '{self.name}' cannot pause its step loop")

    @abstractmethod
    async def close(self) -> None:
        """Aborts every request and releases resources."""

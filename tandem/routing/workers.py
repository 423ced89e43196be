"""Workers the router hands out, and the load it counts for them."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SlaHints:
    """A request's latency targets (milliseconds) and priority, as the router reads them."""

    ttft_ms: float | None = None
    itl_ms: float | None = None
    priority: int | None = None


@dataclass(frozen=True, slots=True)
class WorkerRef:
    worker_id: str
    address: str
    pool: str


@dataclass(frozen=True, slots=True)
class RouteContext:
    """What a policy knows of the request it places."""

    request_id: str
    #: Chained block hashes of the prompt's full blocks (tandem.kv.hashing, the engines' hashing).
    block_hashes: tuple[int, ...]
    #: Prompt length, tokens.
    isl: int
    #: Expected output length, tokens.
    expected_osl: int
    sla: SlaHints = field(default_factory=SlaHints)


@dataclass
class WorkerState:
    """A worker as the router sees it: membership, health and load.

    Load is the worker's last report (its KvEvents WorkerLoad) plus what the router handed it
    since that report: a burst is spread at once instead of piling onto the worker that looked
    idle a moment ago, and each report corrects the estimate.
    """

    ref: WorkerRef
    #: Tokens per KV block on this worker (to turn token counts into blocks).
    block_size: int = 32
    #: In the candidate set: health SERVING and its event stream connected.
    healthy: bool = True
    reported_prefill_blocks: int = 0
    reported_decode_blocks: int = 0
    reported_requests: int = 0
    #: Handed out since the last report.
    pending_prefill_blocks: int = 0
    pending_decode_blocks: int = 0
    pending_requests: int = 0
    #: Load reports received so far (tells whether a report has covered a hand-out).
    num_reports: int = 0

    @property
    def worker_id(self) -> str:
        return self.ref.worker_id

    @property
    def active_prefill_blocks(self) -> int:
        return self.reported_prefill_blocks + self.pending_prefill_blocks

    @property
    def active_decode_blocks(self) -> int:
        return self.reported_decode_blocks + self.pending_decode_blocks

    @property
    def active_requests(self) -> int:
        return self.reported_requests + self.pending_requests

    def hand_out(self, prefill_blocks: int, decode_blocks: int) -> None:
        self.pending_prefill_blocks += prefill_blocks
        self.pending_decode_blocks += decode_blocks
        self.pending_requests += 1

    def report(self, prefill_blocks: int, decode_blocks: int, requests: int) -> None:
        """A load report from the worker replaces the estimate."""
        self.reported_prefill_blocks = prefill_blocks
        self.reported_decode_blocks = decode_blocks
        self.reported_requests = requests
        self.pending_prefill_blocks = self.pending_decode_blocks = self.pending_requests = 0
        self.num_reports += 1

    def take_back(self, prefill_blocks: int, decode_blocks: int, reports_then: int) -> None:
        """A request handed out when `num_reports` was `reports_then` completed: take its load
        out of the estimate now rather than wait for the next report (reports come only when
        load changes, at most every load interval). If no report came since the hand-out, the
        load is in the pending part; otherwise a report counted it. The next report corrects
        whatever this gets wrong."""
        if self.num_reports == reports_then:
            self.pending_prefill_blocks = max(self.pending_prefill_blocks - prefill_blocks, 0)
            self.pending_decode_blocks = max(self.pending_decode_blocks - decode_blocks, 0)
            self.pending_requests = max(self.pending_requests - 1, 0)
        else:
            self.reported_prefill_blocks = max(self.reported_prefill_blocks - prefill_blocks, 0)
            self.reported_decode_blocks = max(self.reported_decode_blocks - decode_blocks, 0)
            self.reported_requests = max(self.reported_requests - 1, 0)


@dataclass(frozen=True, slots=True)
class RouteDecision:
    #: Ordered choices: the first is the pick, the rest are fallbacks.
    decode_workers: tuple[WorkerRef, ...]
    prefill_workers: tuple[WorkerRef, ...] = ()
    encode_workers: tuple[WorkerRef, ...] = ()
    disaggregate: bool = False
    overlap_blocks: int = 0

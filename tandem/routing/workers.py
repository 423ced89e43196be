"""Workers the router hands out, and the load it counts for them."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tandem.runtime.devices import Device
from tandem.runtime.served import ServedStats


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


class Health(enum.Enum):
    """A worker's health as the router last heard it on the worker's health stream."""

    UNKNOWN = "unknown"  # no answer yet
    SERVING = "serving"
    NOT_SERVING = "not_serving"  # starting, draining, or its engine stopped making progress
    UNREACHABLE = "unreachable"  # the health stream is broken (process gone, port closed)


@dataclass(frozen=True, slots=True)
class LoadReport:
    """A worker's own load, as it last reported it on its KvEvents stream."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    #: Prompt tokens still to be prefilled over all its requests.
    pending_prefill_tokens: int = 0
    active_decode_blocks: int = 0
    prefix_cache_hit_rate: float = 0.0
    #: The worker's wall clock when it took the snapshot, Unix epoch milliseconds.
    timestamp_unix_ms: int = 0
    #: What it served since it started, as of the snapshot; None: a worker that does not say.
    served: ServedStats | None = None
    #: The devices it computes on; (): a worker that does not say.
    devices: tuple[Device, ...] = ()


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
    #: What the router's watcher last learnt of the worker, for `candidacy_reason` and
    #: operators: its health, whether its event stream is connected, why either last broke.
    health: Health = Health.UNKNOWN
    events_connected: bool = False
    health_error: str = ""
    events_error: str = ""
    #: The last load report and when it arrived (time.monotonic()); None before the first.
    last_load: LoadReport | None = None
    last_load_at: float = 0.0

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

    def take_report(self, load: LoadReport, now: float) -> None:
        """A load report from the worker's event stream, received at `now` (monotonic)."""
        self.last_load, self.last_load_at = load, now
        self.report(-(-load.pending_prefill_tokens // self.block_size), load.active_decode_blocks,
                    load.num_running + load.num_waiting)

    def refresh_candidacy(self) -> bool:
        """A candidate while its health is SERVING and its event stream connected (the index
        and load it routes on are current); returns whether `healthy` changed."""
        healthy = self.health is Health.SERVING and self.events_connected
        changed, self.healthy = healthy != self.healthy, healthy
        return changed

    def candidacy_reason(self) -> str:
        """Why the worker is not a routing candidate, in one line for people; "" when it is."""
        if self.healthy:
            return ""
        if self.health is Health.UNREACHABLE:
            # Its event stream shares the connection: one cause, said once.
            return "unreachable" + (f" ({self.health_error})" if self.health_error else "")
        reasons = {Health.UNKNOWN: ["no health answer yet"],
                   Health.NOT_SERVING: ["health NOT_SERVING"]}.get(self.health, [])
        if not self.events_connected:
            reasons.append(f"event stream down ({self.events_error})" if self.events_error
                           else "event stream not connected yet")
        return "; ".join(reasons) or "taken out of the candidate set"

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
    #: Ordered video workers (video requests only; decode_workers is then empty).
    video_workers: tuple[WorkerRef, ...] = ()
    #: Ordered embedding workers (embedding requests only; decode_workers is then empty).
    embedding_workers: tuple[WorkerRef, ...] = ()

    @property
    def pick(self) -> WorkerRef:
        """The worker that carries the request: the decode (or aggregated), video or
        embedding pick."""
        return (self.decode_workers or self.video_workers or self.embedding_workers)[0]

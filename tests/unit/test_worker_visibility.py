"""Every worker says what it served and on which devices (issue 40, item 5): a prefill worker's
prefills by outcome, the KV its handles made readable, how its leases ended and were held; a
decode worker's KV reads and their mean time; in Prometheus, Worker.Stats, its load reports and
`tandem status`. The prefill worker here is the real one (services.common.worker_main's
registration over a mock engine) served in-process over gRPC."""
from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
import types
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_disagg_engine import BLOCK_BYTES, BS
from test_mock_engine import prompt

from services.common import worker_main
from tandem.engines.args import EngineArgs
from tandem.engines.mock.engine import MockEngine, create_mock_engine
from tandem.engines.types import (
    EngineStats,
    KvHandle,
    KvLayout,
    MemoryDescriptor,
    TransferRecord,
)
from tandem.kv.event_log import EventLog
from tandem.launcher import status as status_cmd
from tandem.routing.snapshot import PoolSnapshot, WorkerSnapshot
from tandem.routing.workers import Health, LoadReport
from tandem.runtime import devices as devices_lib
from tandem.runtime.devices import CPU, Device, worker_devices
from tandem.runtime.router_status import load_from_pb
from tandem.runtime.served import ServedStats, ServedTally, leased_size
from tandem.runtime.server import GrpcService, ServerOptions
from tandem.runtime.worker import Worker
from tandem.runtime.worker_config import WorkerConfig
from tandem.runtime.worker_metrics import WorkerMetrics
from tandem.v1 import (
    common_pb2,
    kv_events_pb2,
    kv_events_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

#: The expiry grace of the worker's tally here (the worker's own is a second).
GRACE_S = 0.05
GPUS = (Device("3", "NVIDIA H200"), Device("4", "NVIDIA H200"))

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(metrics: WorkerMetrics) -> Samples:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@dataclass
class PrefillWorker:
    engine: MockEngine
    served: ServedTally
    metrics: WorkerMetrics
    channel: grpc.aio.Channel

    async def prefill(self, rid: str, tokens: list[int], lease_ms: int | None = None,
                      max_tokens: int = 6) -> prefill_pb2.PrefillResponse:
        request = prefill_pb2.PrefillRequest(
            request_id=rid, token_ids=tokens,
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens))
        if lease_ms is not None:
            request.lease_ms = lease_ms
        return await prefill_pb2_grpc.PrefillStub(self.channel).Prefill(request, timeout=10)

    async def release(self, rid: str) -> bool:
        reply = await prefill_pb2_grpc.PrefillStub(self.channel).Release(
            prefill_pb2.ReleaseRequest(request_id=rid), timeout=10)
        return reply.released

    async def stats(self) -> worker_pb2.StatsResponse:
        return await worker_pb2_grpc.WorkerStub(self.channel).Stats(worker_pb2.StatsRequest(),
                                                                     timeout=10)

    async def first_load(self) -> kv_events_pb2.WorkerLoad:
        stream = kv_events_pb2_grpc.KvEventsStub(self.channel).Subscribe(
            kv_events_pb2.SubscribeRequest(loads_only=True), timeout=10)
        message = await stream.read()
        stream.cancel()
        return message.load


@pytest.fixture
async def worker(tiny_model: str) -> AsyncIterator[PrefillWorker]:
    """A prefill worker as `tandem serve prefill` registers its servicers, with a metrics
    registry wired as run_worker wires it."""
    engine = create_mock_engine(EngineArgs(model=tiny_model, kv_block_size=BS, speedup_ratio=0,
                                           num_gpu_blocks=64))
    await engine.start()
    served = ServedTally(grace_s=GRACE_S)
    metrics = WorkerMetrics("p", engine.stats, "prefill", served.snapshot)
    served.on_hold_end = metrics.observe_hold
    service = GrpcService(ServerOptions("127.0.0.1", 0, grace_s=1), [
        "tandem.v1.Prefill", "tandem.v1.Worker", "tandem.v1.KvEvents"])
    config = WorkerConfig(worker_id="p", disaggregation_mode="prefill", load_interval_ms=10)
    worker_main._registration(worker_main.STAGES["prefill"])(
        Worker(config, engine, EventLog(100), service, served, GPUS))
    await service.start()
    channel = grpc.aio.insecure_channel(service.address)
    try:
        yield PrefillWorker(engine, served, metrics, channel)
    finally:
        await channel.close()
        await service.shutdown()
        await served.close()
        await engine.close()


async def wait_for(predicate, timeout_s: float = 10.0) -> None:  # noqa: ANN001
    """Until `predicate()` holds, checked every 10 ms (leases end on timers: no other signal)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_prefill_and_release_calls_are_counted_everywhere(worker: PrefillWorker) -> None:
    blocks = {"a": 3, "b": 1, "c": 1, "d": 1}  # prompts of 40, 16, 5 and 7 tokens at 16 a block
    assert (await worker.prefill("a", prompt(0, 40))).HasField("kv_handle")
    assert (await worker.prefill("b", prompt(100, 16))).HasField("kv_handle")
    finished = await worker.prefill("f", prompt(200, 20), max_tokens=1)
    assert not finished.HasField("kv_handle")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await worker.prefill("x", [])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await worker.prefill("c", prompt(300, 5), lease_ms=200)
    await worker.prefill("d", prompt(400, 7), lease_ms=200)
    assert worker.served.num_held == 4

    assert await worker.release("a") is True
    assert await worker.release("a") is False  # twice: nothing more to count
    assert await worker.release("nobody") is False
    # c: the engine expires it; a Release that comes after finds nothing (expired, by its
    # length). d: no Release ever comes; the tally's own timer counts it after the grace.
    await wait_for(lambda: worker.engine.stats().kv_lease_expiries == 2)
    assert await worker.release("c") is False
    await wait_for(lambda: worker.served.num_held == 1)  # b's lease runs 30 s

    served = worker.served.snapshot()
    assert served == ServedStats(
        prefills_leased=4, prefills_finished=1, prefills_failed=1,
        kv_bytes_leased=sum(blocks.values()) * BLOCK_BYTES, kv_blocks_leased=sum(blocks.values()),
        kv_leases_released=1, kv_leases_expired=2)
    assert served.num_prefills == 5 and served.mean_read_s is None

    s = samples(worker.metrics)
    assert {outcome: s[("tandem_worker_prefills_total",
                        frozenset({("worker", "p"), ("outcome", outcome)}))]
            for outcome in ("leased", "finished", "failed")} == {
        "leased": 4, "finished": 1, "failed": 1}
    p = frozenset({("worker", "p")})
    assert s[("tandem_worker_kv_bytes_leased_total", p)] == 6 * BLOCK_BYTES
    assert s[("tandem_worker_kv_blocks_leased_total", p)] == 6
    assert s[("tandem_worker_kv_leases_released_total", p)] == 1
    assert s[("tandem_kv_lease_expiries_total", p)] == 2  # the engine's count agrees
    hold = "tandem_worker_kv_lease_hold_seconds"
    released = p | {("ended", "released")}
    expired = p | {("ended", "expired")}
    assert s[(f"{hold}_count", released)] == 1 and s[(f"{hold}_count", expired)] == 2
    assert 0 < s[(f"{hold}_sum", released)] < 5
    # An expired lease was held its whole length: 200 ms from hand-out, less the time between
    # the lease's start in the engine and the handle's hand-out.
    assert 2 * 0.1 < s[(f"{hold}_sum", expired)] <= 2 * 0.2

    stats = await worker.stats()
    assert stats.served.prefills_leased == 4 and stats.served.kv_bytes_leased == 6 * BLOCK_BYTES
    assert stats.served.kv_leases_expired == 2 and stats.served.prefills_failed == 1
    assert [(d.id, d.name) for d in stats.devices] == [("3", "NVIDIA H200"), ("4", "NVIDIA H200")]
    load = load_from_pb(await worker.first_load())
    assert load.served == served and load.devices == GPUS
    # The row `tandem status` prints for it, from that load report.
    snapshot = WorkerSnapshot("p", "p:1", True, Health.SERVING, True, "", 0, 0, 0, 0, 0, load,
                              0.5)
    row = status_cmd.format_table("r:1", [PoolSnapshot("pre", "prefill", "kv", (snapshot,))])
    header, line = row.splitlines()[1:]
    cells = dict(zip(status_cmd._COLUMNS, _cells(header, line), strict=True))
    assert (cells["PREFILLS"], cells["KV LEASED"], cells["KV READ (MEAN)"], cells["GPUS"]) == (
        "5 (1 failed)", "24.0 KiB", "0 B", "3,4 NVIDIA H200")


def _cells(header: str, line: str) -> list[str]:
    """A table line cut at the header's column starts."""
    starts = [header.index(c) for c in status_cmd._COLUMNS]
    return [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None])]


async def test_a_cancelled_prefill_counts_as_failed_and_leaves_no_lease(
        worker: PrefillWorker) -> None:
    worker.engine.pause_steps()
    call = asyncio.ensure_future(worker.prefill("slow", prompt(0, 40)))
    await wait_for(lambda: worker.engine.stats().num_waiting + worker.engine.stats().num_running
                   == 1)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await wait_for(lambda: worker.served.snapshot().prefills_failed == 1)
    worker.engine.resume_steps()
    assert worker.served.snapshot() == ServedStats(prefills_failed=1)
    assert worker.served.num_held == 0


def test_decode_reads_count_bytes_and_mean_time() -> None:
    tally = ServedTally()
    for seconds, num_bytes in ((0.002, 4096), (0.004, 8192)):
        tally.transfer_ended(TransferRecord("r", "p", num_bytes, 0, seconds))
    tally.transfer_ended(TransferRecord("r", "p", 0, 0, 5.0, error="lease expired"))
    served = tally.snapshot()
    assert (served.kv_reads_ok, served.kv_reads_failed, served.kv_bytes_read) == (2, 1, 12288)
    assert served.mean_read_s == pytest.approx(0.003)  # the failed read's 5 s do not count
    assert served.num_prefills == 0


LAYOUT = KvLayout("bfloat16", 2, 2, 16, 16)  # 2 * 2 * 16 * 2 * 16 * 2 = 4096 bytes a block


def test_leased_size_from_descriptors_blocks_or_tokens() -> None:
    pool = KvHandle("p", "p", "r", "nixl", LAYOUT, 40, block_ids=(5, 6, 7),
                    descriptors=tuple(MemoryDescriptor(a, 2048) for a in range(6)))
    copied = dataclasses.replace(pool, descriptors=(MemoryDescriptor(0, 3 * 4096),))
    mock = dataclasses.replace(pool, backend="mock", descriptors=())
    trtllm = KvHandle("p", "p", "r", "trtllm", LAYOUT, 40)  # the transceiver's blocks
    assert LAYOUT.block_bytes == 4096
    assert [leased_size(h) for h in (pool, copied, mock, trtllm)] == [(12288, 3)] * 4


def handle(rid: str, expiry_unix_ms: int) -> KvHandle:
    return KvHandle("p", "p", rid, "mock", LAYOUT, 20, block_ids=(1, 2),
                    lease_expiry_unix_ms=expiry_unix_ms)


async def test_a_lease_ends_once_released_or_expired_never_both() -> None:
    now = [100.0]
    tally = ServedTally(clock=lambda: now[0], wall_clock=lambda: 5000.0, grace_s=60.0)
    ended: list[tuple[str, float]] = []
    tally.on_hold_end = lambda how, seconds: ended.append((how, seconds))
    tally.prefill_served(handle("r", 5_000_000 + 30_000))  # a 30 s lease
    tally.prefill_served(handle("e", 5_000_000 + 2_000))  # a 2 s lease
    now[0] = 100.25
    tally.release_answered("r", True)
    tally.release_answered("r", False)  # a second Release finds nothing: no expiry either
    now[0] = 103.0
    tally.release_answered("e", False)  # the engine had expired it: held its whole length
    tally.release_answered("e", False)
    assert ended == [("released", 0.25), ("expired", 2.0)]
    assert tally.num_held == 0
    assert (tally.snapshot().kv_leases_released, tally.snapshot().kv_leases_expired) == (1, 1)


async def test_a_handle_without_blocks_is_no_lease_to_time() -> None:
    tally = ServedTally(grace_s=0.0)
    ended: list[tuple[str, float]] = []
    tally.on_hold_end = lambda how, seconds: ended.append((how, seconds))
    expiry = int(time.time() * 1000) + 10
    tally.prefill_served(KvHandle("p", "p", "t", "trtllm", LAYOUT, 40,
                                  lease_expiry_unix_ms=expiry))
    assert tally.num_held == 0
    tally.release_answered("t", False)  # TensorRT-LLM's Release frees nothing: not an expiry
    await asyncio.sleep(0.05)
    assert ended == [] and tally.snapshot() == ServedStats(
        prefills_leased=1, kv_bytes_leased=12288, kv_blocks_leased=3)


def test_prometheus_exposes_the_served_metrics_by_name() -> None:
    served = ServedStats(prefills_leased=3, prefills_finished=1, kv_bytes_leased=8192,
                         kv_blocks_leased=2, kv_leases_released=2)
    idle = EngineStats(0, 0, 0, 0, 0, 0, 0.0)
    metrics = WorkerMetrics("w", lambda: idle, "prefill", lambda: served)
    metrics.observe_hold("released", 0.02)
    text = generate_latest(metrics.registry).decode()
    lines = set(text.splitlines())
    assert {'tandem_worker_prefills_total{outcome="leased",worker="w"} 3.0',
            'tandem_worker_prefills_total{outcome="finished",worker="w"} 1.0',
            'tandem_worker_prefills_total{outcome="failed",worker="w"} 0.0',
            'tandem_worker_kv_bytes_leased_total{worker="w"} 8192.0',
            'tandem_worker_kv_blocks_leased_total{worker="w"} 2.0',
            'tandem_worker_kv_leases_released_total{worker="w"} 2.0',
            'tandem_worker_kv_lease_hold_seconds_count{ended="released",worker="w"} 1.0',
            'tandem_worker_kv_lease_hold_seconds_count{ended="expired",worker="w"} 0.0',
            'tandem_worker_kv_lease_hold_seconds_bucket{ended="released",le="0.025",worker="w"} '
            '1.0'} <= lines
    (help_line,) = [line for line in lines
                    if line.startswith("# HELP tandem_worker_kv_bytes_leased_total")]
    assert "one-sided NIXL READs this worker does not see" in help_line
    # The decode side's were there already, once each.
    names = [line.split()[2] for line in lines if line.startswith("# TYPE")]
    for name in ("tandem_kv_transfer_bytes_total", "tandem_kv_transfers_total",
                 "tandem_kv_transfer_failures_total", "tandem_kv_transfer_seconds"):
        assert names.count(name) == 1, name


@pytest.mark.parametrize(("visible", "names", "expected"), [
    (None, [], CPU),
    ("", [], CPU),
    ("-1", [], CPU),
    ("3", [], (Device("3"),)),
    ("2,3", ["NVIDIA H200", "NVIDIA H200"], (Device("2", "NVIDIA H200"),
                                             Device("3", "NVIDIA H200"))),
    ("GPU-0a1b,-1,5", ["NVIDIA H200"], (Device("GPU-0a1b", "NVIDIA H200"),)),
    (None, ["NVIDIA H200"], (Device("0", "NVIDIA H200"),)),
])
def test_a_worker_finds_its_gpus_in_its_environment(
        visible: str | None, names: list[str], expected: tuple[Device, ...]) -> None:
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert worker_devices(environ, names) == expected


def test_device_names_come_only_from_cuda_the_engine_initialised(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    cuda = types.SimpleNamespace(
        is_initialized=lambda: bool(calls.append("checked")) or initialised,
        device_count=lambda: 2, get_device_name=lambda i: f"GPU model {i}")
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    initialised = False
    assert devices_lib.cuda_device_names() == [] and calls == ["checked"]
    initialised = True
    assert worker_devices({"CUDA_VISIBLE_DEVICES": "6,7"}) == (Device("6", "GPU model 0"),
                                                               Device("7", "GPU model 1"))


def test_gpus_cell() -> None:
    describe = devices_lib.describe
    assert describe(()) == "-" and describe(CPU) == "cpu"
    assert describe((Device("3"),)) == "3"
    assert describe(GPUS) == "3,4 NVIDIA H200"
    assert describe((Device("0", "NVIDIA H200"), Device("1", "NVIDIA A100"))) == (
        "0 NVIDIA H200, 1 NVIDIA A100")


def test_status_table_shows_what_each_worker_served_and_its_gpus() -> None:
    prefill = LoadReport(kv_blocks_total=100, served=ServedStats(
        prefills_leased=11, prefills_finished=1, kv_bytes_leased=3 * 1024 * 1024),
        devices=(Device("0", "NVIDIA H200"),))
    decode = LoadReport(kv_blocks_total=100, served=ServedStats(
        kv_reads_ok=4, kv_bytes_read=1536, kv_read_seconds=0.0125, kv_reads_failed=1),
        devices=CPU)
    old = LoadReport(kv_blocks_total=100)  # a worker that says neither

    def snap(worker_id: str, load: LoadReport | None) -> WorkerSnapshot:
        return WorkerSnapshot(worker_id, worker_id, True, Health.SERVING, True, "", 0, 0, 0, 0,
                              0, load, 0.0 if load else None)
    table = status_cmd.format_table("r:1", [
        PoolSnapshot("pre", "prefill", "kv", (snap("p:0", prefill),)),
        PoolSnapshot("dec", "decode", "kv", (snap("d:0", decode), snap("d:1", old),
                                             snap("d:2", None)))])
    header, *lines = table.splitlines()[1:]
    rows = {cells[2]: cells[8:12] for cells in (_cells(header, line) for line in lines)}
    assert rows == {
        "p:0": ["12", "3.0 MiB", "0 B", "0 NVIDIA H200"],
        "d:0": ["0", "0 B", "1.5 KiB (3.12 ms), 1 failed", "cpu"],
        "d:1": ["-", "-", "-", "-"],
        "d:2": ["-", "-", "-", "-"]}
    listed = status_cmd.format_json("r:1", [PoolSnapshot("pre", "prefill", "kv",
                                                         (snap("p:0", prefill),))])
    assert '"prefills_leased": 11' in listed and '"name": "NVIDIA H200"' in listed

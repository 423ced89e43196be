"""`tandem up`'s side of the planner: the PoolScaler against recorded processes (what it starts,
stops, and tells the router), the launcher's control API over a real socket, and the local
connector on top of it."""
from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Mapping

import pytest

from tandem.errors import InvalidRequest, NotFound, Unavailable
from tandem.launcher.deployment import Deployment, DeploymentPool
from tandem.launcher.pool_view import WorkerPhase
from tandem.launcher.processes import processes
from tandem.launcher.scaling import PoolScaler
from tandem.launcher.served_models import model_topologies
from tandem.launcher.workers import ServiceProcess
from tandem.planner.local import LocalConnector
from tandem.runtime import launcher_control


class Recorded:
    """scaling.Processes that records; a worker serves once `serve` is called, and a stop
    returns once `exit` is."""

    def __init__(self) -> None:
        self.started: list[ServiceProcess] = []
        self.stopping: list[str] = []
        self._serving: dict[str, asyncio.Event] = {}
        self._exited: dict[str, asyncio.Event] = {}

    def start(self, spec: ServiceProcess) -> None:
        self.started.append(spec)

    async def serving(self, spec: ServiceProcess) -> bool:
        await self._event(self._serving, spec.name).wait()
        return True

    async def stop(self, name: str) -> None:
        self.stopping.append(name)
        await self._event(self._exited, name).wait()

    def pid(self, name: str) -> int:
        return 1000 + len(name)

    def serve(self, name: str) -> None:
        self._event(self._serving, name).set()

    def exit(self, name: str) -> None:
        self._event(self._exited, name).set()

    @staticmethod
    def _event(events: dict[str, asyncio.Event], name: str) -> asyncio.Event:
        return events.setdefault(name, asyncio.Event())


def make(tmp_path: pathlib.Path, pool: DeploymentPool, engine: str = "mock",
         ) -> tuple[PoolScaler, Recorded, list[Mapping[str, list[int]]]]:
    d = Deployment(engine=engine, pools=[pool], worker_metrics_ports=[])
    recorded, published = Recorded(), []
    ports = iter(range(20000, 20100))
    scaler = PoolScaler(d, model_topologies(d)[0], processes(d, tmp_path), recorded,
                        published.append, lambda: next(ports))
    scaler.start()
    scaler.open()
    return scaler, recorded, published


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_growing_starts_workers_as_the_first_ones_and_tells_the_router(
        tmp_path: pathlib.Path) -> None:
    scaler, recorded, published = make(tmp_path, DeploymentPool("decode", "decode", [9200]))
    result = scaler.scale("decode", 3)
    assert result.shortfall == ""
    assert [s.name for s in recorded.started] == ["decode-1", "decode-2"]
    first = processes(Deployment(engine="mock", pools=[DeploymentPool("decode", "decode",
                                                                        [9200])]), tmp_path)[0]
    added = recorded.started[0]
    # The same command line as the pool's first worker, on the new port.
    assert added.argv == [a if a != "9200" else "20000" for a in first.argv]
    assert added.health_address == "127.0.0.1:20000"
    assert published[-1] == {"decode": [9200, 20000, 20001]}
    view = scaler.views()[0]
    assert [w.phase for w in view.workers] == [WorkerPhase.STARTING] * 3
    recorded.serve("decode-1")
    await settle()
    assert scaler.views()[0].workers[1].phase is WorkerPhase.SERVING
    assert scaler.scale("decode", 3).pool.num_workers == 3 and len(recorded.started) == 2
    await scaler.close()


async def test_shrinking_drains_the_named_workers_first_and_forgets_them_once_gone(
        tmp_path: pathlib.Path) -> None:
    scaler, recorded, published = make(tmp_path, DeploymentPool("decode", "decode",
                                                                [9200, 9201, 9202, 9203]))
    # An id the pool does not have is skipped; past the named ones, the newest goes.
    result = scaler.scale("decode", 1, ["127.0.0.1:9999", "127.0.0.1:9201"])
    await settle()
    assert recorded.stopping == ["decode-1", "decode-3", "decode-2"]
    assert result.pool.num_workers == 1
    phases = {w.name: w.phase for w in result.pool.workers}
    assert phases["decode-0"] is WorkerPhase.STARTING
    assert {phases[n] for n in ("decode-1", "decode-2", "decode-3")} == {WorkerPhase.DRAINING}
    # Draining workers stay the router's members until they exited.
    assert published == []
    recorded.exit("decode-3")
    await settle()
    assert published[-1] == {"decode": [9200, 9201, 9202]}
    assert [w.name for w in scaler.views()[0].workers] == ["decode-0", "decode-1", "decode-2"]
    # Draining ones do not count: growing back to 2 starts a new worker.
    scaler.scale("decode", 2)
    assert [s.name for s in recorded.started] == ["decode-4"]
    await scaler.close()


async def test_what_it_refuses(tmp_path: pathlib.Path) -> None:
    d = Deployment(engine="mock", pools=[DeploymentPool("decode", "decode", [9200])])
    scaler = PoolScaler(d, model_topologies(d)[0], processes(d, tmp_path), Recorded(),
                        lambda _: None, lambda: 1)
    with pytest.raises(Unavailable):  # still starting
        scaler.scale("decode", 2)
    scaler.open()
    with pytest.raises(NotFound, match="decode"):
        scaler.scale("prefill", 2)
    with pytest.raises(InvalidRequest, match="at least 1"):
        scaler.scale("decode", 0)


async def test_a_placed_pool_grows_onto_its_spare_gpus_only(tmp_path: pathlib.Path) -> None:
    pool = DeploymentPool("decode", "decode", [9200], gpus=["0"], spare_gpus=["2", "3"])
    scaler, recorded, _ = make(tmp_path, pool, engine="reference")
    assert scaler.views()[0].max_workers == 3
    result = scaler.scale("decode", 4)
    assert result.shortfall.startswith("no free GPU entry")
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in recorded.started] == ["2", "3"]
    assert [w.gpus for w in result.pool.workers] == [(0,), (2,), (3,)]
    # A removed worker's GPU is free again.
    scaler.scale("decode", 2, ["127.0.0.1:20000"])
    recorded.exit("decode-1")
    await settle()
    scaler.scale("decode", 3)
    assert recorded.started[-1].env["CUDA_VISIBLE_DEVICES"] == "2"
    await scaler.close()


@pytest.mark.parametrize(("spare", "match"), [
    (["0"], "GPU 0 is listed for decode-0 and decode spare entry 0"),
    (["1", "1"], "GPU 1 is listed for decode spare entry 0 and decode spare entry 1"),
    (["x"], "non-negative integers")])
def test_spare_gpus_are_free_gpus_or_shared_as_placement_allows(
        tmp_path: pathlib.Path, spare: list[str], match: str) -> None:
    pool = DeploymentPool("decode", "decode", [9200], gpus=["0"], spare_gpus=spare)
    with pytest.raises(InvalidRequest, match=match):
        make(tmp_path, pool, engine="reference")


async def test_spare_entries_may_share_a_gpu_with_the_pools_share(
        tmp_path: pathlib.Path) -> None:
    pool = DeploymentPool("decode", "decode", [9200], gpus=["0"], spare_gpus=["0", "0"],
                          gpu_memory_fraction=0.3)
    scaler, recorded, _ = make(tmp_path, pool, engine="reference")
    scaler.scale("decode", 3)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in recorded.started] == ["0", "0"]
    assert all(s.argv[s.argv.index("--gpu-memory-fraction") + 1] == "0.3"
               for s in recorded.started)
    with pytest.raises(InvalidRequest, match="sum to 1.2"):
        make(tmp_path, DeploymentPool("decode", "decode", [9200], gpus=["0"],
                                      spare_gpus=["0", "0", "0"], gpu_memory_fraction=0.3),
             engine="reference")
    await scaler.close()


def test_spare_gpus_need_a_placed_pool(tmp_path: pathlib.Path) -> None:
    with pytest.raises(InvalidRequest, match="spare_gpus"):
        make(tmp_path, DeploymentPool("decode", "decode", [9200], spare_gpus=["1"]),
             engine="reference")


async def test_the_control_api_and_the_local_connector(tmp_path: pathlib.Path) -> None:
    scaler, recorded, _ = make(tmp_path, DeploymentPool("decode", "decode", [9200, 9201]))
    server, address = await launcher_control.serve(
        scaler, launcher_control.control_address(str(tmp_path)))
    assert address == f"unix:{tmp_path}/launcher.sock"
    connector = LocalConnector(address)
    try:
        assert await connector.actual() == {"decode": 2}
        await connector.scale("decode", 1, ["127.0.0.1:9200"])
        await settle()
        assert recorded.stopping == ["decode-0"]
        assert await connector.actual() == {"decode": 1}
        pools = await connector.client.list_pools()
        assert [(w.name, w.phase, w.pid) for w in pools[0].workers] == [
            ("decode-0", WorkerPhase.DRAINING, 1008), ("decode-1", WorkerPhase.STARTING, 1008)]
        with pytest.raises(NotFound, match="no pool 'prefill'"):
            await connector.scale("prefill", 2)
    finally:
        await connector.close()
        await server.stop(None)
        await scaler.close()

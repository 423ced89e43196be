"""The connector for `tandem up --planner`: the launcher's control API on this machine
(Launcher.ListPools and Launcher.ScalePool, tandem.runtime.launcher_control), which starts
workers on free ports and GPUs and drains the ones it removes (tandem.launcher.scaling)."""
from __future__ import annotations

import logging
from collections.abc import Sequence

from tandem.planner.connector import Connector
from tandem.runtime.launcher_control import LauncherClient

log = logging.getLogger("tandem.planner")


class LocalConnector(Connector):
    def __init__(self, launcher_address: str, timeout_s: float = 10.0) -> None:
        self.client = LauncherClient(launcher_address)
        self.timeout_s = timeout_s

    async def actual(self) -> dict[str, int]:
        """Raises TandemError (Unavailable) when the launcher cannot be reached."""
        return {pool.name: pool.num_workers
                for pool in await self.client.list_pools(self.timeout_s)}

    async def scale(self, pool: str, target: int, remove: Sequence[str] = ()) -> None:
        """Raises TandemError as the launcher answers (NotFound, InvalidRequest, Unavailable
        while it starts). A pool that could not reach its target (no free GPU entry) is not
        an error: the launcher did what it could, and the next interval asks again."""
        result = await self.client.scale_pool(pool, target, remove, self.timeout_s)
        if result.shortfall:
            log.warning("pool short of its target", extra={
                "pool": pool, "target": target, "have": result.pool.num_workers,
                "why": result.shortfall})

    async def close(self) -> None:
        await self.client.close()

"""What the planner acts through: a connector reads and sets each pool's worker count on one kind
of deployment (`tandem up` on this machine: tandem.planner.local; Kubernetes: tandem.planner.k8s).

The planner keeps no state that matters: each interval it asks the connector what each pool has
and hands it the targets it decided. So a connector must be safe to call again with the same
target (a no-op), and must leave the deployment as it is when the planner stops calling it (the
planner being killed changes nothing about serving).
"""
from __future__ import annotations

import abc
from collections.abc import Sequence


class Connector(abc.ABC):
    """Acts on a deployment: reads and sets each pool's worker count."""

    @abc.abstractmethod
    async def actual(self) -> dict[str, int]:
        """Workers each pool has now (those starting included, those draining excluded)."""

    @abc.abstractmethod
    async def scale(self, pool: str, target: int, remove: Sequence[str] = ()) -> None:
        """Brings `pool` to `target` workers; when shrinking, `remove` names (worker ids, as the
        router knows them: "host:port") the workers to remove first, in order; the connector
        drains them (no new requests; in-flight ones finish or migrate within the grace period)
        before they exit."""

    async def close(self) -> None:  # noqa: B027 (optional: a connector may hold nothing)
        """Releases what the connector holds (channels, clients); the deployment is untouched."""

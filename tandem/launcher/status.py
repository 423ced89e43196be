"""`tandem status`: every pool and worker as a router sees them (Router.ListWorkers), as a table
for an operator or as JSON for scripts. What a worker served and its devices come with the load
it last reported on its event stream. With a `tandem up` on this machine: its processes, and
its planner's targets and last decisions with their reasons (the planner's report file)."""
from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.errors import TandemError
from tandem.launcher.supervisor import read_state, state_path
from tandem.planner.report import format_report, read_report
from tandem.routing.snapshot import PoolSnapshot, WorkerSnapshot
from tandem.runtime import config as config_lib
from tandem.runtime import devices as devices_lib
from tandem.runtime.router_status import RouterStatusClient
from tandem.runtime.tls import TlsConfig


@dataclass(frozen=True)
class StatusConfig:
    # == network ==
    #: The router's gRPC address, host:port.
    router_address: str = "127.0.0.1:9100"
    #: Longest wait for the router's answer, seconds.
    timeout_s: float = field(default=10.0, metadata={"env": False})
    # == general ==
    #: Print JSON (the ListWorkers answer) instead of a table.
    json: bool = field(default=False, metadata={"env": False})
    # == security ==
    #: Sent as 'authorization: Bearer <key>' metadata (for a router behind a gateway that
    #: checks keys; the router itself checks none).
    api_key: str = field(default="", metadata={"secret": True})
    #: The services' TLS flags: --tls-ca-file alone verifies the router (TLS); with
    #: --tls-cert-file and --tls-key-file the client presents a certificate (mTLS).
    tls: TlsConfig = field(default_factory=TlsConfig)


_COLUMNS = ("POOL", "KIND", "WORKER", "ADDRESS", "CANDIDATE", "IN-FLIGHT", "KV USED/TOTAL",
            "RUN/WAIT", "PREFILLS", "KV LEASED", "KV READ (MEAN)", "GPUS", "REPORTED",
            "WHY NOT A CANDIDATE")
_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def _kv(w: WorkerSnapshot) -> str:
    load = w.last_load
    if load is None:
        return "-"
    percent = f" ({100 * load.kv_blocks_used / load.kv_blocks_total:.0f}%)" \
        if load.kv_blocks_total else ""
    return f"{load.kv_blocks_used}/{load.kv_blocks_total}{percent}"


def format_bytes(num_bytes: int) -> str:
    """"0 B", "512 B", "1.5 KiB", "3.0 MiB"."""
    value, unit = float(num_bytes), 0
    while value >= 1024 and unit < len(_BYTE_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{num_bytes} B" if unit == 0 else f"{value:.1f} {_BYTE_UNITS[unit]}"


def format_seconds(seconds: float) -> str:
    """"0.42 ms", "3.12 ms", "25.3 ms", "1.25 s"."""
    if seconds < 0.01:
        return f"{seconds * 1000:.2f} ms"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _served(w: WorkerSnapshot) -> tuple[str, str, str]:
    """PREFILLS, KV LEASED, KV READ (MEAN): "-" without a report that says."""
    served = w.last_load.served if w.last_load is not None else None
    if served is None:
        return "-", "-", "-"
    failed = f" ({served.prefills_failed} failed)" if served.prefills_failed else ""
    mean = served.mean_read_s
    read = format_bytes(served.kv_bytes_read) + (f" ({format_seconds(mean)})"
                                                 if mean is not None else "")
    if served.kv_reads_failed:
        read += f", {served.kv_reads_failed} failed"
    return f"{served.num_prefills}{failed}", format_bytes(served.kv_bytes_leased), read


def _row(pool: PoolSnapshot, w: WorkerSnapshot) -> tuple[str, ...]:
    load = w.last_load
    return (pool.name, pool.kind, w.worker_id, w.address, "yes" if w.candidate else "no",
            str(w.in_flight_requests), _kv(w),
            f"{load.num_running}/{load.num_waiting}" if load else "-", *_served(w),
            devices_lib.describe(load.devices) if load else "-",
            f"{w.last_load_age_s:.1f}s ago" if w.last_load_age_s is not None else "never",
            w.reason)


def format_table(address: str, pools: Sequence[PoolSnapshot]) -> str:
    """One line per worker under a summary line; REPORTED is the age of the load the worker
    last sent on its event stream, which also says what it served since it started (prefills;
    KV its handles made readable; KV it read, with the mean time of a read) and its GPUs."""
    rows = [_row(pool, w) for pool in pools for w in pool.workers]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(_COLUMNS)]
    candidates = sum(r[4] == "yes" for r in rows)
    lines = [f"router {address}: {len(pools)} pool(s), {len(rows)} worker(s), "
             f"{candidates} candidate(s)"]
    for r in (_COLUMNS, *rows):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(r, widths)).rstrip())
    return "\n".join(lines)


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def format_json(address: str, pools: Sequence[PoolSnapshot],
                launcher: dict[str, Any] | None = None,
                planner: dict[str, Any] | None = None) -> str:
    body: dict[str, Any] = {"router": address,
                            "pools": [_plain(dataclasses.asdict(p)) for p in pools]}
    if launcher is not None:
        body["launcher"] = launcher
    if planner is not None:
        body["planner"] = planner
    return json.dumps(body, indent=2)


async def fetch(config: StatusConfig) -> list[PoolSnapshot]:
    async with RouterStatusClient(config.router_address, config.tls, config.api_key,
                                  ca_only_tls=True) as client:
        return await client.list_workers(config.timeout_s)


_LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]", "0.0.0.0")
_SERVICE_COLUMNS = ("SERVICE", "PID", "STATE", "RESTARTS", "LAST EXIT")


def launcher_state(router_address: str) -> dict[str, Any] | None:
    """What a `tandem up` on this machine with that router port says of its processes."""
    host, _, port = router_address.rpartition(":")
    if host not in _LOCAL_HOSTS or not port.isdigit():
        return None
    return read_state(state_path(int(port)))


def format_services(state: dict[str, Any]) -> str:
    """The launcher's processes: one line each, with restart counts and how each last exited."""
    rows = [(s["name"], str(s["pid"]), s["state"], str(s["restarts"]), s["last_exit"] or "-")
            for s in state["services"]]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(_SERVICE_COLUMNS)]
    restarts = sum(int(s["restarts"]) for s in state["services"])
    lines = [f"tandem up (pid {state['launcher_pid']}, restart policy "
             f"{state['restart_policy']}): {len(rows)} service(s), {restarts} restart(s)"]
    for r in (_SERVICE_COLUMNS, *rows):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(r, widths)).rstrip())
    return "\n".join(lines)


def planner_report(state: dict[str, Any] | None) -> dict[str, Any] | None:
    """The report of the planner a `tandem up --planner` runs (its targets, last decisions and
    why); None without one, or before it wrote any."""
    path = (state or {}).get("planner_status")
    return read_report(path) if isinstance(path, str) else None


def _launcher_text(state: dict[str, Any] | None, planner: dict[str, Any] | None) -> str:
    parts = [format_services(state)] if state is not None else []
    parts += [format_report(planner)] if planner is not None else []
    return "\n\n".join(parts)


def main(argv: Sequence[str]) -> int:
    config = config_lib.load(StatusConfig, argv, prog="tandem status",
                             description="Show every pool and worker of a Tandem router: "
                                         "routing candidate or not (and why), load, KV usage; "
                                         "with a `tandem up` on this machine, its processes "
                                         "and their restarts.")
    state = launcher_state(config.router_address)
    planner = planner_report(state)
    try:
        pools = asyncio.run(fetch(config))
    except TandemError as exc:
        message = " ".join(exc.message.split())  # one line, whatever gRPC said
        if config.router_address not in message:
            message = f"router {config.router_address}: {message}"
        # The router may be the one restarting: say what the launcher knows all the same.
        if config.json:
            print(json.dumps({"router": config.router_address, "error": message,
                              **({"launcher": state} if state is not None else {}),
                              **({"planner": planner} if planner is not None else {})},
                             indent=2), flush=True)
        elif state is not None:
            print(_launcher_text(state, planner), flush=True)
        print(f"tandem status: {message}", file=sys.stderr)
        return 1
    try:
        if config.json:
            print(format_json(config.router_address, pools, state, planner), flush=True)
        else:
            launcher = _launcher_text(state, planner)
            print(format_table(config.router_address, pools)
                  + (f"\n\n{launcher}" if launcher else ""), flush=True)
    except BrokenPipeError:  # `tandem status | head`: the reader took what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0

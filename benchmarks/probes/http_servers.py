"""Which HTTP server costs the least CPU per streamed SSE event and per request (issue 23, item 3).

Six servers answer the same endpoint, each in its own process with one worker (one process,
one event loop, uvloop everywhere):

    aiohttp        web.Application + AppRunner(handler_cancellation=True, access_log=None), as
                   Tandem's frontend (services/frontend/main.py) but without its middlewares
    uvicorn        a raw ASGI app (no framework) on uvicorn with httptools and uvloop
    granian-rsgi   the same endpoint on granian's RSGI interface (one worker process, one
                   runtime thread, single-threaded runtime, uvloop)
    granian-asgi   the ASGI app of the uvicorn row on granian
    granian-embed  the RSGI app on granian's experimental embedded server (granian.server.embed)
                   in this script's own uvloop loop: how Tandem would keep grpc.aio on the loop
    bare           an asyncio.Protocol HTTP/1.1 server written below: parses a POST with
                   Content-Length, answers 200 chunked text/event-stream, one chunk per event

POST /stream with a small chat-completions-like JSON body whose "max_tokens" (N) and "gap_ms"
pick the answer: N events of 126 bytes (an OpenAI chat.completion.chunk with one token), an
asyncio.sleep(gap) between them, then `data: [DONE]`. The two gaps measure different things.
At 0 a stream's events are written back to back with no wake-up between them: uvloop sends each
at once (one write syscall per event while the client keeps up), granian's hyper gathers ~10 per
writev; the cost is mostly the server's own code per write. At 5 ms every event is a wake-up and
a send of its own, as in a token stream paced by engine steps (granian: plus a hop from its
Python thread to its Rust I/O thread, an eventfd write and a second epoll wake per event).

The load generator is this script with --loadgen in its own process, the same for every server:
raw asyncio.Protocol connections on uvloop (cheaper than aiohttp's client, so the server is the
limit more often at gap 0), C keep-alive connections opened and warmed before the measurement,
each sending requests back to back until the point's requests are done. It checks every answer
(200, chunked, text/event-stream, N events then [DONE]). The driver reads the server's utime +
stime (its process and its descendants: granian's worker) from /proc/<pid>/stat when the load
starts and ends. Per point (gap, C) it runs N=5 and N=200 and fits CPU per request = a + b*N:
b is the cost of an event, a the cost of a request apart from its events (connections are kept
alive, so a excludes connect/accept). N=5 rather than 20 for the short run: at 5 ms gaps 20
events cost ~5x the request itself, and the intercept drowned in the machine's noise. All
servers run at once on their own ports (an idle one costs nothing); within a round every point
alternates over the servers (the order rotates by round), and a ratio to aiohttp is taken within
a round, then the median over rounds: this machine may be shared and noisy, and ratios within a
round hold up better than absolute values.

Setup (uvicorn, httptools and granian stay out of Tandem's pyproject; aiohttp and uvloop pinned
to the versions in Tandem's virtualenv):

    .venv/bin/python -m venv /tmp/httpbench-venv
    /tmp/httpbench-venv/bin/pip install \\
        "aiohttp==$(.venv/bin/python -c 'import aiohttp; print(aiohttp.__version__)')" \\
        "uvloop==$(.venv/bin/python -c 'import uvloop; print(uvloop.__version__)')" \\
        uvicorn httptools granian

Usage (from the repository root; a server whose packages are missing is skipped with a line
saying so, e.g. uvicorn and granian under Tandem's own .venv):

    /tmp/httpbench-venv/bin/python benchmarks/probes/http_servers.py              # 3 rounds, ~12 min
    /tmp/httpbench-venv/bin/python benchmarks/probes/http_servers.py --quick      # smoke, ~1 min
    /tmp/httpbench-venv/bin/python benchmarks/probes/http_servers.py --json /tmp/http_servers.json
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import json
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._procstats import CLK_TCK, descendants, read_stat  # noqa: E402

HERE = Path(__file__).resolve().parent
HOST = "127.0.0.1"
#: Server name -> the modules it needs.
SERVERS: dict[str, tuple[str, ...]] = {
    "aiohttp": ("aiohttp", "uvloop"),
    "uvicorn": ("uvicorn", "httptools", "uvloop"),
    "granian-rsgi": ("granian", "uvloop"),
    "granian-asgi": ("granian", "uvloop"),
    "granian-embed": ("granian", "uvloop"),
    "bare": ("uvloop",),
}
BASELINE = "aiohttp"
READY_TIMEOUT_S = 30

# ---- the endpoint, the same for every server ------------------------------------------------

# 126 bytes with the SSE framing: an OpenAI chat.completion.chunk carrying one token.
_EVENT = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","model":"m",'
          b'"choices":[{"index":0,"delta":{"content":" t%05d"}}]}\n\n')
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def event(i: int) -> bytes:
    return _EVENT % (i % 100_000)


def parse_spec(body: bytes) -> tuple[int, float]:
    """(events, gap in seconds) from the request body."""
    spec = json.loads(body)
    return int(spec["max_tokens"]), float(spec.get("gap_ms", 0)) / 1000


def request_body(num_events: int, gap_ms: float) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}],
                       "stream": True, "max_tokens": num_events, "gap_ms": gap_ms}).encode()


def run_on_uvloop(main: Coroutine[Any, Any, None]) -> None:
    import uvloop  # as tandem/runtime/loop.py

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)


async def serve_aiohttp(port: int) -> None:
    from aiohttp import web

    async def stream(request: web.Request) -> web.StreamResponse:
        num_events, gap = parse_spec(await request.read())
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        for i in range(num_events):
            if i and gap:
                await asyncio.sleep(gap)
            await response.write(event(i))
        await response.write(DONE)
        return response

    app = web.Application()
    app.router.add_post("/stream", stream)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, HOST, port).start()
    await asyncio.Event().wait()


async def asgi_app(scope: dict, receive: Any, send: Any) -> None:
    """The endpoint as a raw ASGI app (uvicorn, granian --interface asgi)."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    num_events, gap = parse_spec(body)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(k.lower().encode(), v.encode()) for k, v in SSE_HEADERS.items()]})
    for i in range(num_events):
        if i and gap:
            await asyncio.sleep(gap)
        await send({"type": "http.response.body", "body": event(i), "more_body": True})
    await send({"type": "http.response.body", "body": DONE, "more_body": False})


async def rsgi_app(scope: Any, protocol: Any) -> None:
    """The endpoint on granian's RSGI interface."""
    num_events, gap = parse_spec(await protocol())
    transport = protocol.response_stream(200, list(SSE_HEADERS.items()))
    for i in range(num_events):
        if i and gap:
            await asyncio.sleep(gap)
        await transport.send_bytes(event(i))
    await transport.send_bytes(DONE)


class BareSse(asyncio.Protocol):
    """Minimal HTTP/1.1: one request at a time per connection, POST with Content-Length only."""

    _HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
             b"Transfer-Encoding: chunked\r\n\r\n")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.answering: asyncio.Task | None = None
        self.writable: asyncio.Future | None = None  # set while the transport is paused

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.answering is not None:
            self.answering.cancel()
        self.resume_writing()

    def pause_writing(self) -> None:
        self.writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.writable = None

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.answering is None:
            self._next_request()

    def _next_request(self) -> None:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buffer[:end]).lower()
        start = head.find(b"\r\ncontent-length:")
        line_end = head.find(b"\r\n", start + 2)
        length = int(head[start + 17:line_end if line_end >= 0 else None]) if start >= 0 else 0
        if len(self.buffer) < end + 4 + length:
            return
        body = bytes(self.buffer[end + 4:end + 4 + length])
        del self.buffer[:end + 4 + length]
        assert self.transport is not None
        if not head.startswith(b"post /stream "):
            self.transport.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            return self._next_request()
        self.answering = asyncio.get_running_loop().create_task(self._answer(body))

    async def _answer(self, body: bytes) -> None:
        assert self.transport is not None
        num_events, gap = parse_spec(body)
        write = self.transport.write
        write(self._HEAD)
        for i in range(num_events):
            if i and gap:
                await asyncio.sleep(gap)
            data = event(i)
            write(b"%x\r\n%b\r\n" % (len(data), data))
            if self.writable is not None:
                await self.writable
        write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(DONE), DONE))
        self.answering = None
        self._next_request()


async def serve_granian_embed(port: int) -> None:
    from granian.constants import HTTPModes, Interfaces
    from granian.log import LogLevels
    from granian.server.embed import Server

    await Server(rsgi_app, address=HOST, port=port, interface=Interfaces.RSGI,
                 http=HTTPModes.http1, websockets=False, log_level=LogLevels.error).serve()


async def serve_bare(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(BareSse, HOST, port)
    await server.serve_forever()


def serve_uvicorn(port: int) -> None:
    import uvicorn  # it makes its own uvloop loop

    uvicorn.Server(uvicorn.Config(asgi_app, host=HOST, port=port, loop="uvloop",
                                  http="httptools", ws="none", lifespan="off",
                                  access_log=False, log_level="warning")).run()


#: The servers this script runs itself (--serve NAME); granian's own CLI runs the others.
IN_SCRIPT: dict[str, Callable[[int], None]] = {
    "aiohttp": lambda port: run_on_uvloop(serve_aiohttp(port)),
    "uvicorn": serve_uvicorn,
    "granian-embed": lambda port: run_on_uvloop(serve_granian_embed(port)),
    "bare": lambda port: run_on_uvloop(serve_bare(port)),
}


def server_command(name: str, port: int) -> list[str]:
    if name not in IN_SCRIPT:
        return [sys.executable, "-m", "granian", "--interface", name.removeprefix("granian-"),
                "--host", HOST, "--port", str(port), "--workers", "1", "--runtime-threads", "1",
                "--runtime-mode", "st", "--loop", "uvloop", "--http", "1", "--no-ws",
                "--log-level", "warning", "--working-dir", str(HERE),
                f"http_servers:{name.removeprefix('granian-')}_app"]
    return [sys.executable, str(Path(__file__).resolve()), "--serve", name, "--port", str(port)]


# ---- load generator (its own process) --------------------------------------------------------

class StreamClient(asyncio.Protocol):
    """One keep-alive connection: sends a request, reads its chunked SSE answer, counts events."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.answer: asyncio.Future[int] | None = None
        self.in_body = False
        self.events = 0
        self.tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(f"connection lost: {exc}")

    async def request(self, payload: bytes) -> None:
        assert self.transport is not None
        self.answer = asyncio.get_running_loop().create_future()
        self.in_body, self.events, self.tail = False, 0, b""
        self.transport.write(payload)
        await self.answer

    def _fail(self, why: str) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(RuntimeError(why))

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        pos = 0
        if not self.in_body:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buffer[:end]).lower()
            if not (head.startswith(b"http/1.1 200") and b"transfer-encoding: chunked" in head
                    and b"text/event-stream" in head):
                return self._fail(f"unexpected answer: {head[:300]!r}")
            self.in_body, pos = True, end + 4
        while True:
            eol = buffer.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(buffer[pos:eol].split(b";")[0], 16)
            if len(buffer) < eol + 4 + size:
                break
            chunk = buffer[eol + 2:eol + 2 + size]
            pos = eol + 4 + size
            if size:  # every server writes whole events, one or more per chunk
                self.events += chunk.count(b"\n\n")
                self.tail = bytes(chunk[-len(DONE):])
                continue
            assert self.answer is not None
            if self.tail != DONE:
                self._fail(f"answer did not end with [DONE]: {self.tail!r}")
            elif not self.answer.done():
                self.answer.set_result(self.events - 1)
            break
        del buffer[:pos]


def http_request(port: int, body: bytes) -> bytes:
    return (b"POST /stream HTTP/1.1\r\nHost: %b:%d\r\nContent-Type: application/json\r\n"
            b"Accept: text/event-stream\r\nContent-Length: %d\r\n\r\n%b"
            % (HOST.encode(), port, len(body), body))


async def loadgen(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    clients: list[StreamClient] = []
    for _ in range(args.concurrency):
        _, client = await loop.create_connection(StreamClient, HOST, args.port)
        clients.append(client)
    # Warm-up: every connection opened and served once (connect/accept are not measured).
    await asyncio.gather(*(c.request(http_request(args.port, request_body(4, 0)))
                           for c in clients))
    print("ready", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)

    payload = http_request(args.port, request_body(args.events, args.gap_ms))
    left = args.requests
    done = 0
    errors: list[str] = []

    async def keep_streaming(client: StreamClient) -> None:
        nonlocal left, done
        while left > 0:
            left -= 1
            try:
                await client.request(payload)
            except RuntimeError as exc:
                errors.append(str(exc))
                return
            if client.answer is not None and client.answer.result() != args.events:
                errors.append(f"{client.answer.result()} events, expected {args.events}")
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(keep_streaming(c) for c in clients))
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "requests": done, "events": done * args.events,
                      "errors": errors[:5], "num_errors": len(errors)}), flush=True)


# ---- driver ----------------------------------------------------------------------------------

@dataclass
class Run:
    """One server under one load: CPU seconds over the measured window, and what it served."""
    server: str
    round: int
    gap_ms: float
    concurrency: int
    events_per_request: int
    requests: int
    seconds: float
    server_cpu_s: float
    client_cpu_s: float

    @property
    def events(self) -> int:
        return self.requests * self.events_per_request


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            socket.create_connection((HOST, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)  # a port that starts listening has no other signal to wait on
    raise SystemExit(f"no server on port {port} after {READY_TIMEOUT_S} s")


def cpu_ticks(pids: set[int]) -> int:
    return sum(stat[1] for stat in map(read_stat, pids) if stat)


def measure(server: str, port: int, pid: int, round_: int, gap_ms: float, concurrency: int,
            num_events: int, requests: int) -> Run:
    load = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--loadgen", "--port", str(port),
         "--concurrency", str(concurrency), "--events", str(num_events),
         "--gap-ms", str(gap_ms), "--requests", str(requests)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert load.stdin is not None and load.stdout is not None
    if load.stdout.readline().strip() != "ready":
        raise SystemExit(f"{server}: the load generator failed during warm-up")
    pids = descendants(pid)  # granian: its worker process
    server0, client0 = cpu_ticks(pids), cpu_ticks({load.pid})
    load.stdin.write("go\n")
    load.stdin.flush()
    result = json.loads(load.stdout.readline())
    server1, client1 = cpu_ticks(pids), cpu_ticks({load.pid})
    load.wait()
    if result["num_errors"]:
        raise SystemExit(f"{server}: {result['num_errors']} bad answers, e.g. {result['errors']}")
    return Run(server, round_, gap_ms, concurrency, num_events, result["requests"],
               result["seconds"], (server1 - server0) / CLK_TCK, (client1 - client0) / CLK_TCK)


def fit(runs: list[Run]) -> tuple[float, float]:
    """(seconds per request, seconds per event): CPU per request = a + b * N over two Ns."""
    (lo, hi) = sorted(runs, key=lambda r: r.events_per_request)
    per_lo, per_hi = lo.server_cpu_s / lo.requests, hi.server_cpu_s / hi.requests
    per_event = (per_hi - per_lo) / (hi.events_per_request - lo.events_per_request)
    return per_lo - per_event * lo.events_per_request, per_event


def table(runs: list[Run], servers: list[str]) -> str:
    head = ("| gap | C | server | CPU ms / 1k events | x aiohttp | CPU us / request | x aiohttp "
            "| events/s (N=max) | x aiohttp | server / client core % |")
    lines = [head, "|" + "---|" * 3 + "---:|" * 7]
    points = sorted({(r.gap_ms, r.concurrency) for r in runs})
    rounds = sorted({r.round for r in runs})
    n_max = max(r.events_per_request for r in runs)
    for gap_ms, conc in points:
        per: dict[tuple[str, int], tuple[float, float, float, float, float]] = {}
        for server in servers:
            for rnd in rounds:
                mine = [r for r in runs if (r.server, r.round, r.gap_ms, r.concurrency)
                        == (server, rnd, gap_ms, conc)]
                if len(mine) < 2:
                    continue
                per_request, per_event = fit(mine)
                top = next(r for r in mine if r.events_per_request == n_max)
                per[server, rnd] = (per_event * 1e6, per_request * 1e6, top.events / top.seconds,
                                    100 * top.server_cpu_s / top.seconds,
                                    100 * top.client_cpu_s / top.seconds)
        for server in servers:
            mine = [per[server, rnd] for rnd in rounds if (server, rnd) in per]
            if not mine:
                continue
            med = [statistics.median(col) for col in zip(*mine)]
            ratios = []
            for k in range(3):
                pairs = [per[server, rnd][k] / per[BASELINE, rnd][k] for rnd in rounds
                         if (server, rnd) in per and (BASELINE, rnd) in per
                         and per[BASELINE, rnd][k] > 0]
                ratios.append(f"{statistics.median(pairs):.2f}" if pairs else "n/a")
            lines.append(f"| {gap_ms:g} ms | {conc} | {server} | {med[0]:.1f} | {ratios[0]} "
                         f"| {med[1]:.0f} | {ratios[1]} | {med[2]:,.0f} | {ratios[2]} "
                         f"| {med[3]:.0f} / {med[4]:.0f} |")
    return "\n".join(lines)


def versions() -> str:
    found = []
    for package in ("aiohttp", "uvloop", "uvicorn", "httptools", "granian"):
        try:
            found.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{package} (not installed)")
    return f"Python {platform.python_version()}; " + ", ".join(found)


def available(names: list[str]) -> list[str]:
    kept = []
    for name in names:
        missing = [m for m in SERVERS[name] if importlib.util.find_spec(m) is None]
        if missing:
            print(f"skip {name}: {', '.join(missing)} not installed in {sys.executable} "
                  "(setup: see this script's docstring)", flush=True)
        else:
            kept.append(name)
    return kept


def drive(args: argparse.Namespace) -> None:
    servers = available(args.servers)
    print(versions(), flush=True)
    if BASELINE not in servers:
        print(f"note: {BASELINE} is not running; ratios read n/a", flush=True)
    logs = Path(tempfile.mkdtemp(prefix="http-servers-"))
    procs: dict[str, tuple[subprocess.Popen, int]] = {}
    try:
        for name in servers:
            port = free_port()
            log = logs / f"{name}.log"
            with log.open("w") as out:
                proc = subprocess.Popen(server_command(name, port), stdout=out,
                                        stderr=subprocess.STDOUT, cwd=HERE)
            wait_for_port(port, proc, log)
            procs[name] = (proc, port)
        runs: list[Run] = []
        for rnd in range(args.rounds):
            order = servers[rnd % len(servers):] + servers[:rnd % len(servers)]
            for gap_ms in args.gaps_ms:
                for conc in args.concurrency:
                    for num_events in args.events_per_request:
                        requests = max(2 * conc, args.events_budget // num_events)
                        for name in order:
                            proc, port = procs[name]
                            run = measure(name, port, proc.pid, rnd, gap_ms, conc, num_events,
                                          requests)
                            runs.append(run)
                            print(f"round {rnd} gap {gap_ms:g} ms C {conc} N {num_events} "
                                  f"{name:13s} {run.requests} req {run.seconds:6.2f} s "
                                  f"server {run.server_cpu_s:5.2f} s CPU "
                                  f"({1e6 * run.server_cpu_s / run.events:5.1f} us/event) "
                                  f"client {run.client_cpu_s:5.2f} s", flush=True)
    finally:
        for proc, _ in procs.values():
            proc.terminate()
        for proc, _ in procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(f"\nmedians over {args.rounds} round(s); ratios to {BASELINE} taken within a round. "
          f"CPU = server process (+ children) utime+stime; per event and per request from a "
          f"fit over N = {args.events_per_request}; events/s and core % at the largest N.\n")
    print(table(runs, servers))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in runs], indent=1))
        print(f"\nruns written to {args.json}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", nargs="+", choices=list(SERVERS), default=list(SERVERS))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[32, 128])
    parser.add_argument("--events-per-request", nargs=2, type=int, default=[5, 200])
    parser.add_argument("--gaps-ms", nargs="+", type=float, default=[0, 5])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--events-budget", type=int, default=60_000,
                        help="events per run (requests = budget / N, at least 2 per stream)")
    parser.add_argument("--quick", action="store_true", help="1 round, small runs (smoke)")
    parser.add_argument("--json", help="write every run here")
    # Internal: the processes the driver starts.
    parser.add_argument("--serve", choices=list(IN_SCRIPT), help=argparse.SUPPRESS)
    parser.add_argument("--loadgen", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--events", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--gap-ms", type=float, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        IN_SCRIPT[args.serve](args.port)
    elif args.loadgen:
        args.concurrency = args.concurrency[0]
        run_on_uvloop(loadgen(args))
    else:
        if args.quick:
            args.rounds, args.events_budget = 1, 6_000
        drive(args)


if __name__ == "__main__":
    main()

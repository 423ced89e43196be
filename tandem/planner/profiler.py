"""`tandem profile`: measures what one worker carries within a latency, and writes the capacity
profile the planner sizes its pools from (tandem.planner.profile's JSON, `write_profile`).

    tandem profile --engine mock --output prefill.json -- --speedup-ratio 1
    tandem profile --address 10.0.0.7:9300 --role prefill --engine trtllm --output prefill.json

It measures a running worker (`--address`) or starts one here (`tandem serve prefill` for
`--role prefill`, else `tandem serve decode`, with `--engine` on a free loopback port; the
flags after `--` go to that worker) and stops it at the end. The sweep (tandem.planner.measure
says how each point is measured):

- prefill curve (roles prefill and agg): at each ISL, the saturation throughput of a burst,
  then one Poisson run per load fraction of it, up to past saturation (a profile must reach
  loads past the targets it will be read at); TTFT p90 per run. A run the worker refuses
  requests in (its queue full) ends that ISL's curve;
- decode curve (roles decode and agg): ITL p90 per (context length, batch size).

`--quick` is a sweep of seconds on the mock engine (tests, a first look); the full preset
takes minutes on the mock engine at speedup 1, and a list flag given replaces the preset's.
A prefill worker is measured through Prefill calls that ask one token (so no lease is made),
a decode or aggregated worker through Decode.Session streams, as the frontend reaches it.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from tandem.engines.types import EngineRequest
from tandem.errors import InvalidRequest, UpstreamError
from tandem.planner import measure
from tandem.planner.profile import DecodePoint, PrefillPoint, WorkerProfile, write_profile
from tandem.runtime import config as config_lib
from tandem.runtime import logs
from tandem.runtime.clients import DecodeClients, PrefillClients
from tandem.runtime.health_probe import wait_serving
from tandem.runtime.loop import run
from tandem.runtime.tls import TlsConfig

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode", "agg")
T = TypeVar("T", int, float)


@dataclass(frozen=True)
class Sweep:
    """The points a profile measures."""

    isls: tuple[int, ...]
    #: Offered loads, as fractions of the saturation throughput at that ISL.
    load_fractions: tuple[float, ...]
    context_lengths: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    #: Tokens each decode stream generates.
    osl: int
    #: Requests of a prefill point: at least this many, and enough for point_s seconds.
    min_requests: int
    point_s: float


#: The presets fit the demo model's 2,048-token context; pass longer ISLs for a real model.
FULL = Sweep(isls=(128, 512, 1536), load_fractions=(0.1, 0.3, 0.5, 0.7, 0.85, 1.0, 1.2),
             context_lengths=(256, 1024, 1792), batch_sizes=(1, 4, 8, 16, 32, 64), osl=128,
             min_requests=40, point_s=10.0)
QUICK = Sweep(isls=(128, 1024), load_fractions=(0.2, 0.6, 1.2), context_lengths=(256, 1024),
              batch_sizes=(1, 8, 32), osl=32, min_requests=12, point_s=1.0)


@dataclass(frozen=True)
class ProfilerConfig:
    #: Where to write the profile (JSON, as tandem.planner.profile reads it).
    output: str = "profile.json"
    #: gRPC address (host:port) of a running worker to measure; unset: start one here.
    address: str = ""
    #: What the worker does: prefill (the prefill curve, through Prefill calls), decode (the
    #: decode curve) or agg (both, through Decode streams).
    role: str = "agg"
    #: The worker's engine: the one started here, and the profile's `engine`.
    engine: str = "mock"
    #: The profile's `model`; unset: the --model after `--`, else the demo model (with
    #: --address: none).
    model: str = ""
    #: GPUs the worker owns (the planner checks it against the pool's gpus_per_worker).
    gpus_per_worker: int = 1
    #: The short sweep: seconds on the mock engine (tests, a first look).
    quick: bool = False
    #: Prompt lengths of the prefill curve, tokens; unset: the preset's.
    isls: list[int] = field(default_factory=list)
    #: Offered loads of each prefill curve, as fractions of the throughput at saturation;
    #: unset: the preset's.
    load_fractions: list[float] = field(default_factory=list)
    #: Context lengths of the decode curve (prompt + half the output), tokens; unset: preset.
    context_lengths: list[int] = field(default_factory=list)
    #: Concurrent streams of the decode curve; unset: the preset's.
    batch_sizes: list[int] = field(default_factory=list)
    #: Seed of the prompts and of the arrival times.
    seed: int = 0
    #: Least severe log level written: debug, info, warning or error.
    log_level: str = "info"
    #: The worker's TLS: a client certificate and the CA that verifies the worker (a worker
    #: started here gets the same files).
    tls: TlsConfig = field(default_factory=TlsConfig)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidRequest(f"--role must be one of {', '.join(ROLES)}, got {self.role}",
                                 param="role")
        if self.gpus_per_worker < 1:
            raise InvalidRequest("--gpus-per-worker must be >= 1", param="gpus_per_worker")
        for name in ("isls", "load_fractions", "context_lengths", "batch_sizes"):
            if any(not v > 0 for v in getattr(self, name)):
                raise InvalidRequest(f"--{name.replace('_', '-')} must all be > 0", param=name)

    def sweep(self) -> Sweep:
        """The preset, with the lists this config gives in its place."""
        preset = QUICK if self.quick else FULL

        def given(values: list[T], default: tuple[T, ...]) -> tuple[T, ...]:
            return tuple(sorted(set(values))) if values else default

        return dataclasses.replace(
            preset, isls=given(self.isls, preset.isls),
            load_fractions=given(self.load_fractions, preset.load_fractions),
            context_lengths=given(self.context_lengths, preset.context_lengths),
            batch_sizes=given(self.batch_sizes, preset.batch_sizes))


async def profile_worker(address: str, config: ProfilerConfig, model: str) -> WorkerProfile:
    """Measures the worker at `address` over `config`'s sweep. Raises what the worker's calls
    raise (TandemError subclasses), but Overloaded, which ends a prefill curve."""
    sweep = config.sweep()
    prompts = measure.Prompts(config.seed)
    prefills, decodes = PrefillClients(config.tls), DecodeClients(config.tls)

    async def first_token(request: EngineRequest) -> None:
        if config.role == "prefill":
            await prefills.prefill(address, request)
            return
        await measure.first_token_of(stream, request)

    async def stream(request: EngineRequest) -> AsyncGenerator[int, None]:
        async with contextlib.aclosing(decodes.generate(address, request)) as chunks:
            async for chunk in chunks:
                yield len(chunk.token_ids)

    prefill_points: list[PrefillPoint] = []
    decode_points: list[DecodePoint] = []
    try:
        await measure.saturation_tokens_per_s(first_token, prompts, sweep.isls[0], 2)  # warm up
        if config.role in ("prefill", "agg"):
            for isl in sweep.isls:
                prefill_points += await _prefill_curve(first_token, prompts, isl, sweep,
                                                       config.seed)
        if config.role in ("decode", "agg"):
            for context_length in sweep.context_lengths:
                for batch_size in sweep.batch_sizes:
                    d = await measure.decode_run(stream, prompts, context_length, batch_size,
                                                 sweep.osl)
                    log.info("decode point", extra={
                        "context_length": context_length, "batch_size": batch_size,
                        "itl_p90_ms": round(d.itl_ms, 3), "samples": d.num_samples})
                    decode_points.append(DecodePoint(context_length, batch_size,
                                                     round(d.itl_ms, 3)))
    finally:
        await prefills.close()
        await decodes.close()
    return WorkerProfile(config.engine, model, config.gpus_per_worker, tuple(prefill_points),
                         tuple(decode_points))


async def _prefill_curve(first_token: measure.FirstToken, prompts: measure.Prompts, isl: int,
                         sweep: Sweep, seed: int) -> list[PrefillPoint]:
    saturation = await measure.saturation_tokens_per_s(first_token, prompts, isl,
                                                       sweep.min_requests)
    log.info("prefill saturation", extra={"isl": isl, "tokens_per_s": round(saturation)})
    points = []
    for i, fraction in enumerate(sweep.load_fractions):
        rate = round(fraction * saturation, 1)
        n = measure.requests_for(rate, isl, sweep.min_requests, sweep.point_s)
        r = await measure.prefill_run(first_token, prompts, isl, rate, n, seed + i)
        if r.num_refused:
            log.warning("the worker refused requests (queue full): this ISL's curve ends "
                        "here", extra={"isl": isl, "tokens_per_s": rate,
                                       "refused": r.num_refused, "requests": n})
            break
        log.info("prefill point", extra={"isl": isl, "tokens_per_s": rate,
                                         "of_saturation": fraction,
                                         "ttft_p90_ms": round(r.ttft_ms, 3), "requests": n})
        points.append(PrefillPoint(isl, rate, round(r.ttft_ms, 3)))
    return points


@contextlib.asynccontextmanager
async def started_worker(config: ProfilerConfig, worker_args: Sequence[str]
                         ) -> AsyncIterator[str]:
    """A `tandem serve` worker of the config's role and engine on a free loopback port, until
    the block ends (then SIGTERM, and its exit is awaited). Yields its address once SERVING;
    raises UpstreamError if it exits first."""
    with socket.socket() as sock:  # the kernel's pick of a free port; the worker binds it next
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    stage = "prefill" if config.role == "prefill" else "decode"
    argv = [sys.executable, "-m", "tandem.cli", "serve", stage, "--host", "127.0.0.1",
            "--port", str(port), "--engine", config.engine, "--log-level", "warning",
            *config_lib.to_argv(config.tls), *worker_args]
    proc = await asyncio.create_subprocess_exec(*argv)
    address = f"127.0.0.1:{port}"
    try:
        if not await wait_serving(address, lambda: proc.returncode is None, tls=config.tls):
            raise UpstreamError(f"the {stage} worker exited with code {proc.returncode} before "
                                f"it served (its log above says why)")
        yield address
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 60)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()


async def profile(config: ProfilerConfig, worker_args: Sequence[str] = ()) -> WorkerProfile:
    """Measures the configured worker (starting one unless `config.address` names one), writes
    the profile to `config.output` and returns it."""
    sweep = config.sweep()
    if short := [c for c in sweep.context_lengths if c <= sweep.osl // 2]:
        raise InvalidRequest(f"--context-lengths must exceed half the decode output "
                             f"({sweep.osl // 2} tokens): {short}", param="context_lengths")
    started_model = _flag_value(worker_args, "--model") or "tandem-demo"
    model = config.model or ("" if config.address else started_model)
    if config.address:
        if worker_args:
            raise InvalidRequest("flags after `--` go to a worker started here; with "
                                 "--address none is started", param="address")
        result = await profile_worker(config.address, config, model)
    else:
        async with started_worker(config, worker_args) as address:
            result = await profile_worker(address, config, model)
    write_profile(result, config.output)
    return result


def _flag_value(argv: Sequence[str], flag: str) -> str:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1].rstrip("/").rsplit("/", 1)[-1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1].rstrip("/").rsplit("/", 1)[-1]
    return ""


def main(argv: list[str]) -> int:
    """`tandem profile [flags] [-- worker flags]`; returns the exit code."""
    split = argv.index("--") if "--" in argv else len(argv)
    config = config_lib.load(ProfilerConfig, argv[:split], prog="tandem profile",
                             description="Measure one worker (TTFT vs prompt load, ITL vs "
                                         "batch and context) and write the capacity profile "
                                         "the planner reads. Flags after `--` go to the "
                                         "worker it starts.")
    logs.setup("profile", config.log_level)
    logs.log_config(log, config_lib.as_dict(config))
    result = run(profile(config, argv[split + 1:]))
    print(f"wrote {config.output}: {len(result.prefill)} prefill and {len(result.decode)} "
          f"decode points", flush=True)
    return 0

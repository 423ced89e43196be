"""The benchmarks' shared load generators and statistics (every other script imports from here,
this module from no other benchmark at import time).

`drive` sends n streamed chat completions over aiohttp on C streams (each stream sends its next
request when its last ends) from this process, or from several (`processes`): one Python process
spends a fraction of a millisecond of its own on each request it issues, so a burst of 64 leaves
it over 20-50 ms (benchmarks/history/gpu-serving.md, "Serving on the GPU", rounds 8 and 9), and
that spread is the client's, not the stack's. Processes split the streams and the prompts
round-robin, start together (a barrier, after each opened its connections when asked to) and
time with the system-wide monotonic clock, so their figures merge as one run's. `closed_loop`
sends the same kind of load to an engine in this process (the engine alone, for comparison);
`pct`, `summarize` and `meets_sla` are the statistics both report.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import queue
import random
import statistics
import time
from typing import Any

#: The demo tokenizer's vocabulary (tandem.model.demo): every sampled id detokenizes.
DEMO_VOCAB = 4096


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between neighbours; nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def prompt_texts(n: int, isl: int, seed: int, overhead: int) -> list[str]:
    """n distinct texts of `isl` - `overhead` (the chat template's tokens) demo-tokenizer
    tokens: random ids, decoded, re-encoded and cut until the text re-encodes to that length."""
    from tokenizers import Tokenizer

    from tandem.model.demo import committed_file

    tok = Tokenizer.from_str(committed_file("tokenizer.json").read_text())
    rng = random.Random(seed)
    target = max(1, isl - overhead)
    texts = []
    for _ in range(n):
        ids = [rng.randrange(8, DEMO_VOCAB) for _ in range(target + 16)]
        text = tok.decode(ids, skip_special_tokens=True)
        for _ in range(8):
            ids = tok.encode(text, add_special_tokens=False).ids
            if len(ids) <= target:
                break
            text = tok.decode(ids[:target - (len(ids) > target + 4)], skip_special_tokens=True)
        texts.append(text)
    return texts


async def one_request(session, url: str, text: str, osl: int) -> dict:
    body = {"model": "bench", "messages": [{"role": "user", "content": text}],
            "max_tokens": osl, "ignore_eos": True, "stream": True, "temperature": 0.0,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = first_event = None
    chunks: list[float] = []
    usage = {}
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            return {"error": f"{resp.status}: {(await resp.text())[:200]}"}
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            now = time.perf_counter()
            event = json.loads(data)
            if event.get("usage"):
                usage = event["usage"]
            if first_event is None and event.get("choices"):
                first_event = now  # the role delta: written with the first token, text or not
            for choice in event.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    first = first if first is not None else now
                    last = now
                    chunks.append(now)
    done = time.perf_counter()
    out_tokens = usage.get("completion_tokens", 0)
    if first is None or out_tokens == 0:
        return {"error": f"no tokens (usage {usage})"}
    assert first_event is not None
    return {"ttft": 1000 * (first - start), "e2e": done - start, "tokens": out_tokens,
            "first_event": 1000 * (first_event - start),
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "itl": 1000 * (last - first) / max(1, out_tokens - 1),
            "gaps": [1000 * (b - a) for a, b in zip(chunks, chunks[1:])]}


async def open_loop(url: str, isl: int, osl: int, rate: float, n: int, seed: int,
                    overhead: int) -> dict:
    """n requests arriving as a Poisson process of `rate` per second (whatever is in flight),
    from this process. Returns the run's figures, wall time from the first arrival to the last
    answer."""
    texts = prompt_texts(n, isl, seed, overhead)
    rng = random.Random(seed)
    async with client_session() as session:
        start, at, tasks = time.perf_counter(), 0.0, []
        for text in texts:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_request(session, url, text, osl)))
            at += rng.expovariate(rate)
        results = await asyncio.gather(*tasks)
    return summarize(list(results), time.perf_counter() - start)


def client_session():
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout)


async def open_connections(session, url: str, conc: int) -> None:
    """`conc` connections kept open in `session`'s pool: that many GETs at once (none is free
    while the others run, so each opens its own), as a client that already served holds."""
    async def one() -> None:
        async with session.get(f"{url}/v1/models") as resp:
            await resp.read()

    await asyncio.gather(*(one() for _ in range(conc)))


async def _issue(url: str, osl: int, conc: int, texts: list[str], kept: bool = False,
                 ready=None) -> tuple[list[dict], float, float]:
    """`texts` over `conc` streams from a session of its own: with `kept`, its connections
    opened first (as a client that already served holds them), else opened as the requests go
    out. `ready()`, when given, runs just before the first request (a barrier). Returns the
    results, the start and the end."""
    sem = asyncio.Semaphore(conc)
    async with client_session() as session:
        if kept:
            await open_connections(session, url, conc)

        async def limited(text: str) -> dict:
            async with sem:
                return await one_request(session, url, text, osl)

        if ready is not None:
            await asyncio.to_thread(ready)
        start = time.perf_counter()
        results = await asyncio.gather(*(limited(t) for t in texts))
        return list(results), start, time.perf_counter()


def _client_process(url: str, osl: int, conc: int, texts: list[str], kept: bool, barrier,
                    out) -> None:
    """One client process (spawned): opens its connections when `kept`, waits for the others,
    sends its share and puts (results, start, end) on `out`."""
    def ready() -> None:
        barrier.wait(120)  # a sibling that failed first breaks it: this one fails too

    try:
        out.put(asyncio.run(_issue(url, osl, conc, texts, kept, ready)))
    except BaseException as exc:  # the parent must not wait forever for this share
        out.put(exc)
        raise


def _in_processes(url: str, osl: int, conc: int, texts: list[str], kept: bool,
                  processes: int) -> tuple[list[dict], float, float]:
    ctx = multiprocessing.get_context("spawn")  # the parent may hold CUDA and a running loop
    count = min(processes, conc, len(texts))
    barrier, out = ctx.Barrier(count), ctx.Queue()
    shares = [(texts[i::count], conc // count + (i < conc % count)) for i in range(count)]
    procs = [ctx.Process(target=_client_process, daemon=True,
                         args=(url, osl, streams, part, kept, barrier, out))
             for part, streams in shares]
    for proc in procs:
        proc.start()
    try:
        parts = [_next_share(out, procs) for _ in procs]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    failed = [p for p in parts if isinstance(p, BaseException)]
    if failed:
        raise RuntimeError(f"a client process failed: {failed[0]!r}")
    results = [r for part, _, _ in parts for r in part]
    return results, min(p[1] for p in parts), max(p[2] for p in parts)


def _next_share(out, procs: list) -> Any:
    """The next share put on `out`; raises once every process has exited without one."""
    while True:
        try:
            return out.get(timeout=5)
        except queue.Empty:
            if not any(proc.is_alive() for proc in procs) and out.empty():
                raise RuntimeError("the client processes exited without their results") from None


async def drive(url: str, isl: int, osl: int, conc: int, n: int, seed: int,
                overhead: int, kept: bool = False, processes: int = 1) -> dict:
    """n requests of `isl` tokens over `conc` streams, `osl` tokens each, from this process or
    from `processes` spawned ones, each opening its connections first when `kept`. Returns the
    run's figures."""
    texts = prompt_texts(n, isl, seed, overhead)
    if processes > 1:
        results, start, end = await asyncio.to_thread(_in_processes, url, osl, conc, texts,
                                                      kept, processes)
    else:
        results, start, end = await _issue(url, osl, conc, texts, kept)
    return summarize(results, end - start)


#: The SLA a request must meet to count in goodput (issue 40): TTFT and its own ITL p99, ms.
SLA_TTFT_MS = 2000.0
SLA_ITL_MS = 25.0


def meets_sla(result: dict) -> bool:
    """A request that finished with TTFT and the p99 of its own token gaps inside the SLA."""
    if "error" in result:
        return False
    itl = pct(result["gaps"], 99) if result["gaps"] else result["itl"]
    return result["ttft"] <= SLA_TTFT_MS and itl <= SLA_ITL_MS


def summarize(results: list[dict], wall: float) -> dict:
    """One run's figures from its requests' results (those with "error" count as errors);
    goodput is the requests per second that met the SLA (`meets_sla`)."""
    good = [r for r in results if "error" not in r]
    met = sum(map(meets_sla, good))
    errors = [r["error"] for r in results if "error" in r]
    ttft = [r["ttft"] for r in good]
    first_event = [r["first_event"] for r in good]
    itl = [r["itl"] for r in good]
    gaps = [g for r in good for g in r["gaps"]]
    return {"requests": len(results), "ok": len(good), "errors": len(errors),
            "first_error": errors[:1], "wall_s": wall, "tps": sum(r["tokens"] for r in good) / wall,
            "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in good)
            if good else 0,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "first_event_p50": pct(first_event, 50), "ttft_ms": [round(t, 2) for t in ttft],
            "late_text": sum(r["ttft"] > r["first_event"] + 1.0 for r in good),
            "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
            "chunk_gap_p50": pct(gaps, 50), "chunk_gap_p99": pct(gaps, 99),
            "sla_ok": met, "goodput_rps": met / wall}


async def closed_loop(engine, isl: int, osl: int, concurrency: int, requests: int,
                      vocab: int, seed: int) -> dict:
    """C streams (`concurrency`), each sending its next request of `isl` random prompt tokens
    and `osl` output tokens (greedy, ignore_eos) as soon as its last ended, straight to
    `engine` in this process: the engine alone under the load `drive` sends over HTTP."""
    from benchmarks.reference_gpu import sync
    from tandem.engines.types import EngineRequest, SamplingParams

    rng = random.Random(seed)
    queue = [[rng.randrange(5, vocab - 5) for _ in range(isl)] for _ in range(requests)]
    params = SamplingParams(max_tokens=osl, temperature=0.0, ignore_eos=True)
    ttft: list[float] = []
    gaps: list[float] = []
    per_request: list[float] = []  # (last token - first token) / (tokens - 1), as aiperf's ITL
    tokens = 0

    async def stream_worker(index: int) -> None:
        nonlocal tokens
        while queue:
            prompt = queue.pop()
            sent = time.perf_counter()
            first = last = None
            count = 0
            async for chunk in engine.add_request(EngineRequest(
                    f"m{seed}-{index}-{len(queue)}", tuple(prompt), params)):
                now = time.perf_counter()
                if last is None:
                    ttft.append(1000 * (now - sent))
                    first = now
                elif chunk.token_ids:
                    gaps.append(1000 * (now - last) / len(chunk.token_ids))
                last = now
                tokens += len(chunk.token_ids)
                count += len(chunk.token_ids)
            if first is not None and last is not None and count > 1:
                per_request.append(1000 * (last - first) / (count - 1))

    sync()
    start = time.perf_counter()
    await asyncio.gather(*(stream_worker(i) for i in range(concurrency)))
    sync()
    wall = time.perf_counter() - start
    fig = {"tps": tokens / wall, "wall_s": wall, "ttft_p50": pct(ttft, 50),
           "ttft_p99": pct(ttft, 99), "itl_p50": pct(gaps, 50), "itl_p99": pct(gaps, 99),
           "request_itl_p50": pct(per_request, 50), "ttft_ms": [round(t, 2) for t in ttft]}
    return fig

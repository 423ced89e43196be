"""OpenAI's `n`: several choices from one prompt, each an engine request of its own.

The choices share the prompt's prefill through the workers' prefix cache: choice 0 goes first,
and the others are sent once its first token arrived, when the prompt's full KV blocks are in
the cache of the worker that computed them; the others ask the router for those workers first
(RouteRequest.prefer_worker_ids: the decode worker and, disaggregated, the prefill worker).
Each of them then computes only the prompt's last, partial block. The price is latency: the other choices start one TTFT later than choice 0. An
engine-level fork of the KV would avoid it, at the cost of a choice index in every engine and
contract; the prefix cache already gives the saving that matters (the prompt computed once).

Every choice draws from its own seed stream: seed + i for choice i (as vLLM seeds the choices of
one request); without a seed, a random base seed, so that an engine that is deterministic per
prompt (the mock engine) still gives each choice its own answer. The choices' deltas are merged
in arrival order, each tagged with its `Delta.index`. One failing choice fails the request and
cancels the others; closing the stream cancels them all.
"""
from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing

from tandem.engines.types import Usage
from tandem.frontend.pipeline import Delta, GenerationRequest

#: Most choices one request may ask for (`n`): each is a full engine request.
MAX_CHOICES = 16
_SEED_LIMIT = 2**64

Generate = Callable[[GenerationRequest], AsyncGenerator[Delta, None]]


def choice_requests(req: GenerationRequest, n: int) -> list[GenerationRequest]:
    """The engine requests of `req`'s n choices: the same prompt, ids `<id>-<i>` after the
    first, seeds base + i."""
    if n == 1:
        return [req]
    base = req.sampling.seed
    if base is None:
        base = secrets.randbits(63)
    requests = []
    for i in range(n):
        sampling = dataclasses.replace(req.sampling, seed=(base + i) % _SEED_LIMIT)
        request_id = req.request_id if i == 0 else f"{req.request_id}-{i}"
        requests.append(dataclasses.replace(req, request_id=request_id, sampling=sampling))
    return requests


class _Finished:
    __slots__ = ()


_FINISHED = _Finished()


async def generate_choices(generate: Generate,
                           requests: list[GenerationRequest]) -> AsyncGenerator[Delta, None]:
    """The deltas of every request in `requests` (the choices of one client request), merged;
    the others start once the first one yielded its first delta (see the module doc)."""
    queue: asyncio.Queue[Delta | _Finished | BaseException] = asyncio.Queue()
    tasks: list[asyncio.Task[None]] = []

    async def run(index: int, req: GenerationRequest) -> None:
        try:
            async with aclosing(generate(req)) as deltas:
                async for delta in deltas:
                    delta.index = index
                    queue.put_nowait(delta)
            queue.put_nowait(_FINISHED)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, who raises it
            queue.put_nowait(exc)

    tasks.append(asyncio.create_task(run(0, requests[0])))
    running = 1
    try:
        while running:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if len(tasks) == 1:  # choice 0 has its first token (or ended): the prefix is cached
                prefer = _workers_of(item) if isinstance(item, Delta) else ()
                tasks.extend(asyncio.create_task(run(i, dataclasses.replace(req,
                                                                            prefer_workers=prefer)))
                             for i, req in enumerate(requests[1:], start=1))
                running += len(requests) - 1
            if isinstance(item, _Finished):
                running -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _workers_of(delta: Delta) -> tuple[str, ...]:
    """The workers holding the prompt's KV after `delta`, choice 0's first: its decode worker
    and, disaggregated, its prefill worker."""
    return tuple(w.worker_id for w in (delta.worker, delta.prefill_worker) if w is not None)


def total_usage(per_choice: dict[int, Usage]) -> Usage | None:
    """The usage of a request with several choices: the prompt counted once (as choice 0 saw
    it, cache hits included), the completion tokens (and speculative decoding's accepted and
    rejected drafts) of every choice."""
    if not per_choice:
        return None
    first = per_choice[min(per_choice)]
    usages = per_choice.values()
    return Usage(first.prompt_tokens, sum(u.completion_tokens for u in usages),
                 first.cached_tokens, sum(u.accepted_prediction_tokens for u in usages),
                 sum(u.rejected_prediction_tokens for u in usages))

"""Iteration stats shaped like upstream's IterationStats JSON. The keys and their nesting are
the ones its consumers read: Dynamo's publisher (kvCacheStats.usedNumBlocks) and drain logic
(numActiveRequests, numQueuedRequests), an earlier Dynamo TensorRT-LLM worker's stats loop
(maxNumActiveRequests, kvCacheStats.{maxNumBlocks, freeNumBlocks, allocTotalBlocks,
allocNewBlocks, reusedBlocks, cacheHitRate}, inflightBatchingStats.numPausedRequests), and a
sample IterationStats in a TensorRT-LLM metrics test (inflightBatchingStats.{numContextRequests,
numGenRequests, numScheduledRequests, numCtxTokens, avgNumDecodedTokensPerIter})."""
from __future__ import annotations

import time
from typing import Any

from tensorrt_llm._fake.request import QUEUED, RUNNING, TRANSFER


def iteration_stats(executor: Any) -> dict[str, Any]:
    reqs = list(executor.requests.values())
    running = [r for r in reqs if r.state in (RUNNING, TRANSFER)]
    blocks = executor.blocks
    lookups = blocks.reused + blocks.missed
    return {
        "iter": executor.iteration,
        "timestamp": time.time(),
        "iterLatencyMS": 0.0,
        "numActiveRequests": len(running),
        "numQueuedRequests": sum(1 for r in reqs if r.state == QUEUED),
        "numCompletedRequests": 0,
        "maxNumActiveRequests": executor.args.max_batch_size,
        "kvCacheStats": {
            "maxNumBlocks": blocks.total,
            "freeNumBlocks": blocks.num_free,
            "usedNumBlocks": blocks.num_used,
            "tokensPerBlock": blocks.tokens_per_block,
            "allocTotalBlocks": blocks.alloc_total,
            "allocNewBlocks": blocks.alloc_new,
            "reusedBlocks": blocks.reused,
            "missedBlocks": blocks.missed,
            "cacheHitRate": blocks.reused / lookups if lookups else 0.0,
        },
        "inflightBatchingStats": {
            "numScheduledRequests": len(running),
            "numContextRequests": sum(1 for r in running if r.decoding_iter == 0),
            "numGenRequests": sum(1 for r in running if r.decoding_iter > 0),
            "numPausedRequests": 0,
            "numCtxTokens": sum(len(r.prompt) for r in reqs if r.state == QUEUED),
            "microBatchId": 0,
            "avgNumDecodedTokensPerIter": 1.0,
        },
    }

"""The reference engine of an embedding worker: the decoder model's final hidden states pooled
per input (pooling.py); no sampling, and no KV cache kept between calls.

`embed` packs its inputs into forward passes of at most `token_budget` tokens (an input longer
than the budget runs alone). Each pass is pure prefill over a scratch paged KV cache sized to the
pass and freed after it, so an idle embedding worker holds only its weights. Passes run one at a
time on the engine's own thread: calls made together interleave pass by pass, and a cancelled
call cannot leave its pass overlapping the next one.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from tandem.engines.args import EngineArgs
from tandem.engines.reference.batch import AttentionMetadata, allocate_kv_cache
from tandem.engines.reference.loader import load_model
from tandem.engines.reference.model import DecoderModel
from tandem.engines.reference.pooling import Pooler
from tandem.engines.reference.side_engine import SideEngine
from tandem.errors import InvalidRequest
from tandem.model.config import ModelConfig

log = logging.getLogger(__name__)


class ReferenceEmbedEngine(SideEngine):
    """Engine.embed only; every token-generating call is refused."""

    what = "the embedding engine"
    refusal = ("this worker computes embeddings only (an embedding worker, `tandem serve "
               "embed`); send prompts to a prefill or decode worker")

    def __init__(self, model: DecoderModel, pooler: Pooler, max_model_len: int, block_size: int,
                 token_budget: int, device: torch.device) -> None:
        super().__init__(model.spec.dtype, max_model_len, block_size)
        self.model = model
        self.pooler = pooler
        self.device = device
        self.block_size = block_size
        #: Most tokens in one forward pass (a longer single input still runs, alone).
        self.token_budget = token_budget
        # One thread: forward passes never overlap, even when the call that started one is
        # cancelled while it runs.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tandem-embed")

    async def embed(self, inputs: Sequence[Sequence[int]],
                    dimensions: int | None = None) -> list[list[float]]:
        with self.running():
            self._validate(inputs)
            self.pooler.check_dimensions(dimensions)
            loop = asyncio.get_running_loop()
            result: list[list[float]] = []
            for batch in self._passes(inputs):
                result.extend(await loop.run_in_executor(self._executor, self._run_pass, batch,
                                                         dimensions))
            return result

    def _validate(self, inputs: Sequence[Sequence[int]]) -> None:
        if not inputs:
            raise InvalidRequest("input must hold at least one item", param="input")
        vocab = self.model.spec.vocab_size
        for index, ids in enumerate(inputs):
            if not ids:
                raise InvalidRequest(f"input {index} is empty", param="input")
            if len(ids) > self._max_model_len:
                raise InvalidRequest(
                    f"input {index} has {len(ids)} tokens, more than this model's "
                    f"{self._max_model_len}", param="input")
            if not all(0 <= t < vocab for t in ids):
                raise InvalidRequest(f"input {index} holds a token id outside the vocabulary "
                                     f"(0..{vocab - 1})", param="input")

    def _passes(self, inputs: Sequence[Sequence[int]]) -> list[list[Sequence[int]]]:
        """Consecutive inputs grouped into passes of at most `token_budget` tokens."""
        passes: list[list[Sequence[int]]] = []
        current: list[Sequence[int]] = []
        num_tokens = 0
        for ids in inputs:
            if current and num_tokens + len(ids) > self.token_budget:
                passes.append(current)
                current, num_tokens = [], 0
            current.append(ids)
            num_tokens += len(ids)
        passes.append(current)
        return passes

    @torch.inference_mode()
    def _run_pass(self, batch: list[Sequence[int]],
                  dimensions: int | None) -> list[list[float]]:
        """One forward pass over `batch` (on the engine thread): each sequence prefilled whole
        into its own consecutive blocks of a scratch cache, then pooled."""
        spec, block_size, device = self.model.spec, self.block_size, self.device
        token_ids: list[int] = []
        positions: list[int] = []
        starts: list[int] = []
        tables: list[list[int]] = []
        num_blocks = 0
        for ids in batch:
            starts.append(len(token_ids))
            token_ids.extend(ids)
            positions.extend(range(len(ids)))
            blocks = -(-len(ids) // block_size)
            tables.append(list(range(num_blocks, num_blocks + blocks)))
            num_blocks += blocks
        ends = [*starts[1:], len(token_ids)]
        # Sequence s's blocks are consecutive from its first, so slot = first * size + position.
        slots = [table[0] * block_size + p for table, ids in zip(tables, batch, strict=True)
                 for p in range(len(ids))]
        width = max(len(t) for t in tables)
        lengths = [len(ids) for ids in batch]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start_loc=[*starts, len(token_ids)],
            context_lens=lengths,
            context_lens_t=torch.tensor(lengths, dtype=torch.long, device=device),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                      dtype=torch.long, device=device),
            block_size=block_size,
            is_decode_only=all(n == 1 for n in lengths))
        kv_cache = allocate_kv_cache(spec.num_layers, num_blocks, block_size, spec.num_kv_heads,
                                     spec.head_size, spec.dtype, device)
        hidden = self.model(torch.tensor(token_ids, dtype=torch.long, device=device),
                            torch.tensor(positions, dtype=torch.long, device=device), meta,
                            kv_cache)
        del kv_cache
        pooled: list[list[float]] = self.pooler.pool(hidden, starts, ends, dimensions).cpu().tolist()
        return pooled

    async def close(self) -> None:
        await super().close()
        self._executor.shutdown(wait=False, cancel_futures=True)


def create_embed_engine(args: EngineArgs, config: ModelConfig, device: torch.device,
                        dtype: torch.dtype) -> ReferenceEmbedEngine:
    """Raises InvalidRequest for a model whose pooling (modules.json) is not supported."""
    pooler = Pooler.from_dir(args.model, config.hidden_size)  # refused before loading weights
    model, spec = load_model(args.model, dtype, device, args.load_format, args.seed)
    max_model_len = args.max_seq_len or config.max_position_embeddings
    log.info("reference embedding engine ready", extra={
        "device": str(device), "dtype": str(dtype), "architecture": spec.architecture,
        "pooling": pooler.mode.value, "normalize": pooler.normalize,
        "matryoshka": pooler.is_matryoshka, "token_budget": args.max_num_tokens})
    return ReferenceEmbedEngine(model, pooler, max_model_len, args.kv_block_size,
                                args.max_num_tokens, device)

"""The reference engine: a Hugging Face decoder model in PyTorch over a paged KV cache, driven by
the shared continuous-batching scheduler. CPU and CUDA.

Each step's model inputs are read from request state on the event loop; the forward pass and
sampling then run in a worker thread (torch releases the GIL), so streams keep flowing and new
requests keep arriving while the model computes. Blocks freed by an abort during a step are
reallocated only by the next schedule(), after the step, so the step may still write them.

A LLaVA checkpoint adds an ImageEncoder: a prompt's multimodal items replace the token embeddings
at their placeholder positions, chunk by chunk. Items that are images rather than embeddings
(no encode worker ran) are encoded here, in the step that first computes their placeholders.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import time
from collections.abc import Sequence

import torch

from tandem.engines.args import EngineArgs
from tandem.engines.batching.ahead import StepAhead
from tandem.engines.batching.engine import BatchingEngine, Sampled, validate_args
from tandem.engines.batching.host_copies import CopyTiming
from tandem.engines.batching.request import BatchRequest
from tandem.engines.batching.scheduler import StepPlan
from tandem.engines.guided.matcher import Guide, apply_bitmask, fill_bitmask
from tandem.engines.reference import jit_watch
from tandem.engines.reference.aux_states import AuxStates
from tandem.engines.reference.batch import allocate_kv_cache
from tandem.engines.reference.build import kv_block_bytes, kv_cache_dtype, num_kv_blocks
from tandem.engines.reference.cuda_graphs import DecodeGraphs
from tandem.engines.reference.embed_engine import ReferenceEmbedEngine, create_embed_engine
from tandem.engines.reference.encode_engine import (
    ReferenceEncodeEngine,
    create_encode_engine,
    create_image_encoder,
)
from tandem.engines.reference.encoder import ImageEncoder
from tandem.engines.reference.host_kv import HostKvStore
from tandem.engines.reference.loader import load_model
from tandem.engines.reference.model import DecoderModel
from tandem.engines.reference.overlap import OverlapSteps
from tandem.engines.reference.parallel.group import TensorGroup, init_group
from tandem.engines.reference.parallel.mirror import Mirror
from tandem.engines.reference.parallel.ranks import Followers
from tandem.engines.reference.parallel.transfer import RankedTransfer
from tandem.engines.reference.prefill_graphs import PrefillGraphs
from tandem.engines.reference.sampler import SampleInput, Sampler, prompt_logprobs
from tandem.engines.reference.step_inputs import StepInputs, TokenSpan, build_step_inputs
from tandem.engines.reference.transfer import create_nixl_transfer
from tandem.engines.reference.warmup import warm_eager_steps
from tandem.engines.speculative.create import create_speculation
from tandem.engines.speculative.proposer import StepSpan
from tandem.engines.types import Embedding, EngineRequest, EngineStats, KvLayout, TokenLogprob
from tandem.errors import InvalidRequest
from tandem.kv.host_tier import BlockCopies
from tandem.kv.transfer import KvTransfer
from tandem.model.config import ModelConfig

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_MAX_BAD_IMAGES = 4096
#: The worker's exit status when a tensor-parallel rank died under it.
_EXIT_RANK_LOST = 70


class ReferenceEngine(BatchingEngine):
    name = "reference"
    accepted_backends = frozenset({"nixl"})

    def __init__(self, args: EngineArgs, config: ModelConfig, model: DecoderModel,
                 kv_cache: torch.Tensor, device: torch.device,
                 encoder: ImageEncoder | None = None, followers: Followers | None = None
                 ) -> None:
        num_layers, _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        max_model_len = args.max_seq_len or config.max_position_embeddings
        # The KV tensor's last block is scratch space for CUDA-graph padding, not pooled.
        super().__init__(
            args, KvLayout(dtype, num_layers, num_kv_heads, head_size, block_size, model.tp.size),
            max_model_len, config.vocab_size, frozenset(config.eos_token_ids), num_blocks - 1)
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.sampler = Sampler(device)
        #: The vision side of a LLaVA model; None for a text-only one.
        self.encoder = encoder
        #: Ranks 1.. of a tensor-parallel model (their pools are allocated by
        #: create_reference_engine, which then sets the model's mirror); None with one rank.
        self.followers = followers
        #: Images whose bytes failed to decode in a step: refused at admission from then on,
        #: since blocks hashed with them may hold KV computed without their embeddings. Bounded:
        #: the oldest are forgotten (a dict keeps insertion order).
        self._bad_images: dict[str, None] = {}
        # A model whose decode step syncs with the host (an MoE expert loop reading per-expert
        # token counts, moe.run_experts) decodes eagerly: a CUDA graph cannot hold the sync.
        # Tensor parallelism runs eagerly for now: its graphs would have to be captured and
        # replayed by every rank in step (not built yet; see the README).
        max_graph_batch = min(args.max_batch_size, 256)
        self.graphs = (None if device.type != "cuda" or args.enforce_eager
                       or model.tp.is_parallel or model.decode_syncs(max_graph_batch)
                       else DecodeGraphs(model, kv_cache, max_graph_batch,
                                         -(-max_model_len // block_size)))
        #: Steps with prompt tokens, as graphs between their attentions; None where eager.
        self.prefill_graphs = (PrefillGraphs(model, kv_cache, args.max_num_tokens)
                               if self.graphs is not None and not args.disable_prefill_graphs
                               and PrefillGraphs.supports(model, kv_cache) else None)
        #: Decode steps launched ahead of their tokens; None with --disable-overlap-scheduler.
        self.overlap = (None if args.disable_overlap_scheduler
                        else OverlapSteps(self.sampler, self._decode_logits, device))
        #: The host KV tier's memory (--kv-host-cache-bytes), None without one.
        host = self.pool.host
        self.host_kv = HostKvStore(kv_cache, host.total) if host is not None else None
        if host is not None and self.host_kv is not None:
            log.info("host KV tier ready", extra={"kv_host_blocks": host.total,
                                                  "kv_host_bytes": self.host_kv.nbytes,
                                                  "pinned": self.host_kv.is_cuda})

    def capture_aux_states(self, layers: tuple[int, ...]) -> None:
        """Has every forward keep the hidden states entering `layers` (aux_states: an EAGLE-3
        head reads them), for each step's proposer `observe`. Overlap scheduling goes off:
        a step launched ahead would overwrite the states before the loop hands them on.
        Before `start` (the CUDA graphs capture the copies)."""
        model = self.model
        rows = max(self.args.max_num_tokens, self.graphs.batch_buckets[-1] if self.graphs
                   else 1)
        model.aux = AuxStates(layers, model.spec.hidden_size, rows,
                              model.embed_tokens.weight.dtype, self.device)
        if self.overlap is not None:
            self.overlap.close()
            self.overlap = None

    async def start(self) -> None:
        if self.followers is not None and self._task is None:
            self.followers.watch(_rank_lost)
        if self.graphs is not None and self._task is None:
            started = time.perf_counter()
            count = await asyncio.to_thread(self._capture_graphs)
            log.info("CUDA graphs captured", extra={
                "graphs": count, "seconds": round(time.perf_counter() - started, 1)})
        if self.device.type == "cuda" and self._task is None:
            started = time.perf_counter()
            steps = await asyncio.to_thread(self._warm_eager_steps)
            log.info("eager steps warmed", extra={
                "steps": steps, "seconds": round(time.perf_counter() - started, 1)})
            jit_watch.watch()  # a compilation from here on is on a request's step
        await super().start()

    def _warm_eager_steps(self) -> int:
        """warmup.warm_eager_steps; a step too large for the memory left is logged, not fatal
        (a full step of requests would then fail the same way, and say so)."""
        try:
            return warm_eager_steps(self)
        except torch.cuda.OutOfMemoryError as exc:
            log.warning("warming the eager steps ran out of GPU memory; the first full steps "
                        "may too", extra={"error": str(exc).splitlines()[0]})
            torch.cuda.empty_cache()
            return 0

    @torch.inference_mode()
    def _capture_graphs(self) -> int:
        assert self.graphs is not None
        count = self.graphs.capture_all()
        return count + (self.prefill_graphs.capture_all() if self.prefill_graphs else 0)

    async def close(self) -> None:
        await super().close()  # settles any step launched ahead first
        if self.overlap is not None:
            self.overlap.close()
        if self.followers is not None:
            self.followers.close()
            self.model.tp.close()

    async def _copy_blocks(self, copies: BlockCopies, sync: bool) -> list[CopyTiming]:
        return await asyncio.to_thread(self._copy_host_blocks, copies, sync)

    def _copy_host_blocks(self, copies: BlockCopies, sync: bool) -> list[CopyTiming]:
        assert self.host_kv is not None
        if self.model.mirror is not None:
            self.model.mirror.copy_blocks(copies.offloads, copies.onboards, sync)
        return self.host_kv.copy(copies.offloads, copies.onboards, sync)

    def _create_transfer(self) -> KvTransfer:
        buffer_blocks = transfer_buffer_blocks(self.args, self.pool.total)
        own = create_nixl_transfer(self.kv_cache, "tandem-reference", buffer_blocks)
        mirror = self.model.mirror
        if mirror is None:
            return own
        mirror.send(("transfer", buffer_blocks))  # each follower over its shard
        return RankedTransfer(own, mirror)

    def _request_key(self, request: EngineRequest) -> int:
        seed = request.sampling.seed
        return seed if seed is not None else secrets.randbits(63)

    def _validate(self, request: EngineRequest) -> None:
        super()._validate(request)
        if not request.embeddings:
            return
        if self.encoder is None:
            raise InvalidRequest("this model takes no images (it has no vision encoder)",
                                 param="embeddings")
        bad = next((e for e in request.embeddings if e.content_hash in self._bad_images), None)
        if bad is not None:
            raise InvalidRequest(f"image {bad.content_hash} cannot be decoded",
                                 param="embeddings")
        self.encoder.validate(request.embeddings, request.prompt_token_ids)

    async def encode(self, images: Sequence[bytes]) -> list[Embedding]:
        if self.encoder is None:
            raise InvalidRequest("this model has no vision encoder", param="images")
        return await asyncio.to_thread(self.encoder.embed, list(images))

    def stats(self) -> EngineStats:
        if self.host_kv is not None:  # CUDA copies report their time once they completed
            self.host_copies.record(self.host_kv.finished())
        stats = super().stats()
        encoder = self.encoder
        if encoder is None:
            return stats
        return dataclasses.replace(stats, num_encoded_images=encoder.num_encoded,
                                   encode_cache_hits=encoder.cache.num_hits,
                                   encode_cache_size=len(encoder.cache))

    async def _encode_step_images(self, inputs: StepInputs) -> dict[str, torch.Tensor]:
        """Runs the vision encoder over the images (aggregated fallback) whose placeholders
        this step computes; a request whose image cannot be decoded fails on its own."""
        images = [(span.item.content_hash, span.item.data) for _, span in inputs.mm_spans
                  if span.item.is_image and isinstance(span.item.data, bytes)]
        if not images or self.encoder is None:
            return {}
        encoded, errors = await asyncio.to_thread(self.encoder.encode, images)
        for req, span in inputs.mm_spans:
            error = errors.get(span.item.content_hash)
            if error is not None and not req.is_finished:
                self._bad_images[span.item.content_hash] = None
                if len(self._bad_images) > _MAX_BAD_IMAGES:
                    del self._bad_images[next(iter(self._bad_images))]
                self._fail(req, error)
        return encoded

    async def _execute(self, plan: StepPlan) -> list[Sampled]:
        if not plan.scheduled:
            return []
        inputs = build_step_inputs(plan, self.pool.block_size, self.device,
                                   self.graphs.width_bucket if self.graphs else None)
        encoded = await self._encode_step_images(inputs) if inputs.mm_spans else {}
        samples = _sample_inputs(plan)
        prompt_ids = [req.token_ids[start:start + count + 1]
                      for req, _, start, count, _ in inputs.prompt_spans]
        guides = [guide for req in plan.ready for guide in _row_guides(req)]
        # Before the await (verification moves num_computed); only for EAGLE-3's states.
        spans = _step_spans(plan) if self.model.aux is not None else []
        sampled, prompt_lps, aux = await asyncio.to_thread(
            self._forward_sample_and_keep, inputs, samples, prompt_ids, encoded, guides)
        if aux is not None and self.speculation is not None:
            self.speculation.proposer.observe(spans, aux, self._speculating)
        for (req, _, start, count, _), computed in zip(inputs.prompt_spans, prompt_lps,
                                                       strict=True):
            # Stored by position, so a recompute after preemption overwrites, never appends.
            req.prompt_logprobs[start:start + count] = computed
            if start + count == req.num_prompt - 1:
                req.stream.set_prompt_logprobs(list(req.prompt_logprobs))
        return sampled

    def _launch(self, plan: StepPlan, after: StepAhead | None) -> StepAhead | None:
        if self.overlap is None:
            return None
        inputs = build_step_inputs(plan, self.pool.block_size, self.device,
                                   self.graphs.width_bucket if self.graphs else None)
        if inputs.decode_rows is None or inputs.prompt_spans or inputs.mm_spans:
            return None  # a last prompt token with an image or prompt logprobs: in full
        return self.overlap.launch(plan.ready, inputs, _sample_inputs(plan), after)

    def _decode_logits(self, inputs: StepInputs) -> torch.Tensor:
        """Logits of a decode-only step's sampled rows: through its CUDA graph where one
        serves it, else eagerly."""
        logits = self._graph_logits(inputs)
        if logits is not None:
            return logits
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_cache)
        return self.model.compute_logits(hidden.index_select(0, inputs.sample_rows))

    def _graph_logits(self, inputs: StepInputs) -> torch.Tensor | None:
        """Logits of the sampled rows of a decode-only step (one new token per sequence, but a
        one-token prompt chunk may not sample yet) through its CUDA graph; None where no graph
        serves the step."""
        rows = inputs.decode_rows
        if self.graphs is None or rows is None or inputs.prompt_spans or inputs.mm_spans:
            return None
        shape = self.graphs.buckets(*inputs.meta.block_tables.shape)
        if shape is None:
            return None
        logits = self.graphs.run(rows, inputs.meta.block_tables, shape)
        return logits.index_select(0, inputs.sample_rows)

    @torch.inference_mode()
    def _forward_sample_and_keep(self, inputs: StepInputs, samples: list[SampleInput],
                                 prompt_ids: list[list[int]], encoded: dict[str, torch.Tensor],
                                 guides: list[Guide | torch.Tensor | None],
                                 ) -> tuple[list[Sampled], list[list[TokenLogprob]],
                                            torch.Tensor | None]:
        """`_forward_and_sample`, and a copy of the step's EAGLE-3 hidden states (None
        unless they are captured)."""
        sampled, prompt_lps = self._forward_and_sample(inputs, samples, prompt_ids, encoded,
                                                       guides)
        aux = self.model.aux
        return sampled, prompt_lps, (aux.rows(inputs.input_ids.shape[0]).clone()
                                     if aux is not None else None)

    @torch.inference_mode()
    def _forward_and_sample(self, inputs: StepInputs, samples: list[SampleInput],
                            prompt_ids: list[list[int]], encoded: dict[str, torch.Tensor],
                            guides: list[Guide | torch.Tensor | None],
                            ) -> tuple[list[Sampled], list[list[TokenLogprob]]]:
        """Runs in a worker thread: touches tensors only, never request state (guides are only
        read, to fill the step's grammar bitmask while the device computes the logits)."""
        logits = self._graph_logits(inputs)
        if logits is not None:
            if not samples:
                return [], []
            self._constrain(logits, guides)
            sampled = [(o.token_id, o.logprob) for o in self.sampler.sample(logits, samples)]
            return sampled, []
        # Spans of requests failed this step are skipped: their rows keep token embeddings.
        spans = [span for _, span in inputs.mm_spans
                 if not span.item.is_image or span.item.content_hash in encoded]
        embeds = self.encoder.rows(spans, encoded) if spans and self.encoder else None
        hidden = self._hidden(inputs, embeds)
        prompt_lps = [prompt_logprobs(self.model.compute_logits(hidden[row:row + count]), ids, k)
                      for (_, row, _, count, k), ids in zip(inputs.prompt_spans, prompt_ids,
                                                            strict=True)]
        if not samples:
            return [], prompt_lps
        logits = self.model.compute_logits(hidden.index_select(0, inputs.sample_rows))
        self._constrain(logits, guides)
        sampled = [(out.token_id, out.logprob) for out in self.sampler.sample(logits, samples)]
        return sampled, prompt_lps

    def _hidden(self, inputs: StepInputs,
                embeds: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """The model's final hidden states for a step that no decode graph serves: through the
        prefill graphs where a bucket holds it, else eagerly."""
        graphs = self.prefill_graphs
        bucket = (graphs.bucket(inputs.input_ids.shape[0])
                  if graphs is not None and embeds is None else None)
        if graphs is None or bucket is None:
            return self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_cache,
                              embeds)
        return graphs.run(inputs.input_ids, inputs.positions, inputs.meta, bucket)

    @staticmethod
    def _constrain(logits: torch.Tensor, guides: list[Guide | torch.Tensor | None]) -> None:
        """Masks, in place, what each guided row's grammar forbids: one bitmask for the batch,
        filled on the host while the device still computes `logits`, then applied there."""
        bitmask = fill_bitmask(guides, logits.shape[-1])
        if bitmask is not None:
            apply_bitmask(logits, bitmask)


def _row_guides(req: BatchRequest) -> list[Guide | torch.Tensor | None]:
    """What masks each row a ready request samples: its guide, or a verify pass's masks (one
    row per position; unguided: none)."""
    if not req.num_draft:
        return [req.guide]
    if isinstance(req.draft_masks, torch.Tensor):
        return list(req.draft_masks[:req.num_draft + 1])
    return [None] * (req.num_draft + 1)


def _step_spans(plan: StepPlan) -> list[StepSpan]:
    """Each scheduled request's rows of the step: (request, first row, first position, count),
    in build_step_inputs' order."""
    spans, row = [], 0
    for req, n in plan.scheduled:
        spans.append((req, row, req.num_computed - n, n))
        row += n
    return spans


def _sample_inputs(plan: StepPlan) -> list[SampleInput]:
    """What the sampler reads of each ready request (views of its tokens, taken now): one row,
    or one per position a verify pass scores, whose output runs up to the proposals before it
    (so each row is drawn as a plain step at that position would draw it)."""
    return [SampleInput(req.sampling, TokenSpan(req.token_ids, 0, req.num_prompt),
                        TokenSpan(req.token_ids, req.num_prompt, end), req.stop_ids, req.key)
            for req in plan.ready
            for end in range(len(req.token_ids) - req.num_draft, len(req.token_ids) + 1)]


def transfer_buffer_blocks(args: EngineArgs, pool_blocks: int) -> int:
    """Blocks of the KV transfer buffer: --kv-transfer-buffer-tokens, at most a quarter of the
    pool (a small pool keeps its blocks for requests; larger prompts go region by region)."""
    wanted = -(-max(args.kv_transfer_buffer_tokens, 0) // args.kv_block_size)
    return min(wanted, pool_blocks // 4)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest(f"device '{name}' requested but CUDA is not available",
                             param="device")
    return device


def _dtype(name: str, checkpoint: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # Half precision is slow and inexact on CPU; the checkpoint's dtype on GPU.
        return torch.float32 if device.type == "cpu" else _DTYPES.get(checkpoint, torch.bfloat16)
    if name not in _DTYPES:
        raise InvalidRequest(f"dtype must be auto or one of {', '.join(_DTYPES)}, got '{name}'",
                             param="dtype")
    return _DTYPES[name]


def create_reference_engine(
        args: EngineArgs) -> ReferenceEngine | ReferenceEncodeEngine | ReferenceEmbedEngine:
    validate_args(args)
    if args.load_format not in ("auto", "dummy"):
        raise InvalidRequest(f"load_format must be auto or dummy, got '{args.load_format}'",
                             param="load_format")
    config = ModelConfig.from_dir(args.model)
    if args.max_seq_len > config.max_position_embeddings:
        # Positions index the RoPE table without a bounds check (that would sync the host).
        raise InvalidRequest(
            f"--max-seq-len {args.max_seq_len} exceeds the model's max_position_embeddings "
            f"({config.max_position_embeddings})", param="max_seq_len")
    device = _device(args.device)
    dtype = _dtype(args.dtype, config.dtype, device)
    _refuse_unbuilt_parallelism(args)
    size = args.tensor_parallel_size
    if size > 1 and (args.encode_only or args.embed_only):
        raise InvalidRequest("--tensor-parallel-size above 1 serves language models; encode "
                             "and embedding workers run on one device",
                             param="tensor_parallel_size")
    if args.encode_only:  # an encode worker: the vision model alone, no language model
        return create_encode_engine(args, config, device, dtype)
    if args.embed_only:  # an embedding worker: pooled hidden states, no KV pool
        return create_embed_engine(args, config, device, dtype)
    if size == 1:
        return _build_engine(args, config, device, dtype, TensorGroup(), None)
    devices = _rank_devices(device, size)
    followers, rendezvous = Followers.start(args, devices, str(dtype).removeprefix("torch."))
    tp = TensorGroup()
    try:
        tp = init_group(0, size, rendezvous, torch.device(devices[0]))
        return _build_engine(args, config, torch.device(devices[0]), dtype, tp, followers)
    except BaseException:
        followers.close()
        tp.close()
        raise


def _refuse_unbuilt_parallelism(args: EngineArgs) -> None:
    """The TensorRT-LLM parallelism flags this engine does not build (its MoE experts are
    tensor-parallel: each rank holds every expert, cut in width)."""
    unbuilt = {"pipeline_parallel_size": args.pipeline_parallel_size > 1,
               "expert_parallel_size": args.expert_parallel_size > 1,
               "enable_attention_dp": args.enable_attention_dp}
    for name, is_set in unbuilt.items():
        if is_set:
            raise InvalidRequest(f"--{name.replace('_', '-')} is not built in the reference "
                                 "engine (it shards models with --tensor-parallel-size; MoE "
                                 "experts are then cut in width on every rank)", param=name)


def _build_engine(args: EngineArgs, config: ModelConfig, device: torch.device,
                  dtype: torch.dtype, tp: TensorGroup,
                  followers: Followers | None) -> ReferenceEngine:
    """Rank 0's engine: its shard of the model and of the KV pool; with `followers`, their
    pools sized like its own (the smallest any rank's memory holds) and the model's mirror."""
    model, spec = load_model(args.model, dtype, device, args.load_format, args.seed, tp,
                              args.quantization, kv_scales=args.kv_cache_dtype == "fp8")
    if spec.base_model:
        raise InvalidRequest(f"{args.model} is a base model ({config.architecture}: no "
                             "language-model head), fit for embeddings only: serve it on an "
                             "embedding worker (`tandem serve embed`)", param="model")
    encoder = create_image_encoder(args, device, dtype)
    if encoder is not None and tp.is_parallel:
        raise InvalidRequest("--tensor-parallel-size above 1 with a vision-language model is "
                             "not built yet", param="tensor_parallel_size")
    kv_dtype = kv_cache_dtype(args, dtype)
    bytes_per_block = kv_block_bytes(spec, args.kv_block_size, kv_dtype)
    num_blocks = num_kv_blocks(args, bytes_per_block, device)
    if followers is not None:
        num_blocks = min(num_blocks, *followers.ready_blocks())
    # One block more than the pool: scratch space for CUDA-graph padding rows.
    kv_cache = allocate_kv_cache(spec.num_layers, num_blocks + 1, args.kv_block_size,
                                 spec.num_kv_heads, spec.head_size, kv_dtype, device)
    log.info("reference engine ready", extra={
        "device": str(device), "dtype": str(dtype), "kv_blocks": num_blocks,
        "kv_cache_bytes": num_blocks * bytes_per_block, "architecture": spec.architecture,
        "tensor_parallel_size": tp.size})
    engine = ReferenceEngine(args, config, model, kv_cache, device, encoder, followers)
    if args.speculative_config:
        engine.speculation = create_speculation(args, model, kv_cache, dtype)
        if engine.speculation.proposer.aux_layers:
            engine.capture_aux_states(engine.speculation.proposer.aux_layers)
    if followers is not None:
        host = engine.pool.host
        followers.allocate(num_blocks, host.total if host is not None else 0)
        model.mirror = Mirror(followers.conns, tp)
    return engine


def _rank_devices(device: torch.device, size: int) -> list[str]:
    """The device of each rank: the CPU for all, or `size` GPUs from `device` on (the worker's
    GPUs: CUDA_VISIBLE_DEVICES, set by `tandem up`'s placement)."""
    if device.type != "cuda":
        return [str(device)] * size
    first = device.index or 0
    count = torch.cuda.device_count()
    if first + size > count:
        raise InvalidRequest(f"--tensor-parallel-size {size} needs {size} GPUs from "
                             f"cuda:{first} on; this worker sees {count} (give it more with "
                             "--decode-gpus/--prefill-gpus, e.g. \"0,1\", or "
                             "CUDA_VISIBLE_DEVICES)", param="tensor_parallel_size")
    return [f"cuda:{first + rank}" for rank in range(size)]


def _rank_lost(rank: int, exit_code: int | None) -> None:
    """A follower died: the worker exits at once (ranks.py says why)."""
    log.critical("tensor-parallel rank %d exited (code %s): the worker exits, its requests "
                 "migrate", rank, exit_code)
    logging.shutdown()
    os._exit(_EXIT_RANK_LOST)

"""gpt-oss-20b on a GPU (issue 26, item 4; a script, not a test), in one process:

1. Checks, on fresh random bf16 inputs with outputs poisoned first: the Triton paged decode
   attention with sinks and sliding windows against `sink_attention` (the plain path) in
   float64; gpt-oss's Triton MoE (routing, sort, two grouped GEMMs) against a float64
   computation of the same routing, and torch's grouped_mm path against the same bar.
2. Pieces: one MoE layer's GPU time (CUDA-graph replays) through the Triton kernels and through
   torch's grouped_mm, at 1 and 64 tokens, as bandwidth over the experts it reads.
3. The 20b shape (transformers' GptOssConfig with 24 layers and 32 experts: hidden 2880, 64
   query / 8 KV heads of 64, top 4, expert width 2880, window 128 on every other layer, vocab
   201088) with dummy bf16 weights drawn on the GPU, through the engine API with CUDA graphs:
   decode ITL p50 at batch 1 and 64 with ~1,000-token contexts, next to its floor: the bytes a
   step must read (the experts the batch routes to, counted per layer in an eager pass of the
   same batch; attention, router, norm and LM-head weights; the embedding rows of the batch;
   each sequence's KV, 128 positions on sliding layers) over the measured copy bandwidth.
4. Prefill TFLOP/s: 8 x 2,048-token prompts in one step.

Prints the tables last; every figure also goes to --out as JSON.

    PYTHONPATH=. python3 benchmarks/moe_gpu.py            # on a CUDA machine (one H100)
    PYTHONPATH=. python3 benchmarks/moe_gpu.py --small    # CPU smoke run of the script
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks.reference_gpu import (  # noqa: E402
    H100_DENSE_BF16,
    copy_bandwidth,
    generate,
    itl_ms,
    matmul_rate,
    prompts_of,
    sync,
    write_config,
)
from benchmarks.reference_gpu_kernels import graph_us  # noqa: E402
from tandem.engines.args import EngineArgs  # noqa: E402
from tandem.engines.reference import kernels, moe_kernels  # noqa: E402
from tandem.engines.reference.attention import decode_attention  # noqa: E402
from tandem.engines.reference.batch import AttentionMetadata  # noqa: E402
from tandem.engines.reference.engine import create_reference_engine  # noqa: E402
from tandem.engines.reference.moe import GptOssMoeBlock, clamped_swiglu  # noqa: E402

GPT_OSS = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
           "rms_norm_eps": 1e-5, "swiglu_limit": 7.0, "max_position_embeddings": 131072}
GPT_OSS_20B = dict(GPT_OSS, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                   num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                   num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                   vocab_size=201088)
SMALL = dict(GPT_OSS, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
             num_experts_per_tok=2, sliding_window=16, vocab_size=4096)
BLOCK = 32
DT = torch.bfloat16


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.isnan().any():
        return float("nan")
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def poison(numel: int) -> None:
    """Leaves NaN in the caching allocator's free blocks of this size, so that an output
    allocated next and left partly unwritten shows as NaN."""
    junk = torch.full((numel,), float("nan"), dtype=DT, device="cuda")
    del junk


# ---------------------------------------------------------------- 1. kernel checks

def check_sink_attention() -> list[dict]:
    """The Triton decode kernel with sinks (and windows) against sink_attention in float64;
    the bf16 torch path against the same bar."""
    heads, kv_heads, head = 64, 8, 64
    rows = []
    for lens, window in (([1, 17, 130, 1000], None), ([1, 17, 130, 1000], 128),
                         ([2000], None), ([300, 2000, 129], 128), ([64] * 64, 128)):
        width = max(-(-n // BLOCK) for n in lens) + 3  # padded wider than any sequence needs
        blocks = len(lens) * width + 1
        cache = torch.randn(2, blocks, BLOCK, kv_heads, head, device="cuda", dtype=DT)
        tables = torch.randperm(blocks, device="cuda")[:len(lens) * width].view(len(lens), width)
        q = torch.randn(len(lens), heads, head, device="cuda", dtype=DT)
        sinks = (2 * torch.randn(heads, device="cuda")).to(DT)
        context = torch.tensor(lens, device="cuda")
        meta = AttentionMetadata(torch.zeros(len(lens), dtype=torch.long, device="cuda"),
                                 list(range(len(lens) + 1)), lens, context, tables, BLOCK, True)
        ref = decode_attention(q.double(), cache.double(), meta, window, sinks.double())
        poison(q.numel())
        out = kernels.paged_decode_attention(q, cache, tables, context, BLOCK, window,
                                             sinks=sinks)
        narrow = kernels.paged_decode_attention(q, cache, tables[:, :width - 3], context, BLOCK,
                                                window, sinks=sinks)
        rows.append({"lens": lens if len(lens) < 8 else f"{len(lens)} x {lens[0]}",
                     "window": window, "triton": rel_err(out, ref),
                     "torch_bf16": rel_err(decode_attention(q, cache, meta, window, sinks), ref),
                     "no_sinks": rel_err(kernels.paged_decode_attention(
                         q, cache, tables, context, BLOCK, window), ref),
                     "padding_independent": bool(torch.equal(out, narrow))})
    return rows


def reference_slots(x: torch.Tensor, block: GptOssMoeBlock, ids: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
    """[T, K, H] in float64: each (token, slot)'s weighted expert output for routing ids, weights
    [T, K], an expert at a time."""
    e = block.experts
    x64 = x.double()
    out = torch.zeros(*ids.shape, x.shape[1], dtype=torch.float64, device=x.device)
    for expert in range(block.num_experts):
        t, k = (ids == expert).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        h = x64[t] @ e.gate_up_proj[expert].double() + e.gate_up_proj_bias[expert].double()
        h = clamped_swiglu(h, block.alpha, block.limit)
        y = h @ e.down_proj[expert].double() + e.down_proj_bias[expert].double()
        out[t, k] = y * weights[t, k].double()[:, None]
    return out


def kernel_ids(order: torch.Tensor, ends: torch.Tensor, num_tokens: int,
               top_k: int) -> torch.Tensor:
    """The expert of each (token, slot) pair, [T, K], from route()'s order and ends."""
    ids = torch.empty(num_tokens * top_k, dtype=torch.long, device=order.device)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    for expert, (start, end) in enumerate(zip(starts.tolist(), ends.tolist())):
        ids[order[start:end].long()] = expert
    return ids.view(num_tokens, top_k)


def moe_layer(shape: dict, std: float = 0.05) -> GptOssMoeBlock:
    with torch.device("meta"):
        block = GptOssMoeBlock(shape["hidden_size"], shape["intermediate_size"],
                               shape["num_local_experts"], shape["num_experts_per_tok"], 1.702,
                               shape["swiglu_limit"])
    block = block.to(DT).to_empty(device="cuda").requires_grad_(False)
    for param in block.parameters():
        param.normal_(0.0, std)
    return block


def check_moe(shape: dict) -> list[dict]:
    """Triton MoE (routing + grouped GEMMs) against float64 with the same routing; torch's
    grouped_mm path against float64 with its own routing."""
    block = moe_layer(shape)
    top_k = block.top_k
    rows = []
    for tokens in (1, 5, 64, 256):
        x = torch.randn(tokens, shape["hidden_size"], device="cuda", dtype=DT)
        logits = kernels.linear(x, block.router) if tokens <= 64 else block.router(x)
        weights, order, ends, active = moe_kernels.route(logits, top_k)
        ids = kernel_ids(order, ends, tokens, top_k)
        top, expected_ids = torch.topk(logits.float(), top_k, dim=-1)
        same_routing = (ids.sort(-1).values == expected_ids.sort(-1).values).all(-1)
        poison(tokens * top_k * shape["hidden_size"])
        slots = moe_kernels.experts(x, logits, block.experts.gate_up_proj,
                                    block.experts.gate_up_proj_bias, block.experts.down_proj,
                                    block.experts.down_proj_bias, top_k, block.alpha,
                                    block.limit)
        ref = reference_slots(x, block, ids, weights.view(tokens, top_k)).sum(1)
        torch_ids, torch_w = block.route(x)
        torch_ref = reference_slots(x, block, torch_ids, torch_w).sum(1)
        num_active = int((active >= 0).sum())
        rows.append({"tokens": tokens, "triton": rel_err(slots.sum(1), ref),
                     "torch_grouped_mm": rel_err(block.forward_grouped(x), torch_ref),
                     "routing_equal_tokens": f"{int(same_routing.sum())}/{tokens}",
                     "weights_vs_softmax": rel_err(weights.view(tokens, top_k),
                                                   torch.softmax(top, -1)),
                     "active_experts": num_active,
                     "active_ok": num_active == len(set(ids.flatten().tolist()))})
    return rows


# ---------------------------------------------------------------- 2. pieces

def host_sync(fn: Callable[[], object]) -> str | None:
    """What makes `fn` wait for the device on the host (torch's sync debug mode), or None."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return None
    except RuntimeError as error:
        return str(error).splitlines()[0][:100]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def eager_us(fn: Callable[[], object], reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return 1000 * start.elapsed_time(end) / reps


def moe_times(shape: dict) -> list[dict]:
    """One MoE layer (router included) per path: GPU time from CUDA-graph replays where the
    path has no host sync, eager (launch gaps included) where it has one."""
    block = moe_layer(shape, std=0.02)
    expert_bytes = sum(p[0].numel() * p.element_size() for p in block.experts.parameters())
    rows = []
    for tokens in (1, 64):
        x = torch.randn(tokens, shape["hidden_size"], device="cuda", dtype=DT)
        _, _, _, active = moe_kernels.route(kernels.linear(x, block.router), block.top_k)
        read = int((active >= 0).sum()) * expert_bytes
        for name, fn in (("triton", functools.partial(block.forward_slots, x)),
                         ("torch grouped_mm", functools.partial(block.forward_grouped, x))):
            sync_error = host_sync(fn)
            us = graph_us(fn, reps=10, replays=20) if sync_error is None else eager_us(fn)
            rows.append({"tokens": tokens, "path": name, "us": us, "experts_gb": read / 1e9,
                         "tb_s": read / us / 1e6, "host_sync": sync_error})
    return rows


def attention_times() -> list[dict]:
    rows = []
    for batch, ctx, window in ((1, 1000, None), (1, 1000, 128), (64, 1000, None),
                               (64, 1000, 128)):
        width = -(-ctx // BLOCK)
        cache = torch.randn(2, batch * width + 1, BLOCK, 8, 64, dtype=DT, device="cuda")
        tables = torch.randperm(batch * width, device="cuda").view(batch, width)
        q = torch.randn(batch, 64, 64, dtype=DT, device="cuda")
        sinks = torch.randn(64, dtype=DT, device="cuda")
        lens = torch.full((batch,), ctx, device="cuda")
        us = graph_us(functools.partial(kernels.paged_decode_attention, q, cache, tables, lens,
                                        BLOCK, window, sinks=sinks))
        read = batch * min(ctx, window or ctx) * 8 * 64 * 2 * 2
        rows.append({"batch": batch, "ctx": ctx, "window": window, "us": us,
                     "tb_s": read / us / 1e6})
    return rows


# ---------------------------------------------------------------- 3./4. the engine

def step_bytes(model: torch.nn.Module, batch: int, ctx: float,
               experts_per_layer: list[float]) -> float:
    """The bytes a decode step of `batch` sequences at context `ctx` must read."""
    spec = model.spec
    total = 0.0
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        if name == "embed_tokens.weight":
            total += batch * param.shape[1] * param.element_size()  # the batch's rows
        elif ".experts." in name:
            layer = int(name.split(".")[1])
            total += size * experts_per_layer[layer] / spec.num_experts
        else:
            total += size
    kv_token = 2 * spec.num_kv_heads * spec.head_size * model.embed_tokens.weight.element_size()
    for window in spec.sliding_windows:
        total += batch * min(ctx, window or ctx) * kv_token
    return total


def prefill_flops(model: torch.nn.Module, num: int, length: int) -> float:
    """Matmul FLOPs of `num` prompts of `length` tokens: per token, every attention and router
    weight and top-k experts' (2 per multiply-add); the LM head for each prompt's last token;
    attention's QK and PV over each query's visible keys."""
    spec = model.spec
    per_token = 0
    for name, param in model.named_parameters():
        if param.dim() < 2 or name in ("embed_tokens.weight", "lm_head.weight"):
            continue
        share = spec.num_experts_per_tok / spec.num_experts if ".experts." in name else 1
        per_token += param.numel() * share
    pairs = sum(sum(min(i + 1, window or length) for i in range(length))
                for window in spec.sliding_windows)
    attention = 4 * spec.num_heads * spec.head_size * pairs
    lm_head = 2 * spec.vocab_size * spec.hidden_size
    return num * (2 * per_token * length + attention + lm_head)


class HostTimes:
    """Host-side times of the engine's decode steps (median of the last steps, ms): building
    the step's inputs, the graph call (input copies and the replay's launch), sampling (which
    waits for the GPU), and the gap from one forward pass's end to the next one's start
    (applying the tokens, streaming them, scheduling, the hop to the worker thread)."""

    def __init__(self, engine) -> None:  # type: ignore[no-untyped-def]
        import tandem.engines.reference.engine as engine_module

        self.engine, self.module = engine, engine_module
        self.times: dict[str, list[float]] = {"build_inputs": [], "graph_run": [],
                                              "sample": [], "between_forwards": []}
        self.spans: list[tuple[float, float]] = []

    def _wrap(self, owner: object, name: str, key: str) -> Callable[[], None]:
        original = getattr(owner, name)

        def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            out = original(*args, **kwargs)
            self.times[key].append(time.perf_counter() - start)
            return out

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original)

    def __enter__(self) -> HostTimes:
        engine = self.engine
        self.undo = [self._wrap(self.module, "build_step_inputs", "build_inputs"),
                     self._wrap(engine.sampler, "sample", "sample")]
        if engine.graphs is not None:
            self.undo.append(self._wrap(engine.graphs, "run", "graph_run"))
        forward = engine._forward_and_sample

        def spanned(*args):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            out = forward(*args)
            self.spans.append((start, time.perf_counter()))
            return out

        engine._forward_and_sample = spanned
        self.undo.append(lambda: setattr(engine, "_forward_and_sample", forward))
        return self

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self.undo):
            undo()
        self.times["between_forwards"] = [b[0] - a[1] for a, b in zip(self.spans,
                                                                      self.spans[1:])]

    def medians(self, last: int) -> dict[str, float]:
        return {k: 1000 * statistics.median(v[-last:]) for k, v in self.times.items() if v}


def graph_replay_ms(engine, batch: int) -> float:
    graphs = engine.graphs
    if graphs is None:
        return float("nan")
    keys = [k for k in graphs.graphs if k[0] == batch]
    if not keys:
        return float("nan")
    graph, _ = graphs.graphs[max(keys)]
    for _ in range(3):
        graph.replay()
    sync()
    start = time.perf_counter()
    for _ in range(20):
        graph.replay()
    sync()
    return 1000 * (time.perf_counter() - start) / 20


async def routed_experts(engine, batch: int, prompts: list[list[int]]) -> list[float]:
    """Experts each layer reads in an eager decode step of `batch` sequences (mean over a few
    steps), from the routing kernel's list of active experts."""
    counts: list[torch.Tensor] = []
    original = moe_kernels.route

    def recording(logits: torch.Tensor, top_k: int):  # type: ignore[no-untyped-def]
        out = original(logits, top_k)
        if logits.shape[0] == batch:
            counts.append((out[3] >= 0).sum())
        return out

    graphs, engine.graphs = engine.graphs, None
    moe_kernels.route = recording
    try:
        await generate(engine, prompts, 4)
    finally:
        moe_kernels.route = original
        engine.graphs = graphs
    layers = engine.model.spec.num_layers
    if not counts:  # the CPU (no Triton): every expert, the bound
        return [float(engine.model.spec.num_experts)] * layers
    steps = torch.stack(counts).float().view(-1, layers)
    return steps.mean(0).tolist()


def profile_step(engine, batch: int, out_dir: pathlib.Path) -> dict:
    """Kernel time of one eager decode step of the batch's graph shape (the graph's own static
    inputs), from torch.profiler: the GPU's busy time without launch gaps."""
    from torch.profiler import ProfilerActivity, profile

    graphs = engine.graphs
    keys = [k for k in graphs.graphs if k[0] == batch] if graphs is not None else []
    if not keys:
        return {}
    b, w = max(keys)
    with torch.inference_mode():
        graphs._forward(b, w)
        sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graphs._forward(b, w)
            sync()
    events = prof.key_averages()
    total = sum(getattr(e, "self_device_time_total", 0) for e in events)
    busy = sorted(((getattr(e, "self_device_time_total", 0), e.count, e.key[:40])
                   for e in events), reverse=True)[:8]
    print(f"kernels, batch {batch}: " + "; ".join(f"{name} {us / 1000:.3f} ms x{n}"
                                                  for us, n, name in busy if us > 0))
    try:
        table = events.table(sort_by="self_device_time_total", row_limit=16)
    except (AttributeError, KeyError, ValueError):
        table = events.table(sort_by="self_cuda_time_total", row_limit=16)
    (out_dir / f"profile_b{batch}.txt").write_text(table)
    launches = sum(e.count for e in events if getattr(e, "self_device_time_total", 0) > 0)
    return {"kernel_ms": total / 1000, "kernels": launches}


async def engine_figures(device: str, root: pathlib.Path, shape: dict, small: bool,
                         out_dir: pathlib.Path, log: Callable[[str, object], None]) -> dict:
    batches = [1, 4] if small else [1, 64]
    ctx, new = (96, 8) if small else (992, 32)
    pnum, plen = (2, 256) if small else (8, 2048)
    vocab = shape["vocab_size"]
    blocks = max(max(batches) * (ctx + new + 8), pnum * (plen + 1)) // BLOCK + 256
    engine = create_reference_engine(EngineArgs(
        model=str(write_config(root / "gpt-oss", shape)), device=device, dtype="bfloat16",
        load_format="dummy", num_gpu_blocks=blocks, kv_block_size=BLOCK,
        max_batch_size=max(batches), max_num_tokens=max(8192, pnum * plen), max_seq_len=4096,
        enable_prefix_caching=False))
    model = engine.model
    fig: dict = {"weights_gb": sum(p.numel() * p.element_size()
                                   for p in model.parameters()) / 1e9,
                 "graphs": engine.graphs is not None, "ctx": ctx + new / 2}
    log("engine", fig)
    await engine.start()
    await generate(engine, prompts_of(1, 64, vocab), 4)  # warm-up: kernels compile
    for batch in batches:
        await generate(engine, prompts_of(batch, ctx, vocab, 2), 4)  # this shape's graphs
        inner: list[float] = []
        original = engine._forward_and_sample

        def timed(*args, _inner=inner, _original=original):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            out = _original(*args)
            _inner.append(time.perf_counter() - start)
            return out

        engine._forward_and_sample = timed  # type: ignore[method-assign]
        with HostTimes(engine) as host:
            results = await generate(engine, prompts_of(batch, ctx, vocab, 3), new)
        del engine._forward_and_sample
        row = {"itl_ms": statistics.median(itl_ms(t[2:]) for _, t in results),
               "forward_sample_ms": 1000 * statistics.median(inner[-new // 2:]),
               "replay_ms": graph_replay_ms(engine, batch), "host": host.medians(new // 2)}
        experts = await routed_experts(engine, batch, prompts_of(batch, ctx, vocab, 4))
        row["experts_per_layer"] = statistics.mean(experts)
        row["floor_gb"] = step_bytes(model, batch, fig["ctx"], experts) / 1e9
        embedding = model.embed_tokens.weight
        row["embedding_table_gb"] = embedding.numel() * embedding.element_size() / 1e9
        row.update(profile_step(engine, batch, out_dir) if device == "cuda" else {})
        fig[f"b{batch}"] = row
        log(f"decode batch {batch}", row)
    for reps in range(2):  # one warm-up, then timed: all prompts in one step
        sync()
        start = time.perf_counter()
        await generate(engine, prompts_of(pnum, plen, vocab, 10 + reps), 1)
        sync()
        fig["prefill_s"] = time.perf_counter() - start
    fig["prefill_flops"] = prefill_flops(model, pnum, plen)
    fig["prefill"] = (pnum, plen)
    log("prefill", {"s": fig["prefill_s"], "tflop": fig["prefill_flops"] / 1e12})
    await engine.close()
    return fig


def print_tables(fig: dict, checks: dict, bw: float, peak: float, device: str) -> None:
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"\ndevice: {name}; copy bandwidth (read + write) {bw / 1e12:.2f} TB/s; "
          f"bf16 matmul 8192^3 {peak / 1e12:.0f} TFLOP/s; weights {fig['weights_gb']:.2f} GB; "
          f"CUDA graphs {'on' if fig['graphs'] else 'off'}")
    if checks.get("attention"):
        print("\nTriton decode attention with sinks vs sink_attention (float64), rel. error:\n\n"
              "| contexts | window | Triton bf16 | torch bf16 | Triton without sinks | "
              "same result at narrower table |\n|---|---|---:|---:|---:|---|")
        for r in checks["attention"]:
            print(f"| {r['lens']} | {r['window']} | {r['triton']:.1e} | {r['torch_bf16']:.1e} | "
                  f"{r['no_sinks']:.1e} | {r['padding_independent']} |")
    if checks.get("moe"):
        print("\nMoE layer (20b shape) vs float64 of the same routing, rel. error:\n\n"
              "| tokens | Triton | torch grouped_mm | routing = torch.topk | "
              "weights vs softmax | active experts |\n|---:|---:|---:|---:|---:|---:|")
        for r in checks["moe"]:
            print(f"| {r['tokens']} | {r['triton']:.1e} | {r['torch_grouped_mm']:.1e} | "
                  f"{r['routing_equal_tokens']} | {r['weights_vs_softmax']:.1e} | "
                  f"{r['active_experts']} ({'ok' if r['active_ok'] else 'WRONG'}) |")
    if checks.get("moe_times"):
        print("\nOne MoE layer, GPU time (graph replays):\n\n| tokens | path | us | experts read "
              "GB | TB/s |\n|---:|---|---:|---:|---:|")
        for r in checks["moe_times"]:
            how = "graph" if r["host_sync"] is None else f"eager; host sync: {r['host_sync']}"
            print(f"| {r['tokens']} | {r['path']} ({how}) | {r['us']:.1f} | "
                  f"{r['experts_gb']:.3f} | {r['tb_s']:.2f} |")
    if checks.get("attention_times"):
        print("\nDecode attention with sinks, GPU time:\n\n| batch | context | window | us | "
              "KV TB/s |\n|---:|---:|---|---:|---:|")
        for r in checks["attention_times"]:
            print(f"| {r['batch']} | {r['ctx']} | {r['window']} | {r['us']:.1f} | "
                  f"{r['tb_s']:.2f} |")
    print(f"\nDecode, contexts ~{fig['ctx']:.0f} tokens (engine API, CUDA graphs):\n\n"
          "| batch | ITL p50 ms | forward+sample ms | graph replay ms | kernels' busy ms "
          "(eager, launches) | experts/layer | floor GB | floor ms | ITL / floor | "
          "replay / floor | target |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for batch, target in ((1, 1.5), (64, 2.0), (4, None)):
        row = fig.get(f"b{batch}")
        if row is None:
            continue
        floor = 1000 * row["floor_gb"] * 1e9 / bw
        busy = (f"{row['kernel_ms']:.2f} ({row['kernels']})" if "kernel_ms" in row else "-")
        ratio = row["itl_ms"] / floor
        verdict = "-" if target is None else (f"<= {target}x: "
                                              f"{'met' if ratio <= target else 'missed'}")
        print(f"| {batch} | {row['itl_ms']:.2f} | {row['forward_sample_ms']:.2f} | "
              f"{row['replay_ms']:.2f} | {busy} | {row['experts_per_layer']:.1f} | "
              f"{row['floor_gb']:.2f} | {floor:.2f} | {ratio:.2f}x | "
              f"{row['replay_ms'] / floor:.2f}x | {verdict} |")
    notes = []
    for batch in (1, 64, 4):
        row = fig.get(f"b{batch}")
        if row is not None:
            whole = row["floor_gb"] + row["embedding_table_gb"]
            notes.append(f"batch {batch}: {1000 * whole * 1e9 / bw:.2f} ms "
                         f"(ITL / floor {row['itl_ms'] / (1000 * whole * 1e9 / bw):.2f}x)")
    print("\nThe floor counts the embedding rows a step reads; with the whole table counted "
          "instead: " + "; ".join(notes))
    print("\nHost work per decode step (median ms; between_forwards, which holds build_inputs, "
          "and the graph call's input copies leave the GPU idle; sample waits for it):\n")
    for batch in (1, 64, 4):
        row = fig.get(f"b{batch}")
        if row is not None and row.get("host"):
            print(f"- batch {batch}: " + ", ".join(f"{k} {v:.3f}" for k, v in row["host"].items()))
    num, length = fig["prefill"]
    rate = fig["prefill_flops"] / fig["prefill_s"]
    print(f"\nPrefill, {num} x {length} tokens in one step "
          f"({fig['prefill_flops'] / 1e12:.1f} TFLOP):\n\n| seconds | TFLOP/s | of measured "
          f"matmul | of H100 dense bf16 (989) |\n|---:|---:|---:|---:|\n"
          f"| {fig['prefill_s']:.3f} | {rate / 1e12:.0f} | {rate / peak:.0%} | "
          f"{rate / H100_DENSE_BF16:.0%} |")


def figure_log(path: pathlib.Path) -> tuple[dict, Callable[[str, object], None]]:
    """(figures, log): log(what, value) prints a figure, keeps it in `figures` and rewrites
    `path` (JSON) with all of them, so a run cut short keeps what it measured."""
    path.parent.mkdir(parents=True, exist_ok=True)
    figures: dict = {}

    def log(what: str, value: object) -> None:
        print(f"{what}: {value}", flush=True)
        figures[what] = value
        path.write_text(json.dumps(figures, indent=1, default=str))
    return figures, log


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="CPU smoke run with a tiny shape")
    parser.add_argument("--out", default=os.environ.get("OUT", "moe_gpu_out"),
                        help="folder for the JSON figures and profiles ($OUT by default)")
    args = parser.parse_args()
    device = "cpu" if args.small else "cuda"
    shape = SMALL if args.small else GPT_OSS_20B
    out_dir = pathlib.Path(args.out)
    figures, log = figure_log(out_dir / "moe_gpu.json")

    checks: dict = {}
    if device == "cuda":
        torch.manual_seed(0)
        with torch.inference_mode():
            for name, fn in (("attention", check_sink_attention),
                             ("moe", functools.partial(check_moe, shape)),
                             ("moe_times", functools.partial(moe_times, shape)),
                             ("attention_times", attention_times)):
                checks[name] = fn()
                log(name, checks[name])
                torch.cuda.empty_cache()
    bw = copy_bandwidth() if device == "cuda" else math.nan
    peak = matmul_rate() if device == "cuda" else math.nan
    log("bandwidth", {"copy_tb_s": bw / 1e12, "matmul_tflop_s": peak / 1e12})
    torch.cuda.empty_cache() if device == "cuda" else None
    with tempfile.TemporaryDirectory() as tmp:
        fig = await engine_figures(device, pathlib.Path(tmp), shape, args.small, out_dir, log)
    log("engine_figures", fig)
    if device == "cuda":  # the tiles autotuning chose, per shape
        log("tiles", {name: {str(key): str(config) for key, config in tuner.cache.items()}
                      for name, tuner in (("gemv", kernels._gemv_tuned),
                                          ("skinny_gemm", kernels._skinny_gemm_kernel),
                                          ("expert_gemm", moe_kernels._expert_gemm_kernel))})
    print_tables(fig, checks, bw, peak, device)


if __name__ == "__main__":
    asyncio.run(main())

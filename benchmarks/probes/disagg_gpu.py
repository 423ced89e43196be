"""Disaggregated prefill/decode of the reference engine on one GPU (a script, not a test).

Two processes, each with a reference engine on cuda:0 (a prefill worker and a decode worker,
same dummy weights from the same seed), exchange KV handles over a pipe as the gRPC services
would; the decode worker reads the blocks with one NIXL READ (VRAM to VRAM through UCX) and
resumes. Prints, per prompt length: greedy tokens disaggregated == aggregated, the KV bytes
moved, and the decode worker's time from admission to the first token (the read plus one
schedule) next to an aggregated prefill of the same prompt.

    PYTHONPATH=. python3 benchmarks/probes/disagg_gpu.py            # on a CUDA machine, ~2 min
    PYTHONPATH=. python3 benchmarks/probes/disagg_gpu.py --small    # CPU smoke run of the script
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import pathlib
import tempfile
import time
from multiprocessing.connection import Connection

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                max_position_embeddings=16384, rope_theta=500000.0, rms_norm_eps=1e-5)
SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=4096, max_position_embeddings=4096,
             rope_theta=10000.0, rms_norm_eps=1e-5)


def write_config(path: pathlib.Path, shape: dict) -> str:
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "torch_dtype": "bfloat16", "hidden_act": "silu", "tie_word_embeddings": False,
              "bos_token_id": 0, "eos_token_id": 1, **shape}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def engine_args(model: str, device: str, blocks: int):  # noqa: ANN201
    from tandem.engines.args import EngineArgs

    return EngineArgs(model=model, device=device, load_format="dummy", seed=0,
                      num_gpu_blocks=blocks, kv_block_size=32, max_num_tokens=16384,
                      max_batch_size=8, enable_prefix_caching=False, enforce_eager=True)


def sampling(max_tokens: int):  # noqa: ANN201
    from tandem.engines.types import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prefill_worker(conn: Connection, model: str, device: str, blocks: int) -> None:
    """Serves prefill requests from the pipe: (request id, prompt) -> (first token, handle);
    ("release", id) frees a lease; None stops."""
    from tandem.engines.reference.engine import create_reference_engine
    from tandem.engines.types import EngineRequest

    async def main() -> None:
        engine = create_reference_engine(engine_args(model, device, blocks))
        await engine.start()
        engine.transfer  # noqa: B018  (register the pool before the first request)
        conn.send("ready")
        while (message := await asyncio.to_thread(conn.recv)) is not None:
            if message[0] == "release":
                await engine.release(message[1])
                continue
            request_id, prompt, max_tokens = message
            result = await engine.prefill(EngineRequest(request_id, tuple(prompt),
                                                        sampling(max_tokens)), 60_000)
            conn.send((result.first_token, result.kv_handle))
        await engine.close()

    asyncio.run(main())


async def decode_side(conn: Connection, model: str, device: str, blocks: int,
                      lengths: list[int], max_tokens: int) -> list[tuple]:
    import dataclasses

    from tandem.engines.reference.engine import create_reference_engine
    from tandem.engines.types import EngineRequest

    engine = create_reference_engine(engine_args(model, device, blocks))
    await engine.start()
    engine.transfer  # noqa: B018
    engine.set_lease_releaser(lambda handle: conn.send(("release", handle.request_id)))

    async def run(request: EngineRequest) -> tuple[list[int], float]:
        start = time.perf_counter()
        first_at, tokens = 0.0, []
        async for chunk in engine.add_request(request):
            if chunk.token_ids and not tokens:
                first_at = time.perf_counter() - start
            tokens += chunk.token_ids
        return tokens, first_at

    rows = []
    for n in lengths:
        for attempt in range(3):  # the first of each length warms kernels and the NIXL peer
            prompt = [(i * 7919 + n + attempt) % 4000 + 5 for i in range(n)]
            agg_tokens, agg_ttft = await run(EngineRequest(f"agg-{n}-{attempt}", tuple(prompt),
                                                           sampling(max_tokens)))
            conn.send((f"dis-{n}-{attempt}", prompt, max_tokens))
            first, handle = await asyncio.to_thread(conn.recv)
            bytes_before = engine.stats().kv_bytes_received
            request = dataclasses.replace(
                EngineRequest(f"dis-{n}-{attempt}", tuple(prompt), sampling(max_tokens)),
                kv_handle=handle, first_token=first)
            dis_tokens, dis_first = await run(request)
            moved = engine.stats().kv_bytes_received - bytes_before
            if attempt:
                rows.append((n, dis_tokens == agg_tokens, moved, len(handle.descriptors),
                             agg_ttft, dis_first))
    await engine.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="CPU smoke run, tiny shape")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    device = "cpu" if args.small else "cuda"
    shape = SMALL if args.small else LLAMA_8B
    lengths = [min(n, 1024) for n in args.lengths] if args.small else args.lengths
    blocks = 1024 if args.small else 2048
    model = write_config(pathlib.Path(tempfile.mkdtemp()) / "model", shape)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    worker = ctx.Process(target=prefill_worker, args=(there, model, device, blocks))
    worker.start()
    assert here.recv() == "ready"
    rows = asyncio.run(decode_side(here, model, device, blocks, lengths, args.max_tokens))
    here.send(None)
    worker.join(60)
    name = "tiny llama (CPU)" if args.small else "Llama-3.1-8B shape, dummy bf16 weights (GPU)"
    print(f"model: {name}; 2 processes, NIXL READ of the prompt's KV; greedy "
          f"{args.max_tokens} tokens")
    print(f"{'prompt':>7} {'tokens equal':>12} {'KV MiB':>8} {'descs':>6} "
          f"{'agg TTFT ms':>12} {'read+resume ms':>15} {'GB/s':>6}")
    for n, equal, moved, descs, agg_ttft, dis_first in rows:
        print(f"{n:>7} {str(equal):>12} {moved / 2**20:>8.1f} {descs:>6} {agg_ttft * 1e3:>12.2f} "
              f"{dis_first * 1e3:>15.2f} {moved / dis_first / 1e9:>6.1f}")


if __name__ == "__main__":
    main()

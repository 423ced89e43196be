"""The context_only -> generation_only handoff across two worker processes, through Tandem's
KV handle as it travels on the wire (protobuf), on the fake TensorRT-LLM: a prefill worker
process serves the KV over the fake's transceiver; this process decodes and must produce the
aggregated tokens; afterwards neither side holds a block. Also `tandem check-engine`."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tandem.engines.args import EngineArgs
from tandem.engines.types import EngineRequest, FinishReason, SamplingParams, TokenLogprob
from tandem.runtime import convert
from tandem.v1 import common_pb2
from tests.unit.fake_packages import fake_trtllm  # noqa: F401 (autouse: tensorrt_llm is the fake)

REPO = pathlib.Path(__file__).resolve().parents[2]
FAKES = REPO / "tests" / "fakes"
TRANSCEIVER = json.dumps({"cache_transceiver_config": {"backend": "DEFAULT"}})
PROMPT = tuple(range(40, 61))
SAMPLING = SamplingParams(max_tokens=10, temperature=0.0)

PREFILL_WORKER = """
import asyncio, json, sys
from tandem.engines.args import EngineArgs
from tandem.engines.trtllm.engine import create_trtllm_engine
from tandem.engines.types import EngineRequest, SamplingParams
from tandem.runtime import convert

async def main(model, prompt, max_tokens):
    engine = create_trtllm_engine(EngineArgs(model=model, kv_block_size=4,
        override_engine_args=json.dumps({"cache_transceiver_config": {"backend": "DEFAULT"}})))
    await engine.start()
    result = await engine.prefill(EngineRequest("h", tuple(prompt),
        SamplingParams(max_tokens=max_tokens, temperature=0.0)), lease_ms=30000)
    wire = convert.kv_handle_to_pb(result.kv_handle).SerializeToString().hex()
    print("HANDLE", wire, result.first_token.token_id, flush=True)
    # Serve the transfer (the event loop keeps running) until the decode side is done.
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    executor = engine._llm._executor
    print("HELD", executor.blocks.num_used, executor.sender.num_held, flush=True)
    await engine.close()

asyncio.run(main(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])))
"""




async def _tokens(engine: object, request: EngineRequest) -> tuple[list[int], FinishReason]:
    tokens: list[int] = []
    async for chunk in engine.add_request(request):  # type: ignore[attr-defined]
        tokens.extend(chunk.token_ids)
        reason = chunk.finish_reason
    assert reason is not None
    return tokens, reason


async def test_handoff_across_processes(tiny_model: str) -> None:
    from tandem.engines.trtllm.engine import create_trtllm_engine

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(FAKES)])}
    worker = subprocess.Popen(
        [sys.executable, "-c", PREFILL_WORKER, tiny_model, json.dumps(PROMPT),
         str(SAMPLING.max_tokens)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        assert worker.stdout is not None and worker.stdin is not None
        line = worker.stdout.readline().split()
        assert line and line[0] == "HANDLE", worker.stderr.read() if worker.stderr else line
        msg = common_pb2.KvHandle()
        msg.ParseFromString(bytes.fromhex(line[1]))
        handle = convert.kv_handle_from_pb(msg)
        assert handle.backend == "trtllm" and handle.trtllm_params is not None
        assert handle.trtllm_params.opaque_state and handle.trtllm_params.first_gen_tokens

        args = EngineArgs(model=tiny_model, kv_block_size=4, override_engine_args=TRANSCEIVER)
        decode, agg = create_trtllm_engine(args), create_trtllm_engine(args)
        await decode.start()
        await agg.start()
        try:
            expected, _ = await _tokens(agg, EngineRequest("a", PROMPT, SAMPLING))
            request = EngineRequest("h", PROMPT, SAMPLING, kv_handle=handle,
                                    first_token=TokenLogprob(int(line[2]), 0.0))
            tokens, reason = await _tokens(decode, request)
            assert tokens == expected and reason is FinishReason.LENGTH
            assert decode._llm._executor.blocks.num_used == 0
        finally:
            await decode.close()
            await agg.close()
        worker.stdin.write("done\n")
        worker.stdin.flush()
        held = worker.stdout.readline().split()
        assert held == ["HELD", "0", "0"]  # the context worker freed its KV after the pull
        assert worker.wait(timeout=10) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


async def test_check_engine_agrees_on_the_fake(tiny_model: str) -> None:
    from tandem.engines.trtllm.check import check_engine, with_transceiver

    rows = await check_engine("trtllm", EngineArgs(model=tiny_model, kv_block_size=4),
                              num_prompts=3, max_tokens=6)
    assert len(rows) == 3 and all(row.ok for row in rows)
    assert any(len(row.disaggregated) == 6 for row in rows)  # the decode leg ran
    assert "cache_transceiver_config" in with_transceiver(EngineArgs()).override_engine_args
    kept = EngineArgs(override_engine_args='{"cache_transceiver_config": {"backend": "UCX"}}')
    assert with_transceiver(kept) == kept


def test_check_engine_cli(tiny_model: str, capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.engines.trtllm.check import main

    assert main(["--model", tiny_model, "--kv-block-size", "4", "--num-prompts", "2",
                 "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "2/2 prompts agree" in out

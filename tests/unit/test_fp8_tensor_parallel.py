"""FP8 checkpoints under tensor parallelism, on the CPU: each rank's projections hold exactly the
rank's cut of the whole model's (dequantized, as the CPU loads them, and FP8 with their cut row
or block scales, as a GPU keeps them), for per-tensor, per-row and block scales; a cut that
splits scale blocks is refused by name, and so are MXFP4 experts; and an FP8 checkpoint served
at two ranks (gloo between real processes) gives the tokens of one rank."""
from __future__ import annotations

import pathlib

import pytest
import torch

from tandem.engines.reference.loader import load_model
from tandem.engines.reference.parallel.group import TensorGroup
from tandem.engines.reference.parallel.shard import Shards
from tandem.engines.reference.quant.fp8 import Fp8Linear
from tandem.errors import InvalidRequest
from tandem.model.quantize import write_fp8_checkpoint, write_mxfp4_checkpoint
from tandem.model.tiny import write_tiny_model
from tests.unit.test_reference_engine import prompts, run
from tests.unit.test_tensor_parallel import engine_for

CPU = torch.device("cpu")
#: (family, format, scale block): llama's KV heads are 16 rows, Qwen3's 32.
CASES = [("llama", "ct-channel", (128, 128)), ("llama", "ct-tensor", (128, 128)),
         ("llama", "modelopt", (128, 128)), ("llama", "fp8-block", (16, 16)),
         ("qwen3", "ct-block", (32, 32))]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("fp8-tp")


def checkpoint(root: pathlib.Path, family: str, fmt: str, block: tuple[int, int]
               ) -> pathlib.Path:
    path = root / f"{family}-{fmt}-{block[0]}"
    if not path.exists():
        src = root / family
        if not src.exists():
            write_tiny_model(src, family, seed=9)
        write_fp8_checkpoint(src, path, fmt, block)
    return path


def dense(layer: torch.nn.Module) -> torch.Tensor:
    return (layer.dequantized(torch.float32) if isinstance(layer, Fp8Linear)
            else layer.weight.detach())


@pytest.mark.parametrize("fp8_layers", [False, True])
@pytest.mark.parametrize(("family", "fmt", "block"), CASES)
def test_each_rank_holds_its_cut_of_the_whole(root: pathlib.Path, family: str, fmt: str,
                                              block: tuple[int, int], fp8_layers: bool) -> None:
    path = checkpoint(root, family, fmt, block)
    whole, spec = load_model(path, torch.float32, CPU, fp8_layers=fp8_layers)
    for rank in (0, 1):
        part, _ = load_model(path, torch.float32, CPU, tp=TensorGroup(rank=rank, size=2),
                             fp8_layers=fp8_layers)
        shards = Shards(spec, rank, 2)
        for i, (full, mine) in enumerate(zip(whole.layers, part.layers, strict=True)):
            prefix = f"model.layers.{i}."
            attn, mlp = full.self_attn, full.mlp
            assert isinstance(mine.self_attn.qkv_proj, Fp8Linear) is fp8_layers
            q, k, v = dense(attn.qkv_proj).split([attn.q_size, attn.kv_size, attn.kv_size])
            want = torch.cat([shards.cut(prefix + f"self_attn.{n}_proj.weight", w)
                              for n, w in (("q", q), ("k", k), ("v", v))])
            assert torch.equal(dense(mine.self_attn.qkv_proj), want), (rank, i, "qkv")
            assert torch.equal(dense(mine.self_attn.o_proj), shards.cut(
                prefix + "self_attn.o_proj.weight", dense(attn.o_proj))), (rank, i, "o")
            gate, up = dense(mlp.gate_up_proj).chunk(2)
            want = torch.cat([shards.cut(prefix + "mlp.gate_proj.weight", gate),
                              shards.cut(prefix + "mlp.up_proj.weight", up)])
            assert torch.equal(dense(mine.mlp.gate_up_proj), want), (rank, i, "gate_up")
            assert torch.equal(dense(mine.mlp.down_proj), shards.cut(
                prefix + "mlp.down_proj.weight", dense(mlp.down_proj))), (rank, i, "down")


def test_a_cut_through_scale_blocks_is_refused(root: pathlib.Path) -> None:
    """llama's 16-row KV heads split its 32-row blocks: kept FP8, the scales cannot follow;
    dequantized while loading (the CPU's way), the values can."""
    path = checkpoint(root, "llama", "fp8-block", (32, 32))
    with pytest.raises(InvalidRequest, match="split the checkpoint's 32x32 FP8 scale blocks"):
        load_model(path, torch.float32, CPU, tp=TensorGroup(rank=1, size=2), fp8_layers=True)
    load_model(path, torch.float32, CPU, tp=TensorGroup(rank=1, size=2), fp8_layers=False)


def test_mxfp4_at_two_ranks_is_refused(root: pathlib.Path) -> None:
    path = write_mxfp4_checkpoint(write_tiny_model(root / "gpt-oss", "gpt_oss", seed=6),
                                  root / "gpt-oss-mxfp4")
    with pytest.raises(InvalidRequest, match="MXFP4 weights are not cut across ranks yet"):
        load_model(path, torch.float32, CPU, tp=TensorGroup(rank=0, size=2))


async def test_an_fp8_checkpoint_at_two_ranks_gives_the_tokens_of_one(root: pathlib.Path
                                                                      ) -> None:
    path = checkpoint(root, "llama", "ct-channel", (128, 128))
    tokens = []
    for tp in (1, 2):
        engine = engine_for(path, tp)
        await engine.start()
        try:
            tokens.append([t for t, _ in await run(engine, prompts(engine.vocab_size,
                                                                   [3, 17, 40]))])
        finally:
            await engine.close()
    assert tokens[0] == tokens[1]

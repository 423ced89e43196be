"""Mixture-of-experts families (Mixtral, Qwen3-MoE) in the reference engine against transformers:
ModelSpec reads the routing fields, the MoE block equals transformers' bit for bit in bfloat16,
both checkpoint layouts load, and greedy tokens equal `generate` with long prompts, prefix-cache
hits, chunked prefill and batches."""
from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import pytest
import torch
import transformers

from tandem.engines.args import EngineArgs
from tandem.engines.reference.engine import create_reference_engine
from tandem.engines.reference.loader import load_model
from tandem.engines.reference.moe import SparseMoeBlock
from tandem.engines.reference.spec import ModelSpec
from tandem.errors import InvalidRequest
from tandem.model.tiny import write_tiny_model
from tests.unit.test_reference_engine import engine_for, hf_greedy, prompts, run

FAMILIES = ["mixtral", "qwen3_moe"]
NEW_TOKENS = 10  # test_reference_engine's run/hf_greedy generate this many


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("tiny-moe")
    return {f: write_tiny_model(root / f, f, seed=3) for f in FAMILIES}


def _config(architecture: str, **keys: Any) -> dict[str, Any]:
    return {"architectures": [architecture], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 100, "num_experts_per_tok": 2, **keys}


def test_spec_reads_mixtral_routing() -> None:
    spec = ModelSpec.from_config(_config("MixtralForCausalLM", num_local_experts=8,
                                         sliding_window=24))
    assert (spec.family, spec.num_experts, spec.num_experts_per_tok) == ("mixtral", 8, 2)
    assert spec.moe_intermediate_size == 128  # Mixtral's experts use intermediate_size
    assert spec.norm_topk_prob and spec.router_weights_float32  # always, in transformers
    assert spec.sparse_layers == (True,) * 4 and not spec.qk_norm
    assert spec.sliding_windows == (24,) * 4
    assert ModelSpec.from_config(_config("MixtralForCausalLM", num_local_experts=8,
                                         sliding_window=None)).sliding_windows == (None,) * 4


def test_spec_reads_qwen3_moe_routing() -> None:
    # The Hub's spelling, num_experts; layers 1 and 3 are sparse by the step, 3 is made dense.
    spec = ModelSpec.from_config(_config(
        "Qwen3MoeForCausalLM", num_experts=16, moe_intermediate_size=32, decoder_sparse_step=2,
        mlp_only_layers=[3], norm_topk_prob=False, sliding_window=24, use_sliding_window=False))
    assert (spec.family, spec.num_experts, spec.moe_intermediate_size) == ("qwen3_moe", 16, 32)
    assert spec.intermediate_size == 128  # the dense layers' width
    assert spec.sparse_layers == (False, True, False, False)
    assert not spec.norm_topk_prob and not spec.router_weights_float32 and spec.qk_norm
    assert spec.sliding_windows == (None,) * 4  # the window needs use_sliding_window
    # transformers 5's save_pretrained writes num_local_experts instead.
    saved = ModelSpec.from_config(_config("Qwen3MoeForCausalLM", num_local_experts=16,
                                          moe_intermediate_size=32, norm_topk_prob=True))
    assert saved.num_experts == 16 and saved.norm_topk_prob
    assert saved.sparse_layers == (True,) * 4


def test_spec_of_a_dense_model_has_no_experts() -> None:
    spec = ModelSpec.from_config(_config("LlamaForCausalLM"))
    assert not spec.is_moe and spec.sparse_layers == ()


def test_top_k_beyond_the_experts_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="num_experts_per_tok"):
        ModelSpec.from_config(_config("MixtralForCausalLM", num_local_experts=2,
                                      num_experts_per_tok=3))


def _hf_block(family: str) -> tuple[torch.nn.Module, SparseMoeBlock]:
    """transformers' MoE block of `family`, taken from a whole model so that it dispatches to
    the experts implementation transformers picks by default, and ours, with the same random
    bfloat16 weights."""
    shape = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 100, "num_experts_per_tok": 2}
    if family == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=96, num_local_experts=8, **shape)
    else:
        config = transformers.Qwen3MoeConfig(moe_intermediate_size=96, num_experts=8,
                                             norm_topk_prob=False, **shape)
    hf: torch.nn.Module = transformers.AutoModelForCausalLM.from_config(config).model.layers[0].mlp
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in hf.parameters():
            param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    hf = hf.to(torch.bfloat16).eval()
    ours = SparseMoeBlock(64, 96, 8, 2, norm_topk_prob=family == "mixtral",
                          weights_float32=family == "mixtral").to(torch.bfloat16)
    ours.load_state_dict(hf.state_dict())  # same names: gate.weight, experts.*_proj
    return hf, ours


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_block_equals_transformers_bit_for_bit_in_bf16(family: str) -> None:
    """Routing dtype and the order of the weighted sum decide bf16 rounding: Mixtral weights in
    float32, Qwen3-MoE in bf16. Flipping that choice must break the equality (it is tested)."""
    hf, ours = _hf_block(family)
    x = torch.randn(1, 300, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        expected = hf(x)[0]
        assert torch.equal(ours(x[0]), expected)
        ours.weights_float32 = not ours.weights_float32
        assert not torch.equal(ours(x[0]), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_stacked_expert_checkpoint_loads_the_same_weights(
        family: str, model_dirs: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    """A checkpoint of transformers 5's in-memory names (experts stacked as
    `experts.gate_up_proj` / `experts.down_proj`) loads as the per-expert one does."""
    from safetensors.torch import save_file

    source = model_dirs[family]
    hf = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, tmp_path / "model.safetensors")
    shutil.copyfile(source / "config.json", tmp_path / "config.json")
    stacked, _ = load_model(tmp_path, None, torch.device("cpu"))
    per_expert, _ = load_model(source, None, torch.device("cpu"))
    expected = per_expert.state_dict()
    for name, tensor in stacked.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_missing_expert_is_named(model_dirs: dict[str, pathlib.Path],
                                 tmp_path: pathlib.Path) -> None:
    from safetensors.torch import load_file, save_file

    source = model_dirs["qwen3_moe"]
    shutil.copyfile(source / "config.json", tmp_path / "config.json")
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(InvalidRequest, match=r"model\.layers\.0\.mlp\.experts\.3\.up_proj"):
        load_model(tmp_path, None, torch.device("cpu"))


@pytest.mark.parametrize("family", FAMILIES)
def test_dummy_weights_build_every_layer_kind(family: str, model_dirs: dict[str, pathlib.Path],
                                              tmp_path: pathlib.Path) -> None:
    shutil.copyfile(model_dirs[family] / "config.json", tmp_path / "config.json")
    model, spec = load_model(tmp_path, torch.bfloat16, torch.device("cpu"), load_format="dummy")
    real, _ = load_model(model_dirs[family], None, torch.device("cpu"))
    assert {k: v.shape for k, v in model.state_dict().items()} == \
        {k: v.shape for k, v in real.state_dict().items()}
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    expected = {"mixtral": ["SparseMoeBlock"] * 2,
                "qwen3_moe": ["SparseMoeBlock", "GatedMLP"]}[family]
    assert kinds == expected


def test_tiny_configs_are_what_the_tests_claim(model_dirs: dict[str, pathlib.Path]) -> None:
    """The engine tests below cover renormalised top-2 routing over 4 experts, and Qwen3-MoE's
    dense layer, only if the tiny checkpoints are built that way."""
    for family in FAMILIES:
        config = json.loads((model_dirs[family] / "config.json").read_text())
        spec = ModelSpec.from_config(config)
        assert (spec.num_experts, spec.num_experts_per_tok, spec.norm_topk_prob) == (4, 2, True)
    assert ModelSpec.from_dir(model_dirs["qwen3_moe"]).sparse_layers == (True, False)


# Greedy equality on a mixed batch, with chunked prefill and with prefix-cache hits: the dense
# families' tests in test_reference_engine.py run on these two families too (its FAMILIES).


WINDOWS = {"mixtral": {"sliding_window": 24},
           "qwen3_moe": {"sliding_window": 24, "use_sliding_window": True}}


@pytest.mark.parametrize("family", FAMILIES)
async def test_sliding_window_matches_transformers(family: str,
                                                   tmp_path: pathlib.Path) -> None:
    model_dir = write_tiny_model(tmp_path / family, family, seed=5, **WINDOWS[family])
    assert set(ModelSpec.from_dir(model_dir).sliding_windows) == {24}
    engine = engine_for(model_dir)
    await engine.start()
    try:
        batch = prompts(engine.vocab_size, [40, 9], seed=6)  # 40 + 10 new: past the window
        results = await run(engine, batch)
        for prompt, (tokens, _) in zip(batch, results):
            assert tokens == hf_greedy(model_dir, prompt)
    finally:
        await engine.close()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("family", FAMILIES)
async def test_cuda_engine_decodes_moe_eagerly_and_matches_transformers(
        family: str, model_dirs: dict[str, pathlib.Path]) -> None:
    """On CUDA an MoE model runs without decode graphs (its experts loop syncs with the host)
    and still gives transformers' greedy tokens."""
    engine = create_reference_engine(EngineArgs(
        model=str(model_dirs[family]), device="cuda", dtype="float32", kv_block_size=8,
        num_gpu_blocks=256))
    assert engine.graphs is None
    await engine.start()
    try:
        batch = prompts(engine.vocab_size, [3, 40, 17], seed=7)
        results = await run(engine, batch)
        for prompt, (tokens, _) in zip(batch, results):
            assert tokens == hf_greedy(model_dirs[family], prompt)  # transformers on CPU
    finally:
        await engine.close()


@needs_cuda
def test_cuda_fused_half_path_runs_mixtral(model_dirs: dict[str, pathlib.Path]) -> None:
    """Mixtral (no q/k norm, head size 16) takes the Triton path in float16, its MoE layers
    through torch; its logits stay within half-precision rounding of transformers'."""
    from tandem.engines.reference.batch import AttentionMetadata, allocate_kv_cache

    cuda = torch.device("cuda")
    model, spec = load_model(model_dirs["mixtral"], torch.float16, cuda)
    tokens = prompts(spec.vocab_size, [45], seed=8)[0]
    block_size, n = 16, len(tokens)
    blocks = list(range(-(-n // block_size)))
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=cuda), query_start_loc=[0, n], context_lens=[n],
        context_lens_t=torch.tensor([n], device=cuda),
        block_tables=torch.tensor([blocks], device=cuda), block_size=block_size,
        is_decode_only=False)
    cache = allocate_kv_cache(spec.num_layers, len(blocks), block_size, spec.num_kv_heads,
                              spec.head_size, torch.float16, cuda)
    ids = torch.tensor(tokens, device=cuda)
    with torch.no_grad():
        hidden = model.embed_tokens(ids)
        assert model.fusable(hidden, meta.block_size)
        logits = model.compute_logits(model(ids, torch.arange(n, device=cuda), meta, cache))
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            model_dirs["mixtral"], dtype=torch.float16).to(cuda).eval()
        expected = hf(ids[None]).logits[0].float()
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            model_dirs["mixtral"], dtype=torch.float32).to(cuda).eval()(ids[None]).logits[0]
    # Both half-precision runs sit within a few fp16 roundoffs (2^-11) of float32, and of each
    # other; a MoE layer skipped or mis-weighted is off by O(1).
    ours = ((logits - reference).norm() / reference.norm()).item()
    theirs = ((expected - reference).norm() / reference.norm()).item()
    print(f"relative error vs float32: ours {ours:.2e}, transformers {theirs:.2e}")
    assert ours <= 2 * theirs + 2.0 ** -11

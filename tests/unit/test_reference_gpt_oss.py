"""gpt-oss in the reference engine against transformers' own functions: ModelSpec reads its
config (sinks, alternating windows, YaRN, biased experts) with GptOssConfig's defaults; the YaRN
tables, the sink attention of both paths over the paged cache, and the MoE block equal
transformers'; MXFP4 tensors in a checkpoint whose config does not declare them are refused
by name (MXFP4 checkpoints as shipped: test_quantized_checkpoints.py); greedy tokens equal `generate`.

The tiny gpt_oss family also runs through test_reference_engine.py's FAMILIES (batches, chunked
prefill, prefix-cache hits, preemption) and test_reference_model.py (logits, via tiny.FAMILIES).
"""
from __future__ import annotations

import asyncio
import pathlib
import shutil
from typing import Any

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_oss import modeling_gpt_oss as hf_gpt_oss

from tandem.engines.args import EngineArgs
from tandem.engines.reference.attention import (
    decode_attention,
    prefill_attention,
    sink_prefill,
    write_kv,
)
from tandem.engines.reference.batch import AttentionMetadata
from tandem.engines.reference.engine import create_reference_engine
from tandem.engines.reference.loader import load_model
from tandem.engines.reference.moe import GptOssMoeBlock
from tandem.engines.reference.rope import RotaryEmbedding, attention_factor, inverse_frequencies
from tandem.engines.reference.spec import ModelSpec
from tandem.errors import InvalidRequest
from tandem.model.tiny import write_tiny_model
from tests.unit.test_reference_engine import engine_for, hf_greedy, prompts, run


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-gpt-oss") / "gpt_oss", "gpt_oss",
                            seed=4)


def _config(**keys: Any) -> transformers.GptOssConfig:
    base: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 4,
                            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                            "vocab_size": 100, "num_local_experts": 8, "num_experts_per_tok": 2,
                            "max_position_embeddings": 4096}
    return transformers.GptOssConfig(**{**base, **keys})


def _spec(config: transformers.GptOssConfig) -> ModelSpec:
    return ModelSpec.from_config({**config.to_dict(), "architectures": ["GptOssForCausalLM"]})


def test_spec_reads_gpt_oss_with_transformers_defaults() -> None:
    # Only the shape given: windows, YaRN, theta, biases and experts come from the defaults.
    spec = ModelSpec.from_config({"architectures": ["GptOssForCausalLM"], "hidden_size": 64,
                                  "intermediate_size": 32, "num_hidden_layers": 4,
                                  "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "head_dim": 16, "vocab_size": 100, "num_local_experts": 8,
                                  "num_experts_per_tok": 2})
    hf = _config()
    assert spec.family == "gpt_oss" and spec.attention_sinks and spec.moe_kind == "gpt_oss"
    assert spec.sliding_windows == tuple(hf.sliding_window if t == "sliding_attention" else None
                                         for t in hf.layer_types) == (128, None, 128, None)
    assert spec.rope_theta == hf.rope_parameters["rope_theta"] == 150000.0
    assert spec.rope_scaling is not None and spec.rope_scaling["rope_type"] == "yarn"
    assert spec.rope_scaling["factor"] == 32.0 and not spec.rope_scaling["truncate"]
    assert spec.rope_scaling["original_max_position_embeddings"] == 4096
    assert spec.attention_bias and spec.attention_out_bias and not spec.qk_norm
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (8, 2, 32)
    assert spec.sparse_layers == (True,) * 4 and not spec.norm_topk_prob
    assert (spec.swiglu_alpha, spec.swiglu_limit) == (1.702, 7.0)
    assert spec.rms_norm_eps == hf.rms_norm_eps


@pytest.mark.parametrize("rope", [
    {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 128},  # gpt-oss's shape, a short original context
    {"factor": 8.0, "original_max_position_embeddings": 512},  # truncate defaults to True
    {"factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": True, "mscale": 0.707,
     "mscale_all_dim": 1.0, "original_max_position_embeddings": 1024},
    {"factor": 4.0, "attention_factor": 1.5, "original_max_position_embeddings": 1024},
])
@pytest.mark.parametrize("theta", [10000.0, 150000.0])
def test_yarn_tables_equal_transformers(rope: dict[str, Any], theta: float) -> None:
    config = _config(rope_parameters={"rope_type": "yarn", "rope_theta": theta, **rope})
    spec = _spec(config)
    inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = inverse_frequencies(spec.head_size, spec.rope_theta, spec.rope_scaling)
    assert torch.equal(ours, inv_freq)
    assert attention_factor(spec.rope_scaling) == scale
    # Kept, blended and interpolated frequencies all occur, so the ramp itself is compared.
    plain = inverse_frequencies(spec.head_size, spec.rope_theta)
    assert (ours == plain).any() and (ours < plain).any()

    positions = torch.tensor([0, 1, 7, 100, 1000, 4095])
    cos, sin = RotaryEmbedding(spec.head_size, spec.max_position_embeddings, spec.rope_theta,
                               spec.rope_scaling)(positions)
    hf_cos, hf_sin = hf_gpt_oss.GptOssRotaryEmbedding(config)(torch.zeros(1), positions[None])
    assert torch.equal(cos[:, 0], hf_cos[0]) and torch.equal(sin[:, 0], hf_sin[0])


HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 4, 2, 16, 4


class _HfAttention(torch.nn.Module):
    """What transformers' eager_attention_forward reads from its module."""

    def __init__(self, sinks: torch.Tensor) -> None:
        super().__init__()
        self.sinks = sinks
        self.num_key_value_groups = HEADS // KV_HEADS
        self.eval()


def _hf_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                       window: int | None) -> torch.Tensor:
    """transformers' gpt-oss attention over one whole sequence: q [L, H, D], k/v [L, KV, D]."""
    length = q.shape[0]
    pos = torch.arange(length)
    visible = pos[None, :] <= pos[:, None]
    if window is not None:
        visible &= pos[None, :] > pos[:, None] - window
    mask = torch.zeros(length, length).masked_fill(~visible, torch.finfo(torch.float32).min)
    out, _ = hf_gpt_oss.eager_attention_forward(
        _HfAttention(sinks), q.transpose(0, 1)[None], k.transpose(0, 1)[None],
        v.transpose(0, 1)[None], mask[None, None], scaling=HEAD_SIZE ** -0.5)
    return out[0]  # [L, H, D]


def _paged(seqs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
           num_new: list[int]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A cache holding every sequence's k/v (blocks in reverse order, so tables matter), the
    queries of each one's last `num_new` tokens, and their metadata."""
    tables, slots, queries, starts = [], [], [], [0]
    next_block = sum(-(-q.shape[0] // BLOCK) for q, _, _ in seqs)
    cache = torch.zeros(2, next_block, BLOCK, KV_HEADS, HEAD_SIZE)
    for (q, k, v), new in zip(seqs, num_new, strict=True):
        length = q.shape[0]
        blocks = []
        for _ in range(-(-length // BLOCK)):
            next_block -= 1
            blocks.append(next_block)
        seq_slots = torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)])
        write_kv(cache, k, v, seq_slots)
        tables.append(blocks)
        slots.append(seq_slots[length - new:])
        queries.append(q[length - new:])
        starts.append(starts[-1] + new)
    width = max(len(t) for t in tables)
    lens = [q.shape[0] for q, _, _ in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots), query_start_loc=starts, context_lens=lens,
        context_lens_t=torch.tensor(lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        block_size=BLOCK, is_decode_only=all(n == 1 for n in num_new))
    return cache, torch.cat(queries), meta


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("decode", [False, True])
def test_sink_attention_equals_transformers(window: int | None, decode: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    lengths = [13, 6, 9]
    seqs = [tuple(torch.randn(n, heads, HEAD_SIZE, generator=generator)
                  for heads in (HEADS, KV_HEADS, KV_HEADS)) for n in lengths]
    sinks = 2.0 * torch.randn(HEADS, generator=generator)  # large enough to take real mass
    num_new = [1, 1, 1] if decode else [5, 6, 1]  # cached prefixes, a whole prompt, one token
    cache, q, meta = _paged(seqs, num_new)
    attend = decode_attention if decode else prefill_attention
    ours = attend(q, cache, meta, window, sinks)
    expected = torch.cat([_hf_sink_attention(*seq, sinks, window)[-new:]
                          for seq, new in zip(seqs, num_new)])
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=0)
    # The sinks matter, and with sinks far below every score the attention is plain softmax.
    assert not torch.allclose(ours, attend(q, cache, meta, window, None), atol=1e-3)
    torch.testing.assert_close(attend(q, cache, meta, window, torch.full((HEADS,), -1e4)),
                               attend(q, cache, meta, window, None), atol=1e-6, rtol=0)


@pytest.mark.parametrize("window", [None, 5, 13, 40])
def test_sink_prefill_equals_transformers(window: int | None) -> None:
    """The CUDA path of a whole prompt's sink attention (flash attention's log-sum-exp for
    the sink's share; windows in chunks), run here through torch's CPU flash attention."""
    generator = torch.Generator().manual_seed(2)
    length = 29
    q, k, v = (torch.randn(length, heads, HEAD_SIZE, generator=generator)
               for heads in (HEADS, KV_HEADS, KV_HEADS))
    sinks = 2.0 * torch.randn(HEADS, generator=generator)
    ours = sink_prefill(*(x.transpose(0, 1)[None] for x in (q, k, v)), window, sinks)
    torch.testing.assert_close(ours[0].transpose(0, 1), _hf_sink_attention(q, k, v, sinks, window),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_block_equals_transformers_bit_for_bit(model_dir: pathlib.Path,
                                                   dtype: torch.dtype) -> None:
    model, _ = load_model(model_dir, dtype, torch.device("cpu"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(37, 64, generator=generator).to(dtype)
    for index in range(len(model.layers)):
        block = model.layers[index].mlp
        assert isinstance(block, GptOssMoeBlock)
        with torch.no_grad():
            expected, _ = hf.model.layers[index].mlp(x[None])
            ours = block(x)
        assert torch.equal(ours, expected[0])
    # The clamps bite at these weights (tiny's swiglu_limit is 2).
    layer = model.layers[0].mlp
    with torch.no_grad():
        gate_up = torch.einsum("th,ehi->tei", x.float(), layer.experts.gate_up_proj.float())
    assert (gate_up.abs() > layer.limit).any()


def test_mxfp4_tensors_without_a_quantization_config_are_refused(model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    from safetensors.torch import load_file, save_file

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(model_dir / name, tmp_path / name)
    tensors = load_file(str(model_dir / "model.safetensors"))
    name = "model.layers.0.mlp.experts.gate_up_proj"
    tensors[f"{name}_blocks"] = tensors.pop(name).to(torch.uint8)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(InvalidRequest, match="MXFP4.*quant_method mxfp4"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


async def test_greedy_matches_transformers_past_the_window(model_dir: pathlib.Path) -> None:
    """A batch with prompts several windows long, chunked (12-token budget), then a prefix-cache
    hit on them: every request's tokens equal `generate`'s."""
    engine = engine_for(model_dir, max_num_tokens=12)
    await engine.start()
    try:
        shared = prompts(engine.vocab_size, [32], seed=12)[0]
        batch = prompts(engine.vocab_size, [3, 29, 1], seed=13, prefix=shared)
        results = await run(engine, batch)
        for prompt, (tokens, _) in zip(batch, results):
            assert tokens == hf_greedy(model_dir, prompt)
        again = prompts(engine.vocab_size, [7], seed=14, prefix=shared)
        (tokens, usage), = await run(engine, again)
        assert usage.cached_tokens == 32
        assert tokens == hf_greedy(model_dir, again[0])
        assert len(set(tokens)) > 1  # not a degenerate model that repeats one token
        assert engine.pool.num_used == 0
    finally:
        await engine.close()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_cuda_graphs_decode_gpt_oss_as_eager(model_dir: pathlib.Path,
                                             tmp_path: pathlib.Path) -> None:
    """In bfloat16 on CUDA, gpt-oss decodes through the Triton kernels (sinks in the paged
    attention, routing and experts in moe_kernels) with no host sync, so CUDA graphs hold its
    steps; a batch past the window gives the same greedy tokens with graphs as without.
    Dummy weights: the device's transformers may save gpt-oss's experts in another layout.
    Synchronous (asyncio.run): the GPU machine's pytest has no asyncio plugin."""
    shutil.copyfile(model_dir / "config.json", tmp_path / "config.json")

    async def tokens(eager: bool) -> list[list[int]]:
        engine = create_reference_engine(EngineArgs(
            model=str(tmp_path), device="cuda", dtype="bfloat16", load_format="dummy",
            kv_block_size=16, num_gpu_blocks=256, enforce_eager=eager))
        assert (engine.graphs is None) == eager
        await engine.start()
        try:
            out = await run(engine, prompts(engine.vocab_size, [3, 29, 12], seed=15))
            if not eager:
                assert engine.graphs is not None and engine.graphs.graphs  # graphs were used
            return [t for t, _ in out]
        finally:
            await engine.close()

    assert asyncio.run(tokens(eager=False)) == asyncio.run(tokens(eager=True))

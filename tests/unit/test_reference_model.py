"""DecoderModel over the paged KV cache equals transformers, logit for logit, for every family."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tandem.engines.reference import varlen
from tandem.engines.reference.batch import AttentionMetadata, DecodePart, allocate_kv_cache
from tandem.engines.reference.loader import load_model
from tandem.engines.reference.model import DecoderModel
from tandem.engines.reference.prefill_graphs import PrefillGraphs
from tandem.engines.reference.spec import ModelSpec
from tandem.errors import InvalidRequest
from tandem.model.tiny import FAMILIES, write_tiny_model

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 8
NUM_BLOCKS = 24
# fp32 on CPU: fused qkv/gate_up matmuls and a different SDPA blocking round differently from
# transformers; observed differences are ~1e-6, logits are O(10).
ATOL = 1e-4


@dataclass
class Family:
    path: pathlib.Path
    hf: Any  # a transformers PreTrainedModel
    model: DecoderModel
    spec: ModelSpec


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Family]:
    result = {}
    for name in FAMILIES:
        path = write_tiny_model(tmp_path_factory.mktemp(name), name, seed=1)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        model, spec = load_model(path, torch.float32, torch.device("cpu"))
        result[name] = Family(path, hf.eval(), model, spec)
    return result


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(5, 4000, (length,), generator=generator).tolist()


def hf_logits(family: Family, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return family.hf(torch.tensor([tokens])).logits[0].float()


def make_step(seqs: list[tuple[list[int], list[int], int]], decode: bool = False,
              block_size: int = BLOCK_SIZE
              ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One engine step. Each seq is (all tokens so far, block ids, num already cached); every
    token after the cached ones is new this step. Returns (input_ids, positions, meta)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    context_lens = []
    for tokens, blocks, cached in seqs:
        for pos in range(cached, len(tokens)):
            input_ids.append(tokens[pos])
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        starts.append(len(input_ids))
        context_lens.append(len(tokens))
    width = max(len(blocks) for _, blocks, _ in seqs)
    tables = [blocks + [0] * (width - len(blocks)) for _, blocks, _ in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=starts, context_lens=context_lens,
        context_lens_t=torch.tensor(context_lens), block_tables=torch.tensor(tables),
        block_size=block_size, is_decode_only=decode)
    return torch.tensor(input_ids), torch.tensor(positions), meta


def run_step(family: Family, kv_cache: torch.Tensor,
             seqs: list[tuple[list[int], list[int], int]], decode: bool = False) -> torch.Tensor:
    input_ids, positions, meta = make_step(seqs, decode)
    with torch.no_grad():
        return family.model.compute_logits(family.model(input_ids, positions, meta, kv_cache))


def new_cache(spec: ModelSpec, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    return allocate_kv_cache(spec.num_layers, NUM_BLOCKS, block_size, spec.num_kv_heads,
                             spec.head_size, spec.dtype, torch.device("cpu"))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_whole_prompt_matches_transformers(families: dict[str, Family], name: str) -> None:
    family = families[name]
    tokens = prompt(37, seed=0)
    logits = run_step(family, new_cache(family.spec), [(tokens, [5, 2, 7, 1, 3], 0)])
    torch.testing.assert_close(logits, hf_logits(family, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_chunked_prefill_through_paged_cache(families: dict[str, Family], name: str) -> None:
    family = families[name]
    tokens = prompt(37, seed=1)
    blocks = [5, 2, 7, 11, 9]  # non-contiguous and out of order
    cache = new_cache(family.spec)
    chunks = [run_step(family, cache, [(tokens[:end], blocks, start)])
              for start, end in [(0, 10), (10, 25), (25, 37)]]
    torch.testing.assert_close(torch.cat(chunks), hf_logits(family, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_two_sequences_in_one_batch(families: dict[str, Family], name: str) -> None:
    family = families[name]
    long, short = prompt(37, seed=2), prompt(19, seed=3)
    logits = run_step(family, new_cache(family.spec),
                      [(long, [4, 0, 8, 6, 10], 0), (short, [3, 1, 12], 0)])
    torch.testing.assert_close(logits[:37], hf_logits(family, long), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[37:], hf_logits(family, short), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_batched_decode_matches_last_position(families: dict[str, Family], name: str) -> None:
    family = families[name]
    cache = new_cache(family.spec)
    # Block 0 holds real data, so the zero padding of the shorter tables points at live K/V
    # that only the key-padding mask keeps out.
    seqs = [(prompt(37, seed=4), [9, 2, 14, 6, 1]), (prompt(12, seed=5), [0, 7]),
            (prompt(25, seed=6), [3, 11, 5, 13])]
    run_step(family, cache, [(tokens[:-1], blocks, 0) for tokens, blocks in seqs])
    logits = run_step(family, cache, [(tokens, blocks, len(tokens) - 1)
                                      for tokens, blocks in seqs], decode=True)
    expected = torch.stack([hf_logits(family, tokens)[-1] for tokens, _ in seqs])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def with_decode_part(meta: AttentionMetadata) -> AttentionMetadata:
    """`meta` with its one-token sequences as a DecodePart, as build_step_inputs makes it, their
    tables padded with two more columns of block 0 (which holds live K/V here: only the context
    lengths keep it out), as a width bucket pads them on CUDA."""
    singles = [s for s in range(meta.num_seqs)
               if meta.query_start_loc[s + 1] - meta.query_start_loc[s] == 1]
    index = torch.tensor(singles)
    rows = torch.tensor([meta.query_start_loc[s] for s in singles])
    part = AttentionMetadata(
        slot_mapping=meta.slot_mapping[rows], query_start_loc=[],
        context_lens=[meta.context_lens[s] for s in singles],
        context_lens_t=meta.context_lens_t[index],
        block_tables=torch.nn.functional.pad(meta.block_tables[index], (0, 2)),
        block_size=meta.block_size, is_decode_only=True)
    return dataclasses.replace(meta, decode_part=DecodePart(rows, part, frozenset(singles)))


CPU = torch.device("cpu")
MIXED = (prompt(37, seed=20), prompt(12, seed=21), prompt(25, seed=22), prompt(19, seed=23))


def mixed_step_logits(family: Family, split: bool, device: torch.device = CPU,
                      block_size: int = BLOCK_SIZE, graphs: bool = False,
                      caches: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Two decodes beside a prompt chunk after a cached prefix and a whole prompt, the
    decodes attended together (`split`, a DecodePart) or each on its own; with `graphs`,
    both steps through PrefillGraphs (padded to a bucket of 64 tokens). The KV cache is
    appended to `caches` where given."""
    first, second, chunked, whole = MIXED
    tables = [[9, 2, 14, 6, 1], [0, 7], [3, 11, 5, 13], [8, 10, 12]]
    cache = new_cache(family.spec, block_size).to(device)
    if caches is not None:
        caches.append(cache)
    prefill = PrefillGraphs(family.model, cache, 64) if graphs else None

    def step(seqs: list[tuple[list[int], list[int], int]], mixed: bool) -> torch.Tensor:
        input_ids, positions, meta = make_step(seqs, block_size=block_size)
        meta = with_decode_part(meta) if mixed else meta
        moved = dataclasses.replace(meta, **{
            f.name: getattr(meta, f.name).to(device) for f in dataclasses.fields(meta)
            if isinstance(getattr(meta, f.name), torch.Tensor)})
        if moved.decode_part is not None:
            part = moved.decode_part
            moved.decode_part = DecodePart(part.rows.to(device), dataclasses.replace(
                part.meta, slot_mapping=part.meta.slot_mapping.to(device),
                context_lens_t=part.meta.context_lens_t.to(device),
                block_tables=part.meta.block_tables.to(device)), part.seqs)
        with torch.no_grad():
            if prefill is not None:
                bucket = prefill.bucket(len(input_ids))
                assert bucket == 64
                hidden = prefill.run(input_ids.to(device), positions.to(device), moved, bucket)
            else:
                hidden = family.model(input_ids.to(device), positions.to(device), moved, cache)
            return family.model.compute_logits(hidden).cpu()

    step([(first[:-1], tables[0], 0), (second[:-1], tables[1], 0), (chunked[:10], tables[2], 0)],
         mixed=False)
    return step([(first, tables[0], 36), (chunked, tables[2], 10), (second, tables[1], 11),
                 (whole, tables[3], 0)], mixed=split)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_mixed_step_batches_its_decodes(families: dict[str, Family], name: str) -> None:
    """Decodes beside a prompt chunk (after a cached prefix) and a whole prompt: the decodes
    attended together (DecodePart), every row as transformers has it."""
    family = families[name]
    first, second, chunked, whole = MIXED
    expected = torch.cat([hf_logits(family, first)[-1:], hf_logits(family, chunked)[10:],
                          hf_logits(family, second)[-1:], hf_logits(family, whole)])
    torch.testing.assert_close(mixed_step_logits(family, split=True), expected, atol=ATOL,
                               rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["llama3", "mistral"])
def test_mixed_step_on_cuda_in_bf16(families: dict[str, Family], name: str) -> None:
    """The same step through the Triton kernels (CUDA, bfloat16, blocks of 16 tokens): the
    batched decodes are as accurate as the per-sequence loop, against float32 of the same
    rounded weights."""
    family = families[name]
    cuda = torch.device("cuda")
    model, spec = load_model(family.path, torch.bfloat16, cuda)
    bf16 = Family(family.path, family.hf, model, spec)
    split, loop = (mixed_step_logits(bf16, s, cuda, block_size=16) for s in (True, False))
    rounded = Family(family.path, family.hf, model.float(),
                     dataclasses.replace(spec, dtype=torch.float32))
    reference = mixed_step_logits(rounded, False, cuda, block_size=16)

    def relative_error(logits: torch.Tensor) -> float:
        return ((logits - reference).norm() / reference.norm()).item()

    assert relative_error(loop) <= 16 * BF16_UNIT_ROUNDOFF
    assert relative_error(split) <= 1.25 * relative_error(loop) + BF16_UNIT_ROUNDOFF


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["llama3", "qwen3"])
@pytest.mark.parametrize("split", [True, False])
def test_prompt_chunks_in_one_flash_call_match_the_loop(
        families: dict[str, Family], name: str, split: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The step's prompt sequences in one varlen flash-attention call per layer (a chunk after
    a cached prefix, a whole prompt, with the decodes apart or among them) give the logits of
    the per-sequence loop, within bf16 rounding."""
    family = families[name]
    cuda = torch.device("cuda")
    model, spec = load_model(family.path, torch.bfloat16, cuda)
    bf16 = Family(family.path, family.hf, model, spec)
    batched = mixed_step_logits(bf16, split, cuda, block_size=16)
    monkeypatch.setattr(varlen, "serves", lambda *args: False)
    loop = mixed_step_logits(bf16, split, cuda, block_size=16)
    assert ((batched - loop).norm() / loop.norm()).item() <= 4 * BF16_UNIT_ROUNDOFF


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["llama3", "mistral"])
def test_prefill_graphs_match_the_eager_step(families: dict[str, Family], name: str) -> None:
    """Two steps with prompt chunks (the second mixed with decodes, after cached prefixes)
    through the piecewise graphs, padded to a bucket: the logits of the eager steps within
    bf16 rounding (the padded matmuls may take other kernels), the same K/V in every real
    block, and the padding's K/V only in the scratch block."""
    family = families[name]
    cuda = torch.device("cuda")
    model, spec = load_model(family.path, torch.bfloat16, cuda)
    bf16 = Family(family.path, family.hf, model, spec)
    assert PrefillGraphs.supports(model, new_cache(spec, 16).to(cuda))
    caches: list[torch.Tensor] = []
    graphed = mixed_step_logits(bf16, True, cuda, block_size=16, graphs=True, caches=caches)
    eager = mixed_step_logits(bf16, True, cuda, block_size=16, caches=caches)
    assert ((graphed - eager).norm() / eager.norm()).item() <= 4 * BF16_UNIT_ROUNDOFF
    graph_kv, eager_kv = (cache.float() for cache in caches)
    scratch = NUM_BLOCKS - 1
    real = graph_kv[:, :, :scratch]
    assert ((real - eager_kv[:, :, :scratch]).norm() / eager_kv.norm()).item() <= (
        4 * BF16_UNIT_ROUNDOFF)
    unused = [b for b in range(scratch) if b not in {9, 2, 14, 6, 1, 0, 7, 3, 11, 5, 13, 8,
                                                      10, 12}]
    assert real[:, :, unused].abs().max().item() == 0
    assert graph_kv[:, :, scratch].abs().max().item() > 0


@pytest.mark.parametrize("split", [True, False])
def test_varlen_layout_lists_each_prompt_sequence_and_its_context_slots(split: bool) -> None:
    """VarlenPrefill (built on the CPU here): the prompt rows, the cumulative query and context
    lengths, and every context position's KV slot through the block table, sequence after
    sequence; the decode part's sequences left out."""
    first, second, chunked, whole = MIXED
    tables = [[9, 2, 14, 6, 1], [0, 7], [3, 11, 5, 13], [8, 10, 12]]
    seqs = [(first, tables[0], 36), (chunked, tables[2], 10), (second, tables[1], 11),
            (whole, tables[3], 0)]
    _, _, meta = make_step(seqs)
    meta = with_decode_part(meta) if split else meta
    layout = varlen.build_layout(meta, CPU)
    kept = [1, 3] if split else [0, 1, 2, 3]
    starts = meta.query_start_loc
    assert layout.all_rows is not split
    assert layout.rows.tolist()[:sum(starts[s + 1] - starts[s] for s in kept)] == [
        r for s in kept for r in range(starts[s], starts[s + 1])]
    lens_q = [starts[s + 1] - starts[s] for s in kept]
    lens_k = [len(seqs[s][0]) for s in kept]
    assert layout.cum_q.tolist() == [sum(lens_q[:i]) for i in range(len(kept) + 1)]
    assert layout.cum_k.tolist() == [sum(lens_k[:i]) for i in range(len(kept) + 1)]
    assert (layout.max_q, layout.max_k) == (max(lens_q), max(lens_k))
    assert layout.slots.tolist() == [
        seqs[s][1][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for s in kept for p in range(len(seqs[s][0]))]


def _decode_and_per_sequence_logits(family: Family) -> tuple[torch.Tensor, torch.Tensor]:
    """The last step of two sequences, computed by the per-sequence loop and by the batched
    decode kernel (each on a fresh cache holding the same prompts)."""
    seqs = [(prompt(30, seed=7), [4, 9, 2, 6]), (prompt(9, seed=8), [1, 3])]
    results = []
    for decode in (False, True):
        cache = new_cache(family.spec)
        run_step(family, cache, [(tokens[:-1], blocks, 0) for tokens, blocks in seqs])
        results.append(run_step(family, cache, [(tokens, blocks, len(tokens) - 1)
                                                for tokens, blocks in seqs], decode=decode))
    return results[0], results[1]


def test_decode_path_equals_per_sequence_path(families: dict[str, Family]) -> None:
    """The batched decode kernel and the per-sequence loop are two implementations of one
    contract. That is a question about the algorithm, so it is asked in float32, where the two
    differ only by summation order (~1e-6 on logits of O(10))."""
    per_sequence, decode = _decode_and_per_sequence_logits(families["qwen3"])
    torch.testing.assert_close(decode, per_sequence, atol=ATOL, rtol=0)


# bfloat16's unit roundoff: every rounded operation is off by at most this much, relatively.
BF16_UNIT_ROUNDOFF = 2.0 ** -8


def test_bf16_paths_stay_within_bf16_rounding_of_float32(families: dict[str, Family]) -> None:
    """In bfloat16 each path's error is measured against a float32 run of the same bf16-rounded
    weights, so that only the arithmetic's rounding remains. Bounds are on the relative norm of
    the error, not per logit: over 8,192 logits a few always sit on a rounding boundary, and which
    ones depends on the CPU's kernels (AVX2 vs AVX-512), which broke an elementwise tolerance."""
    family = families["qwen3"]
    model, spec = load_model(family.path, torch.bfloat16, torch.device("cpu"))
    bf16 = Family(family.path, family.hf, model, spec)
    per_sequence, decode = _decode_and_per_sequence_logits(bf16)
    assert per_sequence.dtype == decode.dtype == torch.float32
    rounded = Family(family.path, family.hf, model.float(),
                     dataclasses.replace(spec, dtype=torch.float32))
    reference, _ = _decode_and_per_sequence_logits(rounded)

    def relative_error(logits: torch.Tensor) -> float:
        return ((logits - reference).norm() / reference.norm()).item()

    # Two layers of ~12 rounded operations each: a random walk of sqrt(27) ~ 5 roundoffs is
    # expected (observed: 5.5 on AVX2 and AVX-512); 16 flags an accumulation done in bf16.
    assert relative_error(per_sequence) <= 16 * BF16_UNIT_ROUNDOFF
    # The decode kernel must be as accurate as the loop it replaces, up to one more roundoff.
    assert relative_error(decode) <= 1.25 * relative_error(per_sequence) + BF16_UNIT_ROUNDOFF
    # Where a row's top-two gap exceeds twice both paths' largest error, no rounding can swap
    # the argmax, so the greedy token must be the float32 one.
    worst = torch.maximum((per_sequence - reference).abs().amax(-1),
                          (decode - reference).abs().amax(-1))
    top2 = reference.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * worst
    for logits in (per_sequence, decode):
        assert torch.equal(logits.argmax(-1)[clear], reference.argmax(-1)[clear])


def test_sharded_checkpoint_loads_the_same_weights(families: dict[str, Family],
                                                    tmp_path: pathlib.Path) -> None:
    family = families["llama3"]
    family.hf.save_pretrained(tmp_path, max_shard_size="300KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model, _ = load_model(tmp_path, None, torch.device("cpu"))
    expected = family.model.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_unsupported_architecture_is_named(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(InvalidRequest) as info:
        ModelSpec.from_dir(tmp_path)
    assert "GPT2LMHeadModel" in info.value.message
    assert "Qwen3ForCausalLM" in info.value.message and info.value.param == "model"


def test_unsupported_rope_type_is_named(families: dict[str, Family],
                                        tmp_path: pathlib.Path) -> None:
    config = json.loads((families["llama"].path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidRequest, match="longrope"):
        ModelSpec.from_dir(tmp_path)


def test_missing_and_unexpected_tensors_are_named(families: dict[str, Family],
                                                  tmp_path: pathlib.Path) -> None:
    from safetensors.torch import load_file, save_file

    source = families["qwen2"].path
    shutil.copyfile(source / "config.json", tmp_path / "config.json")
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(InvalidRequest) as info:
        load_model(tmp_path, None, torch.device("cpu"))
    assert "model.layers.1.self_attn.k_proj.bias" in info.value.message
    assert "model.layers.0.mlp.extra.weight" in info.value.message


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_dummy_weights_need_only_config(families: dict[str, Family], name: str,
                                        tmp_path: pathlib.Path) -> None:
    shutil.copyfile(families[name].path / "config.json", tmp_path / "config.json")
    model, spec = load_model(tmp_path, torch.bfloat16, torch.device("cpu"), load_format="dummy")
    again, _ = load_model(tmp_path, torch.bfloat16, torch.device("cpu"), load_format="dummy")
    real = families[name].model.state_dict()
    dummy = model.state_dict()
    assert {k: v.shape for k, v in dummy.items()} == {k: v.shape for k, v in real.items()}
    assert all(t.dtype == torch.bfloat16 for t in dummy.values()) and spec.dtype == torch.bfloat16
    assert all(torch.equal(dummy[k], t) for k, t in again.state_dict().items())  # seeded
    cache = new_cache(spec)
    logits = run_step(Family(tmp_path, families[name].hf, model, spec), cache,
                      [(prompt(10, seed=9), [3, 4], 0)])
    assert logits.shape == (10, spec.vocab_size) and torch.isfinite(logits).all()

"""The reference embedding engine against sentence-transformers: tiny random-weight models wrapped
as sentence-transformers directories give the same vectors for mean, cls and last-token pooling,
with and without Normalize, for batches of mixed lengths and batches split across passes; the
default without modules.json is the last token of transformers' hidden states, normalised;
Matryoshka truncation; and what the engine refuses."""
from __future__ import annotations

import asyncio
import json
import pathlib
import shutil
import warnings

import numpy as np
import pytest
import torch
import transformers

from tandem.engines.args import EngineArgs
from tandem.engines.mock.engine import create_mock_engine
from tandem.engines.reference.embed_engine import ReferenceEmbedEngine
from tandem.engines.reference.engine import create_reference_engine
from tandem.engines.types import EngineRequest, SamplingParams
from tandem.errors import InvalidRequest, Unavailable, Unimplemented
from tandem.model.tiny import write_tiny_model

FAMILIES = ["llama", "qwen3"]
HIDDEN = 64
TEXTS = ["Hi", "The quick brown fox jumps over the lazy dog.",
         "Embeddings " * 40, "a b c d e f g h", "Paged attention over scratch blocks."]
#: Largest difference allowed, relative to the largest value of the reference vector.
RTOL = 1e-5

# Legacy pooling keys, as most Hub models still ship them (sentence-transformers < 6).
_LEGACY_KEYS = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens",
                "max": "pooling_mode_max_tokens", "lasttoken": "pooling_mode_lasttoken"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {f: write_tiny_model(root / f, f, seed=5) for f in FAMILIES}


def st_dir(base: pathlib.Path, out: pathlib.Path, mode: str | list[str], normalize: bool,
           extra_modules: tuple[str, ...] = (), config: dict[str, object] | None = None
           ) -> pathlib.Path:
    """`base` wrapped as a sentence-transformers model the way Hub models are laid out:
    modules.json, 1_Pooling/config.json with the legacy boolean keys, optionally Normalize."""
    shutil.copytree(base, out)
    modes = [mode] if isinstance(mode, str) else mode
    pooling = {"word_embedding_dimension": HIDDEN, "include_prompt": True,
               **{key: name in modes for name, key in _LEGACY_KEYS.items()}}
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    modules = [("", "sentence_transformers.models.Transformer"),
               ("1_Pooling", "sentence_transformers.models.Pooling"),
               *((f"{2 + i}_{m}", f"sentence_transformers.models.{m}")
                 for i, m in enumerate(extra_modules))]
    if normalize:
        modules.append(("2_Normalize", "sentence_transformers.models.Normalize"))
    (out / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": path, "type": kind}
         for i, (path, kind) in enumerate(modules)]))
    if config:
        merged = {**json.loads((out / "config.json").read_text()), **config}
        (out / "config.json").write_text(json.dumps(merged))
    return out


def engine_for(model_dir: pathlib.Path, **overrides: object) -> ReferenceEmbedEngine:
    engine = create_reference_engine(EngineArgs(model=str(model_dir), device="cpu",
                                                kv_block_size=8, embed_only=True,
                                                **overrides))  # type: ignore[arg-type]
    assert isinstance(engine, ReferenceEmbedEngine)
    return engine


def sentence_transformer(model_dir: pathlib.Path):  # noqa: ANN201  (an optional dependency)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sentence_transformers import SentenceTransformer
        return SentenceTransformer(str(model_dir), device="cpu")


def token_ids(model_dir: pathlib.Path, texts: list[str]) -> list[list[int]]:
    """As sentence-transformers tokenizes plain text: the tokenizer's special tokens added."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    return [tokenizer(text, add_special_tokens=True)["input_ids"] for text in texts]


def assert_close(got: list[list[float]],
                 want: np.ndarray | list[list[float]]) -> tuple[float, float]:
    """Returns (max abs difference, that over the largest reference value)."""
    got_array = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got_array.shape == want.shape
    abs_diff = float(np.abs(got_array - want).max())
    rel_diff = abs_diff / float(np.abs(want).max())
    assert rel_diff <= RTOL, f"max abs {abs_diff:.3g}, rel {rel_diff:.3g}"
    return abs_diff, rel_diff


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("mode", ["mean", "cls", "lasttoken"])
@pytest.mark.parametrize("family", FAMILIES)
async def test_matches_sentence_transformers(tiny: dict[str, pathlib.Path],
                                             tmp_path: pathlib.Path, family: str, mode: str,
                                             normalize: bool) -> None:
    model_dir = st_dir(tiny[family], tmp_path / "st", mode, normalize)
    st = sentence_transformer(model_dir)
    ids = token_ids(model_dir, TEXTS)
    assert [list(st.preprocess([t])["input_ids"][0]) for t in TEXTS] == ids
    want = st.encode(TEXTS, batch_size=2, convert_to_numpy=True).astype(np.float64)
    engine = engine_for(model_dir)
    abs_diff, rel_diff = assert_close(await engine.embed(ids), want)
    print(f"{family} {mode} normalize={normalize}: max abs {abs_diff:.2e} rel {rel_diff:.2e}")
    if normalize:
        assert np.allclose(np.linalg.norm(want, axis=1), 1.0)


async def test_sentence_transformers_6_layout(tiny: dict[str, pathlib.Path],
                                              tmp_path: pathlib.Path) -> None:
    """The layout sentence-transformers 6 saves: module types under their new paths and
    `pooling_mode` instead of the boolean keys. (Its own `save` also rewrites the checkpoint as
    the base model, `LlamaModel` without the `model.` prefix, which the reference loader does not
    read yet, so the files are written here.)"""
    model_dir = tmp_path / "st"
    shutil.copytree(tiny["llama"], model_dir)
    for folder, config in (("1_Pooling", {"embedding_dimension": HIDDEN, "pooling_mode": "mean",
                                          "include_prompt": True}),
                           ("2_Normalize", {})):
        (model_dir / folder).mkdir()
        (model_dir / folder / "config.json").write_text(json.dumps(config))
    types = ["sentence_transformers.base.modules.transformer.Transformer",
             "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
             "sentence_transformers.base.modules.normalize.Normalize"]
    (model_dir / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": path, "type": kind}
         for i, (path, kind) in enumerate(zip(["", "1_Pooling", "2_Normalize"], types))]))
    want = sentence_transformer(model_dir).encode(TEXTS, convert_to_numpy=True)
    assert_close(await engine_for(model_dir).embed(token_ids(model_dir, TEXTS)),
                 want.astype(np.float64))


async def test_a_checkpoint_saved_by_sentence_transformers_itself(
        tiny: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    """sentence-transformers' own save() writes the base model (LlamaModel: no "model."
    prefix, no lm_head): loaded as the causal LM's body, for embeddings only."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sentence_transformers import SentenceTransformer, models
        modules = [models.Transformer(str(tiny["llama"])), models.Pooling(HIDDEN, "mean"),
                   models.Normalize()]
        SentenceTransformer(modules=modules, device="cpu").save(str(tmp_path / "saved"))
    saved = tmp_path / "saved"
    assert json.loads((saved / "config.json").read_text())["architectures"] == ["LlamaModel"]
    st = sentence_transformer(saved)
    ids = [list(st.preprocess([t])["input_ids"][0]) for t in TEXTS]
    want = st.encode(TEXTS, batch_size=2, convert_to_numpy=True).astype(np.float64)
    assert_close(await engine_for(saved).embed(ids), want)
    with pytest.raises(InvalidRequest, match="embeddings only"):
        create_reference_engine(EngineArgs(model=str(saved), device="cpu"))


async def test_a_batch_larger_than_the_token_budget(tiny: dict[str, pathlib.Path],
                                                    tmp_path: pathlib.Path) -> None:
    model_dir = st_dir(tiny["qwen3"], tmp_path / "st", "mean", True)
    ids = token_ids(model_dir, TEXTS * 3)
    engine = engine_for(model_dir, max_num_tokens=40)
    passes = engine._passes(ids)
    assert len(passes) > 3 and sum(passes, []) == ids
    assert all(sum(map(len, p)) <= 40 for p in passes if len(p) > 1)
    assert any(len(p[0]) > 40 for p in passes)  # a long input runs alone
    want = sentence_transformer(model_dir).encode(TEXTS * 3, convert_to_numpy=True)
    assert_close(await engine.embed(ids), want.astype(np.float64))


async def test_concurrent_calls_give_the_same_vectors(tiny: dict[str, pathlib.Path],
                                                      tmp_path: pathlib.Path) -> None:
    model_dir = st_dir(tiny["llama"], tmp_path / "st", "lasttoken", True)
    ids = token_ids(model_dir, TEXTS)
    engine = engine_for(model_dir, max_num_tokens=32)
    alone = [await engine.embed([one]) for one in ids]
    together = await asyncio.gather(*(engine.embed([one]) for one in ids))
    assert together == alone
    assert engine.stats().num_running == 0
    # One-token inputs only: the pass takes the batched decode-attention path.
    mixed = await engine.embed([[5], [6], [5, 6, 7]])
    assert_close(await engine.embed([[5], [6]]), mixed[:2])


@pytest.mark.parametrize("family", FAMILIES)
async def test_without_modules_json_the_last_token_normalised(
        tiny: dict[str, pathlib.Path], family: str) -> None:
    ids = token_ids(tiny[family], TEXTS)
    model = transformers.AutoModel.from_pretrained(str(tiny[family]), dtype=torch.float32).eval()
    with torch.no_grad():
        last = [model(torch.tensor([one])).last_hidden_state[0, -1] for one in ids]
    want = torch.nn.functional.normalize(torch.stack(last), dim=1).double().numpy()
    assert_close(await engine_for(tiny[family]).embed(ids), want)


async def test_matryoshka_truncates_then_normalises(tiny: dict[str, pathlib.Path],
                                                    tmp_path: pathlib.Path) -> None:
    ids = token_ids(tiny["llama"], TEXTS)
    listed = engine_for(st_dir(tiny["llama"], tmp_path / "listed", "mean", True,
                               config={"matryoshka_dimensions": [16, 32, 64]}))
    raw = np.asarray(await engine_for(st_dir(tiny["llama"], tmp_path / "raw", "mean",
                                             False)).embed(ids))
    cut = raw[:, :16] / np.linalg.norm(raw[:, :16], axis=1, keepdims=True)
    got = await listed.embed(ids, dimensions=16)
    assert_close(got, cut)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0)
    assert_close(await listed.embed(ids, dimensions=64), await listed.embed(ids))
    for bad in (20, 0, 128):
        with pytest.raises(InvalidRequest, match="dimensions") as error:
            await listed.embed(ids, dimensions=bad)
        assert error.value.param == "dimensions"
    # is_matryoshka: any size up to the hidden size; a model that does not normalise is cut only.
    unnormalised = engine_for(st_dir(tiny["llama"], tmp_path / "any", "mean", False,
                                     config={"is_matryoshka": True}))
    assert_close(await unnormalised.embed(ids, dimensions=20), raw[:, :20])
    with pytest.raises(InvalidRequest, match="between 1 and 64"):
        await unnormalised.embed(ids, dimensions=65)


async def test_refusals(tiny: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    engine = engine_for(tiny["llama"], max_seq_len=16)
    for inputs, message in (([list(range(5, 22))], "input 0 has 17 tokens, more than"),
                            ([[5, 6], []], "input 1 is empty"), ([], "at least one"),
                            ([[5, 10 ** 9]], "outside the vocabulary")):
        with pytest.raises(InvalidRequest, match=message) as error:
            await engine.embed(inputs)
        assert error.value.param == "input"
    with pytest.raises(InvalidRequest, match="not a Matryoshka model") as error:
        await engine.embed([[5, 6]], dimensions=8)
    assert error.value.param == "dimensions"
    with pytest.raises(Unimplemented, match="embeddings only"):
        engine.add_request(EngineRequest("r", (5, 6), SamplingParams(max_tokens=1)))
    assert not engine.abort("r")
    await engine.close()
    with pytest.raises(Unavailable):
        await engine.embed([[5, 6]])


@pytest.mark.parametrize(("mode", "extra", "message"), [
    ("max", (), "unsupported Pooling module mode \\['max'\\]"),
    (["cls", "mean"], (), "unsupported Pooling module mode"),
    ("mean", ("Dense",), "unsupported sentence-transformers module "
                         "sentence_transformers.models.Dense"),
])
def test_unsupported_modules_are_refused(tiny: dict[str, pathlib.Path], tmp_path: pathlib.Path,
                                         mode: str | list[str], extra: tuple[str, ...],
                                         message: str) -> None:
    model_dir = st_dir(tiny["llama"], tmp_path / "st", mode, False, extra_modules=extra)
    with pytest.raises(InvalidRequest, match=message) as error:
        engine_for(model_dir)
    assert str(model_dir) in str(error.value)


def test_the_mock_engine_refuses_embed_only(tiny: dict[str, pathlib.Path]) -> None:
    with pytest.raises(InvalidRequest, match="computes no embeddings"):
        create_mock_engine(EngineArgs(model=str(tiny["llama"]), embed_only=True))

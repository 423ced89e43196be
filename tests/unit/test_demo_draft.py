"""The demo's draft model: installed with the demo, loadable by the reference engine and by
transformers, the demo's tokenizer, and it predicts the demo's greedy tokens well above chance."""
from __future__ import annotations

import json
import pathlib

import pytest
import torch

from tandem.model import demo, draft_eval, train_demo, train_draft


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return demo.ensure_demo_model(tmp_path_factory.mktemp("demo") / "tandem-demo")


@pytest.fixture(scope="module")
def draft_dir(demo_dir: pathlib.Path) -> pathlib.Path:
    return demo.draft_model_dir(demo_dir)


@pytest.fixture(scope="module")
def hf_models(demo_dir: pathlib.Path, draft_dir: pathlib.Path) -> tuple[object, object]:
    from transformers import AutoModelForCausalLM

    return tuple(AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).eval()
                 for path in (draft_dir, demo_dir))


def test_installed_inside_the_demo(demo_dir: pathlib.Path, draft_dir: pathlib.Path) -> None:
    assert draft_dir == demo_dir / demo.DRAFT_DIR
    # The demo's tokenizer files, byte for byte: token ids mean the same in both models.
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (draft_dir / name).read_bytes() == (demo_dir / name).read_bytes(), name
    assert (draft_dir / demo.WEIGHTS_FILE).read_bytes() == demo.committed_file(
        demo.WEIGHTS_FILE, demo.DRAFT_ASSETS_DIR).read_bytes()
    marker = json.loads((demo_dir / demo.MARKER_FILE).read_text())
    assert marker["draft_spec"]["num_hidden_layers"] == demo.DRAFT_SPEC.num_hidden_layers
    assert marker["draft_assets"] == demo.committed_digests(demo.DRAFT_ASSETS_DIR)


def test_draft_model_dir_refuses_a_directory_without_a_draft(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match="no demo draft model"):
        demo.draft_model_dir(tmp_path)


def test_a_stale_demo_without_a_draft_is_rebuilt(tmp_path: pathlib.Path) -> None:
    path = demo.ensure_demo_model(tmp_path / "m")
    marker = json.loads((path / demo.MARKER_FILE).read_text())
    del marker["draft_assets"]  # as a demo installed before drafts were
    (path / demo.MARKER_FILE).write_text(json.dumps(marker))
    for child in (path / demo.DRAFT_DIR).iterdir():
        child.unlink()
    (path / demo.DRAFT_DIR).rmdir()
    assert demo.draft_model_dir(demo.ensure_demo_model(path)).is_dir()


def test_the_reference_loader_reads_it(draft_dir: pathlib.Path, hf_models) -> None:
    from tandem.engines.reference.loader import load_model

    model, spec = load_model(draft_dir, torch.float32, torch.device("cpu"))
    assert spec.vocab_size == demo.DEMO_SPEC.vocab_size
    assert (spec.num_layers, spec.hidden_size) == (demo.DRAFT_SPEC.num_hidden_layers,
                                                   demo.DRAFT_SPEC.hidden_size)
    assert spec.tie_word_embeddings and spec.eos_token_ids == (1, 3)
    embedding = next(p for name, p in model.named_parameters() if "embed" in name)
    assert embedding.equal(hf_models[0].model.embed_tokens.weight)


def test_transformers_reads_it_with_the_demos_vocabulary(draft_dir: pathlib.Path,
                                                         demo_dir: pathlib.Path,
                                                         hf_models) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, info = AutoModelForCausalLM.from_pretrained(str(draft_dir), local_files_only=True,
                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    draft, target = hf_models
    assert draft.config.vocab_size == target.config.vocab_size == demo.DEMO_SPEC.vocab_size
    assert draft.num_parameters() * 4 < target.num_parameters()
    tokenizers = [AutoTokenizer.from_pretrained(str(p), local_files_only=True)
                  for p in (draft_dir, demo_dir)]
    assert tokenizers[0].get_vocab() == tokenizers[1].get_vocab()
    assert tokenizers[0].all_special_ids == tokenizers[1].all_special_ids


async def test_the_reference_engine_runs_it_as_transformers_does(draft_dir: pathlib.Path,
                                                                  hf_models) -> None:
    from tandem.engines.args import EngineArgs
    from tandem.engines.reference.engine import create_reference_engine
    from tandem.engines.types import EngineRequest, SamplingParams

    prompt = train_demo.chat_prompt(train_draft.committed_tokenizer(), "Hello!")
    engine = create_reference_engine(EngineArgs(model=str(draft_dir), device="cpu",
                                                kv_block_size=8, num_gpu_blocks=32))
    await engine.start()
    try:
        request = EngineRequest("draft", tuple(prompt),
                                SamplingParams(max_tokens=24, temperature=0.0))
        tokens = [t async for chunk in engine.add_request(request) for t in chunk.token_ids]
    finally:
        await engine.close()
    assert tokens == draft_eval.greedy(hf_models[0], prompt, 24)


#: About half of what the committed draft measures on these prompts (agreement 0.73, 2.48
#: tokens per step, so 1.48 drafts accepted per step); a draft that never agrees writes 1.
MIN_AGREEMENT = 0.36
MIN_TOKENS_PER_STEP = 1.7


def test_it_predicts_the_demos_greedy_tokens(hf_models) -> None:
    draft, target = hf_models
    tokenizer = train_draft.committed_tokenizer()
    prompts = draft_eval.eval_prompts(tokenizer)
    fixed = prompts["held-out corpus"][:6] + prompts["new chat messages"][:4]
    measured = draft_eval.measure(draft, target, fixed, k=4, max_new_tokens=32)
    assert measured.num_positions > 100
    assert measured.agreement > MIN_AGREEMENT, measured
    assert measured.tokens_per_step > MIN_TOKENS_PER_STEP, measured


def test_acceptance_counts_the_leading_matches() -> None:
    assert draft_eval.accepted([5, 6, 7, 8], [5, 6, 9, 8]) == 2
    assert draft_eval.accepted([5, 6], [4, 6]) == 0
    assert draft_eval.accepted([5, 6, 7, 8], [5, 6]) == 2  # the continuation ended


def test_batched_drafts_are_the_drafts_own_greedy_tokens(hf_models) -> None:
    """draft_eval.drafts runs every position in one right-padded batch; each row must be what
    the draft writes from that context alone."""
    draft, _ = hf_models
    ids = train_demo.chat_prompt(train_draft.committed_tokenizer(), "Good morning.")
    start = len(ids) - 5
    for j, proposed in enumerate(draft_eval.drafts(draft, ids, start, k=3)):
        context = ids[:start + j]
        with torch.inference_mode():
            for _ in range(3):
                context = context + [int(draft(torch.tensor([context])).logits[0, -1].argmax())]
        assert proposed == context[start + j:], j

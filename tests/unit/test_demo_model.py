"""The demo model directory: deterministic, loadable by transformers, round-trips text, and its
trained weights answer a chat in words through the reference engine."""
from __future__ import annotations

import hashlib
import json
import pathlib
import random
import string
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tandem.model import demo
from tandem.model.config import ModelConfig

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing spaces  \n\tand tabs\r\n",
    "café, naïve, crème brûlée, São Paulo, Kraków, Zürich, smörgåsbord",
    "你好，世界！我住在北京。東京タワー、こんにちは、안녕하세요",
    "emoji 😀 🎉 👍🏽 👨‍👩‍👧 🇯🇵 ❤️ and text",
    "numbers 3.14159, 1,000,000, -42, 0x1F, 2025-03-14T23:59:59Z",
    "<|im_start|> looks special but <|not|> this",
    "",
]


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return demo.create_demo_model(tmp_path_factory.mktemp("demo") / "tandem-demo")


@pytest.fixture(scope="session")
def hf_tokenizer(demo_dir: pathlib.Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_dir), local_files_only=True)


def _files(root: pathlib.Path) -> dict[str, bytes]:
    """Every file under `root` (the draft model's directory included), by relative path."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_two_builds_are_byte_identical(demo_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    again = _files(demo.create_demo_model(tmp_path / "again"))
    model_files = {"config.json", "generation_config.json", "tokenizer.json",
                   "tokenizer_config.json", demo.WEIGHTS_FILE}
    assert set(again) >= model_files | {f"{demo.DRAFT_DIR}/{name}" for name in model_files}
    assert again == _files(demo_dir)


def test_build_in_another_process_is_byte_identical(demo_dir: pathlib.Path,
                                                    tmp_path: pathlib.Path) -> None:
    # A build depends on nothing but the committed files and the code, not on the process.
    code = ("import sys; from tandem.model.demo import create_demo_model; "
            "create_demo_model(sys.argv[1])")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "other")], check=True)
    assert _files(tmp_path / "other") == _files(demo_dir)


def test_vocabulary_and_special_tokens(hf_tokenizer) -> None:
    assert len(hf_tokenizer) == demo.DEMO_SPEC.vocab_size
    ids = hf_tokenizer.convert_tokens_to_ids(list(demo.SPECIAL_TOKENS))
    assert ids == [0, 1, 2, 3, 4]
    assert (hf_tokenizer.bos_token, hf_tokenizer.eos_token, hf_tokenizer.pad_token) == (
        demo.BOS_TOKEN, demo.EOS_TOKEN, demo.PAD_TOKEN)
    # The corpus taught it multi-byte tokens: a CJK word and an accented word are not all bytes.
    assert len(hf_tokenizer.encode("你好", add_special_tokens=False)) < 6
    assert len(hf_tokenizer.encode(" café", add_special_tokens=False)) < 6


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(hf_tokenizer, text: str) -> None:
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert hf_tokenizer.decode(ids) == text
    with_bos = hf_tokenizer.encode(text)
    assert with_bos == [0, *ids]
    assert hf_tokenizer.decode(with_bos) == demo.BOS_TOKEN + text


def test_round_trip_of_random_unicode(hf_tokenizer) -> None:
    rng = random.Random(7)
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x4FF), (0x3040, 0x30FF), (0x4E00, 0x9FFF),
              (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x0, 0x1F)]
    for _ in range(200):
        chars = [chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(1, 30))]
        text = "".join(chars)
        assert hf_tokenizer.decode(hf_tokenizer.encode(text, add_special_tokens=False)) == text


def test_chat_template_renders_roles(hf_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi 😀"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text",
                                                                      "text": "now?"}]},
    ]
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|begin_of_text|>"
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi 😀<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nAnd now?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=False,
                                               tokenize=False)
    assert without == text.removesuffix("<|im_start|>assistant\n")
    ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ids[:2] == [0, 2] and ids.count(0) == 1  # one BOS, then <|im_start|>


@pytest.mark.parametrize("message", [
    {"role": "wizard", "content": "x"},
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
])
def test_chat_template_rejects_what_it_cannot_render(hf_tokenizer, message: dict) -> None:
    import jinja2

    with pytest.raises(jinja2.TemplateError):
        hf_tokenizer.apply_chat_template([message], tokenize=False)


def test_model_config_reads_it(demo_dir: pathlib.Path, hf_tokenizer) -> None:
    config = ModelConfig.from_dir(demo_dir)
    assert config.architecture == "LlamaForCausalLM"
    assert config.vocab_size == len(hf_tokenizer) == 4096
    assert config.eos_token_ids == (hf_tokenizer.eos_token_id,
                                    hf_tokenizer.convert_tokens_to_ids(demo.IM_END_TOKEN))
    assert (config.num_layers, config.num_attention_heads, config.num_kv_heads) == (2, 6, 2)
    assert (config.hidden_size, config.head_size, config.dtype) == (96, 16, "float32")
    raw = json.loads((demo_dir / "config.json").read_text())
    assert raw["bos_token_id"] == hf_tokenizer.bos_token_id and raw["tie_word_embeddings"]


def test_transformers_reads_the_config(demo_dir: pathlib.Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(demo_dir), local_files_only=True)
    assert config.model_type == "llama" and config.vocab_size == 4096
    assert config.num_key_value_heads == 2 and config.intermediate_size == 384


def test_transformers_loads_the_weights(demo_dir: pathlib.Path, hf_tokenizer) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(demo_dir), local_files_only=True,
                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]  # nothing left at init
    assert not info["mismatched_keys"]
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    ids = hf_tokenizer("Hello, world!", return_tensors="pt").input_ids
    with torch.inference_mode():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 4096) and torch.isfinite(logits).all()
    assert (demo_dir / demo.WEIGHTS_FILE).stat().st_size < 3 * 1024 * 1024


def test_committed_files_fit_the_spec() -> None:
    from safetensors import safe_open

    weights = demo.committed_file(demo.WEIGHTS_FILE)
    with demo.resources.as_file(weights) as path, safe_open(str(path), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        metadata = f.metadata()
    assert shapes == demo.weight_shapes(demo.DEMO_SPEC, demo.DEMO_SPEC.vocab_size)
    # The weights say what trained them: the script's config and the library versions.
    assert json.loads(metadata["tandem_train_config"])["steps"] > 0
    assert set(json.loads(metadata["tandem_versions"])) == {"tokenizers", "torch",
                                                           "transformers"}
    assert float(metadata["tandem_final_loss"]) < 0.5


def test_train_tokenizer_reproduces_the_committed_one(tmp_path: pathlib.Path) -> None:
    """In a fresh process (Rust hash maps are seeded per process; a tie broken by hash order
    would show up here). Another tokenizers version may train another tokenizer: the committed
    one stays what the weights were trained with, so only the recorded version is held to it."""
    import tokenizers
    from safetensors import safe_open

    with demo.resources.as_file(demo.committed_file(demo.WEIGHTS_FILE)) as path, safe_open(
            str(path), "pt") as f:
        trained_with = json.loads(f.metadata()["tandem_versions"])["tokenizers"]
    if tokenizers.__version__ != trained_with:
        pytest.skip(f"the committed tokenizer was trained with tokenizers {trained_with}, "
                    f"this is {tokenizers.__version__}")
    code = ("import sys; from tandem.model import demo; "
            "open(sys.argv[1], 'w', encoding='utf-8', newline='\\n').write("
            "demo.train_tokenizer(demo.DEMO_SPEC).to_str(pretty=True))")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "t.json")], check=True)
    assert (tmp_path / "t.json").read_bytes() == demo.committed_file(
        demo.TOKENIZER_FILE).read_bytes()


def test_marker_records_the_committed_files(demo_dir: pathlib.Path) -> None:
    marker = json.loads((demo_dir / demo.MARKER_FILE).read_text())
    assert marker["format_version"] == demo.DEMO_FORMAT_VERSION
    # So a cached copy is rebuilt when retrained weights are committed, version bump or not.
    assert marker["assets"] == {name: hashlib.sha256((demo_dir / name).read_bytes()).hexdigest()
                                for name in demo.ASSET_FILES}


#: Leading and trailing characters that do not make a word another word.
_PUNCTUATION = string.punctuation + "“”‘’…"


def _words(text: str) -> list[str]:
    return [w for w in (word.strip(_PUNCTUATION).lower() for word in text.split()) if w]


async def _greedy_chat(engine, tokenizer, message: str) -> tuple[list[int], str]:
    from tandem.engines.types import EngineRequest, FinishReason, SamplingParams

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": message}])
    request = EngineRequest(f"chat-{message}", tuple(prompt),
                            SamplingParams(max_tokens=MAX_ANSWER_TOKENS, temperature=0.0))
    tokens: list[int] = []
    finish = None
    async for chunk in engine.add_request(request):
        tokens.extend(chunk.token_ids)
        finish = chunk.finish_reason or finish
    assert finish in (FinishReason.STOP, FinishReason.LENGTH)
    return tokens, tokenizer.decode(tokens)


MAX_ANSWER_TOKENS = 48


@pytest.mark.parametrize("message", ["Hello!", "What would you like to drink?"])
async def test_the_trained_model_answers_in_words(demo_dir: pathlib.Path, message: str) -> None:
    """Through the real path: the frontend's tokenizer and chat template, the reference engine's
    paged KV cache and greedy sampling; transformers' generate must agree token for token."""
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.engines.args import EngineArgs
    from tandem.engines.reference.engine import create_reference_engine
    from tandem.frontend.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(demo_dir)
    engine = create_reference_engine(EngineArgs(model=str(demo_dir), device="cpu",
                                                kv_block_size=8, num_gpu_blocks=64))
    await engine.start()
    try:
        tokens, answer = await _greedy_chat(engine, tokenizer, message)
    finally:
        await engine.close()

    corpus = set(_words(demo.resources.files("tandem.model").joinpath(
        "demo_corpus.txt").read_text("utf-8")))
    words = _words(answer)
    known = [w for w in words if w in corpus]
    assert len(words) >= 4 and len(known) >= 0.8 * len(words), answer
    assert tokens[-1] in tokenizer.eos_token_ids, answer  # it ended its turn by itself

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": message}])
    model = AutoModelForCausalLM.from_pretrained(str(demo_dir), local_files_only=True).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=MAX_ANSWER_TOKENS)
    assert out[0, len(prompt):].tolist() == tokens


def test_default_dir_follows_tandem_home(monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    assert demo.default_demo_model_dir() == tmp_path / "models" / "tandem-demo"
    monkeypatch.delenv("TANDEM_HOME")
    assert demo.default_demo_model_dir() == (
        pathlib.Path.home() / ".cache" / "tandem" / "models" / "tandem-demo")


def test_ensure_builds_once_and_reuses(monkeypatch: pytest.MonkeyPatch,
                                       tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    path = demo.ensure_demo_model()
    assert path == tmp_path / "models" / "tandem-demo"
    stamp = (path / "tokenizer.json").stat().st_mtime_ns
    assert demo.ensure_demo_model() == path
    assert (path / "tokenizer.json").stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in path.parent.iterdir()] == ["tandem-demo"]  # no temp dirs left


def test_ensure_replaces_a_stale_copy(tmp_path: pathlib.Path) -> None:
    path = demo.ensure_demo_model(tmp_path / "m")
    (path / demo.MARKER_FILE).write_text(json.dumps({"format_version": 0}))
    (path / "leftover.bin").write_text("old")
    assert demo.ensure_demo_model(path) == path
    assert not (path / "leftover.bin").exists()
    assert json.loads((path / demo.MARKER_FILE).read_text())["format_version"] == (
        demo.DEMO_FORMAT_VERSION)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_ensure_refuses_to_replace_foreign_files(tmp_path: pathlib.Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "mine.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        demo.ensure_demo_model(tmp_path / "m")
    assert (tmp_path / "m" / "mine.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_concurrent_ensure_yields_one_complete_directory(tmp_path: pathlib.Path,
                                                         demo_dir: pathlib.Path) -> None:
    target = tmp_path / "m"
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: demo.ensure_demo_model(target), range(4)))
    assert results == [target] * 4
    assert _files(target) == _files(demo_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]

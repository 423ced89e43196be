"""The demo model: a tiny Llama-architecture model directory that Tandem installs on first use.

`make up` and the tests need a real Hugging Face model directory without downloading anything. This
module writes one: a byte-level BPE tokenizer trained on a bundled English corpus
(`demo_corpus.txt`), a ChatML chat template, and a tiny LlamaForCausalLM trained on the same
corpus. The tokenizer and the weights are committed package data (`demo_weights/`, written by
`python -m tandem.model.train_demo`, see there): training them again under other library versions
could give another tokenizer that no longer matches the weights. The JSON configs are written from
`DEMO_SPEC`. Every build gives identical bytes.

The demo's draft model, for speculative decoding, is installed with it, in the subdirectory
`draft/` (`draft_model_dir(demo_dir)`): a complete Hugging Face model directory of shape
`DRAFT_SPEC` with the demo's own tokenizer files, so its token ids are the demo's. Its weights
(`demo_draft_weights/`) were distilled from the demo's by `python -m tandem.model.train_draft`;
`python -m tandem.model.draft_eval` measures how often it predicts the demo's next tokens.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from importlib import resources
from typing import Any

#: Bump whenever the generated files change: ensure_demo_model rebuilds copies of other versions
#: (it also rebuilds when the committed files change: the marker records their digests).
#: 2: random weights (model.safetensors). 3: trained weights and their tokenizer, committed.
#: 4: the draft model in DRAFT_DIR.
DEMO_FORMAT_VERSION = 4
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
#: The committed files, in the package directory ASSETS_DIR.
ASSETS_DIR = "demo_weights"
ASSET_FILES = (TOKENIZER_FILE, WEIGHTS_FILE)
#: The draft's committed weights, in the package directory DRAFT_ASSETS_DIR (its tokenizer is
#: the demo's).
DRAFT_ASSETS_DIR = "demo_draft_weights"
DRAFT_ASSET_FILES = (WEIGHTS_FILE,)
#: The draft model's directory inside the demo model's.
DRAFT_DIR = "draft"
#: Written last; its presence with the expected content marks a complete, current demo model.
MARKER_FILE = "tandem-demo.json"

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
#: Special tokens take ids 0..4 in this order.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN)

# ChatML turns behind a Llama-3-style BOS. Content may be a string or OpenAI-style content parts;
# non-text parts and unknown roles raise, so the frontend reports them instead of dropping them.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('unsupported role: ' + message['role'] | string) }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] is not none %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] != 'text' %}"
    "{{- raise_exception('the demo model accepts text content only, got ' + part['type']) }}"
    "{%- endif %}"
    "{{- part['text'] }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True, slots=True)
class DemoSpec:
    """Shape of the demo model; the committed weights must have it. The marker records it, so a
    changed spec triggers a rebuild. The mock engine sizes its KV blocks from the same config, and
    tests count on 2 layers x 2 KV heads x 16 dims (float32)."""

    vocab_size: int = 4096  # target for BPE training, special tokens included
    hidden_size: int = 96
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0


DEMO_SPEC = DemoSpec()
#: The draft model for speculative decoding: one layer, hidden 32 (`train_draft` explains why).
DRAFT_SPEC = DemoSpec(hidden_size=32, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)


def default_demo_model_dir() -> pathlib.Path:
    """`$TANDEM_HOME/models/tandem-demo`, TANDEM_HOME defaulting to `~/.cache/tandem`.

    Read at call time (not import time) so tests and launchers can point it elsewhere."""
    home = os.environ.get("TANDEM_HOME") or os.path.join("~", ".cache", "tandem")
    return pathlib.Path(home).expanduser() / "models" / "tandem-demo"


def create_demo_model(path: str | pathlib.Path) -> pathlib.Path:
    """Write the demo model into `path` (created if missing; existing files are overwritten).

    Not atomic: use ensure_demo_model where other processes may read the directory.
    Returns the directory. Raises RuntimeError if the committed files do not fit DEMO_SPEC (or
    the draft's DRAFT_SPEC)."""
    spec = DEMO_SPEC
    root = pathlib.Path(path)
    tokenizer_json = committed_file(TOKENIZER_FILE).read_bytes()
    _write_model_dir(root, spec, tokenizer_json, committed_file(WEIGHTS_FILE).read_bytes(),
                     ASSETS_DIR, "train_demo")
    _write_model_dir(root / DRAFT_DIR, DRAFT_SPEC, tokenizer_json,
                     committed_file(WEIGHTS_FILE, DRAFT_ASSETS_DIR).read_bytes(),
                     DRAFT_ASSETS_DIR, "train_draft")
    _write_json(root / MARKER_FILE, _marker(spec))
    return root


def draft_model_dir(demo_dir: str | pathlib.Path) -> pathlib.Path:
    """The draft model directory inside a demo model directory that ensure_demo_model (or
    create_demo_model) wrote; load it as any model directory. Raises FileNotFoundError if
    `demo_dir` holds no draft (not a demo model, or one installed before drafts were)."""
    path = pathlib.Path(demo_dir) / DRAFT_DIR
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{demo_dir} has no demo draft model ({DRAFT_DIR}/config.json); "
                                "install the demo model with tandem.model.demo.ensure_demo_model")
    return path


def _write_model_dir(root: pathlib.Path, spec: DemoSpec, tokenizer_json: bytes, weights: bytes,
                     assets_dir: str, script: str) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    _check_assets(spec, vocab_size, _safetensors_shapes(weights), assets_dir, script)
    ids = special_token_ids(tokenizer)
    root.mkdir(parents=True, exist_ok=True)
    (root / TOKENIZER_FILE).write_bytes(tokenizer_json)
    (root / WEIGHTS_FILE).write_bytes(weights)
    _write_json(root / "tokenizer_config.json", _tokenizer_config(spec))
    _write_json(root / "config.json", model_config(spec, vocab_size, ids))
    _write_json(root / "generation_config.json", _generation_config(ids))


def ensure_demo_model(path: str | pathlib.Path | None = None) -> pathlib.Path:
    """Return a complete, current demo model directory, building it on first use.

    The build happens in a temporary directory beside the target and is renamed into place, so
    concurrent callers never see a half-written directory; if two race, one rename wins and the
    other build is discarded. A stale copy (other format version, spec or committed files) is
    replaced. Raises FileExistsError if `path` is a non-empty directory that is not a demo model,
    rather than replacing someone's files."""
    spec = DEMO_SPEC
    target = pathlib.Path(path) if path is not None else default_demo_model_dir()
    if _is_current(target, spec):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    build = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.build-", dir=target.parent))
    try:
        create_demo_model(build)
        build.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared with other users
        for _ in range(3):  # a concurrent replacer can move the target between our steps
            try:
                os.rename(build, target)  # atomic; succeeds only if target is absent or empty
                return target
            except OSError:
                if _is_current(target, spec):
                    return target  # another process won the race with an identical build
                if target.exists() and not (target / MARKER_FILE).is_file():
                    raise FileExistsError(
                        f"{target} exists and is not a Tandem demo model; remove it or pass "
                        "another path") from None
                _move_aside(target)
        raise RuntimeError(f"could not install the demo model at {target}: it keeps changing")
    finally:
        shutil.rmtree(build, ignore_errors=True)


def _is_current(root: pathlib.Path, spec: DemoSpec) -> bool:
    try:
        return bool(json.loads((root / MARKER_FILE).read_text(encoding="utf-8")) == _marker(spec))
    except (OSError, ValueError):
        return False


def _move_aside(target: pathlib.Path) -> None:
    stale = target.parent / f".{target.name}.stale-{uuid.uuid4().hex}"
    try:
        os.rename(target, stale)
    except FileNotFoundError:
        return  # another process already moved it
    shutil.rmtree(stale, ignore_errors=True)


def _marker(spec: DemoSpec) -> dict[str, Any]:
    return {"format_version": DEMO_FORMAT_VERSION, "spec": dataclasses.asdict(spec),
            "assets": committed_digests(),
            "draft_spec": dataclasses.asdict(DRAFT_SPEC),
            "draft_assets": committed_digests(DRAFT_ASSETS_DIR)}


def committed_file(name: str, assets_dir: str = ASSETS_DIR) -> Any:
    """One of ASSET_FILES (or with DRAFT_ASSETS_DIR, of DRAFT_ASSET_FILES) in the installed
    package (an importlib.resources Traversable)."""
    return resources.files("tandem.model").joinpath(assets_dir, name)


@functools.cache
def committed_digests(assets_dir: str = ASSETS_DIR) -> dict[str, str]:
    """sha256 of each committed file of `assets_dir`, by name."""
    names = {ASSETS_DIR: ASSET_FILES, DRAFT_ASSETS_DIR: DRAFT_ASSET_FILES}[assets_dir]
    return {name: hashlib.sha256(committed_file(name, assets_dir).read_bytes()).hexdigest()
            for name in names}


def _safetensors_shapes(data: bytes) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from a safetensors header (8-byte little-endian length, then JSON): no torch
    needed, no tensor read."""
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    return {name: tuple(entry["shape"]) for name, entry in header.items()
            if name != "__metadata__"}


def _check_assets(spec: DemoSpec, vocab_size: int, shapes: dict[str, tuple[int, ...]],
                  assets_dir: str, script: str) -> None:
    expected = weight_shapes(spec, vocab_size)
    wrong = sorted(name for name in expected.keys() | shapes.keys()
                   if expected.get(name) != shapes.get(name))
    if vocab_size != spec.vocab_size or wrong:
        raise RuntimeError(
            f"the committed model files in tandem/model/{assets_dir}/ do not fit their spec "
            f"(vocabulary {vocab_size}, spec {spec.vocab_size}; tensors missing, unexpected or "
            f"of another shape: {', '.join(wrong) or 'none'}); retrain them with "
            f"`python -m tandem.model.{script} --out tandem/model/{assets_dir}`")


def special_token_ids(tokenizer: Any) -> dict[str, int]:
    """SPECIAL_TOKENS -> id in a `tokenizers.Tokenizer`."""
    return {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}


def train_tokenizer(spec: DemoSpec) -> Any:
    """Byte-level BPE over the bundled corpus, as `train_demo` trains it before the weights (the
    demo model itself installs the committed result). Deterministic: BPE training breaks count
    ties by pair ids, which follow the (sorted) byte alphabet; no randomness is involved."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    # No normalizer: any UTF-8 string must round-trip byte for byte.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        # 1, not the usual 2: the corpus is small and must still fill the vocabulary.
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 bytes, so text never seen in training still encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = resources.files("tandem.model").joinpath("demo_corpus.txt").read_text("utf-8")
    tokenizer.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Plain encodes start with BOS, as Llama 3's do; the chat template writes its own BOS and
    # transformers renders templates with add_special_tokens=False, so chats get exactly one.
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B:1",
            special_tokens=[(BOS_TOKEN, bos_id)],
        ),
    ])
    return tokenizer


def _tokenizer_config(spec: DemoSpec) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        # Cleanup would rewrite " ." as "." and break the round trip.
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }


def model_config(spec: DemoSpec, vocab_size: int, ids: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.hidden_size // spec.num_attention_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": ids[BOS_TOKEN],
        # Both end a generation: <|end_of_text|> for plain text, <|im_end|> for a chat turn.
        "eos_token_id": [ids[EOS_TOKEN], ids[IM_END_TOKEN]],
        "pad_token_id": ids[PAD_TOKEN],
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _generation_config(ids: dict[str, int]) -> dict[str, Any]:
    return {
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": [ids[EOS_TOKEN], ids[IM_END_TOKEN]],
        "pad_token_id": ids[PAD_TOKEN],
    }


def weight_shapes(spec: DemoSpec, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of transformers' LlamaForCausalLM with tied embeddings (so no
    lm_head.weight), in a fixed order."""
    hidden, inter = spec.hidden_size, spec.intermediate_size
    head = spec.hidden_size // spec.num_attention_heads
    q_out, kv_out = spec.num_attention_heads * head, spec.num_key_value_heads * head
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, hidden)}
    for i in range(spec.num_hidden_layers):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.self_attn.q_proj.weight": (q_out, hidden),
            f"{layer}.self_attn.k_proj.weight": (kv_out, hidden),
            f"{layer}.self_attn.v_proj.weight": (kv_out, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, q_out),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
            f"{layer}.mlp.gate_proj.weight": (inter, hidden),
            f"{layer}.mlp.up_proj.weight": (inter, hidden),
            f"{layer}.mlp.down_proj.weight": (hidden, inter),
        }
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def _write_json(path: pathlib.Path, value: dict[str, Any]) -> None:
    _write_text(path, json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def _write_text(path: pathlib.Path, text: str) -> None:
    path.write_text(text, encoding="utf-8", newline="\n")

"""A tiny Wan 2.1 text-to-video pipeline with random weights, written offline.

`write_tiny_wan` builds every component of diffusers' `WanPipeline` from a config (no
download): a T5 (Unigram) tokenizer trained on the bundled demo corpus with the `tokenizers`
library, a UMT5 text encoder, a `WanTransformer3DModel` and an `AutoencoderKLWan`, each with
weights drawn from one fixed seed, and the UniPC flow-matching scheduler real Wan 2.1
checkpoints ship. It saves them with `WanPipeline.save_pretrained`, so diffusers loads the very
files the video worker reads: the equivalence test runs both on the same directory.

The shapes keep Wan's constraints: the VAE downsamples 8x in space and 4x in time and the
transformer patches 2x2, so sizes are multiples of 16 and frame counts are 4k+1. `WAN_1_3B`
is the transformer shape of Wan2.1-T2V-1.3B, for benchmarks with dummy weights.
"""
from __future__ import annotations

import pathlib
from importlib import resources
from typing import Any

#: The tiny transformer (diffusers' own Wan pipeline tests use this shape).
TINY_TRANSFORMER: dict[str, Any] = {
    "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 12,
    "in_channels": 16, "out_channels": 16, "text_dim": 32, "freq_dim": 32, "ffn_dim": 32,
    "num_layers": 2, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 32,
}
#: Wan2.1-T2V-1.3B's transformer/config.json (dummy weights: benchmarks only).
WAN_1_3B: dict[str, Any] = {
    "patch_size": (1, 2, 2), "num_attention_heads": 12, "attention_head_dim": 128,
    "in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960,
    "num_layers": 30, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6, "rope_max_seq_len": 1024,
}
TINY_VAE: dict[str, Any] = {"base_dim": 3, "z_dim": 16, "dim_mult": [1, 1, 1, 1],
                            "num_res_blocks": 1, "temperal_downsample": [False, True, True]}
#: Wan 2.1's VAE (AutoencoderKLWan defaults are its shape).
WAN_VAE: dict[str, Any] = {}
TINY_TEXT_ENCODER: dict[str, Any] = {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2,
                                     "num_heads": 4, "relative_attention_num_buckets": 8}
#: Wan 2.1 scheduler config (flow matching, shift 3.0 for 480p).
SCHEDULER: dict[str, Any] = {"prediction_type": "flow_prediction", "use_flow_sigmas": True,
                             "flow_shift": 3.0, "num_train_timesteps": 1000}
TOKENIZER_VOCAB = 400
#: Special tokens at T5's ids: <pad> 0, </s> 1, <unk> 2.
T5_SPECIALS = ("<pad>", "</s>", "<unk>")


def train_t5_tokenizer(vocab_size: int = TOKENIZER_VOCAB) -> Any:
    """A T5 tokenizer (Unigram over Metaspace, </s> appended) trained on the demo corpus."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import T5Tokenizer

    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=list(T5_SPECIALS),
                                      unk_token="<unk>", shrinking_factor=0.75)
    corpus = resources.files("tandem.model").joinpath("demo_corpus.txt").read_text("utf-8")
    tokenizer.train_from_iterator(corpus.splitlines(), trainer=trainer)
    import json

    pieces = [(str(p), float(s)) for p, s in json.loads(tokenizer.to_str())["model"]["vocab"]]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def build_wan_pipeline(seed: int = 0, *, transformer: dict[str, Any] | None = None,
                       vae: dict[str, Any] | None = None,
                       text_encoder: dict[str, Any] | None = None) -> Any:
    """An in-memory `WanPipeline` (float32, CPU) whose weights all come from `seed`."""
    import torch
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = train_t5_tokenizer()
    text_kwargs = {**TINY_TEXT_ENCODER, **(text_encoder or {})}
    transformer_kwargs = {**TINY_TRANSFORMER, **(transformer or {})}
    transformer_kwargs["text_dim"] = text_kwargs["d_model"]
    torch.manual_seed(seed)
    encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), pad_token_id=0,
                                          eos_token_id=1, decoder_start_token_id=0,
                                          **text_kwargs)).eval()
    torch.manual_seed(seed + 1)
    dit = WanTransformer3DModel(**transformer_kwargs)
    torch.manual_seed(seed + 2)
    autoencoder = AutoencoderKLWan(**(TINY_VAE if vae is None else vae))
    return WanPipeline(tokenizer=tokenizer, text_encoder=encoder, vae=autoencoder,
                       scheduler=UniPCMultistepScheduler(**SCHEDULER), transformer=dit)


def write_tiny_wan(path: str | pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Writes the tiny pipeline to `path` (model_index.json and one folder per component).

    Returns:
        The directory, loadable by `WanPipeline.from_pretrained` and `tandem serve video`.
    """
    root = pathlib.Path(path)
    root.mkdir(parents=True, exist_ok=True)
    build_wan_pipeline(seed).save_pretrained(root)
    return root


#: Bump when the generated files change: ensure_tiny_wan rebuilds older copies.
TINY_WAN_VERSION = 1
_MARKER = "tandem-tiny-wan.json"


def default_tiny_wan_dir() -> pathlib.Path:
    """`$TANDEM_HOME/models/tandem-wan-tiny` (TANDEM_HOME defaults to ~/.cache/tandem)."""
    from tandem.model.demo import default_demo_model_dir

    return default_demo_model_dir().parent / "tandem-wan-tiny"


def ensure_tiny_wan(path: str | pathlib.Path | None = None) -> pathlib.Path:
    """The tiny Wan pipeline directory, built on first use (in a temporary directory renamed
    into place, so concurrent callers never see half of it)."""
    import json
    import shutil
    import tempfile

    target = pathlib.Path(path) if path is not None else default_tiny_wan_dir()
    marker = {"version": TINY_WAN_VERSION, "seed": 0}
    try:
        if json.loads((target / _MARKER).read_text("utf-8")) == marker:
            return target
    except (OSError, ValueError):
        pass
    target.parent.mkdir(parents=True, exist_ok=True)
    build = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.build-", dir=target.parent))
    try:
        write_tiny_wan(build, seed=0)
        (build / _MARKER).write_text(json.dumps(marker), "utf-8")
        build.chmod(0o755)
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            build.rename(target)
        except OSError:
            if not (target / _MARKER).is_file():  # nobody else finished it either
                raise
        return target
    finally:
        shutil.rmtree(build, ignore_errors=True)

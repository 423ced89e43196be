"""A tiny LLaVA test model: a Hugging Face `LlavaForConditionalGeneration` directory with random
weights, for equivalence tests of the encode stage on CPU.

The directory holds what `LlavaForConditionalGeneration.from_pretrained` and
`AutoProcessor.from_pretrained` read offline: config.json (a CLIP vision tower, the projector and
a Llama text model), model.safetensors (written by transformers' own `save_pretrained`), the demo
BPE tokenizer with an `<image>` special token added, a chat template that writes one `<image>` per
image part, preprocessor_config.json (CLIP-style resize, center crop, rescale, normalize) and
processor_config.json (patch size and feature-select strategy, so the processor expands each
`<image>` into as many tokens as the model produces per image).
"""
from __future__ import annotations

import json
import pathlib
from typing import Any

from tandem.model.tiny import randomize

IMAGE_TOKEN = "<image>"
#: CLIP's mean and std (transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# ChatML as in the demo model; an image part renders as one IMAGE_TOKEN where it stands, which the
# processor (or Tandem's frontend) then expands to the model's tokens per image.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] is not none %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] in ['image', 'image_url', 'input_image'] %}{{- '<image>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}"
    "{%- else %}{{- raise_exception('unsupported content part: ' + part['type']) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def write_tiny_llava(path: str | pathlib.Path, seed: int = 0, *, image_size: int = 42,
                     patch_size: int = 14, tokenizer_dir: str | pathlib.Path | None = None,
                     **text_overrides: Any) -> pathlib.Path:
    """Write a tiny float32 LLaVA checkpoint into `path`.

    Args:
        seed: decides every weight; the same seed gives the same tensors.
        image_size: side of the square image the vision tower takes (a multiple of patch_size);
            the model makes (image_size / patch_size)^2 tokens per image ("default" strategy:
            the CLS token is dropped).
        tokenizer_dir: the text tokenizer to extend with IMAGE_TOKEN; default: the demo model's.
        text_overrides: LlamaConfig keys that replace the text model's defaults.
    Returns:
        The directory.
    """
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer

    if image_size % patch_size:
        raise ValueError(f"image_size {image_size} is not a multiple of patch_size {patch_size}")
    if tokenizer_dir is None:
        from tandem.model.demo import ensure_demo_model

        tokenizer_dir = ensure_demo_model()
    source = pathlib.Path(tokenizer_dir)
    token_config = json.loads((source / "config.json").read_text("utf-8"))
    tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    image_token_id = tokenizer.token_to_id(IMAGE_TOKEN)
    assert image_token_id is not None
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    text = transformers.LlamaConfig(**{
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "bos_token_id": token_config.get("bos_token_id"),
        "eos_token_id": token_config.get("eos_token_id"),
        "pad_token_id": token_config.get("pad_token_id"), **text_overrides})
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        image_size=image_size, patch_size=patch_size, projection_dim=32,
        hidden_act="quick_gelu", layer_norm_eps=1e-5)
    tokens_per_image = (image_size // patch_size) ** 2
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_token_id,
        projector_hidden_act="gelu", vision_feature_layer=-2,
        vision_feature_select_strategy="default", image_seq_length=tokens_per_image,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config)  # float32 parameters
    randomize(model, seed)

    root = pathlib.Path(path)
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(root)
    tokenizer.save(str(root / "tokenizer.json"))
    _write_json(root / "tokenizer_config.json", _tokenizer_config(source))
    _write_json(root / "generation_config.json",
                json.loads((source / "generation_config.json").read_text("utf-8")))
    _write_json(root / "preprocessor_config.json", _preprocessor_config(image_size))
    _write_json(root / "processor_config.json", {
        "processor_class": "LlavaProcessor", "patch_size": patch_size,
        "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1,
        "image_token": IMAGE_TOKEN})
    (root / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return root


def _tokenizer_config(source: pathlib.Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((source / "tokenizer_config.json").read_text("utf-8"))
    config["chat_template"] = CHAT_TEMPLATE
    config["additional_special_tokens"] = [*config.get("additional_special_tokens", []),
                                           IMAGE_TOKEN]
    config["extra_special_tokens"] = {"image_token": IMAGE_TOKEN}
    return config


def _preprocessor_config(image_size: int) -> dict[str, Any]:
    """CLIP's preprocessing, scaled down: shortest edge to image_size (bicubic), center crop."""
    return {
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"shortest_edge": image_size},
        "resample": 3,  # PIL.Image.BICUBIC
        "do_center_crop": True,
        "crop_size": {"height": image_size, "width": image_size},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(CLIP_MEAN),
        "image_std": list(CLIP_STD),
    }


def _write_json(path: pathlib.Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")

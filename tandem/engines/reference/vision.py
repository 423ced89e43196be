"""LLaVA's image path: a CLIP vision tower and the multimodal projector, as in transformers'
LlavaModel.get_image_features.

The tower runs only the layers up to the one LLaVA reads its features from
(`vision_feature_layer`, usually the second to last), so the unused last layer and the
post-layernorm are neither built nor loaded. Parameter names follow the checkpoint's, less the
prefixes loader.py strips (`model.`, `vision_model.`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.errors import InvalidRequest
from tandem.multimodal.placeholders import LLAVA_ARCHITECTURES


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


#: Activations by their transformers names.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu, "quick_gelu": _quick_gelu, "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh, "relu": F.relu, "silu": F.silu,
}


@dataclass(frozen=True)
class VisionSpec:
    """Shape of a LLaVA model's tower and projector, from config.json."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    #: Tower layers to run: up to the deepest feature layer.
    num_layers: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    #: Indices into the tower's hidden states (0: the embeddings after the pre-layernorm, i: the
    #: output of layer i), concatenated along the feature axis.
    feature_layers: tuple[int, ...]
    #: "default" strategy: drop the CLS feature.
    drop_cls: bool
    projector_act: str
    projector_bias: bool
    text_hidden_size: int
    image_token_id: int

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        return self.num_patches + (0 if self.drop_cls else 1)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> VisionSpec | None:
        """None for a text-only model. Raises InvalidRequest for a vision tower other than
        CLIP's or settings this module does not implement."""
        if (config.get("architectures") or [""])[0] not in LLAVA_ARCHITECTURES:
            return None
        vision, text = config["vision_config"], config["text_config"]
        kind = vision.get("model_type", "clip_vision_model")
        if kind != "clip_vision_model":
            raise InvalidRequest(f"unsupported vision tower {kind!r}; the reference engine runs "
                                 "CLIP towers (clip_vision_model)", param="model")
        strategy = config.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise InvalidRequest(f"unsupported vision_feature_select_strategy {strategy!r}",
                                 param="model")
        total = int(vision["num_hidden_layers"])
        layer = config.get("vision_feature_layer", -2)
        layers = tuple(i if i >= 0 else total + 1 + i
                       for i in (layer if isinstance(layer, list) else [layer]))
        if not all(0 <= i <= total for i in layers):
            raise InvalidRequest(f"vision_feature_layer {layer} is outside the tower's "
                                 f"{total} layers", param="model")
        for act in (vision.get("hidden_act", "quick_gelu"),
                    config.get("projector_hidden_act", "gelu")):
            if act not in ACTIVATIONS:
                raise InvalidRequest(f"unsupported activation {act!r}", param="model")
        token_id = config.get("image_token_index", config.get("image_token_id"))
        return cls(
            hidden_size=int(vision["hidden_size"]),
            intermediate_size=int(vision["intermediate_size"]),
            num_heads=int(vision["num_attention_heads"]),
            num_layers=max(layers),
            image_size=int(vision["image_size"]),
            patch_size=int(vision["patch_size"]),
            num_channels=int(vision.get("num_channels", 3)),
            layer_norm_eps=float(vision.get("layer_norm_eps", 1e-5)),
            hidden_act=vision.get("hidden_act", "quick_gelu"),
            feature_layers=layers,
            drop_cls=strategy == "default",
            projector_act=config.get("projector_hidden_act", "gelu"),
            projector_bias=bool(config.get("multimodal_projector_bias", True)),
            text_hidden_size=int(text["hidden_size"]),
            image_token_id=int(token_id),
        )


class ClipEmbeddings(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(spec.hidden_size))
        self.patch_embedding = nn.Conv2d(spec.num_channels, spec.hidden_size, spec.patch_size,
                                         stride=spec.patch_size, bias=False)
        self.position_embedding = nn.Embedding(spec.num_patches + 1, spec.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)  # [N, patches, hidden]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class ClipAttention(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.q_proj = nn.Linear(spec.hidden_size, spec.hidden_size)
        self.k_proj = nn.Linear(spec.hidden_size, spec.hidden_size)
        self.v_proj = nn.Linear(spec.hidden_size, spec.hidden_size)
        self.out_proj = nn.Linear(spec.hidden_size, spec.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape

        def heads(proj: nn.Linear) -> torch.Tensor:
            return proj(x).view(n, t, self.num_heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj), heads(self.k_proj),
                                             heads(self.v_proj))  # no mask: every patch sees all
        return self.out_proj(out.transpose(1, 2).reshape(n, t, -1))


class ClipMlp(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.act = ACTIVATIONS[spec.hidden_act]
        self.fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ClipLayer(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.self_attn = ClipAttention(spec)
        self.layer_norm2 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.mlp = ClipMlp(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEncoder(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ClipLayer(spec) for _ in range(spec.num_layers))


class ClipVisionTower(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embeddings = ClipEmbeddings(spec)
        self.pre_layrnorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.encoder = ClipEncoder(spec)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Features [N, tokens, hidden * len(feature_layers)] of pixel values [N, C, H, W]."""
        hidden = self.pre_layrnorm(self.embeddings(pixels))
        states = [hidden]
        for layer in self.encoder.layers:
            hidden = layer(hidden)
            states.append(hidden)
        start = 1 if self.spec.drop_cls else 0
        return torch.cat([states[i][:, start:] for i in self.spec.feature_layers], dim=-1)


class LlavaProjector(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        features = spec.hidden_size * len(spec.feature_layers)
        self.linear_1 = nn.Linear(features, spec.text_hidden_size, bias=spec.projector_bias)
        self.act = ACTIVATIONS[spec.projector_act]
        self.linear_2 = nn.Linear(spec.text_hidden_size, spec.text_hidden_size,
                                  bias=spec.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaVision(nn.Module):
    """Pixel values [N, C, H, W] -> image embeddings [N, tokens_per_image, text hidden]."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.vision_tower = ClipVisionTower(spec)
        self.multi_modal_projector = LlavaProjector(spec)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        size = self.spec.image_size
        if pixels.shape[-2:] != (size, size):
            raise InvalidRequest(f"pixel values of {tuple(pixels.shape[-2:])} do not fit the "
                                 f"vision tower's {size}x{size}", param="images")
        return self.multi_modal_projector(self.vision_tower(pixels))

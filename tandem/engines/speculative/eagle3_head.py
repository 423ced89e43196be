"""An EAGLE-3 head as published checkpoints lay it out, and its loader.

A checkpoint (yuhuili/EAGLE3-*, nvidia/*-Eagle3, RedHatAI's) is one Llama decoder layer over the
target's hidden states, in a directory of `config.json` (architectures
`LlamaForCausalLMEagle3`, the layer's Llama shape, `draft_vocab_size`, optionally
`target_hidden_size` and the target layers it reads) and safetensors:

    fc.weight                                   [hidden, n * target_hidden]  (n = 3 layers)
    midlayer.input_layernorm.weight             [hidden]   norms the token embedding
    midlayer.hidden_norm.weight                 [hidden]   norms the hidden state
    midlayer.self_attn.{q,k,v}_proj.weight      [.., 2 * hidden]  over [embedding | hidden]
    midlayer.self_attn.o_proj.weight            [hidden, heads * head_dim]
    midlayer.post_attention_layernorm.weight    [hidden]
    midlayer.mlp.{gate,up,down}_proj.weight     SwiGLU
    norm.weight                                 [hidden]
    lm_head.weight                              [draft_vocab, hidden]
    d2t                                         [draft_vocab] int: target id = draft id + d2t
    t2d                                         [vocab] bool (unused here)
    embed_tokens.weight                         [vocab, hidden]  (only some; else the target's)

(`layers.0.` for `midlayer.` and a `model.` prefix are read too.) One step over rows whose
input hidden state is h (the target's states through `fc`, or the head's own previous output)
and whose token embedding is e:

    residual = h                    (norm_before_residual: residual = hidden_norm(h))
    x = attention(concat(input_layernorm(e), hidden_norm(h)))     over the head's own KV
    residual = x + residual
    out = mlp(post_attention_layernorm(residual)) + residual     the hidden state fed back
    logits = lm_head(norm(out))                                  over the draft vocabulary
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engines.reference.attention import Attention
from tandem.engines.reference.batch import AttentionMetadata
from tandem.engines.reference.layers import GatedMLP, RMSNorm
from tandem.engines.reference.loader import Target, checkpoint_index, load_safetensors
from tandem.engines.reference.rope import RotaryEmbedding
from tandem.engines.reference.spec import ModelSpec
from tandem.errors import InvalidRequest

#: The architectures an EAGLE-3 checkpoint's config.json names (the published one, vLLM's).
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
_PARAM = "speculative_config"


@dataclass(frozen=True)
class Eagle3Spec:
    """The shape of an EAGLE-3 head, read from its config.json against its target's shape."""

    #: The decoder layer's shape (one layer, the target's vocabulary and context length).
    layer: ModelSpec
    draft_vocab_size: int
    target_hidden_size: int
    #: The target layers read, in vLLM's convention (tandem.engines.reference.aux_states).
    aux_layers: tuple[int, ...]
    #: The residual of the hidden state is taken after hidden_norm (speculators' layout).
    norm_before_residual: bool

    @classmethod
    def from_config(cls, config: Mapping[str, Any], target: ModelSpec) -> Eagle3Spec:
        """Raises InvalidRequest (param "speculative_config"): not an EAGLE-3 head of a shape
        this engine runs, or not one of `target` (its hidden size, vocabulary or layers)."""
        archs = config.get("architectures") or ["<none>"]
        if archs[0] not in ARCHITECTURES:
            _fail(f"architectures {archs} is not an EAGLE-3 head (expected one of "
                  f"{list(ARCHITECTURES)})")
        if int(config.get("num_hidden_layers", 1)) != 1:
            _fail(f"an EAGLE-3 head has one decoder layer, this config says "
                  f"{config.get('num_hidden_layers')}")
        try:
            layer = ModelSpec.from_config({**config, "architectures": ["LlamaForCausalLM"],
                                           "num_hidden_layers": 1})
        except (InvalidRequest, KeyError, TypeError, ValueError) as exc:
            _fail(f"its config.json is not a Llama layer's: {exc}")
        if layer.vocab_size != target.vocab_size:
            _fail(f"its vocab_size {layer.vocab_size} is not the target's {target.vocab_size}"
                  ": the head must share the target's tokenizer")
        target_hidden = int(config.get("target_hidden_size") or layer.hidden_size)
        if target_hidden != target.hidden_size:
            _fail(f"it reads hidden states of size {target_hidden} (target_hidden_size), the "
                  f"target's are {target.hidden_size}")
        draft_vocab = int(config.get("draft_vocab_size") or layer.vocab_size)
        if not 0 < draft_vocab <= layer.vocab_size:
            _fail(f"draft_vocab_size {draft_vocab} must be in [1, vocab_size "
                  f"{layer.vocab_size}]")
        layers = aux_layers(config, target.num_layers)
        # The head's RoPE table must hold every position the target serves.
        layer = dataclasses.replace(
            layer, max_position_embeddings=max(layer.max_position_embeddings,
                                               target.max_position_embeddings),
            tie_word_embeddings=False)
        return cls(layer, draft_vocab, target_hidden, layers,
                   bool(config.get("norm_before_residual", False)))


def aux_layers(config: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head reads, in vLLM's convention (id j: the stream entering
    layer j). Top-level `eagle_aux_hidden_state_layer_ids` is vLLM's and taken as is;
    `eagle_config.eagle_aux_hidden_state_layer_ids` is NVIDIA ModelOpt's, which numbers layer
    outputs (its default 1, L // 2 - 1, L - 4), so each id is shifted by one; neither: the
    EAGLE-3 default (2, L // 2, L - 3).

    Raises:
        InvalidRequest: an id outside [0, num_layers], or no ids and a target too shallow for
            the default.
    """
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    nested = config.get("eagle_config")
    if not ids and isinstance(nested, Mapping) and nested.get("eagle_aux_hidden_state_layer_ids"):
        ids = [int(i) + 1 for i in nested["eagle_aux_hidden_state_layer_ids"]]
    if not ids:
        ids = [2, num_layers // 2, num_layers - 3]
        if num_layers < 6:
            _fail(f"the target has {num_layers} layers, too few for EAGLE-3's default layers "
                  "(2, L // 2, L - 3): name them in config.json's "
                  "eagle_aux_hidden_state_layer_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        _fail(f"eagle_aux_hidden_state_layer_ids must be a list of integers, got {ids!r}")
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        _fail(f"aux hidden state layer ids {bad} are outside the target's [0, {num_layers}]")
    return tuple(ids)


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over [embedding | hidden] (2 * hidden wide)."""

    def __init__(self, spec: ModelSpec, norm_before_residual: bool) -> None:
        super().__init__()
        hidden, eps = spec.hidden_size, spec.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.self_attn = Attention(spec, None)
        self.self_attn.qkv_proj = nn.Linear(2 * hidden, spec.q_size + 2 * spec.kv_size,
                                            bias=spec.attention_bias)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, spec.intermediate_size, spec.mlp_bias)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, meta: AttentionMetadata, kv_layer: torch.Tensor
                ) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        residual = self.self_attn(x, cos, sin, meta, kv_layer) + residual
        return self.mlp(self.post_attention_layernorm(residual)) + residual


class Eagle3Head(nn.Module):
    """An EAGLE-3 head over a paged KV cache of one layer (batch.allocate_kv_cache(1, ...))."""

    def __init__(self, spec: Eagle3Spec, own_embedding: bool) -> None:
        super().__init__()
        layer = spec.layer
        self.spec = spec
        self.fc = nn.Linear(len(spec.aux_layers) * spec.target_hidden_size, layer.hidden_size,
                            bias=False)
        self.midlayer = Eagle3Layer(layer, spec.norm_before_residual)
        self.norm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)
        self.lm_head = nn.Linear(layer.hidden_size, spec.draft_vocab_size, bias=False)
        self.embed_tokens = (nn.Embedding(layer.vocab_size, layer.hidden_size)
                             if own_embedding else None)
        #: Without an embedding of its own: the target's weight (`share_embedding`), kept
        #: out of this module's parameters.
        self._shared_embedding: torch.Tensor | None = None
        self.rotary_emb = RotaryEmbedding(layer.head_size, layer.max_position_embeddings,
                                          layer.rope_theta, layer.rope_scaling)
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        self.d2t: torch.Tensor

    def share_embedding(self, weight: torch.Tensor) -> None:
        """Embeds tokens with the target's embedding `weight` [vocab, hidden]."""
        self._shared_embedding = weight.detach()

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's concatenated hidden states [T, n * target_hidden] -> the head's input
        hidden states [T, hidden]."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """One step over T rows (module docstring): token ids [T], positions [T], input hidden
        states [T, hidden]; writes the rows' K/V into `kv_cache` [1, 2, blocks, ...] first.
        Returns the hidden states fed back [T, hidden] (before the final norm)."""
        weight = (self.embed_tokens.weight if self.embed_tokens is not None
                  else self._shared_embedding)
        assert weight is not None, "no embedding: share_embedding was not called"
        cos, sin = self.rotary_emb(positions)
        return self.midlayer(F.embedding(input_ids, weight), hidden, cos, sin, meta,
                             kv_cache[0])

    def next_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy next token (a target id) after each row of `forward`'s output [N]."""
        draft = self.lm_head(self.norm(hidden)).argmax(dim=-1)
        return draft + self.d2t[draft]


def load_eagle3_head(path: str, target: ModelSpec, target_embedding: torch.Tensor,
                     dtype: torch.dtype, device: torch.device, load_format: str = "auto",
                     seed: int = 0) -> Eagle3Head:
    """Reads the head at `path` (a directory) for `target`, in `dtype` on `device`; without an
    `embed_tokens.weight` of its own it embeds tokens with `target_embedding` (the target's
    embedding weight). "dummy" draws its
    weights from `seed` (d2t all zero) and reads config.json only.

    Raises:
        InvalidRequest (param "speculative_config"): no config.json, not an EAGLE-3 head of
            `target` (Eagle3Spec.from_config), a weight missing, unexpected or of the wrong
            shape, or d2t mapping a draft id outside the target's vocabulary.
    """
    root = pathlib.Path(path)
    try:
        config = json.loads((root / "config.json").read_text("utf-8"))
    except (OSError, ValueError) as exc:
        _fail(f"cannot read the EAGLE-3 head's {root / 'config.json'}: {exc}")
    spec = Eagle3Spec.from_config(config, target)
    files: dict[pathlib.Path, list[str]] = {}
    names: set[str] = set()
    if load_format != "dummy":
        files = _index(root)
        names = {n for n in map(canonical_name, _all(files)) if n is not None}
    own_embed = ("embed_tokens.weight" in names if load_format != "dummy"
                 else spec.layer.hidden_size != target.hidden_size)
    if not own_embed and spec.layer.hidden_size != target.hidden_size:
        _fail(f"the head has no embed_tokens.weight and its hidden size "
              f"{spec.layer.hidden_size} is not the target's {target.hidden_size}, whose "
              "embedding it would use")
    with torch.device("meta"):
        head = Eagle3Head(spec, own_embed)
    head = head.to(dtype).to_empty(device=device)
    if not own_embed:
        head.share_embedding(target_embedding)
    head.rotary_emb.reset_cache()
    head.eval().requires_grad_(False)
    if load_format == "dummy":
        _dummy(head, seed)
        return head
    try:
        load_safetensors(head, _targets(head), files, device, canonical_name, {"d2t", "t2d"},
                         f"an EAGLE-3 head ({ARCHITECTURES[0]})")
    except InvalidRequest as exc:
        _fail(f"the EAGLE-3 head {path!r} cannot be loaded: {exc}")
    _load_d2t(head, files, spec, "d2t" in names)
    return head


def canonical_name(name: str) -> str | None:
    """A checkpoint tensor name -> the published layout's (module docstring)."""
    name = name.removeprefix("model.")
    if name.startswith("layers.0."):
        return "midlayer." + name[len("layers.0."):]
    return name


def _targets(head: Eagle3Head) -> dict[str, Target]:
    """Checkpoint name -> parameter rows, q/k/v and gate/up into their fused parameters."""
    layer = head.spec.layer
    out: dict[str, Target] = {}
    for name, param in head.named_parameters():
        module, _, kind = name.rpartition(".")
        if module.endswith("self_attn.qkv_proj"):
            start = 0
            for part, rows in (("q", layer.q_size), ("k", layer.kv_size), ("v", layer.kv_size)):
                out[f"{module[:-len('qkv_proj')]}{part}_proj.{kind}"] = Target(name, start, rows)
                start += rows
        elif module.endswith("mlp.gate_up_proj"):
            rows = layer.intermediate_size
            out[f"{module[:-len('gate_up_proj')]}gate_proj.{kind}"] = Target(name, 0, rows)
            out[f"{module[:-len('gate_up_proj')]}up_proj.{kind}"] = Target(name, rows, rows)
        else:
            out[name] = Target(name, 0, param.shape[0])
    return out


def _load_d2t(head: Eagle3Head, files: dict[pathlib.Path, list[str]], spec: Eagle3Spec,
              present: bool) -> None:
    """Reads `d2t`, required when the draft vocabulary is smaller than the target's, and
    checks that every draft id maps into the target's vocabulary."""
    from safetensors import safe_open

    if not present:
        if spec.draft_vocab_size != spec.layer.vocab_size:
            _fail(f"the head's draft vocabulary ({spec.draft_vocab_size}) is smaller than the "
                  f"target's ({spec.layer.vocab_size}) and it has no d2t mapping")
        head.d2t.zero_()  # draft ids are target ids
        return
    path, name = next((p, n) for p, ns in files.items() for n in ns
                      if canonical_name(n) == "d2t")
    with safe_open(str(path), framework="pt") as f:
        d2t = f.get_tensor(name)
    if tuple(d2t.shape) != (spec.draft_vocab_size,) or d2t.is_floating_point():
        _fail(f"d2t must be an integer tensor of shape ({spec.draft_vocab_size},), got "
              f"{d2t.dtype} {tuple(d2t.shape)}")
    ids = torch.arange(spec.draft_vocab_size) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= spec.layer.vocab_size:
        _fail(f"d2t maps draft ids outside the target's vocabulary [0, "
              f"{spec.layer.vocab_size})")
    head.d2t.copy_(d2t.long())


def _dummy(head: Eagle3Head, seed: int) -> None:
    from tandem.engines.reference.loader import init_dummy

    init_dummy(head, seed)
    head.d2t.zero_()


def _index(root: pathlib.Path) -> dict[pathlib.Path, list[str]]:
    try:
        return checkpoint_index(root)
    except InvalidRequest as exc:
        _fail(f"the EAGLE-3 head {str(root)!r} cannot be loaded: {exc}")


def _all(files: dict[pathlib.Path, list[str]]) -> list[str]:
    return [n for names in files.values() for n in names]


def _fail(message: str) -> NoReturn:
    raise InvalidRequest(f"speculative config: {message}", param=_PARAM)



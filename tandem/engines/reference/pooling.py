"""How an embedding model turns its final hidden states into one vector per input, read from its
directory the way sentence-transformers reads it.

`modules.json` lists the model's modules in order; the ones served here are a Transformer at the
directory root, one Pooling module (its folder's config.json: `pooling_mode` in
sentence-transformers 6, or the older `pooling_mode_cls_token` / `pooling_mode_mean_tokens` /
`pooling_mode_lasttoken` booleans) with mean, cls or last-token pooling, and an optional
Normalize. Anything else (Dense, LayerNorm, max/weighted-mean pooling, several modes at once, ...)
is refused when the engine starts rather than answered wrongly.

A directory without modules.json gets last-token pooling, normalised: what decoder-only embedding
models such as Qwen3-Embedding use, and vLLM's default for them.

Matryoshka truncation (`dimensions`) follows vLLM: allowed only when config.json says the model
was trained for it (`matryoshka_dimensions`, a list of the sizes it supports, or
`is_matryoshka: true`); the pooled vector is cut to its first `dimensions` values and then
normalised, when the model normalises.
"""
from __future__ import annotations

import enum
import json
import pathlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tandem.errors import InvalidRequest


class PoolingMode(enum.Enum):
    MEAN = "mean"
    CLS = "cls"
    LAST_TOKEN = "lasttoken"


#: sentence-transformers' legacy boolean keys -> its mode names (Pooling.POOLING_MODES).
_LEGACY_MODE_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_SUPPORTED_MODES = ", ".join(mode.value for mode in PoolingMode)
# A module's class is the last part of its "type"; the package path moved between releases
# (sentence_transformers.models.Pooling, ...sentence_transformer.modules.pooling.Pooling).
_TRANSFORMER, _POOLING, _NORMALIZE = "Transformer", "Pooling", "Normalize"


@dataclass(frozen=True, slots=True)
class Pooler:
    """One model's pooling, normalisation and Matryoshka sizes."""

    mode: PoolingMode
    normalize: bool
    hidden_size: int
    #: Whether `dimensions` may be asked for (config.json is_matryoshka or matryoshka_dimensions).
    is_matryoshka: bool = False
    #: The sizes the model was trained for; empty: any size up to hidden_size.
    matryoshka_dimensions: tuple[int, ...] = ()

    @classmethod
    def from_dir(cls, model_dir: str | pathlib.Path, hidden_size: int) -> Pooler:
        """Reads modules.json (and the Pooling module's config) and config.json.

        Raises:
            InvalidRequest: a module or pooling mode the engine does not support, or a file that
                cannot be read (named in the message).
        """
        root = pathlib.Path(model_dir)
        config = _read_json(root / "config.json", root)
        is_matryoshka, sizes = _matryoshka(config, root)
        if not (root / "modules.json").is_file():
            return cls(PoolingMode.LAST_TOKEN, True, hidden_size, is_matryoshka, sizes)
        mode, normalize = _read_modules(root, hidden_size)
        return cls(mode, normalize, hidden_size, is_matryoshka, sizes)

    def check_dimensions(self, dimensions: int | None) -> None:
        """Raises InvalidRequest(param="dimensions") for a size this model cannot give."""
        if dimensions is None:
            return
        if not self.is_matryoshka:
            raise InvalidRequest("this model does not support the dimensions parameter (it is "
                                 "not a Matryoshka model)", param="dimensions")
        if not 1 <= dimensions <= self.hidden_size:
            raise InvalidRequest(f"dimensions must be between 1 and {self.hidden_size}, got "
                                 f"{dimensions}", param="dimensions")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            sizes = ", ".join(map(str, self.matryoshka_dimensions))
            raise InvalidRequest(f"dimensions must be one of {sizes}, got {dimensions}",
                                 param="dimensions")

    def pool(self, hidden: torch.Tensor, starts: list[int], ends: list[int],
             dimensions: int | None = None) -> torch.Tensor:
        """One float32 vector per sequence, [S, dimensions or hidden].

        Args:
            hidden: [T, hidden] final hidden states of S sequences laid end to end.
            starts, ends: sequence s owns rows [starts[s], ends[s]); none is empty.
            dimensions: already checked by `check_dimensions`.
        """
        if self.mode is PoolingMode.MEAN:
            lengths = [end - start for start, end in zip(starts, ends, strict=True)]
            seq_ids = torch.repeat_interleave(
                torch.arange(len(lengths), device=hidden.device),
                torch.tensor(lengths, device=hidden.device))
            sums = torch.zeros(len(lengths), hidden.shape[1], dtype=torch.float32,
                               device=hidden.device).index_add_(0, seq_ids, hidden.float())
            pooled = sums / torch.tensor(lengths, dtype=torch.float32,
                                         device=hidden.device)[:, None]
        else:
            rows = starts if self.mode is PoolingMode.CLS else [end - 1 for end in ends]
            pooled = hidden[torch.tensor(rows, device=hidden.device)].float()
        if dimensions is not None:
            pooled = pooled[:, :dimensions]
        return F.normalize(pooled, p=2, dim=1) if self.normalize else pooled


def _read_modules(root: pathlib.Path, hidden_size: int) -> tuple[PoolingMode, bool]:
    """(pooling mode, normalize) from modules.json: Transformer, Pooling, then optionally
    Normalize, nothing else."""
    modules = _read_json(root / "modules.json", root)
    if not isinstance(modules, list):
        raise InvalidRequest(f"{root / 'modules.json'} is not a list of modules", param="model")
    kinds = [str(m.get("type", "")).rpartition(".")[2] if isinstance(m, dict) else ""
             for m in modules]
    unsupported = [str(m.get("type") if isinstance(m, dict) else m)
                   for m, kind in zip(modules, kinds, strict=True)
                   if kind not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
    if unsupported:
        raise InvalidRequest(
            f"model {root}: unsupported sentence-transformers module {', '.join(unsupported)} "
            "(supported: Transformer, Pooling, Normalize)", param="model")
    if kinds[:2] != [_TRANSFORMER, _POOLING] or kinds[2:] not in ([], [_NORMALIZE]):
        raise InvalidRequest(
            f"model {root}: modules {' -> '.join(kinds)} are not supported (supported: "
            "Transformer -> Pooling, optionally -> Normalize)", param="model")
    if modules[0].get("path", ""):
        raise InvalidRequest(
            f"model {root}: the Transformer module lives in '{modules[0]['path']}'; the engine "
            "reads the weights at the directory root", param="model")
    pooling_dir = root / str(modules[1].get("path", ""))
    return _read_pooling(pooling_dir, root, hidden_size), len(kinds) == 3


def _read_pooling(folder: pathlib.Path, root: pathlib.Path, hidden_size: int) -> PoolingMode:
    config = _read_json(folder / "config.json", root)
    if not isinstance(config, dict):
        raise InvalidRequest(f"{folder / 'config.json'} is not a JSON object", param="model")
    dimension = config.get("embedding_dimension", config.get("word_embedding_dimension"))
    if dimension is not None and dimension != hidden_size:
        raise InvalidRequest(
            f"model {root}: the Pooling module expects {dimension}-wide token embeddings, the "
            f"model's hidden size is {hidden_size}", param="model")
    modes = config.get("pooling_mode")
    if modes is None:  # sentence-transformers < 6: one boolean per mode, mean when none is set
        modes = [mode for key, mode in _LEGACY_MODE_KEYS.items() if config.get(key)] or ["mean"]
    elif isinstance(modes, str):
        modes = [modes]
    if not isinstance(modes, list) or len(modes) != 1 or modes[0] not in _mode_values():
        raise InvalidRequest(
            f"model {root}: unsupported Pooling module mode {modes!r} in {folder.name}/config."
            f"json (supported: one of {_SUPPORTED_MODES})", param="model")
    return PoolingMode(modes[0])


def _mode_values() -> set[str]:
    return {mode.value for mode in PoolingMode}


def _matryoshka(config: Any, root: pathlib.Path) -> tuple[bool, tuple[int, ...]]:
    """As vLLM reads it: `matryoshka_dimensions` (a list) or `is_matryoshka` in config.json."""
    if not isinstance(config, dict):
        raise InvalidRequest(f"{root / 'config.json'} is not a JSON object", param="model")
    sizes = config.get("matryoshka_dimensions")
    if sizes is not None:
        if not isinstance(sizes, list) or not all(isinstance(s, int) for s in sizes):
            raise InvalidRequest(f"model {root}: matryoshka_dimensions in config.json must be "
                                 f"a list of integers, got {sizes!r}", param="model")
        return True, tuple(sizes)
    return bool(config.get("is_matryoshka", False)), ()


def _read_json(path: pathlib.Path, root: pathlib.Path) -> Any:
    try:
        return json.loads(path.read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"model {root}: cannot read {path.name}: {exc}",
                             param="model") from exc

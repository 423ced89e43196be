"""Builds a reference engine's speculative decoding from --speculative-config."""
from __future__ import annotations

import logging

import torch

from tandem.engines.args import EngineArgs
from tandem.engines.speculative.config import SpeculativeConfig
from tandem.engines.speculative.draft_model import DraftModelProposer
from tandem.engines.speculative.proposer import NgramProposer, Proposer
from tandem.engines.speculative.speculation import Speculation
from tandem.errors import InvalidRequest

log = logging.getLogger(__name__)


def create_speculation(args: EngineArgs, vocab_size: int, kv_cache: torch.Tensor,
                       dtype: torch.dtype) -> Speculation:
    """A reference engine's Speculation, its proposer loaded: a draft model beside the
    target's paged `kv_cache` (as many blocks, on its device), in `dtype`.

    Raises:
        InvalidRequest (param "speculative_config"): the config is refused, or names a method
            this engine does not build (eagle3).
    """
    config = SpeculativeConfig.parse(args.speculative_config)
    proposer: Proposer
    if config.method == "ngram":
        proposer = NgramProposer(config)
    elif config.method == "draft_model":
        proposer = DraftModelProposer.load(
            config, vocab_size, kv_cache.shape[2], args.kv_block_size, dtype, kv_cache.device,
            args.load_format, args.seed)
    else:
        raise InvalidRequest(f"speculative method {config.method!r} is not built in the "
                             "reference engine (ngram is)", param="speculative_config")
    log.info("speculative decoding on", extra={"speculative_config": config.to_dict()})
    return Speculation(config, proposer)

"""Builds a reference engine's speculative decoding from --speculative-config."""
from __future__ import annotations

import logging

import torch

from tandem.engines.args import EngineArgs
from tandem.engines.reference.model import DecoderModel
from tandem.engines.speculative.config import SpeculativeConfig
from tandem.engines.speculative.draft_model import DraftModelProposer
from tandem.engines.speculative.eagle3 import Eagle3Proposer
from tandem.engines.speculative.proposer import NgramProposer, Proposer
from tandem.engines.speculative.speculation import Speculation
from tandem.errors import InvalidRequest

log = logging.getLogger(__name__)


def create_speculation(args: EngineArgs, target: DecoderModel, kv_cache: torch.Tensor,
                       dtype: torch.dtype) -> Speculation:
    """A reference engine's Speculation, its proposer loaded: a draft model or an EAGLE-3
    head of `target` (sharing its embedding where the head has none) beside the target's
    paged `kv_cache` (as many blocks, on its device), in `dtype`.

    Raises:
        InvalidRequest (param "speculative_config"): the config or the draft is refused.
    """
    config = SpeculativeConfig.parse(args.speculative_config)
    proposer: Proposer
    if config.method == "ngram":
        proposer = NgramProposer(config)
    elif config.method == "draft_model":
        proposer = DraftModelProposer.load(
            config, target.vocab_size, kv_cache.shape[2], args.kv_block_size, dtype,
            kv_cache.device, args.load_format, args.seed)
    else:
        if args.tensor_parallel_size > 1:
            raise InvalidRequest("speculative method 'eagle3' runs at --tensor-parallel-size "
                                 "1 (its head would embed through a sharded vocabulary)",
                                 param="speculative_config")
        proposer = Eagle3Proposer.load(
            config, target.spec, target.embed_tokens.weight, kv_cache.shape[2],
            args.kv_block_size, dtype,
            kv_cache.device, args.load_format, args.seed)
    log.info("speculative decoding on", extra={"speculative_config": config.to_dict()})
    return Speculation(config, proposer)

"""Speculative decoding's fields on the wire: the per-request opt-out in SamplingParams and the
accepted/rejected draft counts in Usage survive protobuf both ways, through serialized bytes;
the public gRPC API's opt-out reaches the engine's sampling params as the REST API's does."""
from __future__ import annotations

import pytest

from services.frontend.inference import openai_body
from tandem.engines.types import SamplingParams, Usage
from tandem.frontend.openai_request import parse_request
from tandem.runtime import convert
from tandem.v1 import common_pb2, inference_pb2


@pytest.mark.parametrize("speculative", [True, False])
def test_sampling_speculative_round_trips(speculative: bool) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, speculative=speculative)
    msg = convert.sampling_to_pb(params)
    assert msg.disable_speculation is (not speculative)
    wire = common_pb2.SamplingParams.FromString(msg.SerializeToString())
    assert convert.sampling_from_pb(wire, 16) == params


def test_sampling_without_the_field_allows_speculation() -> None:
    # proto3's zero value (a client that never heard of the field) must mean "allowed".
    assert SamplingParams(max_tokens=1).speculative
    assert convert.sampling_from_pb(common_pb2.SamplingParams(), 16).speculative
    assert convert.sampling_from_pb(common_pb2.SamplingParams(disable_speculation=True),
                                    16).speculative is False


def test_usage_prediction_counts_round_trip() -> None:
    usage = Usage(prompt_tokens=11, completion_tokens=7, cached_tokens=4,
                  accepted_prediction_tokens=5, rejected_prediction_tokens=3)
    msg = convert.usage_to_pb(usage)
    assert (msg.accepted_prediction_tokens, msg.rejected_prediction_tokens) == (5, 3)
    wire = common_pb2.Usage.FromString(msg.SerializeToString())
    assert convert.usage_from_pb(wire) == usage


def test_usage_from_an_older_worker_counts_no_predictions() -> None:
    usage = convert.usage_from_pb(common_pb2.Usage(prompt_tokens=2, completion_tokens=1))
    assert usage == Usage(2, 1, 0, 0, 0)


@pytest.mark.parametrize("disable", [False, True])
def test_the_public_grpc_api_takes_the_opt_out(disable: bool) -> None:
    request = inference_pb2.InferenceRequest(
        model="m", prompt="hi", sampling=common_pb2.SamplingParams(disable_speculation=disable))
    body, kind = openai_body(request)
    assert ("speculative_decoding" in body) is disable
    assert parse_request(body, kind).sampling(4).speculative is (not disable)

"""The eager steps a burst of prompts takes first, run once before the worker serves.

CUDA graphs cover pure decode steps (cuda_graphs.capture_all). Prompts run eagerly, and the first
step of each shape pays one-time costs on a fresh process or machine: lazy loading of the GEMM
and attention kernels of large token counts, the allocator growing to a full step's activations,
and Triton compiles that only the eager path needs (the sampler's batched noise, for one). On a
fresh H200 the first 8,000-token step of a burst took 620 ms instead of 230 ms (issue 25). So
the engine runs, on the KV tensor's scratch block, before it reports SERVING:

- a mixed step: one prompt chunk with the rest of the token budget beside decodes, and one of
  a short prompt beside two decodes;
- a step of prompts only, filling the budget;
- one short prompt alone;

each sampling its rows, half greedy and half seeded at temperature 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Protocol, cast

import torch

from tandem.engines.args import EngineArgs
from tandem.engines.batching.scheduler import StepPlan
from tandem.engines.reference.cuda_graphs import DecodeGraphs
from tandem.engines.reference.sampler import SampleInput
from tandem.engines.reference.step_inputs import StepInputs, build_step_inputs
from tandem.engines.types import SamplingParams
from tandem.kv.block_pool import BlockPool

#: Longest prompt chunk of one sequence in the warm steps.
_CHUNK = 1024
_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
_DRAWN = SamplingParams(max_tokens=1, temperature=1.0)


@dataclass
class _Sequence:
    """What build_step_inputs reads of a request: `context` tokens, the last `new` computed
    this step, every block the scratch block."""

    context: int
    new: int
    block_size: int
    scratch: int
    sampling: SamplingParams = _GREEDY
    num_output: int = 0
    num_draft: int = 0
    embeddings: tuple[()] = ()
    token_ids: list[int] = field(init=False)
    num_computed: int = field(init=False)
    num_prompt: int = field(init=False)
    table: SimpleNamespace = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = [0] * self.context
        self.num_computed = self.num_prompt = self.context
        self.table = SimpleNamespace(block_ids=[self.scratch] * -(-self.context
                                                                  // self.block_size))


class WarmedEngine(Protocol):
    """What the warm steps use of the reference engine."""

    @property
    def args(self) -> EngineArgs: ...
    @property
    def pool(self) -> BlockPool: ...
    @property
    def kv_cache(self) -> torch.Tensor: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def graphs(self) -> DecodeGraphs | None: ...

    def _forward_and_sample(self, inputs: StepInputs, samples: list[SampleInput],
                            prompt_ids: list[list[int]], encoded: dict[str, torch.Tensor],
                            guides: list[Any]) -> object: ...


def warm_eager_steps(engine: WarmedEngine) -> int:
    """Runs the steps of the module docstring (in a worker thread, before serving); returns
    how many ran."""
    args, bs = engine.args, engine.pool.block_size
    scratch = engine.kv_cache.shape[2] - 1
    longest = min(_CHUNK, engine.max_model_len - 1)
    budget = min(args.max_num_tokens, args.max_batch_size * longest)

    def seq(context: int, new: int) -> _Sequence:
        return _Sequence(context, new, bs, scratch)

    decodes = [seq(4 * bs if 4 * bs < engine.max_model_len else 1, 1)
               for _ in range(min(args.max_batch_size - 1, 32, max(budget - 1, 0)))]
    chunk = min(budget - len(decodes), longest)
    prompts = [seq(longest, longest) for _ in range(budget // longest)]
    if budget % longest:
        prompts.append(seq(budget % longest, budget % longest))
    few = decodes[:2]  # a small batch of decodes splits its contexts more (kernels.py)
    short = min(17, longest)
    steps = [decodes + [seq(chunk, chunk)] if decodes and chunk > 0 else [],
             few + [seq(short, short)] if len(few) == 2 else [],
             prompts[:args.max_batch_size], [seq(short, short)]]
    ran = 0
    for step in steps:
        if step:
            _run(engine, step)
            ran += 1
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return ran


def _run(engine: WarmedEngine, sequences: list[_Sequence]) -> None:
    for i, s in enumerate(sequences):
        s.sampling = _DRAWN if i % 2 else _GREEDY
    reqs = cast("list[Any]", sequences)
    plan = StepPlan(scheduled=[(r, r.new) for r in reqs], ready=list(reqs))
    inputs = build_step_inputs(plan, engine.pool.block_size, engine.device,
                               engine.graphs.width_bucket if engine.graphs else None)
    samples = [SampleInput(s.sampling, (), (), frozenset(), i) for i, s in enumerate(sequences)]
    engine._forward_and_sample(inputs, samples, [], {}, [None] * len(sequences))

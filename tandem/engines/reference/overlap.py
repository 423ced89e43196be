"""Decode steps of the reference engine launched ahead of their tokens (overlap scheduling: see
tandem.engines.batching.ahead).

Launched steps run in order on one thread of their own. On CUDA a launch only queues work: the
inputs' copy, the graph replay (or eager kernels), the sampling kernels and the copy of the
tokens to pinned host memory, then an event; the step ahead's input ids are the previous step's
tokens, copied on the device. Collecting a step waits for its launch to end and then for its
event, on a second thread, so the loop applies a step's tokens while the next launch may still
run. On CPU the launch computes the step; collecting returns what it computed.

A step with guided requests computes its logits, then waits for the previous step's event: the
grammars take its tokens and fill the step's mask while the device computes, then it samples.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable

import torch

from tandem.engines.batching.ahead import Sampled, StepAhead
from tandem.engines.batching.request import BatchRequest
from tandem.engines.guided.matcher import Guide, apply_bitmask, fill_bitmask, flush_guides
from tandem.engines.reference.sampler import Draws, SampleInput, Sampler
from tandem.engines.reference.step_inputs import StepInputs

#: Logits [rows, vocab] of a decode step's inputs, through a CUDA graph where one serves it.
DecodeLogits = Callable[[StepInputs], torch.Tensor]


class LaunchedStep(StepAhead):
    """One launched step: what its launch left on the device, read back by `sampled`."""

    def __init__(self, reqs: list[BatchRequest], steps: OverlapSteps) -> None:
        super().__init__(reqs)
        self._steps = steps
        #: Set on the steps' thread by the launch: the draws (tokens still on the device), their
        #: values' copy on the host (complete once `event` is), or what the launch raised.
        self.draws: Draws | None = None
        self.host: torch.Tensor | None = None
        self.event: torch.cuda.Event | None = None
        self.error: BaseException | None = None
        #: Set when the launch ended (so are the fields above).
        self.launched = threading.Event()

    async def sampled(self) -> list[Sampled]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._steps.collector, self._collect)

    def _collect(self) -> list[Sampled]:
        self.launched.wait()
        if self.error is not None:
            raise self.error
        assert self.draws is not None and self.host is not None
        if self.event is not None:
            self.event.synchronize()  # releases the GIL while the device finishes
        return [(o.token_id, o.logprob)
                for o in Sampler.collect(self.draws, self.host.tolist())]


class OverlapSteps:
    """The thread that launched steps run on, in order, and the launch itself."""

    def __init__(self, sampler: Sampler, decode_logits: DecodeLogits) -> None:
        self.sampler = sampler
        self.decode_logits = decode_logits
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tandem-steps")
        self.collector = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tandem-collect")

    def launch(self, reqs: list[BatchRequest], inputs: StepInputs, samples: list[SampleInput],
               after: StepAhead | None) -> LaunchedStep:
        """Queues a plain decode step; `after`: the step before it (a LaunchedStep), whose
        alive rows' tokens are this step's input ids, in order."""
        step = LaunchedStep(reqs, self)
        previous = after if isinstance(after, LaunchedStep) else None
        rows = after.alive_rows() if after is not None else None
        guides = [r.guide for r in reqs]
        self.executor.submit(self._launch, step, inputs, samples,
                             guides if any(guides) else None, previous, rows)
        return step

    @torch.inference_mode()
    def _launch(self, step: LaunchedStep, inputs: StepInputs, samples: list[SampleInput],
                guides: list[Guide | None] | None, previous: LaunchedStep | None,
                rows: list[int] | None) -> None:
        try:
            if previous is not None:
                if previous.error is not None:
                    raise previous.error
                assert previous.draws is not None
                tokens = previous.draws.tokens
                if rows is not None:
                    index = torch.tensor(rows)
                    if tokens.is_cuda:  # from pageable memory the copy may wait for the stream
                        index = index.pin_memory()
                    tokens = tokens.index_select(0, index.to(tokens.device, non_blocking=True))
                # The ids row of the inputs (also decode_rows[0]): the placeholders' tokens.
                inputs.input_ids.copy_(tokens)
            logits = self.decode_logits(inputs)
            if guides is not None:
                _constrain(logits, guides, previous, rows)
            draws = self.sampler.launch(logits, samples)
            if draws.values.is_cuda:
                step.host = draws.values.to("cpu", non_blocking=True)
                step.event = torch.cuda.Event()
                step.event.record()
            else:
                step.host = draws.values
            step.draws = draws
        except BaseException as exc:  # raised to the loop by `sampled`
            step.error = exc
        finally:
            step.launched.set()

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        self.collector.shutdown(wait=True)


def _constrain(logits: torch.Tensor, guides: list[Guide | None], previous: LaunchedStep | None,
               rows: list[int] | None) -> None:
    """Masks what each guided row's grammar forbids next. The grammars first take the previous
    step's tokens (that step's `taken`), which are on the host once its event is: row i of
    this step is row rows[i] (or i) of that one. Rows whose grammar ended or refused that token
    are left unmasked: their requests finish when it is settled, and the row is dropped."""
    if previous is not None:
        assert previous.host is not None
        if previous.event is not None:
            previous.event.synchronize()
        values = previous.host.tolist()
        for i, guide in enumerate(guides):
            if guide is not None:
                guide.defer(int(values[rows[i] if rows is not None else i]))
        flush_guides([g for g in guides if g is not None])
    live = [g if g is not None and g.rejected is None and not g.is_terminated else None
            for g in guides]
    bitmask = fill_bitmask(live, logits.shape[-1])
    if bitmask is not None:
        apply_bitmask(logits, bitmask)

"""Decode steps of the reference engine launched ahead of their tokens (overlap scheduling: see
tandem.engines.batching.ahead).

Launched steps run in order on one thread of their own. On CUDA a launch only queues work: the
inputs' copy, the graph replay (or eager kernels), the sampling kernels and the copy of the
tokens to pinned host memory, then an event; the step ahead's input ids are the previous step's
tokens, copied on the device. Collecting a step waits for its launch to end and then for its
event, on a second thread, so the loop applies a step's tokens while the next launch may still
run. On CPU the launch computes the step; collecting returns what it computed.

A step with guided requests needs the previous step's tokens on the host for its mask. On
CUDA the launch queues the whole step anyway, with a wait on a host flag before the mask's copy
up (`StepMasks`), and the mask thread fills the mask while the device computes: it waits for
the previous step's event, the grammars take its tokens, fill the mask in pinned memory and
write the flag. So the grammars' host work runs beside the launches rather than between them.
On the CPU the launch does all of it in order.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable

import torch

from tandem.engines.batching.ahead import Sampled, StepAhead
from tandem.engines.batching.request import BatchRequest
from tandem.engines.guided.matcher import Guide, apply_bitmask, bitmask_words, fill_bitmask
from tandem.engines.reference import host_flag
from tandem.engines.reference.sampler import Draws, SampleInput, Sampler
from tandem.engines.reference.step_inputs import StepInputs

#: Logits [rows, vocab] of a decode step's inputs, through a CUDA graph where one serves it.
DecodeLogits = Callable[[StepInputs], torch.Tensor]


class LaunchedStep(StepAhead):
    """One launched step: what its launch left on the device, read back by `sampled`."""

    def __init__(self, reqs: list[BatchRequest], steps: OverlapSteps, guided: bool) -> None:
        super().__init__(reqs)
        self._steps = steps
        #: A guided launch's end on the CPU, resolved on the loop (`host_done`); else None.
        self._loop = asyncio.get_running_loop()
        self._ended: asyncio.Future[None] | None = (
            self._loop.create_future() if guided and steps.masks is None else None)
        #: Set on the steps' thread by the launch: the draws (tokens still on the device), their
        #: values' copy on the host (complete once `event` is), or what the launch raised (or
        #: the mask thread, before the device passes the step's mask).
        self.draws: Draws | None = None
        self.host: torch.Tensor | None = None
        self.event: torch.cuda.Event | None = None
        self.error: BaseException | None = None
        #: Set when the launch ended (so are the fields above).
        self.launched = threading.Event()

    async def host_done(self) -> None:
        if self._ended is not None:
            await self._ended

    def end_launch(self) -> None:
        """On the steps' thread, when the launch ended (its fields are set)."""
        self.launched.set()
        if self._ended is not None:
            self._loop.call_soon_threadsafe(_resolve, self._ended)

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
            if self.error is not None:  # the mask thread's
                raise self.error
        return [(o.token_id, o.logprob)
                for o in Sampler.collect(self.draws, self.host.tolist())]


class OverlapSteps:
    """The thread that launched steps run on, in order, and the launch itself."""

    def __init__(self, sampler: Sampler, decode_logits: DecodeLogits,
                 device: torch.device) -> None:
        self.sampler = sampler
        self.decode_logits = decode_logits
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tandem-steps")
        self.collector = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tandem-collect")
        #: Guided steps' masks on CUDA, filled beside the launches; None on the CPU.
        self.masks = (StepMasks() if device.type == "cuda" and host_flag.available()
                      else None)

    def launch(self, reqs: list[BatchRequest], inputs: StepInputs, samples: list[SampleInput],
               after: StepAhead | None) -> LaunchedStep:
        """Queues a plain decode step; `after`: the step before it (a LaunchedStep), whose
        alive rows' tokens are this step's input ids, in order."""
        guides = [r.guide for r in reqs]
        step = LaunchedStep(reqs, self, any(guides))
        previous = after if isinstance(after, LaunchedStep) else None
        rows = after.alive_rows() if after is not None else None
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
            noise = None
            if guides is not None:
                # Everything the mask does not change is queued before the host waits for it.
                noise = self.sampler.noise(logits, samples)
                if self.masks is not None:
                    self.masks.queue(step, logits, guides, previous, rows)
                else:
                    _constrain(logits, guides, previous, rows)
            draws = self.sampler.launch(logits, samples, noise)
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
            step.end_launch()

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        if self.masks is not None:
            self.masks.close()
        self.collector.shutdown(wait=True)


def _take_previous(guides: list[Guide | None], previous: LaunchedStep | None,
                   rows: list[int] | None) -> None:
    """The grammars take the previous step's tokens (that step's `taken`), which are on the
    host once its event is: row i of this step is row rows[i] (or i) of that one."""
    if previous is None:
        return
    assert previous.host is not None
    if previous.event is not None:
        previous.event.synchronize()
    values = previous.host.tolist()
    for i, guide in enumerate(guides):
        if guide is not None:
            guide.defer(int(values[rows[i] if rows is not None else i]))


def _constrain(logits: torch.Tensor, guides: list[Guide | None], previous: LaunchedStep | None,
               rows: list[int] | None) -> None:
    """Masks what each guided row's grammar forbids next, once the grammars took the previous
    step's tokens. Rows whose grammar ended or refused that token are left unmasked: their
    requests finish when it is settled, and the row is dropped."""
    _take_previous(guides, previous, rows)
    bitmask = fill_bitmask(guides, logits.shape[-1])
    if bitmask is not None:
        apply_bitmask(logits, bitmask)


class StepMasks:
    """Guided steps' masks on CUDA, filled on a thread of their own while the device computes.

    The steps' thread queues, after a step's logits: a wait on the host flag for the step's
    value, the copy of the mask from pinned memory, and its application; then it hands the fill
    to the mask thread and goes on. The mask thread, in step order, waits for the previous
    step's tokens, has the grammars take them, fills the mask into the pinned buffer and
    writes the value (always, so the device never waits for ever; a fill that raised leaves
    its error on the step). One pinned buffer serves every step: a fill starts only once the
    device copied the buffer for the step before (that step's tokens come after the copy)."""

    def __init__(self) -> None:
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tandem-masks")
        self.flag = host_flag.HostFlag()
        self._host: torch.Tensor | None = None
        #: Recorded after the last copy out of `_host`.
        self._copied: torch.cuda.Event | None = None

    def queue(self, step: LaunchedStep, logits: torch.Tensor, guides: list[Guide | None],
              previous: LaunchedStep | None, rows: list[int] | None) -> None:
        """On the steps' thread: queues the step's mask behind its fill."""
        n, width = logits.shape[0], bitmask_words(logits.shape[-1])
        buffer = self._host
        if buffer is None or buffer.shape[0] < n or buffer.shape[1] != width:
            buffer = self._host = torch.empty((n, width), dtype=torch.int32, pin_memory=True)
        bitmask = buffer[:n]
        value = self.flag.next_value()
        self.flag.wait(value)
        try:
            self.executor.submit(self._fill, step, bitmask, logits.shape[-1], guides, previous,
                                 rows, self._copied, value)
        except BaseException:
            self.flag.set(value)  # no fill will write it: the device must not wait for ever
            raise
        on_device = bitmask.to(logits.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        apply_bitmask(logits, on_device)

    @torch.inference_mode()
    def _fill(self, step: LaunchedStep, bitmask: torch.Tensor, vocab_size: int,
              guides: list[Guide | None], previous: LaunchedStep | None,
              rows: list[int] | None, copied: torch.cuda.Event | None, value: int) -> None:
        try:
            if copied is not None:
                copied.synchronize()
            _take_previous(guides, previous, rows)
            fill_bitmask(guides, vocab_size, bitmask)
        except BaseException as exc:  # raised to the loop by `sampled`
            step.error = exc
        finally:
            self.flag.set(value)

    def close(self) -> None:
        self.executor.shutdown(wait=True)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # a loop that stopped waiting cancelled it
        future.set_result(None)

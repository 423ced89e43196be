"""tandem.runtime.tracing: off unless the OTEL_* variables ask for it (and then a no-op at every
call site), W3C propagation that nests the callee under the caller, and how spans end on errors,
cancellations and closed generators."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import INVALID_SPAN, SpanKind, StatusCode

from tandem.runtime import tracing


@pytest.mark.parametrize("environ,exporters", [
    ({}, []),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
    ({"OTEL_TRACES_EXPORTER": "otlp, console"}, ["otlp", "console"]),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, []),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, []),
])
def test_exporters_follow_the_standard_variables(environ: dict[str, str],
                                                 exporters: list[str]) -> None:
    assert tracing._exporters(environ) == exporters


def test_off_every_helper_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing, "_tracer", None)
    assert not tracing.setup("frontend", {})
    assert tracing.span("a") is tracing.span("b") is tracing.NOOP  # nothing allocated
    with tracing.span("a") as span:
        assert span is INVALID_SPAN
    assert tracing.inject(INVALID_SPAN) == []
    assert tracing.extract({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is None
    assert tracing.current_span() is INVALID_SPAN
    assert tracing.trace_id() is None


@pytest.fixture
def exported(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    yield exporter
    provider.shutdown()


def test_a_callee_continues_the_callers_trace(exported: InMemorySpanExporter) -> None:
    with tracing.span("request", SpanKind.SERVER) as request:
        with tracing.span("call", SpanKind.CLIENT, current=False) as call:
            metadata = tracing.inject(call)
        tracing.annotate({tracing.OUTPUT_TOKENS: 3})
        assert tracing.trace_id() == format(request.get_span_context().trace_id, "032x")
    assert [k for k, _ in metadata] == ["traceparent"]
    # The callee's process: its server span is a child of the client span.
    with tracing.span("serve", SpanKind.SERVER, parent=tracing.extract(metadata)):
        pass
    spans = {s.name: s for s in exported.get_finished_spans()}
    assert spans["call"].parent.span_id == request.get_span_context().span_id
    assert spans["serve"].parent.span_id == call.get_span_context().span_id
    assert spans["serve"].context.trace_id == spans["request"].context.trace_id
    assert spans["request"].attributes[tracing.OUTPUT_TOKENS] == 3


def test_record_makes_a_child_of_the_current_span(exported: InMemorySpanExporter) -> None:
    with tracing.span("generate") as parent:
        tracing.record("kv_transfer", 1_000, 5_000, {"tandem.kv.bytes": 64}, error="expired")
    transfer = next(s for s in exported.get_finished_spans() if s.name == "kv_transfer")
    assert transfer.parent.span_id == parent.get_span_context().span_id
    assert (transfer.start_time, transfer.end_time) == (1_000, 5_000)
    assert transfer.status.status_code == StatusCode.ERROR


async def test_errors_fail_a_span_but_cancellations_and_closes_do_not(
        exported: InMemorySpanExporter) -> None:
    with pytest.raises(ValueError), tracing.span("fails"):
        raise ValueError("bad input")

    async def stream() -> object:
        with tracing.span("stream", current=False):
            for i in range(10):
                yield i

    items = stream()
    await anext(items)
    await items.aclose()  # the consumer stopped reading

    async def slow() -> None:
        with tracing.span("cancelled"):
            await asyncio.sleep(10)

    task = asyncio.ensure_future(slow())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    spans = {s.name: s for s in exported.get_finished_spans()}
    assert spans["fails"].status.status_code == StatusCode.ERROR
    assert "bad input" in (spans["fails"].status.description or "")
    assert spans["stream"].status.status_code == StatusCode.UNSET
    assert spans["cancelled"].status.status_code == StatusCode.UNSET
    assert spans["cancelled"].attributes["tandem.cancelled"] is True

"""OpenTelemetry traces: one trace per request across frontend, router, encode, prefill and
decode, carried as W3C trace context (`traceparent`) in gRPC metadata and HTTP headers.

Off unless the standard OpenTelemetry variables ask for it (read once, by `setup`):

- `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`: export over OTLP/gRPC
  (the only OTLP protocol built in: `OTEL_EXPORTER_OTLP_PROTOCOL`, if set, must be `grpc`);
- `OTEL_TRACES_EXPORTER`: `otlp` and/or `console` (comma-separated); `none` turns tracing off;
- `OTEL_SDK_DISABLED=true` turns it off whatever else is set.

The SDK reads the rest itself: `OTEL_SERVICE_NAME` / `OTEL_RESOURCE_ATTRIBUTES` (default service
name `tandem-<service>`), `OTEL_TRACES_SAMPLER[_ARG]`, `OTEL_BSP_*` (batching),
`OTEL_EXPORTER_OTLP_*` (headers, TLS, timeout) and `OTEL_PROPAGATORS`.

Off, the SDK is not even imported and every helper returns at once (a shared no-op context, an
empty metadata list) without touching a context. The tracer is process-wide state, as
OpenTelemetry's own is; each span belongs to one request.
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode

from tandem.runtime import build_info

log = logging.getLogger(__name__)

#: GenAI semantic-convention attribute names (gen_ai.*), as Tandem sets them.
MODEL = "gen_ai.request.model"
OPERATION = "gen_ai.operation.name"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"

_tracer: trace.Tracer | None = None

Carrier = Mapping[str, str] | Iterable[tuple[str, str | bytes]]


def _exporters(environ: Mapping[str, str]) -> list[str]:
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",")
             if n.strip()]
    if "none" in names:
        return []
    if not names and (environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                      or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        names = ["otlp"]
    return names


def setup(service: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Turns tracing on for this process when the environment asks for it (see the module
    docstring); returns whether it is on. Call once, at start, before serving."""
    global _tracer
    names = _exporters(environ)
    if not names:
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    # build_info's version: a source checkout on PYTHONPATH (the GPU benchmarks) has no
    # installed metadata, and tracing must not keep a service from starting.
    version = build_info.version()
    resource = Resource.create({"service.version": version,
                                "tandem.service": service})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: f"tandem-{service}"}))
    provider = TracerProvider(resource=resource)  # sampler from OTEL_TRACES_SAMPLER
    for name in names:
        if name == "otlp":
            protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
            if protocol != "grpc":
                raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol}: Tandem exports "
                                 "OTLP over gRPC only (use the collector's gRPC port, 4317)")
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER: unsupported exporter '{name}' "
                             "(supported: otlp, console, none)")
    trace.set_tracer_provider(provider)
    _tracer = provider.get_tracer("tandem", version)
    log.info("tracing on", extra={"exporters": names,
                                  "service_name": resource.attributes.get(SERVICE_NAME)})
    return True


def is_enabled() -> bool:
    return _tracer is not None


def extract(carrier: Carrier) -> otel_context.Context | None:
    """The trace context in HTTP headers or gRPC metadata (None when tracing is off)."""
    if _tracer is None:
        return None
    if not isinstance(carrier, Mapping):
        carrier = {k: v for k, v in carrier if isinstance(v, str)}  # -bin values: not ours
    return propagate.extract(carrier)


def inject(span: Span) -> list[tuple[str, str]]:
    """gRPC metadata (`traceparent`, ...) that makes the callee's spans children of `span`;
    empty when tracing is off."""
    if _tracer is None or not span.get_span_context().is_valid:
        return []
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return list(carrier.items())


def span(name: str, kind: SpanKind = SpanKind.INTERNAL,
         attributes: Mapping[str, Any] | None = None, parent: otel_context.Context | None = None,
         current: bool = True) -> AbstractContextManager[Span]:
    """A span around a block: a child of `parent`, else of the current span. `current` makes it
    the current span inside the block (the parent of spans started there); keep it False in
    async generators, whose context is their consumer's. Errors end it with status ERROR; a
    cancellation only marks it `tandem.cancelled`, and a generator closed by its consumer ends
    it normally. Tracing off: a shared no-op context."""
    if _tracer is None:
        return NOOP
    return _span(_tracer, name, kind, attributes, parent, current)


#: The context every helper hands out while tracing is off (reusable: it holds no state).
NOOP: AbstractContextManager[Span] = nullcontext(INVALID_SPAN)


@contextmanager
def _span(tracer: trace.Tracer, name: str, kind: SpanKind, attributes: Mapping[str, Any] | None,
          parent: otel_context.Context | None, current: bool) -> Iterator[Span]:
    s = tracer.start_span(name, context=parent, kind=kind, attributes=attributes)
    token = otel_context.attach(trace.set_span_in_context(s)) if current else None
    try:
        yield s
    except GeneratorExit:
        raise  # the consumer stopped reading: not a failure of this span
    except asyncio.CancelledError:
        s.set_attribute("tandem.cancelled", True)
        raise
    except BaseException as exc:
        s.record_exception(exc)
        s.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        s.end()
        if token is not None:
            otel_context.detach(token)


def start_span(name: str, kind: SpanKind, attributes: Mapping[str, Any] | None,
               parent: otel_context.Context | None) -> Span:
    """A span the caller ends itself (span.end()), for work that outlives any one block: a
    request served inside a long-lived stream. Tracing off: the no-op span."""
    if _tracer is None:
        return INVALID_SPAN
    return _tracer.start_span(name, context=parent, kind=kind, attributes=attributes)


def in_span(s: Span) -> AbstractContextManager[Span]:
    """Makes `s` the current span inside a block, without ending it at the block's end."""
    if _tracer is None:
        return NOOP
    return trace.use_span(s, end_on_exit=False)


def current_span() -> Span:
    """The span of the request being served (a no-op span when tracing is off)."""
    if _tracer is None:
        return INVALID_SPAN
    return trace.get_current_span()


def trace_id() -> str | None:
    """The current trace's id (32 hex digits), for log lines; None when there is none."""
    if _tracer is None:
        return None
    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None


def annotate(attributes: Mapping[str, Any]) -> None:
    """Adds attributes to the current span; nothing when tracing is off."""
    if _tracer is not None:
        trace.get_current_span().set_attributes(attributes)


def record(name: str, start_ns: int, end_ns: int, attributes: Mapping[str, Any],
           error: str | None = None) -> None:
    """A span for work already done (start and end known), as a child of the current span."""
    if _tracer is None:
        return
    s = _tracer.start_span(name, attributes=attributes, start_time=start_ns)
    if error is not None:
        s.set_status(Status(StatusCode.ERROR, error))
    s.end(end_time=end_ns)

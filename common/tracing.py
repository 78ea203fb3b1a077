"""Tracing across the request's path: one trace per request, from the coordinator through
the prefill worker, the KV pull and the decode worker (OpenTelemetry, W3C `traceparent` in
gRPC metadata; a caller's own `traceparent` is honoured, so our spans join its trace).

Configured by the standard variables: export over OTLP/gRPC turns on when
`OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) is set; `OTEL_SERVICE_NAME` and
`OTEL_TRACES_SAMPLER` work as everywhere. With nothing set, the API's no-op tracer stays in
place: spans are not recorded and cost a few attribute lookups per request."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from opentelemetry import propagate, trace
from opentelemetry.context import Context

if TYPE_CHECKING:
    from pdserve.common.request import Request

_provider = None

# Engine timestamps are time.monotonic(); spans want epoch nanoseconds.
_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def setup_tracing(service_name: str) -> bool:
    """Export spans over OTLP if the environment asks for it; returns whether it does."""
    global _provider
    if not (
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    _provider = TracerProvider(resource=Resource.create({"service.name": name}))
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(_provider)
    return True


def shutdown_tracing() -> None:
    """Send what is buffered (on a clean stop)."""
    if _provider is not None:
        _provider.shutdown()


def tracer() -> trace.Tracer:
    return trace.get_tracer("pdserve")


def context_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The trace context a caller sent in its gRPC metadata (empty if none)."""
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier)


def metadata_for_call(span: trace.Span) -> Sequence[tuple[str, str]]:
    """gRPC metadata carrying `span` to the next service as its parent."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items())


def epoch_ns(monotonic_s: float) -> int:
    """An engine timestamp (time.monotonic()) as a span time."""
    return _EPOCH_OFFSET_NS + int(monotonic_s * 1e9)


def record_phases(span: trace.Span, request: Request) -> None:
    """Child spans of `span` for where an engine's time went on this request: waiting for a
    batch slot, then computing (prefill and any decode steps) until its last token."""
    if not span.is_recording() or request.scheduled_time is None:
        return
    parent = trace.set_span_in_context(span)
    end = request.finish_time or time.monotonic()
    for name, start, stop in (
        ("pdserve.queue", request.arrival_time, request.scheduled_time),
        ("pdserve.compute", request.scheduled_time, end),
    ):
        child = tracer().start_span(name, context=parent, start_time=epoch_ns(start))
        child.end(end_time=epoch_ns(stop))

"""Tracing across the request's path: one trace per request, from the coordinator through
the prefill worker, the KV pull and the decode worker (OpenTelemetry, W3C `traceparent` in
gRPC metadata; a caller's own `traceparent` is honoured, so our spans join its trace).

Configured by the standard variables: export over OTLP/gRPC turns on when
`OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) is set; `OTEL_SERVICE_NAME` and
`OTEL_TRACES_SAMPLER` work as everywhere. With nothing set, the API's no-op tracer stays in
place: spans are not recorded; what is left (mostly carrying a caller's `traceparent` on)
costs tens of microseconds per request (`benchmarks/tracing_overhead.py`).

The OpenTelemetry GenAI server metrics (`gen_ai.server.time_to_first_token`,
`gen_ai.server.time_per_output_token`, `gen_ai.server.request.duration`) go over OTLP/gRPC
the same way when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._METRICS_ENDPOINT`) is set, every
`OTEL_METRIC_EXPORT_INTERVAL` ms; with nothing set there is no meter provider and nothing is
recorded. `OTEL_TRACES_EXPORTER=none` / `OTEL_METRICS_EXPORTER=none` turn either off."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry import propagate, trace
from opentelemetry.context import Context

if TYPE_CHECKING:
    from opentelemetry.metrics import Histogram, Meter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    from pdserve.common.request import Request

_provider: TracerProvider | None = None
_meter_provider: MeterProvider | None = None

# Engine timestamps are time.monotonic(); spans want epoch nanoseconds.
_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()


@dataclass(frozen=True)
class GenAiServerMetrics:
    """The OpenTelemetry GenAI server histograms (seconds), with the conventions' buckets."""

    time_to_first_token: Histogram
    time_per_output_token: Histogram
    request_duration: Histogram


_genai: GenAiServerMetrics | None = None

# The bucket boundaries the GenAI semantic conventions advise for each histogram.
_GENAI_HISTOGRAMS = {
    "time_to_first_token": ("gen_ai.server.time_to_first_token",
        "Time to generate the first token for successful responses",
        (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0)),
    "time_per_output_token": ("gen_ai.server.time_per_output_token",
        "Time per output token generated after the first token for successful responses",
        (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)),
    "request_duration": ("gen_ai.server.request.duration",
        "Generative AI server request duration such as time-to-last byte or last output token",
        (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96,
         81.92)),
}  # fmt: skip


def _wants(kind: str) -> bool:
    """Whether the environment asks for OTLP export of `kind` (TRACES or METRICS)."""
    if os.environ.get(f"OTEL_{kind}_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get(f"OTEL_EXPORTER_OTLP_{kind}_ENDPOINT")
    )


def setup_tracing(service_name: str) -> bool:
    """Export spans, and the GenAI server metrics, over OTLP if the environment asks for
    them; returns whether spans are exported."""
    global _provider
    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    if _wants("METRICS"):
        _setup_metrics(name)
    if not _wants("TRACES"):
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    _provider = TracerProvider(resource=Resource.create({"service.name": name}))
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(_provider)
    return True


def _setup_metrics(name: str) -> None:
    global _genai, _meter_provider
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource

    reader = PeriodicExportingMetricReader(OTLPMetricExporter())
    _meter_provider = MeterProvider(
        metric_readers=[reader], resource=Resource.create({"service.name": name})
    )
    _genai = genai_histograms(_meter_provider.get_meter("pdserve"))


def genai_histograms(meter: Meter) -> GenAiServerMetrics:
    """The GenAI server histograms on `meter`."""
    return GenAiServerMetrics(**{
        field: meter.create_histogram(
            metric, unit="s", description=text, explicit_bucket_boundaries_advisory=buckets
        )
        for field, (metric, text, buckets) in _GENAI_HISTOGRAMS.items()
    })  # fmt: skip


def genai_server_metrics() -> GenAiServerMetrics | None:
    """The GenAI server histograms, or None when metrics are not exported (record nothing)."""
    return _genai


def shutdown_tracing() -> None:
    """Send what is buffered (on a clean stop)."""
    if _provider is not None:
        _provider.shutdown()
    if _meter_provider is not None:
        _meter_provider.shutdown()


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

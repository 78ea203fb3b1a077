"""The OpenTelemetry GenAI server metrics of the coordinator: recorded from the same times as
its Prometheus histograms and the root span's TTFT / TPOT when OTLP metrics export is on, and
not at all when it is off (no meter provider, nothing recorded)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import REGISTRY

from pdserve.common import tracing
from pdserve.services.coordinator.metrics import RequestTimer

LABELS = {"model": "genai-test-model", "role": "coordinator", "worker": "genai-test"}


@pytest.fixture
def reader(monkeypatch: pytest.MonkeyPatch) -> InMemoryMetricReader:
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    monkeypatch.setattr(tracing, "_genai", tracing.genai_histograms(meter))
    return reader


def _points(reader: InMemoryMetricReader) -> dict[str, list]:
    data = reader.get_metrics_data()
    out: dict[str, list] = {}
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                assert metric.unit == "s"
                out[metric.name] = list(metric.data.data_points)
    return out


def _timer(operation: str) -> RequestTimer:
    span = (
        TracerProvider()
        .get_tracer("test")
        .start_span("pdserve.generate", attributes={"gen_ai.operation.name": operation})
    )
    return RequestTimer(LABELS, span)


def _prom_sum(name: str) -> float:
    return REGISTRY.get_sample_value(f"{name}_sum", LABELS) or 0.0


def test_a_finished_request_records_ttft_tpot_and_duration(reader) -> None:
    ttft_before = _prom_sum("pdserve_time_to_first_token_seconds")
    tpot_before = _prom_sum("pdserve_request_time_per_output_token_seconds")
    timer = _timer("chat")
    for _ in range(4):
        timer.on_tokens(1)
    span = timer.span
    timer.finished("stop", prompt_tokens=10, cached_tokens=0)
    points = _points(reader)
    (ttft,) = points["gen_ai.server.time_to_first_token"]
    (tpot,) = points["gen_ai.server.time_per_output_token"]
    (duration,) = points["gen_ai.server.request.duration"]
    for point in (ttft, tpot, duration):
        assert point.count == 1
        assert dict(point.attributes) == {
            "gen_ai.request.model": "genai-test-model",
            "gen_ai.operation.name": "chat",
        }
    # the same numbers as the Prometheus histograms and the root span
    assert ttft.sum == pytest.approx(_prom_sum("pdserve_time_to_first_token_seconds") - ttft_before)
    assert ttft.sum == pytest.approx(span.attributes["pdserve.ttft_s"])
    assert tpot.sum == pytest.approx(span.attributes["pdserve.tpot_s"])
    assert tpot.sum == pytest.approx(
        _prom_sum("pdserve_request_time_per_output_token_seconds") - tpot_before
    )
    assert duration.sum >= ttft.sum
    assert tuple(ttft.explicit_bounds[:3]) == (0.001, 0.005, 0.01)  # the conventions' buckets


def test_a_failed_request_records_its_duration_with_the_error_type(reader) -> None:
    _timer("text_completion").failed("unavailable", "prefill worker gone")
    points = _points(reader)
    assert "gen_ai.server.time_to_first_token" not in points
    (duration,) = points["gen_ai.server.request.duration"]
    assert duration.count == 1
    assert duration.attributes["error.type"] == "unavailable"


def test_nothing_is_set_up_or_recorded_without_an_endpoint(monkeypatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tracing, "_genai", None)
    assert tracing.setup_tracing("pdserve-test") is False
    assert tracing.genai_server_metrics() is None
    timer = RequestTimer(LABELS)
    timer.on_tokens(2)
    timer.finished("length", prompt_tokens=3, cached_tokens=0)  # records nothing, raises nothing


def test_none_exporters_turn_export_off(monkeypatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    monkeypatch.setattr(tracing, "_genai", None)
    assert tracing.setup_tracing("pdserve-test") is False
    assert tracing.genai_server_metrics() is None

"""One trace per request across real processes: the coordinator, the prefill worker, the KV
pull and the decode worker export over real OTLP/gRPC (configured only by the standard
`OTEL_*` variables) to a collector run by this test, and every span joins the caller's own
trace, passed in as a W3C `traceparent`. The coordinator's GenAI server metrics reach the
same collector, and the trace's TTFT is the one its histograms recorded."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from pdserve.v1 import generate_pb2, generate_pb2_grpc
from services import running

pytestmark = pytest.mark.slow

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []  # (service name, span)
        self.lock = threading.Lock()
        self.metrics = MetricsCollector()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(
                    a.value.string_value
                    for a in resource_spans.resource.attributes
                    if a.key == "service.name"
                )
                for scope in resource_spans.scope_spans:
                    self.spans += [(service, s) for s in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


class MetricsCollector(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self) -> None:
        self.metrics: list[tuple[str, object]] = []  # (service name, metric), oldest first
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_metrics in request.resource_metrics:
                service = next(
                    a.value.string_value
                    for a in resource_metrics.resource.attributes
                    if a.key == "service.name"
                )
                for scope in resource_metrics.scope_metrics:
                    self.metrics += [(service, m) for m in scope.metrics]
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def latest(self, service: str, name: str):
        """The newest export of one metric from one service (cumulative), or None."""
        with self.lock:
            found = [m for s, m in self.metrics if s == service and m.name == name]
        return found[-1] if found else None


@pytest.fixture(scope="module")
def collector():
    server = grpc.server(futures.ThreadPoolExecutor(4))
    sink = Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(sink.metrics, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield sink, f"http://127.0.0.1:{port}"
    server.stop(0)


def _attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        value = a.value
        kind = value.WhichOneof("value")
        out[a.key] = (
            [v.string_value for v in value.array_value.values] if kind == "array_value"
            else getattr(value, kind)
        )  # fmt: skip
    return out


def test_one_trace_across_every_service(collector):
    sink, endpoint = collector
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
           "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_METRIC_EXPORT_INTERVAL": "200"}  # fmt: skip
    worker = ["--kv-cache-tokens", "4096", "--threads", "1"]
    with (
        running("prefill", *worker, env=env) as prefill,
        running("decode", *worker, env=env) as decode,
        running("coordinator", "--prefill-workers", prefill.grpc,
                "--decode-workers", decode.grpc, env=env) as coordinator,
        grpc.insecure_channel(coordinator.grpc) as channel,
    ):  # fmt: skip
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        request = generate_pb2.GenerateRequest(
            prompt=" ".join(["The quick brown fox jumps over the lazy dog."] * 6),
            sampling=generate_pb2.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
        )
        traceparent = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
        responses = list(stub.Generate(request, metadata=[("traceparent", traceparent)]))
        assert responses[-1].finish_reason == "length"
        wanted = {"pdserve.generate", "pdserve.prefill", "pdserve.kv_send", "pdserve.decode",
                  "pdserve.kv_transfer", "pdserve.queue", "pdserve.compute"}  # fmt: skip
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with sink.lock:
                names = {s.name for _, s in sink.spans}
                computes = sum(1 for _, s in sink.spans if s.name == "pdserve.compute")
            if wanted <= names and computes >= 2:  # prefill's and decode's
                break
            time.sleep(0.2)
        prometheus_ttft = coordinator.metric("pdserve_time_to_first_token_seconds_sum")
        genai = {}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            genai = {
                name: sink.metrics.latest("pdserve-coordinator", f"gen_ai.server.{name}")
                for name in ("time_to_first_token", "time_per_output_token", "request.duration")
            }
            if all(m is not None and m.histogram.data_points for m in genai.values()):
                break
            time.sleep(0.2)

    with sink.lock:
        spans = list(sink.spans)
    assert wanted <= {s.name for _, s in spans}
    assert {s.trace_id.hex() for _, s in spans} == {CALLER_TRACE}  # one trace: the caller's
    by_name = {s.name: (service, s) for service, s in spans}
    service, root = by_name["pdserve.generate"]
    assert service == "pdserve-coordinator" and root.parent_span_id.hex() == CALLER_SPAN
    attrs = _attrs(root)
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.max_tokens"] == 5
    assert attrs["gen_ai.usage.output_tokens"] == 5
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert attrs["gen_ai.usage.input_tokens"] >= 50
    assert attrs["pdserve.ttft_s"] > 0 and attrs["pdserve.tpot_s"] > 0
    assert {"pdserve.prefill_worker", "pdserve.decode_worker"} <= attrs.keys()
    assert by_name["pdserve.prefill"][0] == "pdserve-prefill"
    assert by_name["pdserve.prefill"][1].parent_span_id == root.span_id
    assert by_name["pdserve.decode"][0] == "pdserve-decode"
    assert by_name["pdserve.decode"][1].parent_span_id == root.span_id
    transfer = by_name["pdserve.kv_transfer"][1]
    assert transfer.parent_span_id == by_name["pdserve.decode"][1].span_id
    # a fresh decode cache: every block of the prompt was pulled
    assert _attrs(transfer)["pdserve.kv.blocks"] == -(-attrs["gen_ai.usage.input_tokens"] // 16)
    assert _attrs(transfer)["pdserve.kv.bytes"] > 0
    send = by_name["pdserve.kv_send"]
    assert send[0] == "pdserve-prefill" and send[1].parent_span_id == transfer.span_id

    # One request on a fresh coordinator: its histograms hold exactly the trace's TTFT / TPOT.
    assert prometheus_ttft == pytest.approx(attrs["pdserve.ttft_s"], rel=1e-6)
    for name, metric in genai.items():
        assert metric is not None, f"gen_ai.server.{name} was not exported"
        assert metric.unit == "s"
        (point,) = metric.histogram.data_points
        assert point.count == 1
        labels = {a.key: a.value.string_value for a in point.attributes}
        assert labels["gen_ai.operation.name"] == "text_completion"
        assert labels["gen_ai.request.model"]
    ttft = genai["time_to_first_token"].histogram.data_points[0].sum
    assert ttft == pytest.approx(attrs["pdserve.ttft_s"], rel=1e-6)
    tpot = genai["time_per_output_token"].histogram.data_points[0].sum
    assert tpot == pytest.approx(attrs["pdserve.tpot_s"], rel=1e-6)
    assert genai["request.duration"].histogram.data_points[0].sum > ttft

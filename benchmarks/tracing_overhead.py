"""What tracing costs a request, off and on; prints one JSON object.

1. `per_request_us`: the tracing calls one disaggregated request makes across the three
   services (the root span from the caller's `traceparent`, the metadata for two calls,
   prefill's and decode's spans with their queue / compute / KV transfer children, the KV
   send span: eight spans in all), timed in a loop in this process. "off" is what runs with
   no OTEL_* variable set (the API's no-op tracer); "on" is the SDK with its batch processor
   and an exporter that drops the spans (the export itself happens off the request's path).
2. `end_to_end`: two real systems (coordinator + prefill + decode each) side by side, one
   with nothing set and one exporting spans and metrics over OTLP to a collector in this
   process; requests alternate between them one at a time, so both see the same machine
   load. Client-side TTFT and e2e medians, and the median of the paired differences.

The offline engine (`benchmarks/offline.py`) has no tracing in its path, so it cannot show
a cost; this measures the serving path, where the spans are."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from types import SimpleNamespace
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind

from pdserve.common.tracing import context_from_metadata, metadata_for_call, record_phases
from pdserve.common.tracing import tracer as pdserve_tracer

TRACEPARENT = (("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def one_request() -> None:
    """The tracing calls of one request on the coordinator, prefill and decode workers."""
    tr = pdserve_tracer()
    root = tr.start_span(
        "pdserve.generate", context=context_from_metadata(TRACEPARENT), kind=SpanKind.SERVER,
        attributes={"gen_ai.operation.name": "chat", "gen_ai.request.model": "m",
                    "gen_ai.request.max_tokens": 128, "gen_ai.request.temperature": 0.0},
    )  # fmt: skip
    root.set_attribute("pdserve.request_id", "r-1")
    now = time.monotonic()
    phases = SimpleNamespace(arrival_time=now - 0.3, scheduled_time=now - 0.2, finish_time=now)
    # prefill
    prefill = tr.start_span(
        "pdserve.prefill", context=context_from_metadata(metadata_for_call(root))
    )
    prefill.set_attributes({"gen_ai.usage.input_tokens": 256, "pdserve.cached_tokens": 0})
    record_phases(prefill, phases)  # type: ignore[arg-type]
    prefill.end()
    root.set_attribute("pdserve.prefill_worker", "10.0.0.1:50061")
    # decode, its KV pull and the send on prefill
    decode = tr.start_span("pdserve.decode", context=context_from_metadata(metadata_for_call(root)))
    transfer = tr.start_span("pdserve.kv_transfer", context=trace.set_span_in_context(decode))
    kv = {"pdserve.kv.blocks": 16, "pdserve.kv.bytes": 5_898_240, "pdserve.kv.transport": "ucx"}
    transfer.set_attributes(kv)
    send = tr.start_span(
        "pdserve.kv_send", context=context_from_metadata(metadata_for_call(transfer))
    )
    send.end()
    transfer.end()
    record_phases(decode, phases)  # type: ignore[arg-type]
    decode.end()
    root.set_attributes({"gen_ai.usage.input_tokens": 256, "gen_ai.usage.output_tokens": 128,
                         "gen_ai.response.finish_reasons": ["length"], "pdserve.ttft_s": 0.2,
                         "pdserve.tpot_s": 0.05, "pdserve.cached_tokens": 0,
                         "pdserve.decode_worker": "10.0.0.2:50071"})  # fmt: skip
    root.end()


class Discard(SpanExporter):
    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        self.spans += len(spans)
        return SpanExportResult.SUCCESS


def per_request_us(n: int, repeats: int) -> dict[str, Any]:
    """Best-of-`repeats` mean time of one request's tracing calls, off then on."""

    def best() -> float:
        for _ in range(n // 10):  # warm up
            one_request()
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(n):
                one_request()
            runs.append((time.perf_counter() - start) / n * 1e6)
        return min(runs)

    off = best()
    assert not pdserve_tracer().start_span("x").is_recording(), "a tracer provider is already set"
    exporter = Discard()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=1 << 16))
    trace.set_tracer_provider(provider)
    on = best()
    provider.shutdown()
    return {"off": round(off, 1), "on_sdk_batch_export": round(on, 1),
            "spans_exported_while_on": exporter.spans, "requests_per_run": n}  # fmt: skip


class Sink(
    trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer
):
    """An OTLP/gRPC collector that counts what it receives."""

    def __init__(self) -> None:
        self.spans = 0
        self.metric_exports = 0
        self.lock = threading.Lock()

    def Export(self, request, context):  # both services call it Export
        with self.lock:
            if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
                self.spans += sum(
                    len(s.spans) for rs in request.resource_spans for s in rs.scope_spans
                )
                return trace_service_pb2.ExportTraceServiceResponse()
            self.metric_exports += 1
            return metrics_service_pb2.ExportMetricsServiceResponse()


def end_to_end(requests: int, max_tokens: int) -> dict[str, Any]:
    from pdserve.services.launcher import ServiceChild
    from pdserve.v1 import generate_pb2, generate_pb2_grpc

    sink = Sink()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_EXPORTER_OTLP_INSECURE": "true"}  # fmt: skip
    children: list[ServiceChild] = []

    def start(role: str, args: list[str], env: dict[str, str]) -> str:
        child = ServiceChild(role, ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
                                    *args], env)  # fmt: skip
        children.append(child)
        return child.wait_listening(300)["grpc"]

    worker = ["--kv-cache-tokens", "8192", "--threads", "1"]
    try:
        coordinators = {}
        for name, env in (("off", {}), ("on", otel)):
            prefill = start("prefill", worker, env)
            decode = start("decode", worker, env)
            coordinators[name] = start(
                "coordinator", ["--prefill-workers", prefill, "--decode-workers", decode], env
            )
        log(f"end to end: {requests} requests per system, alternating")
        times: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
        channels = {k: grpc.insecure_channel(a) for k, a in coordinators.items()}
        stubs = {k: generate_pb2_grpc.GenerateServiceStub(c) for k, c in channels.items()}
        for i in range(-2, requests):  # two warm-up rounds
            for name in ("off", "on") if i % 2 else ("on", "off"):
                request = generate_pb2.GenerateRequest(
                    prompt=f"Request {i}: tell me about the history of the number {i * 7}.",
                    sampling=generate_pb2.SamplingParams(
                        max_tokens=max_tokens, temperature=0, ignore_eos=True
                    ),
                )
                start_s = time.perf_counter()
                first = None
                for response in stubs[name].Generate(request, timeout=120):
                    if first is None and response.token_ids:
                        first = time.perf_counter() - start_s
                if i >= 0:
                    times[name].append((first or 0.0, time.perf_counter() - start_s))
        for channel in channels.values():
            channel.close()
    finally:
        for child in children:
            child.proc.terminate()
        for child in children:
            try:
                child.proc.wait(30)
            except Exception:
                child.proc.kill()
        server.stop(0)

    def ms(values: list[float]) -> float:
        return round(statistics.median(values) * 1e3, 2)

    out: dict[str, Any] = {"requests_per_system": requests, "max_tokens": max_tokens}
    for name, pairs in times.items():
        out[f"ttft_ms_median_{name}"] = ms([t for t, _ in pairs])
        out[f"e2e_ms_median_{name}"] = ms([e for _, e in pairs])
    for i, name in ((0, "ttft"), (1, "e2e")):  # on minus off, request by request
        diffs = [on[i] - off[i] for on, off in zip(times["on"], times["off"], strict=True)]
        quartiles = statistics.quantiles(diffs, n=4)
        out[f"{name}_ms_paired_difference_median"] = ms(diffs)
        out[f"{name}_ms_paired_difference_iqr"] = [round(quartiles[0] * 1e3, 2),
                                                   round(quartiles[2] * 1e3, 2)]  # fmt: skip
    out["spans_received_from_on"] = sink.spans
    out["metric_exports_received_from_on"] = sink.metric_exports
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loop", type=int, default=2000, help="requests per timed loop")
    parser.add_argument("--repeats", type=int, default=5, help="timed loops (best is kept)")
    parser.add_argument("--requests", type=int, default=30, help="end-to-end requests each")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--no-end-to-end", action="store_true", help="only the timed loop")
    args = parser.parse_args()
    result: dict[str, Any] = {"per_request_us": per_request_us(args.loop, args.repeats)}
    log(f"per request: {result['per_request_us']}")
    if not args.no_end_to_end:
        result["end_to_end"] = end_to_end(args.requests, args.max_tokens)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

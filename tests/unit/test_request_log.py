"""The coordinator's per-request record: one JSON line when a request ends, carrying its
trace id (so a log line leads to its trace), timings and token counts."""

from __future__ import annotations

import json
import logging

from opentelemetry.sdk.trace import TracerProvider

from pdserve.services.coordinator.metrics import RequestTimer

LABELS = {"model": "m", "role": "coordinator", "worker": "test"}


def _timer() -> RequestTimer:
    span = TracerProvider().get_tracer("test").start_span("pdserve.generate")
    timer = RequestTimer(LABELS, span)
    timer.request_id = "r-1"
    return timer


def _records(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "pdserve.requests"]


def test_finished_request_logs_one_json_line(caplog):
    caplog.set_level(logging.INFO, logger="pdserve.requests")
    timer = _timer()
    for _ in range(3):
        timer.on_tokens(1)
    timer.finished("length", prompt_tokens=12, cached_tokens=4)
    (record,) = _records(caplog)
    assert record["request_id"] == "r-1" and record["finish_reason"] == "length"
    assert record["trace_id"] == f"{timer.span.get_span_context().trace_id:032x}"
    assert (record["prompt_tokens"], record["cached_tokens"], record["completion_tokens"]) == (
        12, 4, 3,
    )  # fmt: skip
    assert 0 <= record["ttft_s"] <= record["e2e_s"] and record["tpot_s"] >= 0
    assert not timer.span.is_recording()  # ended with the request


def test_failed_request_logs_its_cause(caplog):
    caplog.set_level(logging.INFO, logger="pdserve.requests")
    timer = _timer()
    timer.failed("unavailable", "decode worker 10.0.0.7:50071: gone")
    (record,) = _records(caplog)
    assert record["error"] == "unavailable" and "10.0.0.7" in record["message"]
    assert record["ttft_s"] is None and record["completion_tokens"] == 0

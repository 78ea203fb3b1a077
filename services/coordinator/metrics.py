"""The coordinator's request metrics: latency as the client sees it, end to end (TTFT here
includes routing, queueing and prefill; TPOT includes the KV handoff and decode). vLLM's
names and buckets with a `pdserve_` prefix; the buckets span GPU and CPU speeds. The same
times go to the OpenTelemetry GenAI server histograms when OTLP metrics export is on
(`common/tracing.py`)."""

from __future__ import annotations

import json
import logging
import time

from opentelemetry.trace import Span, Status, StatusCode
from prometheus_client import Counter, Histogram

from pdserve.common.tracing import genai_server_metrics

LABELS = ("model", "role", "worker")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

TTFT = Histogram("pdserve_time_to_first_token_seconds",
                 "Request arrival at the coordinator to its first token sent", LABELS,
                 buckets=TTFT_BUCKETS)  # fmt: skip
ITL = Histogram("pdserve_inter_token_latency_seconds",
                "Time between two responses carrying tokens, per token", LABELS,
                buckets=ITL_BUCKETS)  # fmt: skip
TPOT = Histogram("pdserve_request_time_per_output_token_seconds",
                 "Per request: (last token - first token) / (output tokens - 1)", LABELS,
                 buckets=ITL_BUCKETS)  # fmt: skip
E2E = Histogram("pdserve_e2e_request_latency_seconds", "Request arrival to its last response",
                LABELS, buckets=E2E_BUCKETS)  # fmt: skip
KV_HANDOFF = Histogram(
    "pdserve_kv_handoff_seconds",
    "First token sent to the client -> the request running on decode (admission, KV pull)",
    LABELS,
    buckets=ITL_BUCKETS,
)
HANDOFF_RETRIES = Counter(
    "pdserve_kv_handoff_retries",
    "Handoffs a decode worker refused as busy (its admission queue full) and the coordinator "
    "tried again, the prefill lease still holding the blocks",
    LABELS,
)
MIGRATIONS = Counter(
    "pdserve_kv_migrations",
    "Streams a draining decode worker handed over with their KV, by outcome: migrated (going "
    "on on another decode worker from the pulled KV), kept (no other decode worker: the "
    "draining one took it back and finished it) or recomputed (the move failed: a new leg "
    "prefilled the prompt and the tokens sent, as after a lost worker)",
    (*LABELS, "outcome"),
)
PROMPT_TOKENS = Counter("pdserve_prompt_tokens", "Prompt tokens of finished requests", LABELS)
GENERATION_TOKENS = Counter("pdserve_generation_tokens", "Tokens generated", LABELS)
SUCCESS = Counter("pdserve_request_success", "Finished requests, by finish reason",
                  (*LABELS, "finished_reason"))  # fmt: skip
FAILURE = Counter("pdserve_request_failure", "Requests that ended in an error, by cause",
                  (*LABELS, "cause"))  # fmt: skip
HTTP_TOO_LARGE = Counter(
    "pdserve_http_request_too_large",
    "HTTP requests answered 413: a body over the limit, by its Content-Length or once the "
    "bytes read passed it (nothing else of them is done)",
    LABELS,
)


REQUEST_LOG = logging.getLogger("pdserve.requests")


class RequestTimer:
    """Follows one request through the coordinator and records it when it ends: in the
    metrics, and on the request's root span (which it ends)."""

    def __init__(self, labels: dict[str, str], span: Span | None = None) -> None:
        self.labels = labels
        self.span = span
        self.request_id = ""
        self.start = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0

    def on_tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
            TTFT.labels(**self.labels).observe(now - self.start)
            if (genai := genai_server_metrics()) is not None:
                genai.time_to_first_token.record(now - self.start, self._genai_attributes())
        elif self.last is not None:
            gap = (now - self.last) / n
            for _ in range(n):
                ITL.labels(**self.labels).observe(gap)
        self.last = now
        self.tokens += n

    def handed_off(self) -> None:
        """Decode reports the request running (its blocks pulled)."""
        if self.first is not None:
            KV_HANDOFF.labels(**self.labels).observe(time.monotonic() - self.first)

    def handoff_retried(self, reason: str) -> None:
        HANDOFF_RETRIES.labels(**self.labels).inc()
        if self.span is not None:
            self.span.add_event("pdserve.handoff_retry", {"reason": reason})

    def migrated(self, outcome: str, reason: str = "") -> None:
        """A draining decode worker handed the stream over: `outcome` as `MIGRATIONS`."""
        MIGRATIONS.labels(**self.labels, outcome=outcome).inc()
        if self.span is not None:
            self.span.add_event("pdserve.migration", {"outcome": outcome, "reason": reason})

    def finished(self, reason: str, prompt_tokens: int, cached_tokens: int) -> None:
        now = time.monotonic()
        E2E.labels(**self.labels).observe(now - self.start)
        tpot = None
        if self.first is not None and self.last is not None and self.tokens > 1:
            tpot = (self.last - self.first) / (self.tokens - 1)
            TPOT.labels(**self.labels).observe(tpot)
        if (genai := genai_server_metrics()) is not None:
            attributes = self._genai_attributes()
            genai.request_duration.record(now - self.start, attributes)
            if tpot is not None:
                genai.time_per_output_token.record(tpot, attributes)
        PROMPT_TOKENS.labels(**self.labels).inc(prompt_tokens)
        GENERATION_TOKENS.labels(**self.labels).inc(self.tokens)
        SUCCESS.labels(**self.labels, finished_reason=reason).inc()
        self._log(finish_reason=reason, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                  tpot_s=None if tpot is None else round(tpot, 6))  # fmt: skip
        if self.span is not None:
            self.span.set_attributes({
                "gen_ai.usage.input_tokens": prompt_tokens,
                "gen_ai.usage.output_tokens": self.tokens,
                "gen_ai.response.finish_reasons": [reason],
                "pdserve.cached_tokens": cached_tokens,
                "pdserve.ttft_s": (self.first - self.start) if self.first is not None else -1.0,
                "pdserve.tpot_s": tpot if tpot is not None else -1.0,
            })  # fmt: skip
            self.span.end()

    def failed(self, cause: str, message: str = "") -> None:
        GENERATION_TOKENS.labels(**self.labels).inc(self.tokens)
        FAILURE.labels(**self.labels, cause=cause).inc()
        if (genai := genai_server_metrics()) is not None:
            duration = time.monotonic() - self.start
            genai.request_duration.record(duration, self._genai_attributes(error=cause))
        self._log(error=cause, message=message)
        if self.span is not None:
            self.span.set_attribute("gen_ai.usage.output_tokens", self.tokens)
            self.span.set_attribute("error.type", cause)
            self.span.set_status(Status(StatusCode.ERROR, message or cause))
            self.span.end()

    def _genai_attributes(self, error: str | None = None) -> dict[str, str]:
        """The GenAI metric attributes: the model, the operation when the root span recorded
        it (tracing on), `error.type` for a failed request."""
        attributes = {"gen_ai.request.model": self.labels.get("model", "")}
        recorded = getattr(self.span, "attributes", None) or {}  # an SDK span keeps them
        if operation := recorded.get("gen_ai.operation.name"):
            attributes["gen_ai.operation.name"] = str(operation)
        if error is not None:
            attributes["error.type"] = error
        return attributes

    def _log(self, **fields: object) -> None:
        """One JSON line per finished request (logger `pdserve.requests`)."""
        if not REQUEST_LOG.isEnabledFor(logging.INFO):
            return
        context = self.span.get_span_context() if self.span is not None else None
        record = {
            "event": "request",
            "request_id": self.request_id,
            "trace_id": f"{context.trace_id:032x}" if context and context.is_valid else None,
            "e2e_s": round(time.monotonic() - self.start, 6),
            "ttft_s": None if self.first is None else round(self.first - self.start, 6),
            "completion_tokens": self.tokens,
            **fields,
        }
        REQUEST_LOG.info(json.dumps(record))

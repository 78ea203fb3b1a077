"""Fuzzes the coordinator's OpenAI-compatible HTTP API with schemathesis, from the OpenAPI
schema the running coordinator serves (`/openapi.json`, FastAPI's), against a real colocated
worker and the default model, because this port faces clients: no request, valid or not,
may get a 5xx, drop the connection, hang, leak a KV block or stop the service.

Phases: coverage (schemathesis's deterministic boundary and type-violating cases, plus
unsupported methods), fuzzing in positive mode (schema-valid bodies) and in negative mode
(mutated, schema-violating and non-JSON bodies), and stateful (chains along the schema's
OpenAPI links: a listed model id retrieved and completed with). Every response goes through
schemathesis's checks except the ones in EXCLUDED, which this schema cannot satisfy.

Each generated request asks for at most CAP tokens per choice (a `max_tokens`,
`max_completion_tokens` or `max_output_tokens` above it, or none, becomes CAP; values of the
wrong type are left alone), so cases stay fast on a CPU while every other field is the
fuzzer's."""

from __future__ import annotations

import json
import time
from typing import Any

import hypothesis
import pytest
import requests
import schemathesis
from fuzz_support import Cluster, Figures, budget, figures, seed, wait_blocks_back
from hypothesis import HealthCheck
from hypothesis.stateful import run_state_machine_as_test
from schemathesis import GenerationMode, checks
from schemathesis.generation.meta import TestPhase

pytestmark = pytest.mark.slow

CAP = 2
TIMEOUT_S = 60.0  # per request; a CAP-token answer takes well under a second
EXCLUDED = {
    # FastAPI documents 200 and 422 only; the server answers 400 (bad field), 401, 404
    # (unknown model), 429 and 503 with OpenAI's error shape, as its docstring says.
    "status_code_conformance": checks.status_code_conformance,
    # The schema has types, not ranges: a schema-valid body may still be refused with a
    # 400 (empty prompt, n > 16, min_tokens > max_tokens, an unsupported penalty...).
    "positive_data_acceptance": checks.positive_data_acceptance,
    # /metrics is Prometheus text and a stream is text/event-stream, but FastAPI declares
    # application/json for every 200.
    "content_type_conformance": checks.content_type_conformance,
}
SERVICES = ["http_coordinator"]  # and its colocated worker


def bounded(case: schemathesis.Case) -> schemathesis.Case:
    body = case.body
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > CAP:
                body[key] = CAP
        if case.path == "/v1/responses":
            if body.get("max_output_tokens") is None:
                body["max_output_tokens"] = CAP  # unset means "the rest of the context"
        elif body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = CAP
    return case


def describe(case: schemathesis.Case) -> str:
    """A reproducer: method, path, query, headers and the body as sent."""
    body: Any = case.body
    try:
        shown = json.dumps(body, ensure_ascii=True)
    except (TypeError, ValueError):
        shown = repr(body)
    extra = "".join(
        f" {k}={v!r}" for k, v in (("query", case.query), ("headers", case.headers)) if v
    )
    return f"{case.method} {case.path}{extra} body={shown[:2000]}"


class Run:
    """Sends cases, validates them, and keeps the shortest reproducer per failure kind."""

    def __init__(self, cluster: Cluster, name: str) -> None:
        self.cluster = cluster
        self.service = cluster.get("http_coordinator")
        self.base_url = f"http://{self.service.info['http']}"
        self.schema = schemathesis.openapi.from_url(f"{self.base_url}/openapi.json")
        self.seed = seed()
        self.fig: Figures = figures(f"http:{name}", self.seed)
        self.failures: dict[str, str] = {}
        self.session = requests.Session()
        self.before = cluster.idle_free_blocks()  # every worker running, not just ours
        self.started = time.monotonic()
        print(f"\nhttp {name}: PDSERVE_FUZZ_SEED={self.seed} replays this run")

    def send(self, case: schemathesis.Case) -> None:
        try:
            response = self.call(case)
        except requests.RequestException:
            return
        self.check(case, response)

    def call(self, case: schemathesis.Case) -> Any:
        try:
            response = case.call(session=self.session, timeout=TIMEOUT_S)
        except requests.RequestException as e:  # dropped, reset, or no answer in time
            self.fig.count(type(e).__name__)
            self.fail(case, [f"connection: {type(e).__name__}"])
            raise
        self.fig.count(str(response.status_code))
        return response

    def check(self, case: schemathesis.Case, response: Any, **kwargs: Any) -> None:
        try:
            case.validate_response(response, excluded_checks=list(EXCLUDED.values()), **kwargs)
            return
        except (Exception, BaseExceptionGroup) as e:  # schemathesis's FailureGroup is the latter
            found = getattr(e, "exceptions", [e])
        self.fail(case, [f"{type(f).__name__}: {getattr(f, 'title', f)}" for f in found])

    def fail(self, case: schemathesis.Case, kinds: list[str]) -> None:
        self.fig.failures += 1
        shown = describe(case)
        for kind in kinds:
            key = f"{case.operation.label} {kind}"
            if key not in self.failures or len(shown) < len(self.failures[key]):
                self.failures[key] = shown
        dead = self.cluster.dead()
        if dead:
            raise AssertionError(f"{dead} died on {shown}")

    def finish(self) -> None:
        """The run's verdict, then the system's health: processes up, every KV block
        free again, a good request answered."""
        self.fig.seconds = round(time.monotonic() - self.started, 1)
        self.session.close()
        report = "\n".join(f"  {k}\n    {v}" for k, v in self.failures.items())
        assert not self.failures, f"seed {self.seed}:\n{report}"
        services = self.cluster.services
        assert not self.cluster.dead(), f"processes died: {self.cluster.dead()}"
        now = wait_blocks_back(services, self.before, self.fig)
        assert now == self.before, "KV blocks leaked"
        assert_good_chat(self.base_url)


def assert_good_chat(base_url: str) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    reply = requests.post(f"{base_url}/v1/chat/completions", json=body, timeout=TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.fixture
def run(fresh_cluster: Cluster, request: pytest.FixtureRequest) -> Run:
    fresh_cluster.start_all(SERVICES)
    return Run(fresh_cluster, request.node.name)


def test_coverage_phase(run: Run) -> None:
    """Schemathesis's deterministic cases: each field at its boundaries, of the wrong
    type, missing, null; and every operation called with methods it does not allow."""
    config = run.schema.config.generation
    for result in run.schema.get_all_operations():
        operation = result.ok()
        modes = list(GenerationMode)
        for case in run.schema.iter_coverage_cases(
            operation, generation_modes=modes, generation_config=config
        ):
            run.send(bounded(case))
    run.finish()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_fuzzing_phase(run: Run, mode: GenerationMode) -> None:
    """Random requests over every operation: schema-valid ones (positive), and ones that
    break the schema or are not JSON at all (negative)."""
    strategy = run.schema.as_strategy(mode, phase=TestPhase.FUZZING).map(bounded)

    @hypothesis.seed(run.seed)
    @hypothesis.settings(
        max_examples=budget("http") // 2,
        deadline=None,
        database=None,
        phases=[hypothesis.Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @hypothesis.given(strategy)
    def one(case: schemathesis.Case) -> None:
        run.send(case)

    one()
    run.finish()


def test_stateful_phase(run: Run) -> None:
    """Chains of calls along the schema's links: a model id from `GET /v1/models` is
    retrieved (`GET /v1/models/{model}`) and completed with, and a retrieved one chatted
    with; every call bounded and checked as in the other phases, with schemathesis's
    stateful checks as well."""
    machine = run.schema.as_state_machine()
    served = requests.get(f"{run.base_url}/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]
    followed: dict[str, int] = {}  # served model id reached through a link, per operation

    class Chains(machine):  # type: ignore[misc, valid-type]
        def before_call(self, case: schemathesis.Case) -> None:
            bounded(case)

        def call(self, case: schemathesis.Case, **kwargs: Any) -> Any:
            response = run.call(case)
            named = (case.path_parameters or {}).get("model")
            if isinstance(case.body, dict):
                named = named or case.body.get("model")
            if named == served and response.status_code == 200:  # random text never is
                followed[case.operation.label] = followed.get(case.operation.label, 0) + 1
            return response

        def validate_response(self, response: Any, case: schemathesis.Case, **_: Any) -> None:
            run.check(case, response, recorder=self.recorder)

    run_state_machine_as_test(
        Chains,
        settings=hypothesis.settings(
            max_examples=max(1, budget("http") // 20),
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    print(f"stateful: calls with the served model id, by operation: {followed}")
    assert followed.get("GET /v1/models/{model}"), "no chain retrieved the listed model"
    run.finish()


# ---- reproducers of what this fuzzer found (fixed in 9b3fd4a) --------------------------


def test_unsupported_method_names_the_allowed_ones(fresh_cluster: Cluster) -> None:
    """Found (coverage phase, unsupported_method check): `PUT /health` was answered 405
    without the Allow header RFC 9110 requires (the HTTPException handler dropped it)."""
    fresh_cluster.start_all(SERVICES)
    base_url = f"http://{fresh_cluster.get('http_coordinator').info['http']}"
    reply = requests.put(f"{base_url}/health", timeout=TIMEOUT_S)
    assert reply.status_code == 405
    assert reply.headers.get("allow") == "GET"


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": [True, 1.0], "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                  "max_tokens": 1, "stream": 0, "temperature": "0.5"}),
    ],
    ids=["token-ids", "chat"],
)  # fmt: skip
def test_mistyped_fields_are_refused(fresh_cluster: Cluster, path: str, body: dict) -> None:
    """Found (coverage and negative phases, negative_data_rejection check): values of the
    wrong type were coerced by pydantic's lax mode and served with 200 (true / 1.0 as token
    ids, 0 as `stream`, "0.5" as `temperature`, "yes" as a boolean)."""
    fresh_cluster.start_all(SERVICES)
    base_url = f"http://{fresh_cluster.get('http_coordinator').info['http']}"
    reply = requests.post(f"{base_url}{path}", json=body, timeout=TIMEOUT_S)
    assert reply.status_code == 400, reply.text

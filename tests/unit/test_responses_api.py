"""`/v1/responses` without a server process: input and instructions become chat messages and
the sampling fields theirs, `text.format` the chat's constraint; stateful and unimplemented
fields are refused naming the field; a stand-in stream becomes the Responses API's events in
order, each one a valid event of the official `openai` SDK's types; and the route, on the
FastAPI app with a stand-in coordinator, answers with the response object, the event stream,
and the error statuses in this endpoint's own field names."""

from __future__ import annotations

import asyncio
import json
import math
from typing import ClassVar

import grpc
import pytest
from fastapi.testclient import TestClient
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from pdserve.common.errors import InvalidRequestError
from pdserve.services.auth import ApiKeys
from pdserve.services.coordinator.http_api import OpenAIServer
from pdserve.services.coordinator.request_path import RequestFailed
from pdserve.services.coordinator.responses_api import ResponsesRequest, client_words
from pdserve.services.coordinator.responses_events import ResponseObjects
from pdserve.v1 import generate_pb2

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
EVENT = TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FUNCTION = {"type": "function", "name": "get_weather", "description": "Weather in a city",
            "parameters": WEATHER}  # fmt: skip
USAGE = generate_pb2.Usage(prompt_tokens=7, completion_tokens=3, cached_tokens=4)


def convert(**fields) -> generate_pb2.GenerateRequest:
    """The request the route makes of these fields (its tools checked first)."""
    body = ResponsesRequest(**{"input": "hi", **fields})
    return body.to_generate_request(body.tool_plan())


def messages(request: generate_pb2.GenerateRequest) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in request.messages]


def test_text_input_and_instructions_become_chat_messages() -> None:
    request = convert(input="Name a colour.", instructions="Answer in one word.")
    assert messages(request) == [("system", "Answer in one word."), ("user", "Name a colour.")]
    assert messages(convert(input="Name a colour.")) == [("user", "Name a colour.")]


def test_message_items_keep_roles_and_join_text_parts() -> None:
    items = [
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "ab", "annotations": []}]},
        {"type": None, "role": "user", "content": "again"},
    ]  # fmt: skip
    assert messages(convert(input=items)) == [
        ("developer", "Be terse."), ("user", "ab"), ("assistant", "ab"), ("user", "again"),
    ]  # fmt: skip


def test_sampling_fields_map_and_unset_ones_stay_unset() -> None:
    s = convert(max_output_tokens=9, temperature=0.5, top_p=0.25).sampling
    assert (s.max_tokens, s.temperature, s.top_p) == (9, 0.5, 0.25)
    unset = convert().sampling
    for name in ("max_tokens", "temperature", "top_p", "structured_output"):
        assert not unset.HasField(name), name


def test_text_format_becomes_the_chat_constraint() -> None:
    fmt = {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}
    constraint = convert(text={"format": fmt}).sampling.structured_output
    assert json.loads(constraint.json_schema) == SCHEMA and constraint.strict
    assert convert(text={"format": {"type": "json_object"}}).sampling.structured_output.json_object
    assert not convert(text={"format": {"type": "text"}}).sampling.HasField("structured_output")


def test_function_tools_and_call_items_become_the_chat_request() -> None:
    body = ResponsesRequest(
        input=[
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather",
             "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_2", "output": "rain"},
        ],
        tools=[FUNCTION], tool_choice={"type": "function", "name": "get_weather"},
    )  # fmt: skip
    plan = body.tool_plan()
    assert plan is not None and plan.mode == "named" and plan.name == "get_weather"
    request = body.to_generate_request(plan)
    assert [t.name for t in request.tools] == ["get_weather"]
    assert json.loads(request.tools[0].parameters) == WEATHER
    assert json.loads(request.sampling.structured_output.json_schema) == WEATHER
    _, calls, out1, out2 = request.messages
    assert calls.role == "assistant" and [(c.id, c.arguments) for c in calls.tool_calls] == [
        ("call_1", '{"city": "Paris"}'), ("call_2", '{"city": "Rome"}')]  # fmt: skip
    assert [(m.role, m.tool_call_id, m.content) for m in (out1, out2)] == [
        ("tool", "call_1", "sunny"), ("tool", "call_2", "rain")]  # fmt: skip
    auto = ResponsesRequest(input="hi", tools=[FUNCTION])
    assert auto.tool_plan().mode == "auto"  # type: ignore[union-attr]
    assert not auto.to_generate_request(auto.tool_plan()).sampling.HasField("structured_output")


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
        ({"tools": [{"type": "function", "name": "f", "parameters": []}]}, "tools[0].parameters"),
        ({"tools": [FUNCTION], "tool_choice": {"type": "function", "name": "g"}},
         "tool_choice.name"),
        ({"tools": [FUNCTION], "tool_choice": {"type": "web_search"}}, "tool_choice.type"),
        ({"tools": [FUNCTION], "tool_choice": "required",
          "text": {"format": {"type": "json_object"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"truncation": "auto"}, "truncation"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"input": []}, "input"),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
         "input[0].arguments"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"type": {"x": 1}}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "1"}]}, "input[0].role"),
        ({"input": [{"role": "user"}]}, "input[0].content"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]},
         "input[0].content[0].text"),
        ({"input": "a\ud800"}, "input"),
        ({"instructions": "\udfff"}, "instructions"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 2**32}, "max_output_tokens"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": math.nan}, "top_p"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"text": {"format": {}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "schema": SCHEMA}}}, "text.format.name"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objec"}}}},
         "text.format.schema"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA,
                              "strict": "yes"}}}, "text.format.strict"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"user": "\ud800"}, "user"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(fields: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        convert(**fields)
    assert e.value.field == field, e.value


def test_stateful_refusals_say_nothing_is_stored() -> None:
    for fields in ({"store": True}, {"previous_response_id": "resp_1"}):
        with pytest.raises(InvalidRequestError) as e:
            convert(**fields)
        assert "stored" in e.value.message, e.value


def test_neutral_values_are_accepted() -> None:
    convert(
        store=False, tools=[], tool_choice="none", parallel_tool_calls=False, max_tool_calls=3,
        include=[], reasoning={"effort": None, "summary": None}, top_logprobs=0,
        truncation="disabled", text={"format": {"type": "text"}, "verbosity": "medium"},
        metadata={"k": "v"}, user="u", stream_options={"include_obfuscation": True},
    )  # fmt: skip


def test_request_path_fields_are_named_as_this_client_spelled_them() -> None:
    assert client_words("max_tokens", "max_tokens: must be at least 1") == (
        "max_output_tokens", "max_output_tokens: must be at least 1",
    )  # fmt: skip
    assert client_words("messages[2].role", "messages[2].role: bad")[0] == "input"
    assert client_words("prompt", "x")[0] == "input"
    assert client_words("temperature", "temperature: x") == ("temperature", "temperature: x")
    assert client_words(None, "m") == (None, "m")


# ---- the event stream ---------------------------------------------------------------------


def parse(raw: list[bytes]) -> list[dict]:
    """Each server-sent event's data, checked against its `event:` line."""
    events = []
    for chunk in raw:
        head, data = chunk.decode().removesuffix("\n\n").split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}"
        events.append(payload)
    return events


def check_sdk_types(event: dict) -> None:
    """The event as the official SDK's types define it. `usage` is checked apart: the SDK
    also wants `cache_write_tokens`, a count of OpenAI's explicit cache writes."""
    event = json.loads(json.dumps(event))
    usage = event.get("response", {}).pop("usage", None)
    EVENT.validate_python(event)
    if usage is not None:
        assert set(usage) == {"input_tokens", "input_tokens_details", "output_tokens",
                              "output_tokens_details", "total_tokens"}  # fmt: skip


class StandIn:
    """A request path's responses; records whether the stream was closed."""

    def __init__(self, responses: list, fail: RequestFailed | None = None) -> None:
        self.responses, self.fail, self.closed = responses, fail, False

    async def stream(self):
        try:
            for r in self.responses:
                yield r
            if self.fail is not None:
                raise self.fail
        finally:
            self.closed = True


def run_events(body: ResponsesRequest, stand_in: StandIn) -> list[dict]:
    objects = ResponseObjects(body, "r1", "m", body.tool_plan())

    async def go() -> list[bytes]:
        stream = stand_in.stream()
        first = await anext(stream)
        error = {"message": "decode worker lost", "type": "service_unavailable_error",
                 "param": None, "code": "unavailable"}  # fmt: skip
        return [e async for e in objects.events(first, stream, lambda _: error)]

    return parse(asyncio.run(go()))


OPENING = ["response.created", "response.in_progress", "response.output_item.added",
           "response.content_part.added"]  # fmt: skip
CLOSING = ["response.output_text.done", "response.content_part.done",
           "response.output_item.done"]  # fmt: skip


def test_events_come_in_the_api_order_and_join_to_the_text() -> None:
    stand_in = StandIn([
        generate_pb2.GenerateResponse(text="Hel"),
        generate_pb2.GenerateResponse(text=""),  # held back: no delta
        generate_pb2.GenerateResponse(text="lo!"),
        generate_pb2.GenerateResponse(text=" Bye", finish_reason="stop", usage=USAGE),
    ])  # fmt: skip
    events = run_events(ResponsesRequest(input="hi", metadata={"k": "v"}), stand_in)
    kinds = [e["type"] for e in events]
    assert kinds == [*OPENING, *["response.output_text.delta"] * 3, *CLOSING,
                     "response.completed"]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        check_sdk_types(event)
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    assert deltas == "Hello! Bye" == events[-4]["text"] == final["output"][0]["content"][0]["text"]
    opened = events[0]["response"]
    assert opened["status"] == "in_progress" and opened["output"] == [] and opened["usage"] is None
    assert final["status"] == "completed" and final["incomplete_details"] is None
    assert final["metadata"] == {"k": "v"} and final["store"] is False
    assert final["usage"] == {
        "input_tokens": 7, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 10,
    }  # fmt: skip
    ids = {e["item_id"] for e in events if "item_id" in e}
    assert ids == {final["output"][0]["id"]} and stand_in.closed


def test_length_ends_incomplete() -> None:
    stand_in = StandIn([
        generate_pb2.GenerateResponse(text="one"),
        generate_pb2.GenerateResponse(text=" two", finish_reason="length", usage=USAGE),
    ])  # fmt: skip
    events = run_events(ResponsesRequest(input="count", max_output_tokens=2), stand_in)
    final = events[-1]
    assert final["type"] == "response.incomplete"
    check_sdk_types(final)
    response = final["response"]
    assert response["status"] == "incomplete" and response["output"][0]["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["max_output_tokens"] == 2


def test_a_failure_mid_stream_ends_with_error_and_failed() -> None:
    lost = RequestFailed(grpc.StatusCode.UNAVAILABLE, "decode worker lost")
    stand_in = StandIn([generate_pb2.GenerateResponse(text="par")], fail=lost)
    events = run_events(ResponsesRequest(input="hi"), stand_in)
    assert [e["type"] for e in events] == [*OPENING, "response.output_text.delta", "error",
                                           "response.failed"]  # fmt: skip
    for event in events:
        check_sdk_types(event)
    assert events[-2]["message"] == "decode worker lost" and events[-2]["code"] == "unavailable"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert stand_in.closed


def test_calls_come_out_as_function_call_items() -> None:
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    body = ResponsesRequest(input="Weather in Paris?", tools=[FUNCTION])
    # Calls alone: no message item.
    stand_in = StandIn([generate_pb2.GenerateResponse(text=call[:20]),
                        generate_pb2.GenerateResponse(text=call[20:], finish_reason="stop",
                                                      usage=USAGE)])  # fmt: skip
    events = run_events(body, stand_in)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    for event in events:
        check_sdk_types(event)
    (item,) = events[-1]["response"]["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather"
    assert json.loads(item["arguments"]) == {"city": "Paris"}
    assert events[-2]["item"] == item and item["call_id"].startswith("call_")
    # Text, then a call: the message item first, then the call's.
    stand_in = StandIn([generate_pb2.GenerateResponse(text="Let me check. "),
                        generate_pb2.GenerateResponse(text=call, finish_reason="stop",
                                                      usage=USAGE)])  # fmt: skip
    events = run_events(body, stand_in)
    for event in events:
        check_sdk_types(event)
    message, item = events[-1]["response"]["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "Let me check."
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["type"]) for e in added] == [
        (0, "message"), (1, "function_call")]  # fmt: skip
    assert events[-1]["response"]["tools"] == [FUNCTION]


# ---- the route ----------------------------------------------------------------------------


class StandInCoordinator:
    """Answers every request with `responses`, or refuses it with `refuse`."""

    metric_labels: ClassVar[dict[str, str]] = {
        "model": "m", "role": "coordinator", "worker": "responses-api",
    }  # fmt: skip

    def __init__(self) -> None:
        self.refuse: RequestFailed | None = None
        self.seen: list[generate_pb2.GenerateRequest] = []

    async def generate(self, request, headers=(), fill_context=False):
        self.seen.append(request)
        if self.refuse is not None:
            raise self.refuse
        yield generate_pb2.GenerateResponse(text="Hi")
        yield generate_pb2.GenerateResponse(text=" there", finish_reason="stop", usage=USAGE)


@pytest.fixture
def coordinator() -> StandInCoordinator:
    return StandInCoordinator()


@pytest.fixture
def client(coordinator) -> TestClient:
    server = OpenAIServer(coordinator, None, ["m"], 64)  # type: ignore[arg-type]
    return TestClient(server.app, raise_server_exceptions=False)


def test_the_route_answers_a_response_object(client, coordinator) -> None:
    r = client.post("/v1/responses", json={"input": "hi", "store": False},
                    headers={"x-request-id": "abc"})  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    response = Response.model_validate({**body, "usage": None})
    assert response.output_text == "Hi there" and response.id == "resp_abc"
    assert body["usage"]["total_tokens"] == 10 and body["model"] == "m"
    assert coordinator.seen[0].request_id == "abc"


def test_the_route_streams_events(client) -> None:
    with client.stream("POST", "/v1/responses", json={"input": "hi", "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = parse([c.encode() + b"\n\n" for c in r.read().decode().split("\n\n") if c])
    assert [e["type"] for e in events] == [*OPENING, *["response.output_text.delta"] * 2,
                                           *CLOSING, "response.completed"]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
def test_the_route_refuses_with_the_apis_statuses_and_names(client, coordinator, stream) -> None:
    r = client.post("/v1/responses", json={"input": "hi", "previous_response_id": "resp_1",
                                           "stream": stream})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/responses", json={"input": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    coordinator.refuse = RequestFailed(
        grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: too many", "sampling.max_tokens"
    )
    r = client.post("/v1/responses", json={"input": "hi", "stream": stream})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "max_output_tokens"
    assert r.json()["error"]["message"].startswith("max_output_tokens: ")
    busy = RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
    busy.retry_after_s = 2
    coordinator.refuse = busy
    r = client.post("/v1/responses", json={"input": "hi", "stream": stream})
    assert r.status_code == 429 and r.headers["retry-after"] == "2"
    coordinator.refuse = RequestFailed(grpc.StatusCode.UNAVAILABLE, "no decode worker")
    r = client.post("/v1/responses", json={"input": "hi", "stream": stream})
    assert r.status_code == 503 and r.json()["error"]["message"] == "no decode worker"


def test_the_route_checks_keys_first(coordinator) -> None:
    server = OpenAIServer(coordinator, None, ["m"], 64, ApiKeys("k"))  # type: ignore[arg-type]
    client = TestClient(server.app, raise_server_exceptions=False)
    r = client.post("/v1/responses", json={"input": "hi", "store": True})
    assert r.status_code == 401 and not coordinator.seen
    r = client.post("/v1/responses", json={"input": "hi"}, headers={"Authorization": "Bearer k"})
    assert r.status_code == 200 and len(coordinator.seen) == 1
    r = client.post("/v1/responses", json={"input": "hi", "model": "other"},
                    headers={"Authorization": "Bearer k"})  # fmt: skip
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"

"""`/v1/responses` on real processes (a coordinator with `--http-port` and one colocated
worker, the default model), called with the official `openai` client as newer SDK code calls
it, `store=False`: the same greedy text and token counts as a chat completion of the same
messages (with `instructions` as the system message), the stream's events in the API's order
joining to that text, `text.format` json_schema output that validates, `max_output_tokens`
ending the response incomplete, function tools (a required call whose arguments validate, its
streamed argument events, and a round trip through `function_call_output` to an answer),
stateful fields and built-in tools refused with a 400 naming them, and a client that leaves
mid-stream freeing the request's KV blocks."""

from __future__ import annotations

import http.client
import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from services import start

pytestmark = pytest.mark.slow

WORKER_ARGS = ["--kv-cache-tokens", "16384", "--threads", "1"]
QUESTION = "What is the capital of France?"


class City(BaseModel):
    city: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: int = Field(ge=0, le=50)


@pytest.fixture(scope="module")
def cluster():
    worker = start("colocated", *WORKER_ARGS)
    coordinator = start("coordinator", f"--colocated-workers={worker.grpc}", "--http-port=0")
    try:
        yield {"colocated": worker, "coordinator": coordinator}
    finally:
        coordinator.stop()
        worker.stop()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    address = cluster["coordinator"].info["http"]
    return openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def chat(client, model, messages: list[dict], max_tokens: int = 24):
    return client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0
    )


def test_text_and_usage_equal_the_chat_completions(client, model):
    reply = client.responses.create(
        model=model, input=QUESTION, store=False, temperature=0, max_output_tokens=24
    )
    expected = chat(client, model, [{"role": "user", "content": QUESTION}])
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert reply.output_text == expected.choices[0].message.content and reply.output_text
    assert reply.usage.input_tokens == expected.usage.prompt_tokens
    assert reply.usage.output_tokens == expected.usage.completion_tokens
    assert reply.usage.total_tokens == expected.usage.total_tokens
    finished = expected.choices[0].finish_reason
    assert reply.status == ("completed" if finished == "stop" else "incomplete")
    [message] = reply.output
    assert (message.type, message.role, message.content[0].annotations) == (
        "message", "assistant", [],
    )  # fmt: skip


def test_instructions_and_message_items_are_the_chat_messages(client, model):
    reply = client.responses.create(
        model=model, instructions="Answer in one short sentence.", input=QUESTION,
        store=False, temperature=0, max_output_tokens=24,
    )  # fmt: skip
    expected = chat(client, model, [{"role": "system", "content": "Answer in one short sentence."},
                                    {"role": "user", "content": QUESTION}])  # fmt: skip
    assert reply.output_text == expected.choices[0].message.content
    assert reply.instructions == "Answer in one short sentence."
    history = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Hello Ada!"},
        {"role": "user", "content": "What is my name?"},
    ]
    turns = [
        history[0],  # a string as content
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello Ada!"}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "What is my name?"}]},
    ]  # fmt: skip
    reply = client.responses.create(
        model=model, input=turns, store=False, temperature=0, max_output_tokens=16
    )
    expected = chat(client, model, history, 16)
    assert reply.output_text == expected.choices[0].message.content


def test_stream_events_come_in_order_and_join_to_the_text(client, model):
    whole = client.responses.create(
        model=model, input=QUESTION, store=False, temperature=0, max_output_tokens=24
    )
    events = list(
        client.responses.create(
            model=model, input=QUESTION, store=False, temperature=0, max_output_tokens=24,
            stream=True,
        )
    )  # fmt: skip
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    done = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * len(deltas),
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        done,
    ]  # fmt: skip
    assert len(deltas) > 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(d.delta for d in deltas)
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    # The SDK's own stream helper assembles the same response.
    with client.responses.stream(
        model=model, input=QUESTION, store=False, temperature=0, max_output_tokens=24
    ) as stream:
        assert stream.get_final_response().output_text == text


def test_json_schema_output_validates(client, model):
    schema = City.model_json_schema()
    reply = client.responses.create(
        model=model, input="Describe Paris as JSON.", store=False, temperature=0,
        max_output_tokens=120,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                         "strict": True}},
    )  # fmt: skip
    assert reply.status == "completed", reply
    jsonschema.validate(json.loads(reply.output_text), schema)
    parsed = client.responses.parse(
        model=model, input="Tell me about the capital of Japan.", text_format=City,
        store=False, temperature=0, max_output_tokens=120,
    )  # fmt: skip
    assert isinstance(parsed.output_parsed, City), parsed.output_text


def test_max_output_tokens_ends_incomplete(client, model):
    reply = client.responses.create(
        model=model, input="Write a long story about the sea.", store=False, temperature=0,
        max_output_tokens=5,
    )  # fmt: skip
    assert reply.status == "incomplete"
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 5 and reply.output[0].status == "incomplete"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "name": "x",
                              "schema": {"type": "objec"}}}}, "text.format.schema"),
    ],
)  # fmt: skip
def test_refusals_are_400_naming_the_field(client, model, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=model, input=QUESTION, **fields)
    assert refused.value.status_code == 400
    assert refused.value.body["param"] == param, refused.value.body
    assert refused.value.body["message"].startswith(f"{param}: ")


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
           "required": ["city"], "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": WEATHER}]  # fmt: skip


def test_function_tools_round_trip(client, model):
    question = {"role": "user", "content": "What is the weather in Paris?"}
    called = client.responses.create(
        model=model, input=[question], tools=TOOLS, tool_choice="required", store=False,
        parallel_tool_calls=False, temperature=0, max_output_tokens=80,
    )  # fmt: skip
    calls = [item for item in called.output if item.type == "function_call"]
    assert called.status == "completed" and len(calls) == 1, called.output
    for call in calls:
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER)

    streamed = client.responses.create(
        model=model, input=[question], tools=TOOLS, store=False, temperature=0,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=80,
        stream=True,
    )  # fmt: skip
    events = list(streamed)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == json.loads(calls[0].arguments)
    assert events[-1].type == "response.completed"

    history = [question] + [
        {"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
        for c in calls
    ] + [{"type": "function_call_output", "call_id": c.call_id, "output": "Sunny, 21 C"}
         for c in calls]  # fmt: skip
    answer = client.responses.create(
        model=model, input=history, tools=TOOLS, store=False, temperature=0,
        max_output_tokens=40,
    )  # fmt: skip
    assert answer.output_text  # the model answers from the tool's output
    assert answer.output[0].type == "message"


def test_context_too_long_names_input(client, model):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=model, input="word " * 20000, store=False)
    assert refused.value.body["param"] == "input"
    assert refused.value.body["code"] == "context_length_exceeded"


def test_leaving_mid_stream_cancels_and_frees_the_blocks(cluster, model):
    worker, coordinator = cluster["colocated"], cluster["coordinator"]
    free, total = worker.blocks_once_idle()
    assert free == total
    cancelled = coordinator.metric("pdserve_request_failure_total", cause="cancelled")
    host, port = coordinator.info["http"].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {"model": model, "input": "Write a long story about the sea.", "store": False,
            "stream": True, "temperature": 0, "max_output_tokens": 2000}  # fmt: skip
    conn.request("POST", "/v1/responses", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    deltas = 0
    while deltas < 3:
        deltas += response.readline() == b"event: response.output_text.delta\n"
    assert worker.metric("pdserve_num_requests_running") >= 1
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    assert worker.blocks_once_idle() == (total, total)
    after = coordinator.metric("pdserve_request_failure_total", cause="cancelled")
    assert after == cancelled + 1

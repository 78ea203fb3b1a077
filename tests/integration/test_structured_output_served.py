"""Structured output and tool calls on real processes (the default model), asked for as
clients ask: the official `openai` client's `.parse()` with pydantic models,
`response_format` json_schema and json_object, vLLM's `structured_outputs` and `guided_*`,
the gRPC field, and `tools` with named, required and streamed tool choices and a round
trip; and prompt log-probabilities as evaluation harnesses ask for them (`echo` with
`logprobs` and `max_tokens: 0`, vLLM's `prompt_logprobs`). Every output is checked by its
validator (pydantic, `jsonschema`, the regex, the choice list); a greedy constrained request
gives the same token ids split (1 prefill + 1 decode) and colocated, and so do prompt
logprobs; bad constraints are 400 naming the client's field; no KV block leaks."""

from __future__ import annotations

import json
import re
from enum import StrEnum

import grpc
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from pdserve.v1 import generate_pb2, generate_pb2_grpc
from services import post, start, wait_idle

pytestmark = pytest.mark.slow

WORKER_ARGS = ["--kv-cache-tokens", "16384", "--threads", "1"]


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Pet(BaseModel):
    name: str = Field(max_length=24)
    legs: int = Field(ge=0, le=8)


class Person(BaseModel):
    name: str = Field(max_length=32)
    age: int = Field(ge=0, le=130)
    favourite: Color
    pets: list[Pet] = Field(min_length=1, max_length=3)


class City(BaseModel):
    city: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: int = Field(ge=0, le=50)


PROMPTS = {
    Person: [
        "Ann is 31, loves green and has a cat called Tom. Describe her.",
        "Make up a person with two dogs.",
    ],
    City: ["Tell me about Paris.", "Describe the capital of Japan."],
}


@pytest.fixture(scope="module")
def clusters():
    prefill = start("prefill", *WORKER_ARGS)
    decode = start("decode", *WORKER_ARGS)
    colocated = start("colocated", *WORKER_ARGS)
    split = start(
        "coordinator", f"--prefill-workers={prefill.grpc}", f"--decode-workers={decode.grpc}",
        "--http-port=0",
    )  # fmt: skip
    together = start("coordinator", f"--colocated-workers={colocated.grpc}", "--http-port=0")
    services = {"prefill": prefill, "decode": decode, "colocated": colocated, "split": split,
                "together": together}  # fmt: skip
    try:
        yield services
    finally:
        for role in ("split", "together", "decode", "prefill", "colocated"):
            services[role].stop()


def _client(service) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://{service.info['http']}/v1", api_key="unused", max_retries=0
    )


@pytest.fixture(scope="module")
def client(clusters) -> openai.OpenAI:
    return _client(clusters["split"])


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_parse_returns_validated_objects_for_every_prompt(clusters, client, model):
    free = {role: clusters[role].free_blocks() for role in ("prefill", "decode")}
    for schema, prompts in PROMPTS.items():
        for prompt in prompts:
            completion = client.beta.chat.completions.parse(
                model=model, messages=[{"role": "user", "content": prompt}],
                response_format=schema, temperature=0, max_tokens=200,
            )  # fmt: skip
            choice = completion.choices[0]
            assert choice.finish_reason == "stop", choice
            assert isinstance(choice.message.parsed, schema), choice.message.content
            jsonschema.validate(json.loads(choice.message.content), schema.model_json_schema())
    assert wait_idle(clusters, free) == free


def test_json_object_and_vllm_constraints(client, model):
    question = "Reply with a JSON object with the keys name and age, for a dog called Rex aged 3."
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=200,
    )  # fmt: skip
    assert out.choices[0].finish_reason == "stop"
    assert json.loads(out.choices[0].message.content) == {"name": "Rex", "age": 3}
    cases = [
        ({"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}}, r"[0-9]{3}-[0-9]{4}"),
        ({"guided_regex": "(yes|no), [a-z]+"}, r"(yes|no), [a-z]+"),
        ({"structured_outputs": {"choice": ["Paris", "Lyon", "Nice"]}}, r"Paris|Lyon|Nice"),
        ({"guided_choice": ["positive", "negative"]}, r"positive|negative"),
    ]
    for extra, pattern in cases:
        text = client.completions.create(
            model=model, prompt="The answer:", temperature=0.7, seed=5, max_tokens=24,
            extra_body=extra,
        ).choices[0].text  # fmt: skip
        assert re.fullmatch(pattern, text), (extra, text)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    text = client.completions.create(
        model=model, prompt="Is water wet? Answer in JSON.", temperature=0, max_tokens=40,
        extra_body={"guided_json": schema},
    ).choices[0].text  # fmt: skip
    jsonschema.validate(json.loads(text), schema)


def _grpc_tokens(service, sampling: generate_pb2.SamplingParams) -> list[int]:
    with grpc.insecure_channel(service.grpc) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        request = generate_pb2.GenerateRequest(
            messages=[generate_pb2.ChatMessage(role="user", content="Describe Rome as JSON.")],
            sampling=sampling,
        )
        return [t for r in stub.Generate(request) for t in r.token_ids]


def test_split_and_colocated_give_the_same_constrained_tokens(clusters):
    schema = City.model_json_schema()
    sampling = generate_pb2.SamplingParams(max_tokens=120, temperature=0)
    sampling.structured_output.json_schema = json.dumps(schema)
    sampling.structured_output.strict = True
    split = _grpc_tokens(clusters["split"], sampling)
    together = _grpc_tokens(clusters["together"], sampling)
    assert split == together and len(split) > 5
    regex = generate_pb2.SamplingParams(max_tokens=30, temperature=0)
    regex.structured_output.regex = "[A-Z][a-z]+ is [a-z ]+\\."
    assert _grpc_tokens(clusters["split"], regex) == _grpc_tokens(clusters["together"], regex)


def test_bad_constraints_are_400_naming_the_field(clusters, client, model):
    address = clusters["split"].info["http"]
    ask = [{"role": "user", "content": "hi"}]
    cases = [
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"whitespace_pattern": " "}},
         "structured_outputs.whitespace_pattern"),
        ({"guided_grammar": "root ::= "}, "guided_grammar"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ]  # fmt: skip
    for extra, field in cases:
        status, _, payload = post(address, "/v1/chat/completions", {"messages": ask, **extra})
        assert status == 400, extra
        assert payload["error"]["param"] == field, payload
    # The gRPC field is checked the same way, naming the field as gRPC spells it.
    sampling = generate_pb2.SamplingParams(max_tokens=4)
    sampling.structured_output.regex = "(unclosed"
    with pytest.raises(grpc.RpcError) as refused:
        _grpc_tokens(clusters["split"], sampling)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.structured_output.regex" in refused.value.details()
    assert client.chat.completions.create(model=model, messages=ask, max_tokens=2)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False},
}}  # fmt: skip
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"], "additionalProperties": False},
}}  # fmt: skip
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Oslo?"}]


def _valid_call(call, tools=(WEATHER, TIME)) -> dict:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schemas[call.function.name])
    return arguments


def test_named_and_required_tool_choices_call_with_valid_arguments(clusters, client, model):
    free = {role: clusters[role].free_blocks() for role in ("prefill", "decode")}
    named = client.chat.completions.create(
        model=model, messages=ASK_WEATHER, tools=[WEATHER, TIME], temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=80,
    ).choices[0]  # fmt: skip
    assert named.finish_reason == "tool_calls" and named.message.content is None
    [call] = named.message.tool_calls
    assert call.function.name == "get_weather" and _valid_call(call)
    required = client.chat.completions.create(
        model=model, messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice="required",
        temperature=0, max_tokens=150,
    ).choices[0]  # fmt: skip
    assert required.finish_reason == "tool_calls" and required.message.tool_calls
    for call in required.message.tool_calls:
        _valid_call(call)
    single = client.chat.completions.create(
        model=model, messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, temperature=0.8, seed=3, max_tokens=150,
    ).choices[0]  # fmt: skip
    assert len(single.message.tool_calls) == 1
    assert wait_idle(clusters, free) == free


def test_streamed_tool_call_deltas_join_into_valid_arguments(client, model):
    stream = client.chat.completions.create(
        model=model, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required",
        temperature=0, max_tokens=150, stream=True,
    )  # fmt: skip
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or ():
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    assert finish == "tool_calls" and calls
    for entry in calls.values():
        assert entry["name"] == "get_weather"
        jsonschema.validate(json.loads(entry["arguments"]), WEATHER["function"]["parameters"])


def test_a_tool_round_trip_ends_in_an_answer(client, model):
    first = client.chat.completions.create(
        model=model, messages=ASK_WEATHER, tools=[WEATHER], temperature=0, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ).choices[0].message  # fmt: skip
    [call] = first.tool_calls
    history = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "12 degrees and sunny"},
    ]
    answer = client.chat.completions.create(
        model=model, messages=history, tools=[WEATHER], temperature=0, max_tokens=40,
    ).choices[0]  # fmt: skip
    assert answer.message.content and not answer.message.tool_calls
    assert answer.finish_reason in ("stop", "length")


ECHO_PROMPT = "The capital of France is"


def test_echo_with_logprobs_scores_the_prompt_split_and_colocated(clusters, model):
    """An evaluation harness's request: `echo`, `logprobs`, `max_tokens: 0`."""
    free = {role: clusters[role].free_blocks() for role in ("prefill", "decode")}
    scored = {}
    for name in ("split", "together"):
        out = _client(clusters[name]).completions.create(
            model=model, prompt=ECHO_PROMPT, echo=True, logprobs=2, max_tokens=0,
        )  # fmt: skip
        choice = out.choices[0]
        assert choice.text == ECHO_PROMPT and choice.finish_reason == "length"
        assert out.usage.completion_tokens == 0
        lp = choice.logprobs
        assert len(lp.tokens) == out.usage.prompt_tokens > 1
        assert "".join(lp.tokens) == ECHO_PROMPT
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(v <= 0 for v in lp.token_logprobs[1:])
        assert all(len(top) == 2 for top in lp.top_logprobs[1:])
        assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
        scored[name] = lp.token_logprobs
    assert scored["split"] == scored["together"]  # the same bits, whichever worker computed

    # With generated tokens: the prompt's entries, then the completion's, as without echo.
    client = _client(clusters["split"])
    kwargs = dict(model=model, prompt=ECHO_PROMPT, logprobs=1, max_tokens=4, temperature=0)
    echoed = client.completions.create(echo=True, **kwargs).choices[0]
    plain = client.completions.create(**kwargs).choices[0]
    assert echoed.text == ECHO_PROMPT + plain.text
    assert echoed.logprobs.token_logprobs[: len(scored["split"])] == scored["split"]
    assert echoed.logprobs.token_logprobs[len(scored["split"]) :] == plain.logprobs.token_logprobs

    streamed = client.completions.create(
        model=model, prompt=ECHO_PROMPT, echo=True, max_tokens=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == ECHO_PROMPT
    assert wait_idle(clusters, free) == free


def test_vllm_prompt_logprobs_on_chat_and_completions(clusters, client, model):
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        temperature=0, extra_body={"prompt_logprobs": 3},
    )  # fmt: skip
    entries = chat.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == chat.usage.prompt_tokens
    for step in entries[1:]:
        ranks = sorted(v["rank"] for v in step.values())
        assert {1, 2, 3} <= set(ranks) and all(v["logprob"] <= 0 for v in step.values())
        assert len(step) in (3, 4)  # the prompt's token, and the best three
    text = client.completions.create(
        model=model, prompt=ECHO_PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 0}
    ).choices[0]
    assert len(text.model_extra["prompt_logprobs"]) > 1
    assert all(len(step) == 1 for step in text.model_extra["prompt_logprobs"][1:])

    for body, field in (
        ({"prompt": ECHO_PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"prompt": ECHO_PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": ECHO_PROMPT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ):
        status, _, reply = post(clusters["split"].info["http"], "/v1/completions",
                                {"model": model, **body})  # fmt: skip
        assert status == 400 and reply["error"]["param"] == field, reply


def test_skip_special_tokens_false_keeps_their_text_across_the_handoff(client, model):
    """Every token forced to the end-of-turn token (a special one): its text is in the
    output only when the request keeps special tokens, on the decode worker's tokens too."""
    end = client.completions.create(
        model=model,
        prompt="hi",
        max_tokens=1,
        logprobs=0,
        temperature=0,
        extra_body={"allowed_token_ids": [2], "ignore_eos": True},
    ).choices[0]
    forced = dict(model=model, prompt="hi", max_tokens=3, temperature=0,
                  extra_body={"allowed_token_ids": [2], "ignore_eos": True})  # fmt: skip
    kept = client.completions.create(**{**forced, "extra_body": {
        **forced["extra_body"], "skip_special_tokens": False}}).choices[0].text  # fmt: skip
    skipped = client.completions.create(**forced).choices[0].text
    token = end.logprobs.tokens[0]
    assert token.startswith("<|") and kept == token * 3 and skipped == ""

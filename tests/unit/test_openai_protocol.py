"""The HTTP API's request and response shapes, without a server: OpenAI fields become the
request path's `GenerateRequest`s (one per choice), refusals name the field, usage counts a
prompt once however many choices it has, and log-probabilities take each endpoint's shape."""

from __future__ import annotations

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from pdserve.common.errors import InvalidRequestError
from pdserve.services.coordinator.http_api import api_error, validation_error
from pdserve.services.coordinator.openai_protocol import ChatCompletionRequest, CompletionRequest
from pdserve.services.coordinator.openai_responses import (
    Choice,
    CompletionFormat,
    usage_dict,
)
from pdserve.services.coordinator.request_path import RequestFailed
from pdserve.v1 import generate_pb2


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_chat_fields_map_to_sampling() -> None:
    [request] = chat(
        max_completion_tokens=7, max_tokens=99, temperature=0.5, top_p=0.9, top_k=4,
        seed=11, stop="END", min_tokens=2, ignore_eos=True, logprobs=True, top_logprobs=3,
    ).to_generate_requests()  # fmt: skip
    s = request.sampling
    assert [(m.role, m.content) for m in request.messages] == [("user", "hi")]
    assert (s.max_tokens, s.top_k, s.seed, list(s.stop), s.min_tokens) == (7, 4, 11, ["END"], 2)
    assert s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9)
    assert s.ignore_eos and s.logprobs == 3


def test_unset_fields_stay_unset() -> None:
    [request] = chat().to_generate_requests()
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs",
                 "prompt_logprobs", "skip_special_tokens"):  # fmt: skip
        assert not request.sampling.HasField(name), name


def test_special_tokens_kept_when_asked_and_for_mistral_tool_calls() -> None:
    [request] = chat(skip_special_tokens=False).to_generate_requests()
    assert request.sampling.HasField("skip_special_tokens")
    assert not request.sampling.skip_special_tokens
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for parser, kept in (("mistral", True), ("hermes", False)):
        body = chat(tools=tools)
        [request] = body.to_generate_requests(body.tool_plan(parser))
        assert request.sampling.HasField("skip_special_tokens") == kept, parser


def test_text_parts_are_joined_and_other_parts_refused() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    [request] = ChatCompletionRequest(
        messages=[{"role": "user", "content": parts}]
    ).to_generate_requests()
    assert request.messages[0].content == "ab"
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(InvalidRequestError) as e:
        ChatCompletionRequest(messages=[{"role": "user", "content": image}]).to_generate_requests()
    assert e.value.field == "messages[0].content[0]"


def test_n_choices_get_consecutive_seeds() -> None:
    requests = chat(n=3, seed=5, temperature=1.0).to_generate_requests()
    assert [r.sampling.seed for r in requests] == [5, 6, 7]


def test_completion_prompts_are_prompt_major() -> None:
    requests = CompletionRequest(prompt=["a", "b"], n=2).to_generate_requests()
    assert [r.prompt for r in requests] == ["a", "a", "b", "b"]
    [ids] = CompletionRequest(prompt=[5, 6, 7]).to_generate_requests()
    assert list(ids.token_ids) == [5, 6, 7]
    two = CompletionRequest(prompt=[[1, 2], [3]]).to_generate_requests()
    assert [list(r.token_ids) for r in two] == [[1, 2], [3]]


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: chat(n=0), "n"),
        (lambda: chat(n=17), "n"),
        (lambda: chat(frequency_penalty=float("inf")), "frequency_penalty"),
        (lambda: chat(logit_bias={"five": 1.0}), "logit_bias"),
        (lambda: chat(logit_bias={"5": float("nan")}), "logit_bias[5]"),
        (lambda: chat(allowed_token_ids=[-1]), "allowed_token_ids"),
        (
            lambda: ChatCompletionRequest(
                messages=[{"role": "assistant", "tool_calls": [{"function": 3}]}]
            ),
            "messages[0].tool_calls[0]",
        ),
        (lambda: chat(top_logprobs=2), "top_logprobs"),
        (lambda: chat(functions=[{"name": "f"}]), "functions"),
        (lambda: chat(modalities=["text", "audio"]), "modalities"),
        (lambda: chat(use_beam_search=True), "use_beam_search"),
        (lambda: chat(chat_template="{{ x }}"), "chat_template"),
        (lambda: CompletionRequest(prompt="x", prompt_logprobs=21), "prompt_logprobs"),
        (lambda: CompletionRequest(prompt="x", prompt_logprobs=1, stream=True), "prompt_logprobs"),
        (lambda: CompletionRequest(prompt="x", max_tokens=0), "max_tokens"),
        (
            lambda: ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], echo=True),
            "echo",
        ),
        (lambda: chat(logprobs=True, top_logprobs=21), "top_logprobs"),
        (lambda: chat(max_completion_tokens=0), "max_completion_tokens"),
        (lambda: chat(seed=-1), "seed"),
        (lambda: chat(min_tokens=-1), "min_tokens"),
        (lambda: CompletionRequest(prompt="x", best_of=3), "best_of"),
        (lambda: CompletionRequest(prompt="x", logprobs=50), "logprobs"),
        (lambda: CompletionRequest(prompt=[]), "prompt"),
        (lambda: CompletionRequest(prompt=""), "prompt"),
        (lambda: CompletionRequest(prompt=["a"] * 9, n=2), "prompt"),
    ],
)
def test_refusals_name_the_field(build, field: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        build().to_generate_requests()
    assert e.value.field == field


def test_validation_errors_name_the_field() -> None:
    with pytest.raises(ValidationError) as e:
        CompletionRequest(prompt={"a": 1})
    error = validation_error(RequestValidationError(e.value.errors()))
    assert (error.status, error.param) == (400, "prompt")
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest()
    error = validation_error(RequestValidationError(e.value.errors()))
    assert error.param == "messages" and "required" in error.message


def test_request_path_errors_map_to_http() -> None:
    import grpc

    bad = api_error(
        RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p: too big", "sampling.top_p")
    )
    assert (bad.status, bad.param, bad.message) == (400, "top_p", "top_p: too big")
    long = api_error(
        RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, "x", "prompt", context_length=True)
    )
    assert long.code == "context_length_exceeded"
    assert api_error(RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")).status == 429
    assert api_error(RequestFailed(grpc.StatusCode.UNAVAILABLE, "gone")).status == 503
    assert api_error(RequestFailed(grpc.StatusCode.INTERNAL, "bug")).status == 500


def _usage(prompt: int, completion: int, cached: int) -> generate_pb2.Usage:
    return generate_pb2.Usage(
        prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached
    )


def test_usage_counts_each_prompt_once() -> None:
    choices = [
        Choice(0, usage=_usage(10, 3, 4)),
        Choice(1, usage=_usage(10, 5, 10)),
        Choice(2, usage=_usage(6, 2, 0)),
        Choice(3, usage=_usage(6, 1, 6)),
    ]
    assert usage_dict(choices, n=2) == {
        "prompt_tokens": 16,
        "completion_tokens": 11,
        "total_tokens": 27,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def _entry(token: int, logprob: float, top: list[tuple[int, float]]):
    return generate_pb2.TokenLogprobs(
        token_id=token,
        logprob=logprob,
        top=[generate_pb2.TopLogprob(token_id=t, logprob=v) for t, v in top],
    )


def test_logprob_shapes() -> None:
    texts = {1: "ab", 2: "c", 3: "é"}.__getitem__
    entries = [_entry(1, -0.5, [(1, -0.5), (2, -1.5)]), _entry(3, -0.25, [])]
    chat_format = CompletionFormat(True, "r", "m", texts)  # type: ignore[arg-type]
    content = chat_format.logprobs(0, entries)["content"]
    assert content[0]["token"] == "ab" and content[0]["logprob"] == pytest.approx(-0.5)
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["ab", "c"]
    assert content[1]["bytes"] == list("é".encode())
    text_format = CompletionFormat(False, "r", "m", texts)  # type: ignore[arg-type]
    first = text_format.logprobs(0, entries[:1])
    second = text_format.logprobs(0, entries[1:])
    assert first["tokens"] == ["ab"] and first["top_logprobs"] == [
        {"ab": pytest.approx(-0.5), "c": pytest.approx(-1.5)}
    ]
    assert (first["text_offset"], second["text_offset"]) == ([0], [2])


def test_a_failure_part_way_carries_its_usage() -> None:
    import grpc

    failed = RequestFailed(grpc.StatusCode.UNAVAILABLE, "decode worker gone")
    failed.usage = _usage(10, 4, 2)
    body = api_error(failed).body()
    assert body["error"]["code"] == "unavailable"
    assert body["usage"]["completion_tokens"] == 4 and body["usage"]["total_tokens"] == 14
    assert "usage" not in api_error(RequestFailed(grpc.StatusCode.UNAVAILABLE, "x")).body()


def test_known_fields_at_their_neutral_values_are_accepted() -> None:
    neutral = chat(modalities=["text"], skip_special_tokens=True, use_beam_search=False,
                   length_penalty=1.0, add_generation_prompt=True, functions=[])  # fmt: skip
    assert len(neutral.to_generate_requests()) == 1

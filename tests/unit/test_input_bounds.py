"""Every value a client can put in a request is bounded before it reaches the engine:
numbers outside their protobuf field's range, non-finite floats, text that is not valid
Unicode, too many or too long stop strings, and prompts too long (in characters, checked
before tokenizing) are refused naming the field; a subnormal temperature samples as greedy
instead of turning the logits into NaN."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
import torch
from transformers import AutoTokenizer

from pdserve.common.errors import InvalidRequestError
from pdserve.common.sampler import Sampler
from pdserve.common.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams
from pdserve.services.coordinator.openai_protocol import ChatCompletionRequest, CompletionRequest
from pdserve.services.frontend import ContextLengthError, Frontend
from pdserve.v1 import generate_pb2


def chat(content: str = "hi", **fields) -> list[generate_pb2.GenerateRequest]:
    return ChatCompletionRequest(
        messages=[{"role": "user", "content": content}], **fields
    ).to_generate_requests()


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: chat(max_tokens=-1), "max_tokens"),
        (lambda: chat(max_tokens=2**32), "max_tokens"),
        (lambda: chat(max_completion_tokens=2**40), "max_tokens"),
        (lambda: chat(top_k=2**31), "top_k"),
        (lambda: chat(top_k=-(2**31) - 1), "top_k"),
        (lambda: chat(seed=-1), "seed"),
        (lambda: chat(seed=2**64), "seed"),
        (lambda: chat(min_tokens=2**32), "min_tokens"),
        (lambda: chat(stop_token_ids=[2**32]), "stop_token_ids"),
        (lambda: chat(temperature=math.inf), "temperature"),
        (lambda: chat(temperature=1e39), "temperature"),
        (lambda: chat(top_p=math.nan), "top_p"),
        (lambda: chat(stop=["ok", "\ud800"]), "stop[1]"),
        (lambda: chat(content="a\udfffb"), "messages[0].content"),
        (lambda: CompletionRequest(prompt=[1, 2**32]).to_generate_requests(), "prompt"),
        (lambda: CompletionRequest(prompt="\ud83d").to_generate_requests(), "prompt"),
        (lambda: CompletionRequest(prompt="x", logprobs=2**40).to_generate_requests(), "logprobs"),
    ],
)
def test_http_values_outside_their_field_are_refused(build, field) -> None:
    with pytest.raises(InvalidRequestError) as e:
        build()
    assert e.value.field == field, e.value


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(stop=["s"] * (MAX_STOP_STRINGS + 1)), "stop"),
        (SamplingParams(stop=["x" * (MAX_STOP_CHARS + 1)]), "stop"),
        (SamplingParams(stop_token_ids=list(range(257))), "stop_token_ids"),
        (SamplingParams(temperature=math.nan), "temperature"),
        (SamplingParams(temperature=-math.inf), "temperature"),
        (SamplingParams(seed=2**64), "seed"),
        (SamplingParams(stop_token_ids=[True]), "stop_token_ids"),
    ],
)
def test_engine_params_are_bounded(params, field) -> None:
    with pytest.raises(InvalidRequestError) as e:
        params.validate()
    assert e.value.field == field


def test_limits_themselves_are_accepted() -> None:
    SamplingParams(stop=["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS).validate()
    [request] = chat(max_tokens=2**32 - 1, top_k=2**31 - 1, seed=2**63 - 1)
    assert request.sampling.max_tokens == 2**32 - 1


def test_subnormal_temperature_samples_greedy() -> None:
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]])
    for temperature in (1e-39, 1e-30, 1e-6):
        params = SamplingParams(temperature=temperature, seed=1).validate()
        assert params.greedy
        generator = torch.Generator().manual_seed(1)
        assert Sampler().sample(logits, [params], [generator]).token_ids == [1]
    assert not SamplingParams(temperature=1e-4).greedy


@pytest.fixture(scope="module")
def frontend(default_model_dir) -> Frontend:
    return Frontend(AutoTokenizer.from_pretrained(default_model_dir), 49152, 64)


class CountingTokenizer:
    """Wraps a tokenizer and counts encodes: a refusal by size must not tokenize."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def get_vocab(self):
        return self.inner.get_vocab()

    def encode(self, text):
        self.calls += 1
        return self.inner.encode(text)


def test_prompt_too_long_in_characters_is_refused_before_tokenizing(default_model_dir) -> None:
    tokenizer = CountingTokenizer(AutoTokenizer.from_pretrained(default_model_dir))
    frontend = Frontend(tokenizer, 49152, 64)
    longest = max(len(t) for t in tokenizer.get_vocab())
    assert frontend.max_prompt_chars == 64 * longest
    with pytest.raises(ContextLengthError) as e:
        frontend.check_size(generate_pb2.GenerateRequest(prompt="a" * (64 * longest + 1)))
    assert e.value.field == "prompt" and str(64 * longest) in str(e.value)
    with pytest.raises(ContextLengthError):
        frontend.parse(generate_pb2.GenerateRequest(prompt="b" * (64 * longest + 1)))
    assert tokenizer.calls == 0
    frontend.parse(generate_pb2.GenerateRequest(prompt="short"))  # the bound is not too tight
    assert tokenizer.calls == 1


def test_too_many_messages_or_token_ids_are_refused_by_count(frontend) -> None:
    many = [generate_pb2.ChatMessage(role="user", content="") for _ in range(64)]
    with pytest.raises(ContextLengthError) as e:
        frontend.check_size(generate_pb2.GenerateRequest(messages=many))
    assert e.value.field == "messages"
    with pytest.raises(ContextLengthError) as e:
        frontend.check_size(generate_pb2.GenerateRequest(token_ids=[1] * 64))
    assert e.value.field == "token_ids"


def test_a_chat_template_refusal_is_a_bad_request(default_model_dir, tmp_path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('unsupported role ' + m.role) }}{% endif %}{{ m.content }}"
        "{% endfor %}"
    )
    frontend = Frontend(tokenizer, 49152, 64)
    bad = generate_pb2.GenerateRequest(
        messages=[generate_pb2.ChatMessage(role="tool", content="a")]  # OpenAI's; not this model's
    )
    with pytest.raises(InvalidRequestError) as e:
        frontend.parse(bad)
    assert e.value.field == "messages" and "unsupported role tool" in str(e.value)


@pytest.mark.parametrize("role", ["hacker", "", "User", "function", "x" * 1000])
def test_roles_outside_openais_are_refused_naming_the_message(frontend, role) -> None:
    messages = [generate_pb2.ChatMessage(role="system", content="Be brief."),
                generate_pb2.ChatMessage(role=role, content="hi")]  # fmt: skip
    with pytest.raises(InvalidRequestError) as e:
        frontend.parse(generate_pb2.GenerateRequest(messages=messages))
    assert e.value.field == "messages[1].role"
    assert "system, developer, user, assistant, tool" in str(e.value)
    assert len(str(e.value)) < 200  # a long role is not echoed whole


def test_every_openai_role_is_taken(frontend) -> None:
    for role in ("system", "developer", "user", "assistant", "tool"):
        messages = [generate_pb2.ChatMessage(role=role, content="hi")]
        assert frontend.parse(generate_pb2.GenerateRequest(messages=messages)).token_ids


def test_parse_async_tokenizes_off_the_event_loop(frontend) -> None:
    seen = []
    inner = frontend.tokenizer.encode

    def encode(text):
        seen.append(threading.current_thread().name)
        return inner(text)

    frontend.tokenizer.encode = encode
    try:
        parsed = asyncio.run(frontend.parse_async(generate_pb2.GenerateRequest(prompt="hello")))
    finally:
        del frontend.tokenizer.encode
    assert parsed.token_ids == inner("hello")
    assert seen and seen[0].startswith("pdserve-tokenize")

"""The coordinator's front door (`GenerateRequest` → token ids, params, id) and its worker
picking. Every refusal names the field as the client spelled it."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pdserve.common.errors import InvalidRequestError
from pdserve.services.frontend import Frontend
from pdserve.v1 import generate_pb2


@pytest.fixture(scope="module")
def frontend(default_model_dir) -> Frontend:
    return Frontend(AutoTokenizer.from_pretrained(default_model_dir), 49152, 64)


def _request(**kw) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(**kw)


def test_prompt_messages_and_token_ids(frontend):
    text = frontend.parse(_request(prompt="Hello there"))
    assert text.token_ids == frontend.tokenizer.encode("Hello there")
    assert text.request_id.startswith("pd-") and text.params.max_tokens == 16
    chat = frontend.parse(
        _request(messages=[generate_pb2.ChatMessage(role="user", content="Hi")], request_id="c")
    )
    assert chat.request_id == "c"
    assert frontend.tokenizer.decode(chat.token_ids).endswith("<|im_start|>assistant\n")
    ids = frontend.parse(_request(token_ids=[1, 2, 3]))
    assert ids.token_ids == [1, 2, 3]


def test_sampling_defaults_and_values(frontend):
    unset = frontend.parse(_request(prompt="x")).params
    assert (unset.temperature, unset.top_p, unset.top_k, unset.seed) == (1.0, 1.0, -1, None)
    sampling = generate_pb2.SamplingParams(
        max_tokens=5, temperature=0, top_k=3, seed=0, stop=["a"], ignore_eos=True
    )
    params = frontend.parse(_request(prompt="x", sampling=sampling)).params
    assert (params.max_tokens, params.temperature, params.top_k, params.seed) == (5, 0.0, 3, 0)
    assert params.stop == ["a"] and params.ignore_eos


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(), r"^prompt: give exactly one .* \(all are empty\)"),
        (dict(prompt="a", token_ids=[1]), r"^prompt: .*\(got prompt, token_ids\)"),
        (dict(token_ids=[0, 49152]), r"^token_ids: ids must be in \[0, 49152\), got 49152"),
        (dict(token_ids=[5] * 64), r"^token_ids: 64 tokens leaves no room .* 64 tokens"),
        (dict(prompt="x", request_id="r" * 257), r"^request_id: at most 256"),
        (dict(prompt="x", sampling=generate_pb2.SamplingParams(top_p=0)), r"^sampling.top_p"),
        (dict(prompt="x", sampling=generate_pb2.SamplingParams(top_k=0)), r"^sampling.top_k"),
        (dict(messages=[generate_pb2.ChatMessage(role="user")]), None),
    ],
)
def test_refusals_name_the_field(frontend, kw, message):
    if message is None:  # an empty message is allowed: the template still makes a prompt
        assert frontend.parse(_request(**kw)).token_ids
        return
    with pytest.raises(InvalidRequestError, match=message):
        frontend.parse(_request(**kw))

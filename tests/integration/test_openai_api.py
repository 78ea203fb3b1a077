"""The OpenAI-compatible HTTP API on real processes (coordinator with `--http-port`, one
prefill and one decode worker, the default model), called with the official `openai` client
and with raw HTTP: the same greedy text as the gRPC API, streaming, stop / min_tokens /
seed / logprobs / n, usage, every error's status and shape, 32 concurrent streams, and a
disconnect that frees the request's blocks on both workers."""

from __future__ import annotations

import asyncio
import http.client
import json

import grpc
import openai
import pytest

from pdserve.v1 import generate_pb2, generate_pb2_grpc
from services import post, running, start, wait_idle

pytestmark = pytest.mark.slow

WORKER_ARGS = ["--kv-cache-tokens", "16384", "--threads", "1"]
QUESTION = "What is the capital of France?"
API_KEY = "sk-test-key"


def ask(question: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def cluster():
    prefill = start("prefill", *WORKER_ARGS)
    decode = start("decode", *WORKER_ARGS)
    coordinator = start(
        "coordinator",
        f"--prefill-workers={prefill.grpc}",
        f"--decode-workers={decode.grpc}",
        "--http-port=0",
    )
    try:
        yield {"prefill": prefill, "decode": decode, "coordinator": coordinator}
    finally:
        for service in (coordinator, decode, prefill):
            service.stop()


@pytest.fixture(scope="module")
def http_address(cluster) -> str:
    return cluster["coordinator"].info["http"]


@pytest.fixture(scope="module")
def client(http_address) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{http_address}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_served_model(client, model):
    [card] = client.models.list().data
    assert card.id == model == "SmolLM2-135M-Instruct"


def test_models_retrieve_names_one_model_or_404(client, model):
    card = client.models.retrieve(model)
    assert (card.id, card.object, card.owned_by) == (model, "model", "pdserve")
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"


def test_greedy_chat_equals_grpc(cluster, client, model):
    channel = grpc.insecure_channel(cluster["coordinator"].grpc)
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    grpc_text, grpc_tokens = "", 0
    for r in stub.Generate(
        generate_pb2.GenerateRequest(
            messages=[generate_pb2.ChatMessage(role="user", content=QUESTION)],
            sampling=generate_pb2.SamplingParams(max_tokens=24, temperature=0),
        )
    ):
        grpc_text += r.text
        grpc_tokens += len(r.token_ids)
    channel.close()
    reply = client.chat.completions.create(
        model=model, messages=ask(), max_tokens=24, temperature=0
    )
    assert reply.choices[0].message.content == grpc_text
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.completion_tokens == grpc_tokens
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + grpc_tokens
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")


def test_streamed_chat_equals_unstreamed(client, model):
    whole = client.chat.completions.create(
        model=model, messages=ask(), max_tokens=16, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=model, messages=ask(), max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert len(deltas) >= 3  # token by token, not one lump
    assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == whole.choices[0].finish_reason and set(finish[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # The whole prompt was seen a moment ago: the prefill worker's prefix cache serves it.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_completions_with_text_and_token_prompts(client, model):
    text = client.completions.create(model=model, prompt="The sky is", max_tokens=6, temperature=0)
    assert text.object == "text_completion" and text.choices[0].finish_reason == "length"
    assert text.usage.completion_tokens == 6
    streamed = client.completions.create(
        model=model, prompt="The sky is", max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text
    ids = client.completions.create(model=model, prompt=[504, 3820, 314], max_tokens=3)
    assert ids.usage.prompt_tokens == 3
    both = client.completions.create(
        model=model, prompt=["The sky is", "Water is"], max_tokens=4, temperature=0
    )
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == text.choices[0].text[: len(both.choices[0].text)]
    assert both.usage.completion_tokens == 8


def test_stop_string_cuts_the_text(client, model):
    full = (
        client.chat.completions.create(model=model, messages=ask(), max_tokens=24, temperature=0)
        .choices[0]
        .message.content
    )
    assert " Paris" in full  # the premise of the test
    cut = client.chat.completions.create(
        model=model, messages=ask(), max_tokens=24, temperature=0, stop=[" Paris"]
    ).choices[0]
    assert cut.message.content == full[: full.index(" Paris")]
    assert cut.finish_reason == "stop"


def test_min_tokens_holds_off_the_end(client, model):
    short = client.chat.completions.create(
        model=model, messages=ask(), max_tokens=40, temperature=0
    )
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 20
    held = client.chat.completions.create(
        model=model, messages=ask(), max_tokens=40, temperature=0, extra_body={"min_tokens": 20}
    )
    assert held.usage.completion_tokens >= 20


def test_seed_reproduces_and_n_gives_distinct_choices(client, model):
    def sample(seed: int, n: int = 1):
        return client.chat.completions.create(
            model=model, messages=ask("Write a list of random words."), max_tokens=16,
            temperature=1.0, seed=seed, n=n,
        )  # fmt: skip

    a, b, c = sample(1234), sample(1234), sample(99)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content != c.choices[0].message.content
    two = sample(1234, n=2)
    assert [ch.index for ch in two.choices] == [0, 1]
    assert two.choices[0].message.content == a.choices[0].message.content  # choice 0: seed
    assert two.choices[1].message.content != two.choices[0].message.content  # choice 1: seed+1
    assert two.usage.prompt_tokens == a.usage.prompt_tokens  # the prompt counts once


def test_logprobs(client, model):
    reply = client.chat.completions.create(
        model=model, messages=ask(), max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for entry in content:  # greedy: the sampled token is the most likely one
        assert len(entry.top_logprobs) == 3
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.logprob <= 0
    text = client.completions.create(
        model=model, prompt="The sky is", max_tokens=4, temperature=0, logprobs=2
    ).choices[0]
    assert len(text.logprobs.tokens) == 4 and all(len(t) == 2 for t in text.logprobs.top_logprobs)


def test_bad_fields_get_400_naming_them(http_address):
    cases = [
        ({"messages": ask(), "temperature": -1}, "temperature"),
        ({"messages": ask(), "top_p": 0}, "top_p"),
        ({"messages": ask(), "max_tokens": 0}, "max_tokens"),
        ({"messages": ask(), "n": 100}, "n"),
        ({"messages": ask(), "presence_penalty": 3.0}, "presence_penalty"),
        ({"messages": ask(), "repetition_penalty": 0}, "repetition_penalty"),
        ({"messages": ask(), "logit_bias": {"999999": 5}}, "logit_bias"),
        ({"messages": "hello"}, "messages"),
        ({"max_tokens": 5}, "messages"),
    ]
    for body, param in cases:
        status, _, payload = post(http_address, "/v1/chat/completions", body)
        assert status == 400, body
        error = payload["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param and param in error["message"], error
        assert error["type"] == "invalid_request_error"


def test_malformed_bodies_never_crash(http_address, client, model):
    for body, headers in [
        (b"{not json", {}),
        (b"", {}),
        (b"[1, 2]", {}),
        (json.dumps({"messages": ask()}).encode(), {"Content-Type": "text/plain"}),
        (b"\xff\xfe", {}),
    ]:
        status, _, payload = post(http_address, "/v1/chat/completions", body, headers)
        assert status == 400, body
        assert payload["error"]["message"], body
    assert client.chat.completions.create(model=model, messages=ask(), max_tokens=2)


def test_unknown_model_is_404(http_address):
    status, _, payload = post(
        http_address, "/v1/chat/completions", {"model": "gpt-nope", "messages": ask()}
    )
    assert status == 404 and payload["error"]["code"] == "model_not_found"
    assert payload["error"]["param"] == "model"


@pytest.fixture(scope="module")
def guarded(cluster):
    """A second coordinator over the same workers: an API key, a 64-token context and room
    for one request in flight."""
    with running(
        "coordinator",
        f"--prefill-workers={cluster['prefill'].grpc}",
        f"--decode-workers={cluster['decode'].grpc}",
        "--http-port=0",
        "--max-model-len=64",
        "--max-inflight-requests=1",
        env={"PDSERVE_API_KEY": API_KEY},
    ) as coordinator:
        yield coordinator.info["http"]


def test_api_key_is_required_when_set(guarded):
    body = {"messages": ask(), "max_tokens": 2}
    status, _, payload = post(guarded, "/v1/chat/completions", body)
    assert status == 401 and payload["error"]["type"] == "authentication_error"
    status, _, _ = post(guarded, "/v1/chat/completions", body, {"Authorization": "Bearer nope"})
    assert status == 401
    ok = openai.OpenAI(base_url=f"http://{guarded}/v1", api_key=API_KEY, max_retries=0)
    assert ok.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ask(), max_tokens=2)


def test_prompt_over_the_context_is_400(guarded):
    status, _, payload = post(
        guarded,
        "/v1/completions",
        {"prompt": [500] * 100, "max_tokens": 4},
        {"Authorization": f"Bearer {API_KEY}"},
    )
    assert status == 400 and payload["error"]["code"] == "context_length_exceeded"
    assert payload["error"]["param"] == "prompt" and "64" in payload["error"]["message"]


def test_full_coordinator_answers_429_with_retry_after(guarded):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    host, port = guarded.rsplit(":", 1)
    holder = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"prompt": "Count:", "max_tokens": 40, "ignore_eos": True, "stream": True}
    holder.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", **headers}
    )
    response = holder.getresponse()
    assert response.status == 200
    response.readline()  # the first token is out: the request is in flight
    status, got_headers, payload = post(
        guarded, "/v1/completions", {"prompt": "x", "max_tokens": 2}, headers
    )
    holder.close()
    assert status == 429 and payload["error"]["type"] == "rate_limit_error"
    assert int(got_headers["Retry-After"]) >= 1


def test_no_worker_is_503():
    with running(
        "coordinator", "--prefill-workers=127.0.0.1:9", "--decode-workers=127.0.0.1:9",
        "--http-port=0",
    ) as coordinator:  # fmt: skip
        status, _, payload = post(
            coordinator.info["http"], "/v1/completions", {"prompt": "hi", "max_tokens": 2}
        )
    assert status == 503 and "127.0.0.1:9" in payload["error"]["message"]


def test_32_concurrent_streams_and_no_block_leaks(cluster, http_address, model):
    free = {role: cluster[role].free_blocks() for role in ("prefill", "decode")}
    aclient = openai.AsyncOpenAI(
        base_url=f"http://{http_address}/v1", api_key="unused", max_retries=0
    )

    async def one(i: int) -> tuple[str, int]:
        stream = await aclient.chat.completions.create(
            model=model, messages=ask(f"Say the number {i}."), max_tokens=8, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        text, usage = "", 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            elif chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, usage

    async def main() -> list[tuple[str, int]]:
        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert all(text and 1 <= usage <= 8 for text, usage in results)
    assert wait_idle(cluster, free) == free


def test_disconnect_cancels_on_the_workers(cluster, http_address):
    free = {role: cluster[role].free_blocks() for role in ("prefill", "decode")}
    decode = cluster["decode"]
    host, port = http_address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"prompt": "Count to a thousand:", "max_tokens": 2000, "ignore_eos": True,
            "stream": True}  # fmt: skip
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    events = 0
    while events < 4:  # a few tokens: the request runs on the decode worker
        if response.readline().startswith(b"data: "):
            events += 1
    assert decode.metric("pdserve_num_requests_running") >= 1
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    assert wait_idle(cluster, free) == free
    assert decode.metric("pdserve_num_requests_running") == 0


def test_logit_bias_and_penalties_change_the_choice(client, model, default_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    yes = tokenizer.encode(" yes", add_special_tokens=False)[0]
    forced = client.completions.create(
        model=model, prompt="Hello", max_tokens=5, temperature=0, logit_bias={str(yes): 100}
    )
    assert forced.choices[0].text == tokenizer.decode([yes] * 5)
    ask_twice = {"model": model, "prompt": "List some fruits:", "max_tokens": 24,
                 "temperature": 0}  # fmt: skip
    plain = client.completions.create(**ask_twice).choices[0].text
    penalised = client.completions.create(**ask_twice, frequency_penalty=2.0).choices[0].text
    banned = client.completions.create(
        **ask_twice, extra_body={"bad_words": [plain.split()[0]]}
    ).choices[0].text  # fmt: skip
    assert penalised != plain and plain.split()[0] not in banned.split()[:1]

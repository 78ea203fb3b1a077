"""The OpenAI-compatible HTTP API's responses: the coordinator's `GenerateResponse`s become
chat / text completion objects and stream chunks, with usage (cached prompt tokens in
`prompt_tokens_details`) and log-probabilities in each endpoint's own shape, and errors in
OpenAI's `{"error": {...}}` shape."""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.services.coordinator.tool_calls import ToolPlan, ToolStream
from pdserve.v1 import generate_pb2

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "internal_error"),
            "param": param,
            "code": code,
        }
    }


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class TokenTexts:
    """Each token's own text, for log-probability entries (cached: a vocabulary is small)."""

    def __init__(self, tokenizer: Any) -> None:
        self._decode = functools.lru_cache(maxsize=1 << 16)(
            lambda token_id: tokenizer.decode([token_id])
        )

    def __call__(self, token_id: int) -> str:
        return self._decode(token_id)


@dataclass
class Choice:
    """One choice's accumulated output."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    usage: generate_pb2.Usage | None = None
    logprobs: list[generate_pb2.TokenLogprobs] = field(default_factory=list)
    # With prompt logprobs: the prompt's ids and its tokens' entries (token i + 1's at i).
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[generate_pb2.TokenLogprobs] = field(default_factory=list)


@dataclass(frozen=True)
class Echo:
    """A completion's `echo`: each choice's text starts with its prompt's (`prompts[k]` is
    choice k's); `only`: `max_tokens: 0`, the prompt alone."""

    prompts: list[str]
    only: bool


def usage_dict(choices: list[Choice], n: int) -> dict[str, Any]:
    """Usage over all choices; a prompt's tokens count once however many choices (n) it
    has, as OpenAI counts them."""
    done = [c for c in choices if c.usage is not None]
    firsts = [c.usage for c in done if c.index % n == 0]
    prompt = sum(u.prompt_tokens for u in firsts)  # type: ignore[union-attr]
    cached = sum(u.cached_tokens for u in firsts)  # type: ignore[union-attr]
    completion = sum(c.usage.completion_tokens for c in done)  # type: ignore[union-attr]
    return _usage(prompt, completion, cached)


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class CompletionFormat:
    """The fields that differ between `/v1/chat/completions` and `/v1/completions`."""

    def __init__(
        self,
        chat: bool,
        request_id: str,
        model: str,
        texts: TokenTexts,
        tools: ToolPlan | None = None,
        echo: Echo | None = None,
        prompt_logprobs: bool = False,
    ) -> None:
        self.chat = chat
        self.echo = echo  # completions only
        self.prompt_logprobs = prompt_logprobs  # the client asked for vLLM's field
        self.tools = tools  # a chat request's tools: its output is read for calls
        self.tool_streams: dict[int, ToolStream] = {}
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.model = model
        self.created = int(time.time())
        self.texts = texts
        self.offsets: dict[int, int] = {}  # completions' text_offset, per choice

    def _head(self, chunk: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def logprobs(
        self,
        index: int,
        entries: list[generate_pb2.TokenLogprobs],
        prompt: Choice | None = None,
    ) -> Any:
        """The choice's log-probabilities in the endpoint's shape; a completion that echoes
        its prompt (`prompt`: the choice, holding the prompt's entries) starts with the
        prompt's tokens, the first of which has none."""
        if self.chat:
            return {"content": [self._chat_logprob(e) for e in entries]}
        ids = [e.token_id for e in entries]
        values: list[float | None] = [e.logprob for e in entries]
        tops: list[dict[str, float] | None] = [self._top(e) for e in entries]
        if prompt is not None and prompt.prompt_token_ids:
            given = prompt.prompt_logprobs
            ids = prompt.prompt_token_ids + ids
            values = [None] + [e.logprob for e in given] + values
            tops = [None] + [self._top(e) for e in given] + tops
        tokens = [self.texts(t) for t in ids]
        offsets = []
        offset = self.offsets.get(index, 0)
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        self.offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _top(self, entry: generate_pb2.TokenLogprobs) -> dict[str, float]:
        return {self.texts(t.token_id): t.logprob for t in entry.top}

    def vllm_prompt_logprobs(self, choice: Choice) -> list[dict[str, Any] | None]:
        """vLLM's `prompt_logprobs`: None for the first prompt token, then per token a map
        from token id to its logprob, rank and text: the prompt's token and the best ones."""
        out: list[dict[str, Any] | None] = [None]
        for entry in choice.prompt_logprobs:
            step = {str(entry.token_id): self._vllm_entry(entry.token_id, entry.logprob,
                                                          entry.rank)}  # fmt: skip
            for rank, top in enumerate(entry.top, start=1):
                step.setdefault(str(top.token_id), self._vllm_entry(top.token_id, top.logprob,
                                                                    rank))  # fmt: skip
            out.append(step)
        return out

    def _vllm_entry(self, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": self.texts(token_id)}

    def _chat_logprob(self, entry: generate_pb2.TokenLogprobs) -> dict[str, Any]:
        def one(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.texts(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            **one(entry.token_id, entry.logprob),
            "top_logprobs": [one(t.token_id, t.logprob) for t in entry.top],
        }

    def chunk(
        self,
        index: int,
        response: generate_pb2.GenerateResponse,
        first: bool,
        want_logprobs: bool,
        include_usage: bool,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        finish_reason = response.finish_reason or None
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            delta["content"] = response.text
            if self.tools is not None:
                finish_reason = self._tool_delta(index, delta, response)
            choice["delta"] = delta
        else:
            choice["text"] = response.text
        entries = list(response.logprobs)
        if self.echo is not None:
            if self.echo.only:  # the one token generated is dropped
                choice["text"], entries = "", []
                finish_reason = "length" if finish_reason else None
            if first:
                choice["text"] = self.echo.prompts[index] + choice["text"]
        echoed = self._echoed(response) if first else None
        choice["logprobs"] = self.logprobs(index, entries, echoed) if want_logprobs else None
        choice["finish_reason"] = finish_reason
        out = {**self._head(chunk=True), "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    def _echoed(self, response: generate_pb2.GenerateResponse) -> Choice | None:
        """A first chunk's prompt entries, when the completion echoes its prompt."""
        if self.echo is None or not response.prompt_token_ids:
            return None
        return Choice(-1, prompt_token_ids=list(response.prompt_token_ids),
                      prompt_logprobs=list(response.prompt_logprobs))  # fmt: skip

    def _tool_delta(
        self, index: int, delta: dict[str, Any], response: generate_pb2.GenerateResponse
    ) -> str | None:
        """Content up to a call; at the end, the calls (OpenAI's delta shape). The finish
        reason is "tool_calls" when the output was calls."""
        assert self.tools is not None
        stream = self.tool_streams.setdefault(index, ToolStream(self.tools))
        delta["content"] = stream.feed(response.text)
        if not response.finish_reason:
            return None
        rest, calls = stream.finish()
        delta["content"] = delta["content"] + rest or None
        if not calls:
            return response.finish_reason
        delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
        return "tool_calls" if response.finish_reason == "stop" else response.finish_reason

    def usage_chunk(self, choices: list[Choice], n: int) -> dict[str, Any]:
        return {**self._head(chunk=True), "choices": [], "usage": usage_dict(choices, n)}

    def final(self, choices: list[Choice], n: int, want_logprobs: bool) -> dict[str, Any]:
        out = []
        for c in choices:
            entry: dict[str, Any] = {"index": c.index}
            finish_reason = c.finish_reason
            if self.chat:
                entry["message"] = {"role": "assistant", "content": c.text}
                if self.tools is not None:
                    content, calls = self.tools.parse(c.text)
                    if calls:
                        entry["message"] = {"role": "assistant", "content": content,
                                            "tool_calls": calls}  # fmt: skip
                        finish_reason = "tool_calls" if c.finish_reason == "stop" else finish_reason
            else:
                entry["text"] = c.text
            entries, echoed = c.logprobs, None
            if self.echo is not None:
                if self.echo.only:
                    entry["text"], entries, finish_reason = "", [], "length"
                entry["text"] = self.echo.prompts[c.index] + entry["text"]
                echoed = c
            entry["logprobs"] = self.logprobs(c.index, entries, echoed) if want_logprobs else None
            entry["finish_reason"] = finish_reason
            if self.prompt_logprobs and not self.chat:
                entry["prompt_logprobs"] = self.vllm_prompt_logprobs(c)
            out.append(entry)
        usage = usage_dict(choices, n)
        if self.echo is not None and self.echo.only:  # nothing generated that counts
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            usage = _usage(usage["prompt_tokens"], 0, cached)
        body = {**self._head(chunk=False), "choices": out, "usage": usage}
        if self.prompt_logprobs and self.chat:  # vLLM: one list for the request's prompt
            body["prompt_logprobs"] = self.vllm_prompt_logprobs(choices[0])
        return body

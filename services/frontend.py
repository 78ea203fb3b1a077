"""Step 1 of a request's path, shared by the coordinator and a colocated worker: a
`GenerateRequest` becomes token ids, validated sampling params and a request id. Exactly one
of prompt / messages / token_ids; chat messages (of OpenAI's roles only) go through the
model's chat template; the prompt must fit the model's context. Every refusal names the
field and the limit."""

from __future__ import annotations

import asyncio
import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from pdserve.common.errors import InvalidRequestError
from pdserve.common.prompts import Prompt, tokenize_prompt
from pdserve.common.sampling_params import SamplingParams
from pdserve.services.convert import params_from_proto
from pdserve.v1 import generate_pb2

MAX_REQUEST_ID_LEN = 256
# The chat roles OpenAI's API takes ("function", its deprecated one, is not served).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ContextLengthError(InvalidRequestError):
    """The prompt does not fit the model's context."""


@dataclass
class ParsedRequest:
    request_id: str
    token_ids: list[int]
    params: SamplingParams


def longest_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters one token stands for: the longest entry of the
    vocabulary (byte-level entries spell one byte per character, so decoded text is never
    longer)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


class Frontend:
    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_prompt_chars = max_model_len * longest_token_chars(tokenizer)
        # One thread: a Rust-backed tokenizer used from two threads can fail ("Already
        # borrowed"), and one thread keeps tokenizing from taking both cores from the engine.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="pdserve-tokenize")

    async def parse_async(
        self, request: generate_pb2.GenerateRequest, fill_context: bool = False
    ) -> ParsedRequest:
        """`parse` on the tokenizer's thread; the cheap checks run first, on the caller's."""
        self.check_size(request)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.parse, request, fill_context)

    def check_size(self, request: generate_pb2.GenerateRequest) -> None:
        """Refuse a prompt that cannot fit the context, from its size alone."""
        if len(request.token_ids) >= self.max_model_len:
            raise ContextLengthError(
                "token_ids",
                f"{len(request.token_ids)} tokens leaves no room to generate within the "
                f"model's context of {self.max_model_len} tokens",
            )
        if len(request.messages) >= self.max_model_len:
            raise ContextLengthError(
                "messages",
                f"{len(request.messages)} messages cannot fit the model's context of "
                f"{self.max_model_len} tokens",
            )
        field = "messages" if request.messages else "prompt"
        chars = len(request.prompt) + sum(len(m.content) + len(m.role) for m in request.messages)
        if chars > self.max_prompt_chars:
            raise ContextLengthError(
                field,
                f"{chars} characters cannot fit the model's context of {self.max_model_len} "
                f"tokens (at most {self.max_prompt_chars} characters)",
            )

    def parse(
        self, request: generate_pb2.GenerateRequest, fill_context: bool = False
    ) -> ParsedRequest:
        """`fill_context`: an unset max_tokens means the rest of the context (the HTTP
        API's default) rather than the gRPC default of 16."""
        given = [
            name
            for name, present in (
                ("prompt", bool(request.prompt)),
                ("messages", len(request.messages) > 0),
                ("token_ids", len(request.token_ids) > 0),
            )
            if present
        ]
        if len(given) != 1:
            raise InvalidRequestError(
                "prompt",
                "give exactly one of prompt, messages or token_ids"
                + (f" (got {', '.join(given)})" if given else " (all are empty)"),
            )
        if len(request.request_id) > MAX_REQUEST_ID_LEN:
            raise InvalidRequestError(
                "request_id",
                f"at most {MAX_REQUEST_ID_LEN} characters, got {len(request.request_id)}",
            )
        prompt: Prompt
        if request.prompt:
            prompt = request.prompt
        elif request.messages:
            for i, m in enumerate(request.messages):
                if m.role not in CHAT_ROLES:
                    shown = m.role[:32] + ("..." if len(m.role) > 32 else "")
                    raise InvalidRequestError(
                        f"messages[{i}].role",
                        f"must be one of {', '.join(CHAT_ROLES)}, got {shown!r}",
                    )
            prompt = [_message(i, m) for i, m in enumerate(request.messages)]
        else:
            prompt = list(request.token_ids)
        params = params_from_proto(request.sampling)
        if params.structured is not None:  # parsed here; the workers compile it
            params.structured.check()
        for name, ids in (("logit_bias", params.logit_bias),
                          ("allowed_token_ids", params.allowed_token_ids)):  # fmt: skip
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"sampling.{name}", f"token ids must be in [0, {self.vocab_size}), got {bad}"
                )
        self.check_size(request)
        try:
            token_ids = tokenize_prompt(self.tokenizer, prompt, self.vocab_size,
                                        _tools(request.tools))  # fmt: skip
        except TemplateError as e:
            raise InvalidRequestError(
                "messages", f"the model's chat template refused them: {e}"
            ) from None
        if len(token_ids) >= self.max_model_len:
            raise ContextLengthError(
                given[0],
                f"{len(token_ids)} tokens leaves no room to generate within the model's "
                f"context of {self.max_model_len} tokens",
            )
        if fill_context and not request.sampling.HasField("max_tokens"):
            params.max_tokens = self.max_model_len - len(token_ids)
            params.validate()
        return ParsedRequest(request.request_id or f"pd-{uuid.uuid4().hex}", token_ids, params)


def _message(index: int, m: generate_pb2.ChatMessage) -> dict[str, Any]:
    """A chat turn as chat templates take it: tool calls with their arguments as objects."""
    message: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        calls = []
        for j, call in enumerate(m.tool_calls):
            field = f"messages[{index}].tool_calls[{j}].function.arguments"
            function = {"name": call.name, "arguments": _json_object(call.arguments, field)}
            calls.append({"id": call.id, "type": "function", "function": function})
        message["tool_calls"] = calls
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    return message


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """The request's tools, OpenAI-shaped, for the chat template."""
    if not tools:
        return None
    return [
        {"type": "function", "function": {
            "name": t.name, "description": t.description,
            "parameters": _json_object(t.parameters, f"tools[{i}].function.parameters")
            if t.parameters else {"type": "object", "properties": {}},
        }}
        for i, t in enumerate(tools)
    ]  # fmt: skip


def _json_object(text: str, field: str) -> dict[str, Any]:
    try:
        value = json.loads(text or "{}")
    except ValueError as e:
        raise InvalidRequestError(field, f"is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(field, "must be a JSON object")
    return value


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> generate_pb2.Usage:
    return generate_pb2.Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, cached_tokens=cached
    )

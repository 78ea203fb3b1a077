"""`POST /v1/responses`, OpenAI's Responses API, served without storing anything: the
request's fields become one `GenerateRequest` of chat messages (the chat template applied on
the request path, as for `/v1/chat/completions`), and its `GenerateResponse`s become one
`response` object or the API's server-sent events, `response.created` through
`response.completed`, each numbered by `sequence_number`. The route around this (auth, the
model check, the request id, cancellation when the client leaves, error statuses) is the
chat route's own (`http_api.py`).

Choices where the API leaves room:
- Nothing is stored. `store: false` is served, and so is a request without `store` (OpenAI's
  default is true; here it means "not stored", since nothing ever is); the stateful fields
  `store: true`, `previous_response_id`, `conversation`, `prompt` (a stored prompt),
  `background: true` and `item_reference` inputs are refused with a 400 that names them.
- `instructions` becomes a system message before `input`; a string `input` is one user
  message; message items take roles user, system, developer and assistant, with a string or
  `input_text` / `output_text` parts as content.
- `text.format` `json_object` / `json_schema` is the same constraint as chat's
  `response_format` (`structured_request.py`), its errors naming `text.format.<field>`.
- Refused with a 400 naming the field unless neutral, as they would change the output and
  are not implemented: `tools` and function-call input items (tool calling is not supported
  yet), `tool_choice` other than none / auto, `include`, `reasoning`, `top_logprobs`,
  `truncation: auto`, `text.verbosity` other than medium.
- Accepted: `metadata` and `user` (echoed), `parallel_tool_calls` and `max_tool_calls`
  (no tools, so no effect), `stream_options.include_obfuscation` (deltas carry no
  obfuscation padding). Unknown fields are ignored, as elsewhere in this API."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import BaseModel

from pdserve.common.errors import InvalidRequestError
from pdserve.services.coordinator.openai_protocol import (
    STRICT,
    UINT32_MAX,
    _finite,
    _in_range,
    _utf8,
)
from pdserve.services.coordinator.openai_responses import Choice
from pdserve.services.coordinator.request_path import RequestFailed
from pdserve.services.coordinator.structured_request import structured_output
from pdserve.v1 import generate_pb2

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
STATELESS = "nothing is stored by this server; send the whole conversation as input"
NOT_YET = "tool calling is not supported yet by /v1/responses"
ITEMS_REFUSED = {
    "function_call": NOT_YET,
    "function_call_output": NOT_YET,
    "item_reference": f"refers to a stored item: {STATELESS}",
}
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
# A request-path field (as `http_api.api_error` names it) as this endpoint's client spelled it.
CLIENT_FIELDS = {"max_tokens": "max_output_tokens", "prompt": "input", "messages": "input",
                 "structured_output": "text.format"}  # fmt: skip
# An error's `type` (OpenAI's error shape) as a failed response's `error.code`.
FAILED_CODES = {"rate_limit_error": "rate_limit_exceeded",
                "invalid_request_error": "invalid_prompt"}  # fmt: skip


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class TextConfig(BaseModel):
    model_config = STRICT

    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesRequest(BaseModel):
    model_config = STRICT

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Stateful: refused unless absent or neutral.
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    background: bool | None = None
    # Not implemented: accepted only at their neutral values.
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    truncation: str | None = None

    def to_generate_request(self) -> generate_pb2.GenerateRequest:
        self._refuse_unsupported()
        self._check_echoed()
        messages = []
        if self.instructions is not None:
            content = _utf8("instructions", self.instructions)
            messages.append(generate_pb2.ChatMessage(role="system", content=content))
        if isinstance(self.input, str):
            content = _utf8("input", self.input)
            messages.append(generate_pb2.ChatMessage(role="user", content=content))
        elif not self.input:
            raise InvalidRequestError("input", "must not be empty")
        else:
            messages.extend(_message(i, item) for i, item in enumerate(self.input))
        sampling = generate_pb2.SamplingParams()
        if self.max_output_tokens is not None:
            _in_range("max_output_tokens", self.max_output_tokens, 1, UINT32_MAX)
            sampling.max_tokens = self.max_output_tokens
        _finite("temperature", self.temperature)
        _finite("top_p", self.top_p)
        if self.temperature is not None:
            sampling.temperature = self.temperature
        if self.top_p is not None:
            sampling.top_p = self.top_p
        constraint = _text_format(self.text_format)
        if constraint is not None:
            sampling.structured_output.CopyFrom(constraint)
        return generate_pb2.GenerateRequest(messages=messages, sampling=sampling)

    @property
    def text_format(self) -> dict[str, Any]:
        given = self.text.format if self.text is not None else None
        return given if given is not None else {"type": "text"}

    def _refuse_unsupported(self) -> None:
        refusals = [
            ("store", self.store is True, f"must be false or absent: {STATELESS}"),
            ("previous_response_id", self.previous_response_id is not None,
             f"responses are not stored, so none can be continued: {STATELESS}"),
            ("conversation", self.conversation is not None, STATELESS),
            ("prompt", self.prompt is not None, "stored prompts are not supported: "
             "send the text as instructions and input"),
            ("background", self.background is True,
             "background responses need stored responses, which this server does not keep"),
            ("tools", bool(self.tools), NOT_YET),
            ("tool_choice", self.tool_choice not in (None, "none", "auto"), NOT_YET),
            ("include", bool(self.include), "is not supported by this server"),
            ("reasoning", not _neutral_reasoning(self.reasoning),
             "is not supported by this server (no reasoning model is served)"),
            ("top_logprobs", self.top_logprobs not in (None, 0),
             "is not supported by this server"),
            ("truncation", self.truncation not in (None, "disabled"),
             "only disabled is supported (a prompt too long for the context is refused)"),
            ("text.verbosity", self.text is not None and self.text.verbosity
             not in (None, "medium"), "is not supported by this server"),
        ]  # fmt: skip
        for name, refused, why in refusals:
            if refused:
                raise InvalidRequestError(name, why)

    def _check_echoed(self) -> None:
        """The strings a response carries back must be valid text, within OpenAI's limits."""
        _utf8("user", self.user)
        metadata = self.metadata or {}
        if len(metadata) > METADATA_PAIRS:
            raise InvalidRequestError("metadata", f"at most {METADATA_PAIRS} pairs")
        for key, value in metadata.items():
            _utf8("metadata", key)
            _utf8(f"metadata.{key}", value)
            if len(key) > METADATA_KEY_CHARS or len(value) > METADATA_VALUE_CHARS:
                raise InvalidRequestError(
                    "metadata",
                    f"keys of at most {METADATA_KEY_CHARS} characters and values of at most "
                    f"{METADATA_VALUE_CHARS}",
                )


def _neutral_reasoning(reasoning: dict[str, Any] | None) -> bool:
    given = {k: v for k, v in (reasoning or {}).items() if v is not None}
    return given in ({}, {"effort": "none"})


def _message(i: int, item: dict[str, Any]) -> generate_pb2.ChatMessage:
    """Input item `i`, which must be a message with text content."""
    where = f"input[{i}]"
    kind = item.get("type")
    if kind not in (None, "message"):
        why = ITEMS_REFUSED.get(kind) if isinstance(kind, str) else None
        raise InvalidRequestError(
            f"{where}.type", why or f"only message items are supported, got {_shown(kind)}"
        )
    role = item.get("role")
    if role not in ROLES:
        raise InvalidRequestError(
            f"{where}.role", f"must be one of {', '.join(ROLES)}, got {_shown(role)}"
        )
    content = item.get("content")
    if isinstance(content, str):
        return generate_pb2.ChatMessage(role=role, content=_utf8(f"{where}.content", content))
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content", "must be a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else part
            raise InvalidRequestError(
                f"{at}.type", f"only input_text and output_text parts are supported, "
                f"got {_shown(kind)}",
            )  # fmt: skip
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{at}.text", "must be a string")
        texts.append(_utf8(f"{at}.text", part["text"]))
    return generate_pb2.ChatMessage(role=role, content="".join(texts))


def _text_format(fmt: dict[str, Any]) -> generate_pb2.StructuredOutput | None:
    """`text.format` as chat's `response_format`, checked by the same code; its errors name
    `text.format.<field>` (`response_format.json_schema.X` there is `text.format.X` here)."""
    response_format: dict[str, Any] = {"type": fmt.get("type")}
    if fmt.get("type") == "json_schema":
        name = fmt.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("text.format.name", "must be a non-empty string")
        _utf8("text.format.name", name)
        if not isinstance(fmt.get("description"), str | None):
            raise InvalidRequestError("text.format.description", "must be a string")
        _utf8("text.format.description", fmt.get("description"))
        response_format["json_schema"] = {
            key: fmt[key] for key in ("name", "schema", "strict") if key in fmt
        }
    try:
        return structured_output(response_format, None, {})
    except InvalidRequestError as e:
        field = e.field.removeprefix("response_format").removeprefix(".json_schema")
        raise InvalidRequestError(f"text.format{field}", e.message) from None


def client_words(param: str | None, message: str) -> tuple[str | None, str]:
    """An error's field and message (`http_api.api_error`'s) in this endpoint's words: the
    request path says `max_tokens` and `messages` where this client sent
    `max_output_tokens` and `input`."""
    if param is None:
        return param, message
    base = param.split("[", 1)[0].split(".", 1)[0]
    if base not in CLIENT_FIELDS:
        return param, message
    renamed = CLIENT_FIELDS[base]
    if message.startswith(f"{param}: "):
        message = f"{renamed}: {message.removeprefix(f'{param}: ')}"
    return renamed, message


def sse(kind: str, payload: dict[str, Any]) -> bytes:
    """One server-sent event, named as the Responses API names them."""
    return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def _usage(usage: generate_pb2.Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseObjects:
    """The `response` object and the stream's events for one request."""

    def __init__(self, body: ResponsesRequest, request_id: str, model: str) -> None:
        self.body = body
        self.id = f"resp_{request_id}"
        self.item_id = f"msg_{request_id}"
        self.model = model
        self.created_at = int(time.time())
        self.sequence = 0

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        choice: Choice | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        b = self.body
        incomplete = None
        if status == "incomplete" and choice is not None:
            reason = choice.finish_reason
            incomplete = {"reason": "max_output_tokens" if reason == "length" else reason}
        fmt = b.text_format
        if fmt.get("type") == "json_schema":  # echoed as checked, nothing else of it
            fmt = {k: fmt[k] for k in ("type", "name", "description", "schema", "strict")
                   if k in fmt}  # fmt: skip
        else:
            fmt = {"type": fmt.get("type")}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "max_tool_calls": b.max_tool_calls,
            "metadata": b.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": b.temperature,
            "text": {"format": fmt},
            "tool_choice": b.tool_choice or "auto",
            "tools": [],
            "top_p": b.top_p,
            "truncation": "disabled",
            "usage": _usage(choice.usage) if choice is not None else None,
            "user": b.user,
        }

    def message(self, status: str, text: str | None) -> dict[str, Any]:
        return {
            "id": self.item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": [] if text is None else [_part(text)],
        }

    def final(self, choice: Choice) -> dict[str, Any]:
        status = "completed" if choice.finish_reason in (None, "stop") else "incomplete"
        return self.response(status, [self.message(status, choice.text)], choice)

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return sse(kind, payload)

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    async def events(
        self,
        first: generate_pb2.GenerateResponse,
        rest: AsyncIterator[generate_pb2.GenerateResponse],
        error_of: Callable[[RequestFailed], dict[str, Any]],
    ) -> AsyncIterator[bytes]:
        """The stream's events, from the request's first response (already in hand) and
        the rest; `error_of` gives a failure's OpenAI error (message, type, param, code).
        A failure ends the stream with an `error` event and `response.failed`."""
        choice = Choice(0)
        yield self.event("response.created", response=self.response("in_progress", []))
        yield self.event("response.in_progress", response=self.response("in_progress", []))
        yield self.event(
            "response.output_item.added", output_index=0, item=self.message("in_progress", None)
        )
        yield self.event("response.content_part.added", **self._where(), part=_part(""))
        try:
            response: generate_pb2.GenerateResponse | None = first
            while response is not None:
                choice.text += response.text
                if response.finish_reason:
                    choice.finish_reason, choice.usage = response.finish_reason, response.usage
                if response.text:  # empty: text held back (it may begin a stop string)
                    yield self.event(
                        "response.output_text.delta", **self._where(), delta=response.text,
                        logprobs=[],
                    )  # fmt: skip
                response = await anext(rest, None)
        except RequestFailed as e:
            error = error_of(e)
            yield self.event("error", code=error["code"], message=error["message"],
                             param=error["param"])  # fmt: skip
            failed = {"code": FAILED_CODES.get(error["type"], "server_error"),
                      "message": error["message"]}  # fmt: skip
            yield self.event("response.failed", response=self.response("failed", [], None, failed))
            return
        finally:
            await rest.aclose()  # type: ignore[attr-defined]
        final = self.final(choice)
        item = final["output"][0]
        yield self.event(
            "response.output_text.done", **self._where(), text=choice.text, logprobs=[]
        )
        yield self.event("response.content_part.done", **self._where(), part=_part(choice.text))
        yield self.event("response.output_item.done", output_index=0, item=item)
        done = "response.completed" if final["status"] == "completed" else "response.incomplete"
        yield self.event(done, response=final)

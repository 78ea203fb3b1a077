"""`POST /v1/responses`, OpenAI's Responses API, served without storing anything: the
request's fields become one `GenerateRequest` of chat messages (the chat template applied on
the request path, as for `/v1/chat/completions`); `responses_events.py` turns its
`GenerateResponse`s into the `response` object or the API's server-sent events. The route
around this (auth, the model check, the request id, cancellation when the client leaves,
error statuses) is the chat route's own (`http_api.py`).

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
- Function tools are chat's (`tool_calls.py`) in this API's flat shape: `tools` of
  `{"type": "function", "name", "description", "parameters"}`, `tool_choice` none / auto /
  required / `{"type": "function", "name"}`, `parallel_tool_calls`; `function_call` input
  items become an assistant turn's calls and `function_call_output` items tool turns. Calls
  come out as `function_call` output items (after a message item when there is text too),
  streamed as `response.function_call_arguments.delta` / `.done` once the output ends.
  Other tool types (built-in tools: web search, file search, computer use, MCP) are refused
  naming `tools[i].type`.
- Refused with a 400 naming the field unless neutral, as they would change the output and
  are not implemented: `include`, `reasoning`, `top_logprobs`, `truncation: auto`,
  `text.verbosity` other than medium.
- Accepted: `metadata` and `user` (echoed), `max_tool_calls` (it bounds built-in tools'
  calls: there are none), `stream_options.include_obfuscation` (deltas carry no
  obfuscation padding). Unknown fields are ignored, as elsewhere in this API."""

from __future__ import annotations

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
from pdserve.services.coordinator.structured_request import structured_output
from pdserve.services.coordinator.tool_calls import DEFAULT_PARSER, ToolPlan
from pdserve.v1 import generate_pb2

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
STATELESS = "nothing is stored by this server; send the whole conversation as input"
ITEMS_REFUSED = {"item_reference": f"refers to a stored item: {STATELESS}"}
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
# A request-path field (as `http_api.api_error` names it) as this endpoint's client spelled it.
CLIENT_FIELDS = {"max_tokens": "max_output_tokens", "prompt": "input", "messages": "input",
                 "structured_output": "text.format"}  # fmt: skip


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
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None  # bounds built-in tools' calls: none here, no effect
    # Not implemented: accepted only at their neutral values.
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    truncation: str | None = None

    def tool_plan(self, parser: str = DEFAULT_PARSER) -> ToolPlan | None:
        """Chat's plan for this request's function tools (`tool_calls.py`), its errors in
        this API's field names."""
        tools = None
        if self.tools is not None:
            tools = [_chat_tool(i, tool) for i, tool in enumerate(self.tools)]
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function":
                raise InvalidRequestError("tool_choice.type", 'only "function" is supported')
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        try:
            return ToolPlan.from_request(tools, choice, self.parallel_tool_calls, parser)
        except InvalidRequestError as e:
            raise InvalidRequestError(e.field.replace(".function.", "."), e.message) from None

    def to_generate_request(self, plan: ToolPlan | None = None) -> generate_pb2.GenerateRequest:
        self._refuse_unsupported()
        self._check_echoed()
        if (
            plan is not None
            and plan.constraint is not None
            and self.text_format != {"type": "text"}
        ):
            raise InvalidRequestError(
                "tool_choice", "a required or named tool choice is a constraint of its own"
            )
        messages: list[generate_pb2.ChatMessage] = []
        if self.instructions is not None:
            content = _utf8("instructions", self.instructions)
            messages.append(generate_pb2.ChatMessage(role="system", content=content))
        if isinstance(self.input, str):
            content = _utf8("input", self.input)
            messages.append(generate_pb2.ChatMessage(role="user", content=content))
        elif not self.input:
            raise InvalidRequestError("input", "must not be empty")
        else:
            for i, item in enumerate(self.input):
                _add_item(messages, i, item)
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
        request = generate_pb2.GenerateRequest(messages=messages, sampling=sampling)
        if plan is not None:
            request.tools.extend(plan.tools)
            if plan.constraint is not None:
                request.sampling.structured_output.CopyFrom(plan.constraint)
        return request

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


def _chat_tool(i: int, tool: Any) -> Any:
    """A Responses function tool (flat) in chat's shape (`{"type", "function": {...}}`)."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise InvalidRequestError(
            f"tools[{i}].type", f'only "function" tools are supported, got {_shown(kind)}'
        )
    keys = ("name", "description", "parameters")
    return {"type": "function", "function": {k: tool[k] for k in keys if k in tool}}


def _add_item(messages: list[generate_pb2.ChatMessage], i: int, item: Any) -> None:
    """Input item `i` onto `messages`: a message, a call the model made (joined to the
    assistant turn before it, as a chat's `tool_calls`) or a call's output (a tool turn)."""
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise InvalidRequestError(where, "must be an object")
    kind = item.get("type")
    if kind == "function_call":
        call = generate_pb2.ToolCall(
            id=_text_field(item, "call_id", where), name=_text_field(item, "name", where),
            arguments=_text_field(item, "arguments", where),
        )  # fmt: skip
        last = messages[-1] if messages else None
        if last is None or last.role != "assistant" or (last.content and not last.tool_calls):
            last = generate_pb2.ChatMessage(role="assistant")
            messages.append(last)
        last.tool_calls.append(call)
    elif kind == "function_call_output":
        messages.append(generate_pb2.ChatMessage(
            role="tool", content=_text_field(item, "output", where),
            tool_call_id=_text_field(item, "call_id", where),
        ))  # fmt: skip
    else:
        messages.append(_message(i, item))


def _text_field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where}.{key}", "must be a string")
    return _utf8(f"{where}.{key}", value)


def _message(i: int, item: dict[str, Any]) -> generate_pb2.ChatMessage:
    """Input item `i`, which must be a message with text content."""
    where = f"input[{i}]"
    kind = item.get("type")
    if kind not in (None, "message"):
        why = ITEMS_REFUSED.get(kind) if isinstance(kind, str) else None
        raise InvalidRequestError(
            f"{where}.type",
            why
            or "only message, function_call and function_call_output items are "
            f"supported, got {_shown(kind)}",
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

"""Tool calling on the chat API, in the coordinator (workers see only tokens and constraints).

Request side (`ToolPlan.from_request`): the request's function tools are checked (names,
parameter schemas) and travel in the `GenerateRequest` for the chat template; `tool_choice`
decides the rest, as vLLM does: `none` (no parsing), `auto` (the model's text is parsed for
calls by the `--tool-call-parser`), `required` (the output is held to a JSON array of
`{"name", "parameters"}` objects, one of the tools each: at most one without
`parallel_tool_calls`) and a named function (the output is held to its parameters' schema).
The last two are constrained decoding, so their arguments always parse.

Response side (`ToolPlan.parse`): the text becomes `message.tool_calls` (ids, names,
arguments as JSON text) and the content left; `ToolStream` does it for a stream: content
flows until a call begins (text that may begin one is held back), the calls follow as
OpenAI-shaped deltas when the output ends. Parsers: `hermes` (`<tool_call>{...}</tool_call>`,
Qwen's and the default model's format as pdserve renders tools for it), `llama3_json`
(a JSON object with `name` and `parameters`, after an optional `<|python_tag|>`) and
`mistral` (`[TOOL_CALLS]` then a JSON array)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pdserve.common.errors import InvalidRequestError
from pdserve.common.structured_output import StructuredOutput
from pdserve.v1 import generate_pb2

PARSERS = ("hermes", "llama3_json", "mistral")
DEFAULT_PARSER = "hermes"
MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_START = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>"}


def _constraint(c: StructuredOutput) -> generate_pb2.StructuredOutput:
    from pdserve.services.convert import structured_to_proto  # (torch: not for --help)

    return structured_to_proto(c.check())


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    tools: list[generate_pb2.Tool] = field(default_factory=list)
    name: str = ""  # the named function
    parallel: bool = True
    parser: str = DEFAULT_PARSER
    constraint: generate_pb2.StructuredOutput | None = None

    @classmethod
    def from_request(
        cls, tools: list[Any] | None, tool_choice: Any, parallel: bool | None, parser: str
    ) -> ToolPlan | None:
        """The request's plan (None: no tools); a bad field raises naming it."""
        if not tools:
            if tool_choice not in (None, "none"):
                raise InvalidRequestError("tool_choice", "needs tools")
            return None
        if len(tools) > MAX_TOOLS:
            raise InvalidRequestError("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
        plan = cls("auto", parallel=parallel is not False, parser=parser)
        schemas: dict[str, dict[str, Any]] = {}
        for i, tool in enumerate(tools):
            name, schema, proto = _tool(i, tool)
            if name in schemas:
                raise InvalidRequestError(f"tools[{i}].function.name", f"{name!r} is repeated")
            schemas[name] = schema
            plan.tools.append(proto)
        if tool_choice in (None, "auto"):
            return plan
        if tool_choice == "none":
            plan.mode = "none"
        elif tool_choice == "required":
            plan.mode = "required"
            plan.constraint = _required(schemas, plan.parallel)
        elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
            function = tool_choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if name not in schemas:
                raise InvalidRequestError(
                    "tool_choice.function.name", f"{name!r} is not one of the request's tools"
                )
            plan.mode, plan.name = "named", name
            plan.constraint = _constraint(StructuredOutput(
                "json", json.dumps(schemas[name]), field="tool_choice.function.name"
            ))  # fmt: skip
        else:
            raise InvalidRequestError(
                "tool_choice", 'must be "none", "auto", "required" or {"type": "function", ...}'
            )
        return plan

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of a finished output."""
        if self.mode == "none":
            return text, []
        if self.mode == "named":
            return None, [_call(self.name, text)]
        if self.mode == "required":
            try:
                calls = json.loads(text)
                return None, [_call(c["name"], json.dumps(c["parameters"])) for c in calls]
            except (ValueError, KeyError, TypeError):  # cut by max_tokens: no whole call
                return text, []
        return parse_text(text, self.parser)


def _tool(i: int, tool: Any) -> tuple[str, dict[str, Any], generate_pb2.Tool]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidRequestError(f"tools[{i}].type", 'only "function" tools are supported')
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidRequestError(f"tools[{i}].function", "must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequestError(
            f"tools[{i}].function.name", "must be 1-64 letters, digits, _ . : or -"
        )
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise InvalidRequestError(f"tools[{i}].function.description", "must be a string")
    schema = function.get("parameters")
    if schema is None:
        schema = {"type": "object", "properties": {}}
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"tools[{i}].function.parameters", "must be a JSON schema")
    text = json.dumps(schema, ensure_ascii=False)
    StructuredOutput("json", text, field=f"tools[{i}].function.parameters").check()
    return name, schema, generate_pb2.Tool(name=name, description=description, parameters=text)


def _required(schemas: dict[str, dict[str, Any]], parallel: bool) -> generate_pb2.StructuredOutput:
    calls = [
        {"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                          "parameters": schema},
         "required": ["name", "parameters"], "additionalProperties": False}
        for name, schema in schemas.items()
    ]  # fmt: skip
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        array["maxItems"] = 1
    return _constraint(StructuredOutput("json", json.dumps(array), field="tools"))


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


def parse_text(text: str, parser: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Calls written by the model in `parser`'s format; text that is not a whole call stays
    content."""
    try:
        if parser == "hermes":
            blocks = re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.DOTALL)
            if not blocks:
                return text, []
            calls = [json.loads(b) for b in blocks]
            content = text.split("<tool_call>", 1)[0].strip()
            return content or None, [_call(c["name"], _args(c.get("arguments"))) for c in calls]
        if parser == "mistral":
            if "[TOOL_CALLS]" not in text:
                return text, []
            before, after = text.split("[TOOL_CALLS]", 1)
            calls = json.loads(after.strip())
            calls = calls if isinstance(calls, list) else [calls]
            content = before.strip() or None
            return content, [_call(c["name"], _args(c.get("arguments"))) for c in calls]
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        objects = [json.loads(part) for part in re.split(r"\s*;\s*(?=\{)", body)]
        return None, [
            _call(o["name"], _args(o.get("parameters", o.get("arguments")))) for o in objects
        ]
    except (ValueError, KeyError, TypeError, AttributeError):
        return text, []


def _args(arguments: Any) -> str:
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)


class ToolStream:
    """A stream's text split into content to send now and calls to send at the end."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""  # everything so far
        self.sent = 0  # characters of it sent as content
        self.calling = plan.mode in ("named", "required")  # all of the output is calls

    def feed(self, delta: str) -> str:
        """The content to send for this delta (possibly none: held back or a call)."""
        self.text += delta
        if self.plan.mode == "none":
            self.sent = len(self.text)
            return delta
        if self.calling:
            return ""
        start = _START[self.plan.parser]
        if self.plan.parser == "llama3_json" and self.sent == 0:
            head = self.text.lstrip()
            if head.startswith("{") or head.startswith(start):
                self.calling = True  # the whole output is the call
                return ""
            if not head or start.startswith(head):
                return ""  # too early to tell
        at = self.text.find(start, self.sent)
        if at >= 0:
            self.calling = True
            out, self.sent = self.text[self.sent : at], at
            return out
        end = len(self.text) - _partial_suffix(self.text, start)
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the end: content still held back, and the calls."""
        content, calls = self.plan.parse(self.text)
        if not calls:
            return self.text[self.sent :], []
        rest = (content or "")[self.sent :] if content and len(content) > self.sent else ""
        return rest, calls


def _partial_suffix(text: str, marker: str) -> int:
    """How many trailing characters of `text` could begin `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0

"""`POST /v1/responses`' output (the request side is `responses_api.py`): the coordinator's
`GenerateResponse`s become one `response` object, or the API's server-sent events from
`response.created` to `response.completed`, each numbered by `sequence_number`. With
function tools the output is read for calls (`tool_calls.py`): they become `function_call`
items after the message item (which an output of calls alone does not have)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from pdserve.services.coordinator.openai_responses import Choice
from pdserve.services.coordinator.request_path import RequestFailed
from pdserve.services.coordinator.responses_api import ResponsesRequest
from pdserve.services.coordinator.tool_calls import ToolPlan, ToolStream
from pdserve.v1 import generate_pb2

# An error's `type` (OpenAI's error shape) as a failed response's `error.code`.
FAILED_CODES = {"rate_limit_error": "rate_limit_exceeded",
                "invalid_request_error": "invalid_prompt"}  # fmt: skip


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

    def __init__(
        self, body: ResponsesRequest, request_id: str, model: str, plan: ToolPlan | None = None
    ) -> None:
        self.body = body
        self.plan = plan  # its function tools: the output is read for calls
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
            "tools": b.tools or [],
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
        """The finished response: a message item with the text (unless the output was only
        calls), then a `function_call` item per call."""
        content, calls = (
            self.plan.parse(choice.text) if self.plan is not None else (choice.text, [])
        )
        status = "completed" if choice.finish_reason in (None, "stop") else "incomplete"
        output = [] if calls and not content else [self.message(status, content or "")]
        output += [self.function_call(k, call) for k, call in enumerate(calls)]
        return self.response(status, output, choice)

    def function_call(self, k: int, call: dict[str, Any], done: bool = True) -> dict[str, Any]:
        return {
            "id": f"fc_{self.id.removeprefix('resp_')}_{k}",
            "type": "function_call",
            "status": "completed" if done else "in_progress",
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if done else "",
        }

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return sse(kind, payload)

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def _open_message(self) -> list[bytes]:
        return [
            self.event(
                "response.output_item.added", output_index=0, item=self.message("in_progress", None)
            ),
            self.event("response.content_part.added", **self._where(), part=_part("")),
        ]

    async def events(
        self,
        first: generate_pb2.GenerateResponse,
        rest: AsyncIterator[generate_pb2.GenerateResponse],
        error_of: Callable[[RequestFailed], dict[str, Any]],
    ) -> AsyncIterator[bytes]:
        """The stream's events, from the request's first response (already in hand) and
        the rest; `error_of` gives a failure's OpenAI error (message, type, param, code).
        A failure ends the stream with an `error` event and `response.failed`. With tools,
        the message item opens at the first content (an output of calls alone has none)
        and the calls follow once the output ends."""
        choice = Choice(0)
        tools = ToolStream(self.plan) if self.plan is not None else None
        yield self.event("response.created", response=self.response("in_progress", []))
        yield self.event("response.in_progress", response=self.response("in_progress", []))
        opened = tools is None or self.plan is None or self.plan.mode == "none"
        if opened:
            for event in self._open_message():
                yield event
        try:
            response: generate_pb2.GenerateResponse | None = first
            while response is not None:
                choice.text += response.text
                if response.finish_reason:
                    choice.finish_reason, choice.usage = response.finish_reason, response.usage
                text = tools.feed(response.text) if tools is not None else response.text
                if text:  # empty: text held back (a stop string or a call may begin)
                    if not opened:
                        opened = True
                        for event in self._open_message():
                            yield event
                    yield self.event(
                        "response.output_text.delta", **self._where(), delta=text, logprobs=[]
                    )
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
        if tools is not None:
            held, _ = tools.finish()
            if held:
                if not opened:
                    opened = True
                    for event in self._open_message():
                        yield event
                yield self.event(
                    "response.output_text.delta", **self._where(), delta=held, logprobs=[]
                )
        final = self.final(choice)
        items = final["output"]
        if opened:
            message = (
                items[0]
                if items and items[0]["type"] == "message"
                else self.message(final["status"], "")
            )
            text = message["content"][0]["text"] if message["content"] else ""
            yield self.event("response.output_text.done", **self._where(), text=text, logprobs=[])
            yield self.event("response.content_part.done", **self._where(), part=_part(text))
            yield self.event("response.output_item.done", output_index=0, item=message)
        calls = [item for item in items if item["type"] == "function_call"]
        first_index = 1 if opened else 0
        for k, item in enumerate(calls):
            index = first_index + k
            added = {**item, "status": "in_progress", "arguments": ""}
            yield self.event("response.output_item.added", output_index=index, item=added)
            where = {"item_id": item["id"], "output_index": index}
            yield self.event(
                "response.function_call_arguments.delta", **where, delta=item["arguments"]
            )
            yield self.event(
                "response.function_call_arguments.done", **where, arguments=item["arguments"]
            )
            yield self.event("response.output_item.done", output_index=index, item=item)
        done = "response.completed" if final["status"] == "completed" else "response.incomplete"
        yield self.event(done, response=final)

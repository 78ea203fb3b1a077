"""The coordinator's OpenAI-compatible HTTP front (FastAPI on uvicorn, in the same process
and event loop as its gRPC server): `/v1/chat/completions`, `/v1/completions`,
`/v1/responses` (`responses_api.py`), `/v1/models` (and `/v1/models/{model}`), `/health`,
`/metrics`. Each choice of a request goes through the same request path as a gRPC call
(`request_path.Coordinator`); tokens stream as server-sent events, the first as soon as
prefill returns it. A client that disconnects cancels its requests on the workers. Every
error has OpenAI's shape and a status saying whose fault it is."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.exceptions import HTTPException

from pdserve.common.errors import InvalidRequestError
from pdserve.services.auth import ApiKeys
from pdserve.services.convert import RETRY_AFTER_S
from pdserve.services.coordinator.metrics import HTTP_TOO_LARGE
from pdserve.services.coordinator.openai_protocol import ChatCompletionRequest, CompletionRequest
from pdserve.services.coordinator.openai_responses import (
    Choice,
    CompletionFormat,
    Echo,
    TokenTexts,
    error_body,
    sse,
)
from pdserve.services.coordinator.request_path import Coordinator, RequestFailed
from pdserve.services.coordinator.responses_api import ResponsesRequest, client_words
from pdserve.services.coordinator.responses_events import ResponseObjects
from pdserve.services.coordinator.tool_calls import DEFAULT_PARSER
from pdserve.v1 import generate_pb2

logger = logging.getLogger(__name__)

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.FAILED_PRECONDITION: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# An idle keep-alive connection is closed by the client first: a server that closes it at
# the moment a client reuses it resets that request (clients expire theirs after 5 s, as
# httpx and Node do, or 15 s as aiohttp does; this is nginx's default).
HTTP_KEEP_ALIVE_S = 75
HTTP_BACKLOG = 2048  # connections not yet accepted (uvicorn's default; listen()'s is 128)
# A request id travels back in a header: printable ASCII only.
REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")
# Pydantic names a union's branch in an error's location ("prompt.list[int].0"); drop them.
_TYPE_TAGS = ("str", "int", "float", "bool", "list", "dict", "function-after", "nullable")


# OpenAPI links, for clients and tools that follow them (schemathesis's stateful phase): a
# model id from the list names a model to retrieve or to complete with.
LIST_MODELS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The models served here",
        "links": {
            "RetrieveModel": {
                "operationId": "retrieve_model",
                "parameters": {"path.model": "$response.body#/data/0/id"},
            },
            "CreateCompletion": {
                "operationId": "create_completion",
                "requestBody": {"model": "$response.body#/data/0/id"},
            },
        },
    }
}
RETRIEVE_MODEL_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The model",
        "links": {
            "CreateChatCompletion": {
                "operationId": "create_chat_completion",
                "requestBody": {"model": "$response.body#/id"},
            },
        },
    }
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        usage: dict[str, int] | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.usage = usage  # a request that failed part way: what it had generated
        self.retry_after_s = retry_after_s or RETRY_AFTER_S

    def body(self) -> dict[str, Any]:
        body = error_body(self.status, self.message, self.param, self.code)
        if self.usage is not None:
            body["usage"] = self.usage
        return body

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after_s)} if self.status == 429 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _param(field: str | None) -> str | None:
    """A request-path field name as the HTTP client spelled it."""
    if field is None:
        return None
    field = field.removeprefix("sampling.")
    return "prompt" if field == "token_ids" else field


def api_error(e: RequestFailed | InvalidRequestError) -> ApiError:
    if isinstance(e, InvalidRequestError):
        return ApiError(400, str(e), _param(e.field))
    status = HTTP_STATUS.get(e.code, 500)
    code = "context_length_exceeded" if e.context_length else e.code.name.lower()
    param, message = _param(e.field), e.message
    if e.field and param and message.startswith(f"{e.field}: "):
        message = f"{param}: {message.removeprefix(f'{e.field}: ')}"
    usage = None
    if e.usage is not None:
        u = e.usage
        usage = {
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        }
    return ApiError(status, message, param, code, usage, e.retry_after_s)


class OpenAIServer:
    """The FastAPI app over a `Coordinator`. `served_models`: the ids clients may name
    (the first is the default when a request names none); `api_keys`: when given, `/v1/*`
    needs `Authorization: Bearer <one of them>`; `max_body_bytes`: larger bodies get 413."""

    def __init__(
        self,
        coordinator: Coordinator,
        tokenizer: Any,
        served_models: list[str],
        max_model_len: int,
        api_keys: ApiKeys | None = None,
        max_body_bytes: int = 8 * 1024 * 1024,
        tool_call_parser: str = DEFAULT_PARSER,
    ) -> None:
        if not served_models:
            raise ValueError("served_models: give at least one model id")
        self.coordinator = coordinator
        self.tool_call_parser = tool_call_parser  # how chat output is read for tool calls
        self.tokenizer = tokenizer
        self.texts = TokenTexts(tokenizer)
        self.served_models = served_models
        self.max_model_len = max_model_len
        self.api_keys = api_keys
        self.max_body_bytes = max_body_bytes
        self.started = int(time.time())
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
        app.add_middleware(
            BodyLimit, max_bytes=self.max_body_bytes, labels=self.coordinator.metric_labels
        )

        @app.exception_handler(ApiError)
        async def on_api_error(_: Request, e: ApiError) -> JSONResponse:
            return e.response()

        @app.exception_handler(RequestValidationError)
        async def on_invalid(_: Request, e: RequestValidationError) -> JSONResponse:
            return validation_error(e).response()

        @app.exception_handler(HTTPException)
        async def on_http(_: Request, e: HTTPException) -> JSONResponse:
            response = ApiError(e.status_code, str(e.detail)).response()
            response.headers.update(e.headers or {})  # e.g. a 405's Allow
            return response

        @app.exception_handler(Exception)
        async def on_crash(request: Request, e: Exception) -> JSONResponse:
            # The details stay in the log: they can name internals a client must not see.
            ref = uuid.uuid4().hex[:12]
            logger.error("internal error %s on %s", ref, request.url.path, exc_info=e)
            return ApiError(500, f"internal error (reference {ref})").response()

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models", operation_id="list_models", responses=LIST_MODELS_RESPONSES)
        async def models(request: Request) -> dict[str, Any]:
            self._authorize(request)
            return {"object": "list", "data": [self._model_card(m) for m in self.served_models]}

        @app.get(
            "/v1/models/{model:path}",
            operation_id="retrieve_model",
            responses=RETRIEVE_MODEL_RESPONSES,
        )
        async def model(model: str, request: Request) -> dict[str, Any]:
            self._authorize(request)
            if model not in self.served_models:
                raise ApiError(404, f"model: {model!r} is not served here", "model",
                               "model_not_found")  # fmt: skip
            return self._model_card(model)

        @app.post("/v1/chat/completions", operation_id="create_chat_completion")
        async def chat(body: ChatCompletionRequest, request: Request) -> Response:
            return await self._complete(body, request, chat=True)

        @app.post("/v1/completions", operation_id="create_completion")
        async def completions(body: CompletionRequest, request: Request) -> Response:
            return await self._complete(body, request, chat=False)

        @app.post("/v1/responses", operation_id="create_response")
        async def responses(body: ResponsesRequest, request: Request) -> Response:
            return await self._respond(body, request)

        return app

    def _model_card(self, model: str) -> dict[str, Any]:
        return {
            "id": model,
            "object": "model",
            "created": self.started,
            "owned_by": "pdserve",
            "root": model,
            "max_model_len": self.max_model_len,
        }

    def _authorize(self, request: Request) -> None:
        if self.api_keys is not None and not self.api_keys.allows(
            request.headers.get("authorization", "")
        ):
            raise ApiError(401, "missing or wrong API key", code="invalid_api_key")

    def _model(self, request: Request, model: str | None) -> str:
        """The served model a request names (authorized first)."""
        self._authorize(request)
        model = model or self.served_models[0]
        if model not in self.served_models:
            raise ApiError(
                404,
                f"model: {model!r} is not served here (served: {', '.join(self.served_models)})",
                "model",
                "model_not_found",
            )
        return model

    def _request_id(self, request: Request, given: str | None) -> str:
        request_id = given or request.headers.get("x-request-id") or uuid.uuid4().hex
        if not REQUEST_ID.fullmatch(request_id):
            param = "request_id" if given else "x-request-id"
            raise ApiError(400, f"{param}: 1 to 256 printable ASCII characters", param)
        return request_id

    async def _complete(
        self, body: ChatCompletionRequest | CompletionRequest, request: Request, chat: bool
    ) -> Response:
        model = self._model(request, body.model)
        tools = None
        try:
            if isinstance(body, ChatCompletionRequest):
                tools = body.tool_plan(self.tool_call_parser)
                requests = body.to_generate_requests(tools)
            else:
                requests = body.to_generate_requests()
        except InvalidRequestError as e:
            raise api_error(e) from None
        request_id = self._request_id(request, body.request_id)
        for k, r in enumerate(requests):
            r.request_id = request_id if len(requests) == 1 else f"{request_id}-{k}"
        echo = None
        if isinstance(body, CompletionRequest) and body.echo:
            echo = Echo([self._prompt_text(p) for p in body.prompts() for _ in range(body.n)],
                        body.echo_only)  # fmt: skip
        fmt = CompletionFormat(chat, request_id, model, self.texts, tools, echo,
                               body.prompt_logprobs is not None)  # fmt: skip
        want_logprobs = bool(body.logprobs) if chat else body.logprobs is not None
        headers = {"X-Request-Id": request_id}
        stream = merge(
            [
                self.coordinator.generate(r, request.headers.items(), fill_context=True)
                for r in requests
            ]
        )
        if not body.stream:
            choices = [Choice(i) for i in range(len(requests))]
            try:
                await until_disconnect(request, collect(stream, choices))
            except RequestFailed as e:
                raise api_error(e) from None
            return JSONResponse(fmt.final(choices, body.n, want_logprobs), headers=headers)

        # Wait for the first token before answering, so a request refused before it (bad
        # field, overload, no worker) gets its own status rather than a 200 and an error event.
        try:
            first = await until_disconnect(request, anext(stream))
        except RequestFailed as e:
            await stream.aclose()
            raise api_error(e) from None
        events = self._events(first, stream, fmt, body, want_logprobs, len(requests))
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)

    def _prompt_text(self, prompt: str | list[int]) -> str:
        """What `echo` puts before a completion: the prompt as sent, token ids as text."""
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    async def _respond(self, body: ResponsesRequest, request: Request) -> Response:
        """`/v1/responses` (`responses_api.py`): one request, on the path a chat takes."""
        model = self._model(request, body.model)
        try:
            plan = body.tool_plan(self.tool_call_parser)
            generate = body.to_generate_request(plan)
        except InvalidRequestError as e:
            raise responses_error(e) from None
        generate.request_id = self._request_id(request, None)
        objects = ResponseObjects(body, generate.request_id, model, plan)
        headers = {"X-Request-Id": generate.request_id}
        stream = self.coordinator.generate(generate, request.headers.items(), fill_context=True)
        if not body.stream:
            choice = Choice(0)
            try:
                await until_disconnect(request, collect(merge([stream]), [choice]))
            except RequestFailed as e:
                raise responses_error(e) from None
            return JSONResponse(objects.final(choice), headers=headers)
        try:  # the first token first, so a refusal gets its own status (as in _complete)
            first = await until_disconnect(request, anext(stream))
        except RequestFailed as e:
            await stream.aclose()  # type: ignore[attr-defined]
            raise responses_error(e) from None
        events = objects.events(first, stream, lambda e: responses_error(e).body()["error"])
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)

    async def _events(
        self,
        first: tuple[int, generate_pb2.GenerateResponse],
        stream: AsyncIterator[tuple[int, generate_pb2.GenerateResponse]],
        fmt: CompletionFormat,
        body: ChatCompletionRequest | CompletionRequest,
        want_logprobs: bool,
        num_choices: int,
    ) -> AsyncIterator[bytes]:
        choices = [Choice(i) for i in range(num_choices)]
        started: set[int] = set()
        try:
            async for index, response in _prepend(first, stream):
                record(choices[index], response)
                empty = not (response.text or response.finish_reason or response.logprobs)
                if empty and index in started:
                    continue  # text held back (it may begin a stop string)
                first_of_choice = index not in started
                started.add(index)
                yield sse(
                    fmt.chunk(index, response, first_of_choice, want_logprobs, body.include_usage)
                )
            if body.include_usage:
                yield sse(fmt.usage_chunk(choices, body.n))
        except RequestFailed as e:
            yield sse(api_error(e).body())
        finally:
            await stream.aclose()
        yield sse("[DONE]")


async def _prepend(item: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield item
    async for x in rest:
        yield x


def responses_error(e: RequestFailed | InvalidRequestError) -> ApiError:
    """`api_error` in `/v1/responses`' words (`max_output_tokens`, `input`)."""
    error = api_error(e)
    error.param, error.message = client_words(error.param, error.message)
    return error


def record(choice: Choice, response: generate_pb2.GenerateResponse) -> None:
    choice.text += response.text
    choice.logprobs.extend(response.logprobs)
    choice.prompt_token_ids.extend(response.prompt_token_ids)
    choice.prompt_logprobs.extend(response.prompt_logprobs)
    if response.finish_reason:
        choice.finish_reason = response.finish_reason
        choice.usage = response.usage


async def collect(
    stream: AsyncIterator[tuple[int, generate_pb2.GenerateResponse]], choices: list[Choice]
) -> None:
    try:
        async for index, response in stream:
            record(choices[index], response)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


async def merge(
    streams: list[AsyncIterator[generate_pb2.GenerateResponse]],
) -> AsyncIterator[tuple[int, generate_pb2.GenerateResponse]]:
    """The responses of several requests as (choice index, response), as they come. The
    first failure cancels the others; leaving early cancels them all."""
    if len(streams) == 1:
        try:
            async for response in streams[0]:
                yield 0, response
        finally:
            await streams[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[generate_pb2.GenerateResponse]) -> None:
        try:
            async for response in stream:
                queue.put_nowait((index, response))
        except Exception as e:
            queue.put_nowait((index, e))
        else:
            queue.put_nowait((index, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnect(request: Request, awaitable: Any) -> Any:
    """Await `awaitable`, cancelling it if the client disconnects first."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise ApiError(499, "client disconnected")
    return work.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def validation_error(e: RequestValidationError) -> ApiError:
    errors = e.errors()
    if not errors:
        return ApiError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"body: invalid JSON ({first.get('msg', '')})", "body")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(p for p in loc if not p.startswith(_TYPE_TAGS)) or None
    if first.get("type") == "missing":
        message = f"{param}: is required"
    elif param is None:
        message = f"body: {first.get('msg', 'invalid')} (send a JSON object)"
        param = "body"
    else:
        message = f"{param}: {first.get('msg', 'invalid')}"
    return ApiError(400, message, param)


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413, by its Content-Length
    before anything is read, or as soon as the bytes read pass the limit."""

    def __init__(self, app: Any, max_bytes: int, labels: dict[str, str]) -> None:
        self.app, self.max_bytes = app, max_bytes
        self.refused = HTTP_TOO_LARGE.labels(**labels)  # 0 from the start: rate() works

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = ApiError(
            413,
            f"body: larger than this server's limit of {self.max_bytes} bytes",
            "body",
            "request_too_large",
        )
        length = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            self.refused.inc()
            await too_large.response()(scope, receive, send)
            return
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            if seen > self.max_bytes:  # counted already; a handler reading on
                raise HTTPException(413, too_large.message)
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                self.refused.inc()
                raise HTTPException(413, too_large.message)
            return message

        await self.app(scope, counted, send)


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside an event loop we own: the process's own signal handling stays."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """Listens at once (so the port is known for the ready line); `start` serves, `drain`
    stops taking connections and lets open ones finish within the grace period."""

    def __init__(
        self, app: FastAPI, host: str, port: int, tls: tuple[str, str] | None = None
    ) -> None:
        """`tls`: (certificate, key) files to serve HTTPS with."""
        self.socket = socket.create_server((host, port), backlog=HTTP_BACKLOG)
        self.host = host
        self.port = self.socket.getsockname()[1]
        cert, key = tls or (None, None)
        self.server = _EmbeddedServer(
            uvicorn.Config(
                app,
                log_level="warning",
                access_log=False,
                lifespan="off",
                timeout_keep_alive=HTTP_KEEP_ALIVE_S,
                ssl_certfile=cert,
                ssl_keyfile=key,
            )
        )
        self._task: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self.server.serve(sockets=[self.socket]))
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
            await asyncio.sleep(0.01)

    async def drain(self, grace_s: float) -> None:
        if self._task is None:
            return
        self.server.config.timeout_graceful_shutdown = max(int(grace_s), 1)
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

"""The OpenAI-compatible HTTP API's requests: the fields of `/v1/chat/completions` and
`/v1/completions` as the OpenAI API defines them, plus the extensions vLLM accepts (`top_k`,
`ignore_eos`, `min_tokens`, `stop_token_ids`, `structured_outputs` and the `guided_*`
constraints: `structured_request.py`), turned into the `GenerateRequest`s of the
coordinator's request path (one per choice). Types are checked here; ranges are checked by
the same code as the gRPC API's, so both refuse a bad value with the same words.

Choices we made where the API leaves room: unknown fields are ignored (as OpenAI's own
server does); known fields that would change the output and are not implemented (a chat's
echo, best_of, suffix, legacy `functions`, audio, vLLM's beam search and template
controls: `NOT_IMPLEMENTED`) are refused when set to anything but their neutral
value, naming the field; `n`
choices run as n requests, and with a `seed` choice i uses `seed + i`. Every number is
checked against its protobuf field's range and every string for UTF-8 before the message is
filled, so no value a client can send makes filling it fail."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from pdserve.common.errors import InvalidRequestError
from pdserve.common.sampling_params import MAX_LOGPROBS
from pdserve.services.coordinator.structured_request import structured_output
from pdserve.services.coordinator.tool_calls import DEFAULT_PARSER, ToolPlan
from pdserve.v1 import generate_pb2

MAX_CHOICES = 16  # n x prompts per request
UINT32_MAX = 2**32 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38


def _in_range(name: str, value: int | None, lo: int, hi: int) -> None:
    if value is not None and not lo <= value <= hi:
        raise InvalidRequestError(name, f"must be in [{lo}, {hi}], got {value}")


def _finite(name: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
        raise InvalidRequestError(name, f"must be a finite number, got {value}")


def _utf8(name: str, text: str | None) -> str:
    """`text`, which must encode as UTF-8 (JSON lets a string carry a lone surrogate)."""
    if text is None:
        return ""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        raise InvalidRequestError(name, f"is not valid Unicode text ({e.reason})") from None
    return text


# Strict: a value of the wrong JSON type is refused (400 naming it), never coerced ("0.5"
# as a temperature, true as a token id, 1.0 as n); JSON numbers still serve as floats.
STRICT = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = STRICT

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions, as vLLM accepts them.
    top_k: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    request_id: str | None = None
    # Structured output: OpenAI's, vLLM's, and vLLM's older names (`structured_request.py`).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # The rest of the sampler (`common/logits_processors.py`): OpenAI's and vLLM's.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    # vLLM's: every prompt token's log-probability and this many alternatives (not streamed).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True  # vLLM's: special tokens' text left out of the output

    # Known fields that would change the output and are not implemented: refused unless
    # at their neutral value (unknown fields are ignored, as OpenAI's server does).
    use_beam_search: Any = None
    length_penalty: Any = None
    include_stop_str_in_output: Any = None
    spaces_between_special_tokens: Any = None
    truncate_prompt_tokens: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None
    NOT_IMPLEMENTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
        "include_stop_str_in_output": (None, False),
        "spaces_between_special_tokens": (None, True), "truncate_prompt_tokens": (None,),
        "logits_processors": (None, []),
        "return_tokens_as_token_ids": (None, False),
    }  # fmt: skip

    def _refuse_unsupported(self) -> None:
        for name, neutral in self.NOT_IMPLEMENTED.items():
            value = getattr(self, name)
            if not any(value == v and type(value) is type(v) for v in neutral):
                raise InvalidRequestError(name, "is not supported by this server")
        if not 1 <= self.n <= MAX_CHOICES:
            raise InvalidRequestError("n", f"must be between 1 and {MAX_CHOICES}, got {self.n}")
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise InvalidRequestError(
                    "prompt_logprobs",
                    f"must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}",
                )
            if self.stream:
                raise InvalidRequestError(
                    "prompt_logprobs", "is not available when streaming (stream: true)"
                )

    def _prompt_logprobs(self) -> int | None:
        """How many alternatives each prompt position's log-probabilities carry (None: no
        prompt logprobs are computed)."""
        return self.prompt_logprobs

    def _sampling(self, max_tokens: int | None, logprobs: int | None, choice: int) -> Any:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for i, text in enumerate(stop):
            _utf8(f"stop[{i}]", text)
        if max_tokens is not None and max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be at least 1, got {max_tokens}")
        _in_range("max_tokens", max_tokens, 1, UINT32_MAX)
        _in_range("min_tokens", self.min_tokens, 0, UINT32_MAX)
        _in_range("top_k", self.top_k, INT32_MIN, INT32_MAX)
        _finite("temperature", self.temperature)
        _finite("top_p", self.top_p)
        sampling = generate_pb2.SamplingParams(stop=stop, ignore_eos=self.ignore_eos)
        for name, value in (
            ("max_tokens", max_tokens),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("top_k", self.top_k),
            ("logprobs", logprobs),
            ("prompt_logprobs", self._prompt_logprobs()),
        ):
            if value is not None:
                setattr(sampling, name, value)
        if not self.skip_special_tokens:
            sampling.skip_special_tokens = False
        if self.seed is not None:
            if not 0 <= self.seed < 2**63:
                raise InvalidRequestError("seed", f"must be in [0, 2^63), got {self.seed}")
            sampling.seed = self.seed + choice
        if self.min_tokens < 0:
            raise InvalidRequestError("min_tokens", f"must be >= 0, got {self.min_tokens}")
        sampling.min_tokens = self.min_tokens
        if any(not 0 <= t <= UINT32_MAX for t in self.stop_token_ids or ()):
            raise InvalidRequestError("stop_token_ids", f"must be token ids in [0, {UINT32_MAX}]")
        sampling.stop_token_ids.extend(self.stop_token_ids or ())
        constraint = structured_output(
            self.response_format,
            self.structured_outputs,
            {name: getattr(self, name) for name in
             ("guided_json", "guided_regex", "guided_choice", "guided_grammar")},
        )  # fmt: skip
        if constraint is not None:
            sampling.structured_output.CopyFrom(constraint)
        self._adjustments(sampling)
        return sampling

    def _adjustments(self, sampling: generate_pb2.SamplingParams) -> None:
        """Penalties, logit_bias, min_p, bad_words and allowed_token_ids onto the message
        (their ranges are checked with the gRPC API's)."""
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            value = getattr(self, name)
            _finite(name, value)
            if value is not None:
                setattr(sampling, name, value)
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit() or int(key) > UINT32_MAX:
                raise InvalidRequestError("logit_bias", f"keys must be token ids, got {key!r}")
            _finite(f"logit_bias[{key}]", bias)
            sampling.logit_bias[int(key)] = bias
        for i, word in enumerate(self.bad_words or ()):
            sampling.bad_words.append(_utf8(f"bad_words[{i}]", word))
        if any(not 0 <= t <= UINT32_MAX for t in self.allowed_token_ids or ()):
            raise InvalidRequestError(
                "allowed_token_ids", f"must be token ids in [0, {UINT32_MAX}]"
            )
        sampling.allowed_token_ids.extend(self.allowed_token_ids or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatMessage(BaseModel):
    model_config = STRICT

    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def to_proto(self, i: int) -> generate_pb2.ChatMessage:
        message = generate_pb2.ChatMessage(
            role=_utf8(f"messages[{i}].role", self.role), content=self.text(i),
            tool_call_id=_utf8(f"messages[{i}].tool_call_id", self.tool_call_id),
        )  # fmt: skip
        for j, call in enumerate(self.tool_calls or ()):
            field = f"messages[{i}].tool_calls[{j}]"
            function = call.get("function")
            if call.get("type", "function") != "function" or not isinstance(function, dict):
                raise InvalidRequestError(field, "must be a function call")
            name, arguments = function.get("name"), function.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(arguments, str):
                raise InvalidRequestError(
                    f"{field}.function", "needs a string name and arguments (JSON text)"
                )
            call_id = call.get("id") or ""
            if not isinstance(call_id, str):
                raise InvalidRequestError(f"{field}.id", "must be a string")
            message.tool_calls.append(generate_pb2.ToolCall(
                id=_utf8(f"{field}.id", call_id), name=_utf8(f"{field}.function.name", name),
                arguments=_utf8(f"{field}.function.arguments", arguments),
            ))  # fmt: skip
        return message

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return _utf8(f"messages[{index}].content", self.content)
        texts = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(
                    f"messages[{index}].content[{j}]",
                    f"only text parts are supported, got type {part.get('type')!r}",
                )
            texts.append(_utf8(f"messages[{index}].content[{j}].text", part["text"]))
        return "".join(texts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Chat fields that would change the output and are not implemented (legacy functions,
    # audio, vLLM's template controls).
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    echo: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    NOT_IMPLEMENTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_SamplingFields.NOT_IMPLEMENTED,
        "functions": (None, []), "function_call": (None, "none"), "modalities": (None, ["text"]),
        "audio": (None,), "echo": (None, False), "add_generation_prompt": (None, True),
        "continue_final_message": (None, False), "chat_template": (None,),
        "chat_template_kwargs": (None, {}),
    }  # fmt: skip

    def tool_plan(self, parser: str = DEFAULT_PARSER) -> ToolPlan | None:
        """How this request's tools are offered and its output read (`tool_calls.py`)."""
        return ToolPlan.from_request(self.tools, self.tool_choice, self.parallel_tool_calls,
                                     parser)  # fmt: skip

    def to_generate_requests(
        self, plan: ToolPlan | None = None
    ) -> list[generate_pb2.GenerateRequest]:
        self._refuse_unsupported()
        if plan is not None and plan.constraint is not None and any(
            (self.response_format, self.structured_outputs, self.guided_json, self.guided_regex,
             self.guided_choice, self.guided_grammar)
        ):  # fmt: skip
            raise InvalidRequestError(
                "tool_choice", "a required or named tool choice is a constraint of its own"
            )
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise InvalidRequestError("top_logprobs", "needs logprobs: true")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise InvalidRequestError(
                    "top_logprobs", f"must be between 0 and {MAX_LOGPROBS}, got {self.top_logprobs}"
                )
        max_tokens = self.max_completion_tokens or self.max_tokens
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise InvalidRequestError(
                "max_completion_tokens", f"must be at least 1, got {self.max_completion_tokens}"
            )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        messages = [m.to_proto(i) for i, m in enumerate(self.messages)]
        requests = []
        for choice in range(self.n):
            sampling = self._sampling(max_tokens, logprobs, choice)
            request = generate_pb2.GenerateRequest(messages=messages, sampling=sampling)
            if plan is not None:
                request.tools.extend(plan.tools)
                if plan.parser == "mistral" and plan.mode == "auto":
                    # Its calls begin with the special token [TOOL_CALLS] (as vLLM does).
                    request.sampling.skip_special_tokens = False
                if plan.constraint is not None:  # (the request holds a copy of `sampling`)
                    request.sampling.structured_output.CopyFrom(plan.constraint)
            requests.append(request)
        return requests


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt", "must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the prompt alone (how evaluation harnesses score
        one): one token is generated and dropped, as vLLM does."""
        return self.echo and self.max_tokens == 0

    def _prompt_logprobs(self) -> int | None:
        if self.echo and self.logprobs is not None:  # the echoed prompt's logprobs
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def to_generate_requests(self) -> list[generate_pb2.GenerateRequest]:
        """Prompt-major: request k is prompt k // n, choice k % n."""
        self._refuse_unsupported()
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError("max_tokens", "must be at least 1 (0 only with echo)")
        if self.suffix:
            raise InvalidRequestError("suffix", "is not supported by this server")
        if self.best_of not in (None, 1, self.n):
            raise InvalidRequestError("best_of", "must equal n (best-of selection is not done)")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                "logprobs", f"must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}"
            )
        prompts = self.prompts()
        if len(prompts) * self.n > MAX_CHOICES:
            raise InvalidRequestError(
                "prompt",
                f"{len(prompts)} prompts x n={self.n} is more than {MAX_CHOICES} choices",
            )
        requests = []
        for p in prompts:
            for choice in range(self.n):
                max_tokens = 1 if self.echo_only else self.max_tokens
                request = generate_pb2.GenerateRequest(
                    sampling=self._sampling(max_tokens, self.logprobs, choice)
                )
                if isinstance(p, str):
                    if not p:
                        raise InvalidRequestError("prompt", "must not be empty")
                    request.prompt = _utf8("prompt", p)
                else:
                    if any(not 0 <= t <= UINT32_MAX for t in p):
                        raise InvalidRequestError(
                            "prompt", f"token ids must be in [0, {UINT32_MAX}]"
                        )
                    request.token_ids.extend(p)
                requests.append(request)
        return requests

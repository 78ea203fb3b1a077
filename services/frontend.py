"""Step 1 of a request's path, shared by the coordinator and a colocated worker: a
`GenerateRequest` becomes token ids, validated sampling params and a request id. Exactly one
of prompt / messages / token_ids; chat messages go through the model's chat template; the
prompt must fit the model's context. Every refusal names the field and the limit."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from pdserve.common.errors import InvalidRequestError
from pdserve.common.prompts import Prompt, tokenize_prompt
from pdserve.common.sampling_params import SamplingParams
from pdserve.services.convert import params_from_proto
from pdserve.v1 import generate_pb2

MAX_REQUEST_ID_LEN = 256


class ContextLengthError(InvalidRequestError):
    """The prompt does not fit the model's context."""


@dataclass
class ParsedRequest:
    request_id: str
    token_ids: list[int]
    params: SamplingParams


class Frontend:
    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

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
            prompt = [{"role": m.role, "content": m.content} for m in request.messages]
        else:
            prompt = list(request.token_ids)
        params = params_from_proto(request.sampling)
        token_ids = tokenize_prompt(self.tokenizer, prompt, self.vocab_size)
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


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> generate_pb2.Usage:
    return generate_pb2.Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, cached_tokens=cached
    )

"""Between the wire and the engine: protobuf sampling settings to `SamplingParams` and
back. A bad field raises `InvalidRequestError` naming it as the client spelled it
(`sampling.top_p`), which servicers turn into INVALID_ARGUMENT."""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.common.errors import InvalidRequestError
from pdserve.common.request import Resume
from pdserve.common.sampler import TokenLogprobs
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.structured_output import StructuredOutput
from pdserve.v1 import generate_pb2

_DEFAULTS = SamplingParams()
# Trailing metadata of a RESOURCE_EXHAUSTED refusal: whole seconds to wait, as HTTP's header.
RETRY_AFTER_KEY = "retry-after"
RETRY_AFTER_S = 1  # what a refusal that knows no better says (HTTP's 429 and gRPC alike)


def params_from_proto(sampling: generate_pb2.SamplingParams) -> SamplingParams:
    """Validated engine params; unset optional fields take the engine's defaults."""

    def get(name: str) -> object:
        return getattr(sampling, name) if sampling.HasField(name) else getattr(_DEFAULTS, name)

    params = SamplingParams(
        max_tokens=int(get("max_tokens")),  # type: ignore[call-overload]
        temperature=float(get("temperature")),  # type: ignore[arg-type]
        top_p=float(get("top_p")),  # type: ignore[arg-type]
        top_k=int(get("top_k")),  # type: ignore[call-overload]
        seed=int(sampling.seed) if sampling.HasField("seed") else None,
        stop=list(sampling.stop),
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        min_tokens=int(sampling.min_tokens),
        logprobs=int(sampling.logprobs) if sampling.HasField("logprobs") else None,
        structured=structured_from_proto(sampling),
        presence_penalty=float(get("presence_penalty")),  # type: ignore[arg-type]
        frequency_penalty=float(get("frequency_penalty")),  # type: ignore[arg-type]
        repetition_penalty=float(get("repetition_penalty")),  # type: ignore[arg-type]
        logit_bias={int(k): float(v) for k, v in sampling.logit_bias.items()},
        min_p=float(get("min_p")),  # type: ignore[arg-type]
        bad_words=list(sampling.bad_words),
        allowed_token_ids=list(sampling.allowed_token_ids),
        prompt_logprobs=(
            int(sampling.prompt_logprobs) if sampling.HasField("prompt_logprobs") else None
        ),
        skip_special_tokens=bool(get("skip_special_tokens")),
    )
    try:
        return params.validate()
    except InvalidRequestError as e:
        raise InvalidRequestError(f"sampling.{e.field}", e.message) from None


def structured_from_proto(sampling: generate_pb2.SamplingParams) -> StructuredOutput | None:
    """The constraint of `sampling.structured_output`, unchecked (a worker compiles it, which
    checks it; an unset `oneof` is refused naming the field)."""
    if not sampling.HasField("structured_output"):
        return None
    s = sampling.structured_output
    kind = s.WhichOneof("constraint")
    field = f"sampling.structured_output.{kind}"
    if kind is None:
        raise InvalidRequestError(
            "sampling.structured_output", "set one of json_schema, json_object, regex, choice, "
            "grammar"
        )  # fmt: skip
    if kind == "json_schema":
        return StructuredOutput("json", s.json_schema, strict=s.strict, field=field)
    if kind == "json_object":
        return StructuredOutput("json_object", field=field)
    if kind == "choice":
        return StructuredOutput("choice", choices=tuple(s.choice.choices), field=field)
    return StructuredOutput(kind, getattr(s, kind), field=field)


def structured_to_proto(c: StructuredOutput) -> generate_pb2.StructuredOutput:
    proto = generate_pb2.StructuredOutput(strict=c.strict)
    if c.kind == "json":
        proto.json_schema = c.spec
    elif c.kind == "json_object":
        proto.json_object = True
    elif c.kind == "choice":
        proto.choice.choices.extend(c.choices)
    elif c.kind == "regex":
        proto.regex = c.spec
    else:
        proto.grammar = c.spec
    return proto


def worker_request(
    request_id: str, token_ids: Iterable[int], sampling: generate_pb2.SamplingParams
) -> tuple[list[int], SamplingParams]:
    """A worker RPC's request as the engine takes it: its prompt and validated params.
    Raises `InvalidRequestError` naming the empty or bad field."""
    if not request_id:
        raise InvalidRequestError("request_id", "must not be empty")
    prompt = list(token_ids)
    if not prompt:
        raise InvalidRequestError("prompt_token_ids", "must not be empty")
    return prompt, params_from_proto(sampling)


def resume_from_proto(message: object) -> Resume | None:
    """A worker RPC's `resumed` field (the engine checks its ranges)."""
    if not message.HasField("resumed"):  # type: ignore[attr-defined]
        return None
    resumed = message.resumed  # type: ignore[attr-defined]
    return Resume(resumed.output_tokens, resumed.sent_chars)


def params_to_proto(params: SamplingParams) -> generate_pb2.SamplingParams:
    proto = generate_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
    )
    if params.seed is not None:
        proto.seed = params.seed
    if params.logprobs is not None:
        proto.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        proto.prompt_logprobs = params.prompt_logprobs
    if not params.skip_special_tokens:
        proto.skip_special_tokens = False
    if params.structured is not None:
        proto.structured_output.CopyFrom(structured_to_proto(params.structured))
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        if getattr(params, name) != getattr(_DEFAULTS, name):
            setattr(proto, name, getattr(params, name))
    proto.logit_bias.update(params.logit_bias)
    proto.bad_words.extend(params.bad_words)
    proto.allowed_token_ids.extend(params.allowed_token_ids)
    return proto


def logprobs_to_proto(logprobs: Iterable[TokenLogprobs]) -> list[generate_pb2.TokenLogprobs]:
    return [
        generate_pb2.TokenLogprobs(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[generate_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
            rank=lp.rank,
        )
        for lp in logprobs
    ]

"""How an OpenAI or vLLM client asks for structured output, turned into the one
`StructuredOutput` of the gRPC `SamplingParams`: OpenAI's `response_format` (`json_object`,
`json_schema` with `strict`), vLLM's `structured_outputs` (`json`, `json_object`, `regex`,
`choice`, `grammar`) and its older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`. Each constraint is parsed here (`StructuredOutput.check`, no tokenizer
needed), so a bad schema, regex or grammar is a 400 naming the client's own field before any
worker is asked; a request that sets two is refused, and so is any option of
`structured_outputs` that would change the output and is not implemented."""

from __future__ import annotations

import json
from typing import Any

from pdserve.common.errors import InvalidRequestError
from pdserve.common.structured_output import StructuredOutput
from pdserve.services.convert import structured_to_proto
from pdserve.v1 import generate_pb2

# vLLM's structured_outputs keys, and those that only tune what is already decided.
_KINDS = {"json": "json", "json_object": "json_object", "regex": "regex", "choice": "choice",
          "grammar": "grammar"}  # fmt: skip
_NO_EFFECT = {"disable_fallback", "backend"}


def structured_output(
    response_format: dict[str, Any] | None,
    structured_outputs: dict[str, Any] | None,
    guided: dict[str, Any],
) -> generate_pb2.StructuredOutput | None:
    """The constraint a request asked for (None: free text). `guided`: the request's
    `guided_*` fields by name (unset ones None)."""
    found: list[StructuredOutput] = []
    if response_format is not None:
        c = _from_response_format(response_format)
        if c is not None:
            found.append(c)
    if structured_outputs is not None:
        c = _from_structured_outputs(structured_outputs)
        if c is not None:
            found.append(c)
    for name, value in guided.items():
        if value is not None:
            found.append(_guided(name, value))
    if not found:
        return None
    if len(found) > 1:
        raise InvalidRequestError(
            found[1].field,
            f"only one structured-output constraint per request (also set: {found[0].field})",
        )
    return structured_to_proto(found[0].check())


def _from_response_format(rf: dict[str, Any]) -> StructuredOutput | None:
    kind = rf.get("type")
    if kind in (None, "text"):
        if kind is None:
            raise InvalidRequestError("response_format.type", "is required")
        return None
    if kind == "json_object":
        return StructuredOutput("json_object", field="response_format")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequestError("response_format.json_schema", "must be an object")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                "response_format.json_schema.schema", "must be a JSON schema object"
            )
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequestError("response_format.json_schema.strict", "must be a boolean")
        return StructuredOutput(
            "json", _dump(schema), strict=bool(strict), field="response_format.json_schema.schema"
        )
    raise InvalidRequestError(
        "response_format.type", f"must be text, json_object or json_schema, got {kind!r}"
    )


def _from_structured_outputs(so: dict[str, Any]) -> StructuredOutput | None:
    given = [k for k, v in so.items() if k in _KINDS and v not in (None, False)]
    for key, value in so.items():
        if key not in _KINDS and key not in _NO_EFFECT and value not in (None, False, ""):
            raise InvalidRequestError(
                f"structured_outputs.{key}", "is not supported by this server"
            )
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequestError(
            "structured_outputs", f"set only one of {', '.join(_KINDS)} (got {', '.join(given)})"
        )
    key = given[0]
    return _constraint(_KINDS[key], so[key], f"structured_outputs.{key}")


def _guided(name: str, value: Any) -> StructuredOutput:
    kind = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
            "guided_grammar": "grammar"}[name]  # fmt: skip
    return _constraint(kind, value, name)


def _constraint(kind: str, value: Any, field: str) -> StructuredOutput:
    if kind == "json_object":
        return StructuredOutput("json_object", field=field)
    if kind == "json":
        if isinstance(value, dict):
            return StructuredOutput("json", _dump(value), field=field)
        if isinstance(value, str):
            return StructuredOutput("json", value, field=field)
        raise InvalidRequestError(field, "must be a JSON schema (an object or its text)")
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise InvalidRequestError(field, "must be a list of strings")
        return StructuredOutput("choice", choices=tuple(value), field=field)
    if not isinstance(value, str):
        raise InvalidRequestError(field, "must be a string")
    return StructuredOutput(kind, value, field=field)


def _dump(schema: dict[str, Any]) -> str:
    try:
        return json.dumps(schema, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError("response_format", f"cannot be written as JSON: {e}") from None

"""The JSONL lines of `pdserve generate` (`offline.py`, and each rank's share of them in
`expert_parallel.py`): one request per input line, with its own sampling fields over the
command's defaults, and one result row per output line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdserve.common.engine import Prompt, RequestOutput
from pdserve.common.errors import InvalidRequestError
from pdserve.common.sampling_params import SamplingParams

PROMPT_FIELDS = ("prompt", "messages", "token_ids")
SAMPLING_FIELDS = {
    "max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int,
    "stop": list, "stop_token_ids": list, "ignore_eos": bool, "logprobs": int,
}  # fmt: skip


@dataclass
class Defaults:
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int | None = None


def parse_line(line: str, defaults: Defaults) -> tuple[Prompt, SamplingParams]:
    """One JSONL line → (prompt, params); raises InvalidRequestError naming the field."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(
            "line", f"is not valid JSON ({exc.msg} at column {exc.colno})"
        ) from None
    if not isinstance(row, dict):
        raise InvalidRequestError("line", "must be a JSON object")
    present = [f for f in PROMPT_FIELDS if f in row]
    if len(present) != 1:
        raise InvalidRequestError(
            "prompt", f"each line needs exactly one of {', '.join(PROMPT_FIELDS)}"
        )
    prompt = row[present[0]]
    if present[0] == "prompt" and not isinstance(prompt, str):
        raise InvalidRequestError("prompt", "must be a string")
    if present[0] == "messages" and not (
        isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt)
    ):
        raise InvalidRequestError("messages", "must be a non-empty list of {role, content}")
    if present[0] == "token_ids" and not (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        raise InvalidRequestError("token_ids", "must be a non-empty list of integers")
    kwargs: dict[str, Any] = {
        "max_tokens": defaults.max_tokens,
        "temperature": defaults.temperature,
        "seed": defaults.seed,
    }
    for name, kind in SAMPLING_FIELDS.items():
        if name not in row or row[name] is None:
            continue
        value = row[name]
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        if name == "stop" and isinstance(value, str):
            value, ok = [value], True
        if not ok:
            raise InvalidRequestError(name, f"must be of type {kind.__name__}, got {value!r}")
        kwargs[name] = value
    return prompt, SamplingParams(**kwargs).validate()


def result_row(index: int, out: RequestOutput) -> dict[str, Any]:
    return {
        "index": index,
        "text": out.text,
        "token_ids": list(out.token_ids),
        "finish_reason": out.finish_reason,
        "prompt_tokens": out.prompt_tokens,
    }

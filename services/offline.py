"""`pdserve generate`: offline batch generation from a JSONL file.

Each input line is one request — `{"prompt": ...}`, `{"messages": [...]}` (chat template
applied) or `{"token_ids": [...]}` — optionally with its own sampling fields. All valid lines
run together through one engine (continuous batching); each output line, in input order, is
`{"index", "text", "token_ids", "finish_reason", "prompt_tokens"}`. A bad line gets a one-line
error on stderr naming the line and field, and `{"index", "error"}` in the output; the other
lines are unaffected and the command exits non-zero."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any, TextIO

from pdserve.common.engine import LLMEngine, Prompt, RequestOutput
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


def run_generate(engine: LLMEngine, infile: TextIO, outfile: TextIO, defaults: Defaults,
                 progress: bool = True) -> int:  # fmt: skip
    """Run every line of `infile`; write results to `outfile`. Returns the number of bad lines."""
    if engine.config.expert_parallel > 1:
        from pdserve.services.expert_parallel import run_generate_ranks

        return run_generate_ranks(engine, infile, outfile, defaults)
    runner = engine.runner
    if runner.tp is not None and runner.tp.rank != 0:  # runs rank 0's steps on its shard
        runner.follow()
        return 0
    try:
        return _run_lines(engine, infile, outfile, defaults, progress)
    finally:
        runner.stop_followers()


def _run_lines(engine: LLMEngine, infile: TextIO, outfile: TextIO, defaults: Defaults,
               progress: bool) -> int:  # fmt: skip
    results: dict[int, dict[str, Any]] = {}
    request_to_index: dict[str, int] = {}
    errors = 0
    index = 0
    for lineno, line in enumerate(infile, start=1):
        if not line.strip():
            continue
        try:
            prompt, params = parse_line(line, defaults)
            request = engine.add_request(prompt, params, request_id=f"line-{lineno}")
            request_to_index[request.request_id] = index
        except InvalidRequestError as exc:
            errors += 1
            print(f"pdserve generate: line {lineno}: {exc}", file=sys.stderr)
            results[index] = {"index": index, "error": str(exc)}
        index += 1
    final = engine.run_until_done(len(request_to_index), progress=progress)
    for request_id, out in final.items():
        i = request_to_index[request_id]
        results[i] = result_row(i, out)
    for i in range(index):
        outfile.write(json.dumps(results[i], ensure_ascii=False) + "\n")
    return errors

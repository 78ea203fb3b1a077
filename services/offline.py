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
from typing import Any, TextIO

from pdserve.common.engine import LLMEngine
from pdserve.common.errors import InvalidRequestError
from pdserve.services.expert_parallel import run_generate_ranks
from pdserve.services.generate_lines import Defaults, parse_line, result_row


def run_generate(engine: LLMEngine, infile: TextIO, outfile: TextIO, defaults: Defaults,
                 progress: bool = True) -> int:  # fmt: skip
    """Run every line of `infile`; write results to `outfile`. Returns the number of bad lines."""
    if engine.config.expert_parallel > 1:
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

"""The `pdserve` command line: the front door of every pdserve process.

Serving: `serve` (the whole system on this host; `make serve` runs it), or one service per
process for containers: `coordinator`, `prefill`, `decode`, `colocated`. Clients: `chat` and
`complete` talk to a running coordinator. Offline: `generate` (JSONL batch) and `demo`.
Every flag of a service can also come from a `PDSERVE_<FLAG>` environment variable (for
containers); a flag on the command line wins. `options` prints them all (docs/options.md)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Sequence
from typing import TextIO

from pdserve.common.errors import PdserveError
from pdserve.services.engine_args import add_engine_args, load_engine

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for writing clear code.",
    "Explain in two sentences why the sky is blue.",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="pdserve: prefill-decode disaggregated LLM serving.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser(
        "generate",
        help="offline batch generation: JSONL requests in, JSONL results out",
        description="Run every request of a JSONL file through one engine and write one "
        'result line per input line, in order. Input lines: {"prompt": "..."}, '
        '{"messages": [{"role": "user", "content": "..."}]} or {"token_ids": [...]}, '
        "optionally with max_tokens, temperature, top_p, top_k, seed, stop, stop_token_ids, "
        "ignore_eos.",
    )
    gen.add_argument("--input", required=True, help="JSONL file of requests ('-' for stdin)")
    gen.add_argument("--output", required=True, help="JSONL file for results ('-' for stdout)")
    gen.add_argument(
        "--max-tokens",
        type=int,
        default=128,
        help="default max new tokens per request (default: %(default)s)",
    )
    gen.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="default temperature; 0 is greedy (default: %(default)s)",
    )
    gen.add_argument("--seed", type=int, default=None, help="default per-request sampling seed")
    gen.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    # Offline nobody watches tokens stream: steps take the whole token budget, as vLLM's
    # offline engine does, unless a TPOT target is asked for.
    add_engine_args(gen, tpot_target_ms=0.0)

    _add_serving_commands(sub)

    demo = sub.add_parser("demo", help="stream answers to a few chat prompts, offline")
    demo.add_argument("prompts", nargs="*", help="chat prompts (default: a small demo set)")
    demo.add_argument("--max-tokens", type=int, default=96, help="max new tokens per answer")
    add_engine_args(demo)

    sub.add_parser(
        "options",
        help="every option of the serving, client and offline commands, with its PDSERVE_* "
        "variable",
        description="Print docs/options.md: one table per group of flags (flag, variable, "
        "commands, meaning and default), from this parser with no PDSERVE_* variable set.",
    )

    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    return parser


def _add_serving_commands(sub: argparse._SubParsersAction) -> None:
    from pdserve.services.client import add_client_args
    from pdserve.services.coordinator.main import add_coordinator_args, add_http_args
    from pdserve.services.service_args import (
        add_admission_args,
        add_service_args,
        add_worker_args,
    )

    serve = sub.add_parser(
        "serve",
        help="run a coordinator and its workers on this host",
        description="Start prefill and decode workers (or one colocated worker) and a "
        "coordinator, each its own process, on this host. Prints one JSON 'ready' line once "
        "all are healthy; Ctrl-C stops them all.",
    )
    serve.add_argument("--prefill", type=int, default=1, help="prefill workers (default: 1)")
    serve.add_argument("--decode", type=int, default=1, help="decode workers (default: 1)")
    serve.add_argument(
        "--prefill-tensor-parallel",
        type=int,
        metavar="N",
        default=None,
        help="rank processes per prefill worker (default: --tensor-parallel)",
    )
    serve.add_argument(
        "--decode-tensor-parallel",
        type=int,
        metavar="N",
        default=None,
        help="rank processes per decode worker; may differ from prefill's, the KV heads are "
        "mapped between the groups (default: --tensor-parallel)",
    )
    serve.add_argument(
        "--colocated",
        action="store_true",
        help="one engine doing prefill and decode (the baseline), no KV transfer",
    )
    serve.add_argument(
        "--internal-tls",
        action="store_true",
        help="mTLS between the processes with a throwaway CA made at start (the public "
        "ports stay plain unless --public-tls-cert/--public-tls-key are given)",
    )
    add_service_args(serve, 50051)
    add_admission_args(serve)
    add_http_args(serve, 8000)
    add_engine_args(serve)

    coord = sub.add_parser(
        "coordinator",
        help="the public GenerateService in front of worker pools",
        description="Validate, tokenize and route each request through a prefill then a "
        "decode worker (or a colocated one), streaming tokens back.",
    )
    add_coordinator_args(coord)
    for role, text in [
        ("prefill", "compute prompts, hand their KV blocks to decode workers"),
        ("decode", "pull prefilled KV blocks and generate the remaining tokens"),
        ("colocated", "one engine doing prefill and decode behind GenerateService"),
    ]:
        add_worker_args(sub.add_parser(role, help=f"a {role} worker: {text}"), role)

    complete = sub.add_parser("complete", help="stream one completion from a coordinator")
    complete.add_argument("prompt", help="the prompt")
    complete.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user chat message (chat template applied)",
    )
    add_client_args(complete)
    chat = sub.add_parser("chat", help="an interactive chat with a coordinator, streamed")
    chat.add_argument("--system", default=None, help="a system message to start with")
    add_client_args(chat)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "demo":
            return _demo(args)
        if args.command == "options":
            return _options()
        return _serving_command(args)
    except (PdserveError, ValueError) as exc:
        print(f"pdserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _serving_command(args: argparse.Namespace) -> int:
    if args.command in ("coordinator", "prefill", "decode", "colocated"):
        from pdserve.common import faults

        faults.arm_from_env()  # a test's named faults (off unless PDSERVE_FAULTS is set)
    if args.command == "serve":
        from pdserve.services.launcher import run_serve

        return run_serve(args)
    if args.command == "coordinator":
        from pdserve.services.coordinator.main import run_coordinator

        return run_coordinator(args)
    if args.command in ("prefill", "decode", "colocated"):
        from pdserve.services.worker_process import run_worker

        return run_worker(args, args.command)
    from pdserve.services.client import run_chat, run_complete

    return run_complete(args) if args.command == "complete" else run_chat(args)


def _generate(args: argparse.Namespace) -> int:
    from pdserve.services.generate_lines import Defaults
    from pdserve.services.offline import run_generate

    defaults = Defaults(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    # Check the request-wide defaults before loading anything.
    from pdserve.common.sampling_params import SamplingParams

    SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature).validate()
    with contextlib.ExitStack() as files:
        infile = _open(files, args.input, "r", sys.stdin, "input")
        engine = load_engine(args)
        outfile = _open(files, args.output, "w", sys.stdout, "output")
        errors = run_generate(engine, infile, outfile, defaults, progress=not args.no_progress)
    if errors:
        print(f"pdserve generate: {errors} line(s) rejected; see above", file=sys.stderr)
        return 1
    return 0


def _options() -> int:
    import os

    from pdserve.services.option_table import markdown

    for name in [n for n in os.environ if n.startswith("PDSERVE_")]:
        del os.environ[name]  # the declared defaults, not this shell's
    sys.stdout.write(markdown(build_parser()))
    return 0


def _open(files: contextlib.ExitStack, path: str, mode: str, std: TextIO, field: str) -> TextIO:
    if path == "-":
        return std
    try:
        return files.enter_context(open(path, mode, encoding="utf-8"))
    except OSError as exc:
        raise PdserveError(f"{field}: cannot open {path}: {exc.strerror}") from exc


def _demo(args: argparse.Namespace) -> int:
    from pdserve.common.sampling_params import SamplingParams

    engine = load_engine(args)
    prompts = args.prompts or DEMO_PROMPTS
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    ids = [engine.add_request([{"role": "user", "content": p}], params).request_id for p in prompts]
    # All prompts run in one continuous batch; answers are shown in order, each streamed
    # token by token once the ones before it are done.
    texts: dict[str, list[str]] = {i: [] for i in ids}
    done: set[str] = set()
    shown = 0

    def show_ready() -> None:
        nonlocal shown
        while shown < len(ids):
            rid = ids[shown]
            chunk = "".join(texts[rid])
            texts[rid].clear()
            if chunk:
                sys.stdout.write(chunk)
                sys.stdout.flush()
            if rid not in done:
                return
            sys.stdout.write("\n\n")
            shown += 1
            if shown < len(ids):
                sys.stdout.write(f">>> {prompts[shown]}\n")

    sys.stdout.write(f">>> {prompts[0]}\n")
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id].append(out.new_text)
            if out.finished:
                done.add(out.request_id)
        show_ready()
    show_ready()
    return 0


if __name__ == "__main__":
    sys.exit(main())

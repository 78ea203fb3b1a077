"""The `pdserve` command line: the front door of every pdserve process.

Subcommands today: `generate` (offline batch generation from JSONL) and `demo` (streams
answers to a few chat prompts on the embedded default model; `make serve` runs it). Every
engine flag can also come from a `PDSERVE_<FLAG>` environment variable (for containers);
a flag on the command line wins."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from pdserve.common.config import DTYPES, EngineConfig
from pdserve.common.errors import ModelLoadError, PdserveError

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for writing clear code.",
    "Explain in two sentences why the sky is blue.",
]


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"PDSERVE_{name.upper()}", default)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (each also read from PDSERVE_<NAME>)")
    g.add_argument(
        "--model",
        default=_env("model"),
        help="local Hugging Face model folder (default: the embedded SmolLM2-135M-Instruct)",
    )
    g.add_argument(
        "--dtype",
        default=_env("dtype", "bfloat16"),
        choices=sorted(DTYPES),
        help="weights, activations and KV cache dtype (default: %(default)s)",
    )
    g.add_argument(
        "--device", default=_env("device", "cpu"), help="cpu or cuda[:N] (default: %(default)s)"
    )
    g.add_argument(
        "--threads",
        type=int,
        default=_int_env("threads"),
        help="torch threads (default: every core this process may use)",
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=_int_env("block_size", 16),
        help="tokens per KV block (default: %(default)s)",
    )
    g.add_argument(
        "--kv-cache-gb",
        type=float,
        default=float(_env("kv_cache_gb", "2")),
        help="KV cache size in GiB (default: %(default)s)",
    )
    g.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=_int_env("kv_cache_tokens"),
        help="KV cache size in tokens (overrides --kv-cache-gb)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=_int_env("max_num_seqs", 128),
        help="most requests in one batch (default: %(default)s)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=_int_env("max_num_batched_tokens", 2048),
        help="token budget of one step; longer prompts are prefilled in chunks "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=_int_env("max_model_len"),
        help="longest prompt + output (default: the model's limit)",
    )
    g.add_argument("--no-prefix-caching", action="store_true",
                   default=_env("no_prefix_caching", "0") not in ("0", "", "false"),
                   help="turn off automatic prefix caching")  # fmt: skip


def _int_env(name: str, default: int | None = None) -> int | None:
    value = _env(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise SystemExit(
            f"pdserve: error: PDSERVE_{name.upper()} must be an integer, got {value!r}"
        ) from None


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        block_size=args.block_size,
        kv_cache_gb=args.kv_cache_gb,
        kv_cache_tokens=args.kv_cache_tokens,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
    )


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
    add_engine_args(gen)

    demo = sub.add_parser("demo", help="stream answers to a few chat prompts (make serve)")
    demo.add_argument("prompts", nargs="*", help="chat prompts (default: a small demo set)")
    demo.add_argument("--max-tokens", type=int, default=96, help="max new tokens per answer")
    add_engine_args(demo)

    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    return parser


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
    except (PdserveError, ValueError) as exc:
        print(f"pdserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    parser.error(f"unknown command {args.command}")
    return 2


def _load_engine(args: argparse.Namespace):
    from pdserve.common.engine import LLMEngine

    try:
        return LLMEngine(engine_config(args))
    except (OSError, KeyError) as exc:
        raise ModelLoadError(
            f"model: cannot load {args.model or 'the default model'}: {exc}"
        ) from exc


def _generate(args: argparse.Namespace) -> int:
    from pdserve.services.offline import Defaults, run_generate

    defaults = Defaults(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    # Check the request-wide defaults before loading anything.
    from pdserve.common.sampling_params import SamplingParams

    SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature).validate()
    with contextlib.ExitStack() as files:
        infile = _open(files, args.input, "r", sys.stdin, "input")
        engine = _load_engine(args)
        outfile = _open(files, args.output, "w", sys.stdout, "output")
        errors = run_generate(engine, infile, outfile, defaults, progress=not args.no_progress)
    if errors:
        print(f"pdserve generate: {errors} line(s) rejected; see above", file=sys.stderr)
        return 1
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

    engine = _load_engine(args)
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

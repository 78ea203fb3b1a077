"""`pdserve complete` and `pdserve chat`: a person talking to a running coordinator over
the public `GenerateService`, answers streamed as they are generated."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

import grpc

from pdserve.common.config import Option
from pdserve.services.engine_args import FROM_ENV, add_options
from pdserve.v1 import generate_pb2, generate_pb2_grpc

# The coordinator a client talks to and how (`add_client_args`).
CONNECTION_OPTIONS = (
    Option("address", str, "127.0.0.1:50051", "coordinator host:port (default: %(default)s)"),
    Option(
        "api_key",
        str,
        None,
        "the coordinator's API key, sent as 'authorization: Bearer KEY' (prefer "
        "PDSERVE_API_KEY: a flag shows in the process list)",
    ),
    Option(
        "public_tls_ca",
        str,
        None,
        "CA bundle (PEM) to verify a coordinator serving TLS (--public-tls-cert); "
        "default: plain text",
    ),
)


def add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-tokens", type=int, default=256, help="most tokens per answer (default: %(default)s)"
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)"
    )
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    g = p.add_argument_group(f"connection to the coordinator ({FROM_ENV})")
    add_options(g, CONNECTION_OPTIONS)


def _channel(args: argparse.Namespace) -> grpc.Channel:
    if not args.public_tls_ca:
        return grpc.insecure_channel(args.address)
    with open(args.public_tls_ca, "rb") as f:
        return grpc.secure_channel(args.address, grpc.ssl_channel_credentials(f.read()))


def _metadata(args: argparse.Namespace) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {args.api_key}")] if args.api_key else []


def _sampling(args: argparse.Namespace) -> generate_pb2.SamplingParams:
    sampling = generate_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.seed is not None:
        sampling.seed = args.seed
    return sampling


def _print_stream(responses: Iterator[generate_pb2.GenerateResponse]) -> str:
    text = []
    for response in responses:
        sys.stdout.write(response.text)
        sys.stdout.flush()
        text.append(response.text)
    sys.stdout.write("\n")
    return "".join(text)


def run_complete(args: argparse.Namespace) -> int:
    with _channel(args) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        if args.chat:
            request = generate_pb2.GenerateRequest(
                messages=[generate_pb2.ChatMessage(role="user", content=args.prompt)],
                sampling=_sampling(args),
            )
        else:
            request = generate_pb2.GenerateRequest(prompt=args.prompt, sampling=_sampling(args))
        try:
            _print_stream(stub.Generate(request, metadata=_metadata(args)))
        except grpc.RpcError as e:
            print(f"pdserve complete: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


def run_chat(args: argparse.Namespace) -> int:
    messages: list[generate_pb2.ChatMessage] = []
    if args.system:
        messages.append(generate_pb2.ChatMessage(role="system", content=args.system))
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"Chatting with {args.address}. Empty line or Ctrl-D to quit.")
    with _channel(args) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        while True:
            try:
                line = input(">>> " if interactive else "")
            except EOFError:
                break
            if not line.strip():
                break
            messages.append(generate_pb2.ChatMessage(role="user", content=line))
            request = generate_pb2.GenerateRequest(messages=messages, sampling=_sampling(args))
            try:
                answer = _print_stream(stub.Generate(request, metadata=_metadata(args)))
            except grpc.RpcError as e:
                print(f"pdserve chat: {e.code().name}: {e.details()}", file=sys.stderr)
                messages.pop()
                continue
            messages.append(generate_pb2.ChatMessage(role="assistant", content=answer))
    return 0

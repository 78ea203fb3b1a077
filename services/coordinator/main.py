"""`pdserve coordinator`: the public gRPC endpoint (and, with `--http-port`, the
OpenAI-compatible HTTP API) in front of the worker pools. It loads only the tokenizer and the
model's config (no weights)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sys
from typing import TYPE_CHECKING

from pdserve.common.config import Option
from pdserve.services.coordinator.router import DEFAULT_POLICY, POLICIES, RouterWeights
from pdserve.services.coordinator.tool_calls import DEFAULT_PARSER, PARSERS
from pdserve.services.engine_args import FROM_ENV, add_options
from pdserve.services.service_args import add_service_args

if TYPE_CHECKING:
    import grpc

    from pdserve.services.auth import ApiKeys
    from pdserve.services.coordinator.discovery import Discovery

# The worker pools and how requests are routed to them (`add_coordinator_args`).
WORKERS_OPTIONS = (
    Option("prefill_workers", str, "", "comma-separated host:port of prefill workers"),
    Option("decode_workers", str, "", "comma-separated host:port of decode workers"),
    Option(
        "colocated_workers",
        str,
        "",
        "comma-separated host:port of colocated workers (instead of the two pools)",
    ),
    Option(
        "policy",
        str,
        DEFAULT_POLICY,
        "how a worker is picked in a pool (default: %(default)s)",
        choices=POLICIES,
    ),
    Option(
        "prefix_weight",
        float,
        RouterWeights().prefix_weight,
        "prefix_aware: cost of each prompt block a prefill worker must compute "
        "(default: %(default)s)",
    ),
    Option(
        "load_weight",
        float,
        RouterWeights().load_weight,
        "prefix_aware: cost of each request queued on a prefill worker, in blocks "
        "(default: %(default)s)",
    ),
    Option(
        "no_kv_events",
        bool,
        False,
        "prefix_aware: index prefixes from this coordinator's own decisions instead of "
        "the workers' cache reports (approximate)",
    ),
    Option(
        "local_prefill_tokens",
        int,
        0,
        "skip the KV transfer when a decode worker caches all of a prompt but at most "
        "this many tokens: it computes them itself (0: never; default: %(default)s)",
    ),
    Option(
        "max_retries",
        int,
        2,
        "times one request may move to another worker after losing one (default: %(default)s)",
    ),
    Option(
        "model",
        str,
        None,
        "model folder, for the tokenizer and context length (default: the "
        "embedded SmolLM2-135M-Instruct)",
    ),
    Option("no_log_requests", bool, False, "no JSON line on stderr per finished request"),
    Option("max_model_len", int, None, "longest prompt + output (default: the model's limit)"),
    Option(
        "max_inflight_requests",
        int,
        1024,
        "requests in flight at once; more are refused with RESOURCE_EXHAUSTED / HTTP "
        "429 (default: %(default)s)",
    ),
)

# The OpenAI-compatible HTTP API and the public ports' door (`add_http_args`); the port's
# default is each command's own.
HTTP_OPTIONS = (
    Option(
        "http_port",
        int,
        None,
        "port of /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics; "
        "0 picks a free one, -1 turns HTTP off (default: %(default)s)",
    ),
    Option(
        "api_key",
        str,
        None,
        "when set, HTTP /v1/* and gRPC GenerateService need 'authorization: Bearer "
        "KEY' (prefer PDSERVE_API_KEY: a flag shows in the process list)",
    ),
    Option(
        "api_key_file",
        str,
        None,
        "file of accepted keys, one per line (read again when it changes: rotate by "
        "adding the new key, moving clients, then removing the old one)",
    ),
    Option(
        "public_tls_cert",
        str,
        None,
        "server certificate (PEM) of the public gRPC and HTTP ports (no client "
        "certificate is asked there: clients use the API key); default: plain",
    ),
    Option("public_tls_key", str, None, "its private key (PEM)"),
    Option(
        "served_model_name",
        str,
        None,
        "comma-separated model ids clients may name; the first is the default "
        "(default: the model folder's name)",
    ),
    Option(
        "tool_call_parser",
        str,
        DEFAULT_PARSER,
        "how chat output is read for tool calls with tool_choice auto: the model family's "
        "format (default: %(default)s, the default model's as pdserve renders tools for it)",
        choices=PARSERS,
    ),
)


def add_coordinator_args(p: argparse.ArgumentParser) -> None:
    add_service_args(p, 50051)
    add_options(p.add_argument_group(f"workers ({FROM_ENV})"), WORKERS_OPTIONS)
    from pdserve.services.coordinator.discovery import add_discovery_args

    add_discovery_args(p)
    add_http_args(p, None)


def add_http_args(p: argparse.ArgumentParser, default_port: int | None) -> None:
    """The OpenAI-compatible HTTP API's flags (on `coordinator` and `serve`); HTTP is off
    unless `default_port` or --http-port names a port."""
    port, *rest = HTTP_OPTIONS
    if default_port is None:
        port = dataclasses.replace(port, help=port.help.replace("%(default)s", "off"))
    g = p.add_argument_group(f"OpenAI-compatible HTTP API ({FROM_ENV})")
    add_options(g, (port, *rest), http_port=default_port)


def _log_requests() -> None:
    """One JSON line per finished request on stderr, whatever the log level of the rest."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger("pdserve.requests")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def _split(value: str) -> list[str]:
    return [a.strip() for a in value.split(",") if a.strip()]


def run_coordinator(args: argparse.Namespace) -> int:
    from pdserve.services.coordinator.discovery import build_discovery

    static = {
        "prefill": _split(args.prefill_workers),
        "decode": _split(args.decode_workers),
        "colocated": _split(args.colocated_workers),
    }
    from pdserve.services.auth import ApiKeys

    discovery = build_discovery(args, static)  # raises ValueError naming what is missing
    from pdserve.services.tls import TlsFiles, public_server_credentials, use_internal_tls

    keys = ApiKeys.configured(args.api_key, args.api_key_file)  # refuses an empty key
    use_internal_tls(TlsFiles.from_args(args))  # its certificate towards the workers
    if bool(args.public_tls_cert) != bool(args.public_tls_key):
        raise ValueError("public TLS: --public-tls-cert and --public-tls-key go together")
    public = None
    if args.public_tls_cert:
        public = public_server_credentials(args.public_tls_cert, args.public_tls_key)
    code = asyncio.run(_serve(args, discovery, keys, public))
    sys.stdout.flush()
    os._exit(code)


async def _serve(
    args: argparse.Namespace,
    discovery: Discovery,
    keys: ApiKeys | None,
    public: grpc.ServerCredentials | None,
) -> int:
    from transformers import AutoConfig, AutoTokenizer

    from pdserve.common.model_files import resolve_model
    from pdserve.common.prompts import max_model_len
    from pdserve.common.tracing import setup_tracing, shutdown_tracing
    from pdserve.services.auth import ApiKeyInterceptor
    from pdserve.services.coordinator.servicer import CoordinatorServicer
    from pdserve.services.frontend import Frontend
    from pdserve.services.grpc_server import ServiceProcess, message_limit
    from pdserve.v1 import decode_pb2_grpc, generate_pb2_grpc, prefill_pb2_grpc

    setup_tracing("pdserve-coordinator")
    if not args.no_log_requests:
        _log_requests()
    model_dir = resolve_model(args.model)
    hf_config = AutoConfig.from_pretrained(model_dir)
    frontend = Frontend(
        AutoTokenizer.from_pretrained(model_dir),
        hf_config.vocab_size,
        max_model_len(hf_config, args.max_model_len),
    )
    from pdserve.services.coordinator.pool import WorkerPool
    from pdserve.services.coordinator.request_path import Coordinator

    routing = {
        "policy": args.policy,
        "weights": RouterWeights(args.prefix_weight, args.load_weight),
        "kv_events": not args.no_kv_events,
        "keepalive_s": args.grpc_keepalive,
    }
    pools = {
        "prefill": WorkerPool("prefill", [], prefill_pb2_grpc.PrefillServiceStub, **routing),
        "decode": WorkerPool("decode", [], decode_pb2_grpc.DecodeServiceStub, **routing),
        "colocated": WorkerPool("colocated", [], generate_pb2_grpc.GenerateServiceStub, **routing),
    }
    colocated = "colocated" in discovery.roles
    if not colocated:
        from pdserve.services.coordinator.prefill_names import PrefillNames

        PrefillNames(pools["prefill"], pools["decode"])  # hooks itself into both pools
    watching = asyncio.ensure_future(
        discovery.run(lambda role, addresses: pools[role].set_addresses(addresses))
    )
    process = ServiceProcess(
        args.host,
        args.port,
        args.metrics_port,
        interceptors=[ApiKeyInterceptor(keys)] if keys else [],
        max_message_bytes=message_limit(frontend.max_prompt_chars),
        credentials=public,
        health_port=args.health_port,
        keepalive_s=args.grpc_keepalive,
    )
    identity = {
        "model": model_dir.name,
        "worker_id": f"coordinator-{process.port}",
        "max_inflight": args.max_inflight_requests,
        "max_retries": args.max_retries,
        "local_prefill_tokens": args.local_prefill_tokens,
    }
    if colocated:
        coordinator = Coordinator(frontend, colocated=pools["colocated"], **identity)
    else:
        coordinator = Coordinator(
            frontend, prefill=pools["prefill"], decode=pools["decode"], **identity
        )
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(
        CoordinatorServicer(coordinator), process.server
    )
    http = None
    if args.http_port is not None and args.http_port >= 0:
        from pdserve.services.coordinator.http_api import HttpServer, OpenAIServer

        served = _split(args.served_model_name or "") or [model_dir.name]
        api = OpenAIServer(
            coordinator,
            AutoTokenizer.from_pretrained(model_dir),  # its own: the frontend's has a thread
            served,
            frontend.max_model_len,
            keys,
            max_body_bytes=message_limit(frontend.max_prompt_chars),
            tool_call_parser=args.tool_call_parser,
        )
        tls_files = (args.public_tls_cert, args.public_tls_key) if public else None
        http = HttpServer(api.app, args.host, args.http_port, tls_files)
        await http.start()
        process.on_drain(http.drain)

    async def close_pools() -> None:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
        for pool in pools.values():
            await pool.close()
        shutdown_tracing()

    process.on_stop(close_pools)
    ready = {
        "event": "listening",
        "role": "coordinator",
        "grpc": process.address,
        "metrics": f"http://{args.host}:{process.metrics_port}/metrics",
    }
    if http is not None:
        ready["http"] = http.address
    if process.health_port:
        ready["health"] = f"{args.host}:{process.health_port}"
    await process.run(
        ["pdserve.v1.GenerateService"],
        on_ready=lambda: print(json.dumps(ready), flush=True),
        grace_s=args.drain_timeout,
    )
    return 0

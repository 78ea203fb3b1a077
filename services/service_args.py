"""Flags of the serving commands (`serve`, `prefill`, `decode`, `colocated`), each also read
from a `PDSERVE_<NAME>` environment variable. Kept apart from the services themselves so
that `pdserve --help` and the clients start without importing torch."""

from __future__ import annotations

import argparse

from pdserve.services.engine_args import add_engine_args, env
from pdserve.services.tls import add_tls_args


def add_service_args(p: argparse.ArgumentParser, default_port: int) -> None:
    g = p.add_argument_group("service (each also read from PDSERVE_<NAME>)")
    g.add_argument(
        "--host",
        default=env("host", "127.0.0.1"),
        help="address to listen on (default: %(default)s)",
    )
    g.add_argument(
        "--port",
        type=int,
        default=int(env("port", str(default_port)) or 0),
        help="gRPC port; 0 picks a free one (default: %(default)s)",
    )
    g.add_argument(
        "--metrics-port",
        type=int,
        default=int(env("metrics_port", "0") or 0),
        help="Prometheus /metrics port; 0 picks a free one (default: %(default)s)",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=float(env("drain_timeout", "30") or 30),
        help="on SIGTERM / SIGINT: health turns NOT_SERVING, new calls are refused, and "
        "calls in flight get this many seconds to finish (default: %(default)s)",
    )
    add_tls_args(p)


def add_worker_args(p: argparse.ArgumentParser, role: str) -> None:
    add_service_args(p, {"prefill": 50061, "decode": 50071, "colocated": 50081}[role])
    g = p.add_argument_group("worker")
    g.add_argument(
        "--worker-id",
        default=env("worker_id"),
        help="name in KV handles and metrics (default: ROLE-HOST-PORT)",
    )
    g.add_argument(
        "--advertise-address",
        default=env("advertise_address"),
        help="host:port other workers call this one at (put in KV handles); default: "
        "--host:port, or this host's address when --host is 0.0.0.0",
    )
    g.add_argument(
        "--kv-transport",
        default=env("kv_transport", "ucx"),
        choices=["ucx"],
        help="how KV blocks move between workers (default: %(default)s)",
    )
    g.add_argument(
        "--transfer-timeout",
        type=float,
        default=float(env("transfer_timeout", "30") or 30),
        help="seconds a KV transfer may take before it fails (default: %(default)s)",
    )
    if role == "prefill":
        g.add_argument(
            "--kv-lease",
            type=float,
            default=float(env("kv_lease", "30") or 30),
            help="seconds prefilled blocks wait for a pull before they are freed "
            "(default: %(default)s)",
        )
    g.add_argument(
        "--max-pending",
        type=int,
        default=int(env("max_pending", "256") or 256),
        help="requests that may wait (for a batch slot"
        + (", or for KV blocks" if role == "decode" else "")
        + ") before new ones are refused with RESOURCE_EXHAUSTED (default: %(default)s)",
    )
    add_admission_args(g)
    g.add_argument(
        "--status-interval",
        type=float,
        default=float(env("status_interval", "0.1") or 0.1),
        help="seconds between this worker's status reports to coordinators (default: %(default)s)",
    )
    if role == "decode":
        g.add_argument(
            "--prefill-workers",
            default=env("prefill_workers", ""),
            help="comma-separated host:port of prefill workers this worker may pull KV from, "
            "beside the prefill pools its coordinators name; a KV handle naming any other "
            "address is refused (PERMISSION_DENIED) before a connection is made",
        )
    add_engine_args(p)


def add_admission_args(g: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    """Flags of a serving worker's admission that `serve` passes to its workers too."""
    g.add_argument(
        "--ttft-target-ms",
        type=float,
        default=float(env("ttft_target_ms", "0") or 0),
        help="refuse a prompt (RESOURCE_EXHAUSTED / HTTP 429 with Retry-After) whose first "
        "token is predicted later than this, from the prompts queued ahead of it and the "
        "measured step costs; 0: never (default: %(default)s)",
    )
    g.add_argument(
        "--handoff-wait-ms",
        type=float,
        default=float(env("handoff_wait_ms", "0") or 0),
        help="decode workers: report saturation once a new handoff is predicted to wait "
        "longer than this for a batch slot (from the handoffs queued here and the rate "
        "streams leave the batch); coordinators then refuse new requests at arrival "
        "(RESOURCE_EXHAUSTED / HTTP 429 with Retry-After) until it clears; 0: never "
        "(default: %(default)s)",
    )

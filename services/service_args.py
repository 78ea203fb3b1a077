"""Flags of the serving commands (`serve`, `coordinator`, `prefill`, `decode`, `colocated`):
the options declared here, each also read from a `PDSERVE_<NAME>` environment variable. Kept
apart from the services themselves so that `pdserve --help` and the clients start without
importing torch."""

from __future__ import annotations

import argparse

from pdserve.common.config import GRPC_KEEPALIVE, Option
from pdserve.services.engine_args import FROM_ENV, add_engine_args, add_options
from pdserve.services.tls import add_tls_args

# Every service; the port's default is each command's own (`add_service_args`).
SERVICE_OPTIONS = (
    Option("host", str, "127.0.0.1", "address to listen on (default: %(default)s)"),
    Option("port", int, None, "gRPC port; 0 picks a free one (default: %(default)s)"),
    Option(
        "metrics_port",
        int,
        0,
        "Prometheus /metrics port; 0 picks a free one (default: %(default)s)",
    ),
    Option(
        "drain_timeout",
        float,
        30.0,
        "on SIGTERM / SIGINT: health turns NOT_SERVING, new calls are refused, and "
        "calls in flight get this many seconds to finish (default: %(default)s)",
    ),
    GRPC_KEEPALIVE,
)
WORKER_PORTS = {"prefill": 50061, "decode": 50071, "colocated": 50081}

# A serving worker's admission (`add_admission_args`).
ADMISSION_OPTIONS = (
    Option(
        "ttft_target_ms",
        float,
        0.0,
        "refuse a prompt (RESOURCE_EXHAUSTED / HTTP 429 with Retry-After) whose first "
        "token is predicted later than this, from the prompts queued ahead of it and the "
        "measured step costs; 0: never (default: %(default)s)",
    ),
    Option(
        "handoff_wait_ms",
        float,
        0.0,
        "decode workers: report saturation once a new handoff is predicted to wait "
        "longer than this for a batch slot (from the handoffs queued here and the rate "
        "streams leave the batch); coordinators then refuse new requests at arrival "
        "(RESOURCE_EXHAUSTED / HTTP 429 with Retry-After) until it clears; 0: never "
        "(default: %(default)s)",
    ),
)

# Every worker, in the order `--help` lists them; ONLY_ON names those of one role alone.
WORKER_OPTIONS = (
    Option("worker_id", str, None, "name in KV handles and metrics (default: ROLE-HOST-PORT)"),
    Option(
        "advertise_address",
        str,
        None,
        "host:port other workers call this one at (put in KV handles); default: "
        "--host:port, or this host's address when --host is 0.0.0.0",
    ),
    Option(
        "kv_transport",
        str,
        "ucx",
        "how KV blocks move between workers (default: %(default)s)",
        choices=("ucx",),
    ),
    Option(
        "transfer_timeout",
        float,
        30.0,
        "seconds a KV transfer may take before it fails (default: %(default)s)",
    ),
    Option(
        "kv_lease",
        float,
        30.0,
        "seconds prefilled blocks wait for a pull before they are freed (default: %(default)s)",
    ),
    Option(
        "max_pending",
        int,
        256,
        "requests that may wait (for a batch slot; on decode also for KV blocks) before "
        "new ones are refused with RESOURCE_EXHAUSTED (default: %(default)s)",
    ),
    Option(
        "status_interval",
        float,
        0.1,
        "seconds between this worker's status reports to coordinators (default: %(default)s)",
    ),
    Option(
        "prefill_workers",
        str,
        "",
        "comma-separated host:port of prefill workers this worker may pull KV from, "
        "beside the prefill pools its coordinators name; a KV handle naming any other "
        "address is refused (PERMISSION_DENIED) before a connection is made",
    ),
)
ONLY_ON = {"kv_lease": "prefill", "prefill_workers": "decode"}


def add_service_args(p: argparse.ArgumentParser, default_port: int) -> None:
    g = p.add_argument_group(f"service ({FROM_ENV})")
    add_options(g, SERVICE_OPTIONS, port=default_port)
    add_tls_args(p)


def add_worker_args(p: argparse.ArgumentParser, role: str) -> None:
    add_service_args(p, WORKER_PORTS[role])
    g = p.add_argument_group(f"worker ({FROM_ENV})")
    add_options(g, [o for o in WORKER_OPTIONS if ONLY_ON.get(o.name, role) == role])
    add_admission_args(p)
    add_engine_args(p)


def add_admission_args(p: argparse.ArgumentParser) -> None:
    """A serving worker's admission; `serve` passes these flags to its workers."""
    add_options(p.add_argument_group(f"admission ({FROM_ENV})"), ADMISSION_OPTIONS)

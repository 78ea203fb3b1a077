"""`pdserve serve`: the whole system on one host — N prefill and M decode workers (or one
colocated worker) and a coordinator, each its own process. When every one answers healthy
it prints one JSON "ready" line; SIGINT / SIGTERM stops them all (SIGTERM, a drain of
`--drain-timeout`, then SIGKILL), and a worker that dies takes the rest down with an error."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from pdserve.common.config import default_threads
from pdserve.services.engine_args import engine_argv
from pdserve.services.grpc_server import wait_healthy
from pdserve.services.service_args import ADMISSION_OPTIONS
from pdserve.services.tls import TlsFiles

START_TIMEOUT_S = 300.0


class ServiceChild:
    """One service process started with `pdserve <role> --port 0`, known once it printed
    its "listening" line."""

    def __init__(
        self, role: str, argv: list[str], env: dict[str, str] | None = None, stderr: Any = None
    ) -> None:
        """`stderr`: where the child's log goes (a file; None: this process's stderr)."""
        self.role = role
        # -P: the working directory stays off sys.path, so a folder there (this repository's
        # kernels/, say, beside a package of that name) never shadows an installed module.
        cmd = [sys.executable, "-P", "-m", "pdserve.services.cli", role, *argv]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=stderr, text=True,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
        self.info: dict[str, Any] = {}

    def wait_listening(self, timeout_s: float) -> dict[str, Any]:
        """The child's "listening" line. Other lines before it (UCX logs to stdout) are
        passed on to stderr."""
        box: list[dict[str, Any]] = []
        reader = threading.Thread(target=self._read_until_listening, args=(box,), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not box:
            code = self.proc.poll()
            why = f"exited with code {code}" if code is not None else "did not start in time"
            raise RuntimeError(f"{self.role} worker {why} (its log is above)")
        self.info = box[0]
        # Keep draining stdout so the child never blocks on a full pipe.
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # type: ignore[union-attr]
        return self.info

    def _read_until_listening(self, box: list[dict[str, Any]]) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            try:
                message = json.loads(line)
            except ValueError:
                message = None
            if isinstance(message, dict) and message.get("event") == "listening":
                box.append(message)
                return
            sys.stderr.write(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)


def stop_all(children: list[ServiceChild], grace_s: float) -> None:
    for child in children:
        child.stop()
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()


def endpoints(listening: dict[str, Any]) -> list[dict[str, Any]]:
    """The endpoints of a worker's "listening" line: itself, or each rank of its group."""
    return listening.get("ranks") or [listening]


def _security_env(args: argparse.Namespace, folder: str) -> tuple[dict[str, str], dict[str, str]]:
    """(every child's, the coordinator's) environment for keys and certificates: checked
    here, before any child starts. `--internal-tls` writes a throwaway CA into `folder`."""
    from pdserve.services.auth import ApiKeys
    from pdserve.services.tls import make_throwaway

    ApiKeys.configured(args.api_key, args.api_key_file)  # refuses an empty key
    tls = TlsFiles.from_args(args)
    if args.internal_tls and tls is None:
        tls = make_throwaway(Path(folder), args.tls_server_name)
    every = tls.env() if tls is not None else {}
    coordinator = {
        name: value
        for name, value in (
            ("PDSERVE_API_KEY", args.api_key),  # by environment: a flag shows in `ps`
            ("PDSERVE_API_KEY_FILE", args.api_key_file),
            ("PDSERVE_PUBLIC_TLS_CERT", args.public_tls_cert),
            ("PDSERVE_PUBLIC_TLS_KEY", args.public_tls_key),
        )
        if value
    }
    return every, coordinator


def run_serve(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="pdserve-tls-") as folder:
        return _run_serve(args, *_security_env(args, folder))


def _run_serve(
    args: argparse.Namespace, tls_env: dict[str, str], coordinator_env: dict[str, str]
) -> int:
    roles = (
        ["colocated"] if args.colocated else ["prefill"] * args.prefill + ["decode"] * args.decode
    )
    tp = {
        "colocated": args.tensor_parallel,
        "prefill": args.prefill_tensor_parallel or args.tensor_parallel,
        "decode": args.decode_tensor_parallel or args.tensor_parallel,
    }
    processes = sum(args.expert_parallel * tp[role] for role in roles)
    threads = args.threads or max(1, default_threads() // processes)
    common = ["--host", args.host, "--port", "0", "--metrics-port", "0",
              "--drain-timeout", str(args.drain_timeout)]  # fmt: skip
    # The workers take the admission flags as serve was given them.
    admission = [a for o in ADMISSION_OPTIONS for a in (o.flag, str(getattr(args, o.name)))]
    if tls_env or coordinator_env.get("PDSERVE_PUBLIC_TLS_CERT"):
        common += ["--health-port", "0"]  # health is then checked where no certificate is asked
    children: list[ServiceChild] = []
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        for i, role in enumerate(roles):
            child_args = argparse.Namespace(
                **{**vars(args), "threads": threads, "tensor_parallel": tp[role]}
            )
            if args.kv_offload_dir:  # each worker its own tier (its own index and LRU)
                child_args.kv_offload_dir = os.path.join(args.kv_offload_dir, f"{role}-{i}")
            argv = [*common, *admission, *engine_argv(child_args)]
            children.append(ServiceChild(role, argv, tls_env))
        # An expert-parallel worker is a group of ranks, each an endpoint of its own.
        workers = [
            {"role": child.role, **rank}
            for child in children
            for rank in endpoints(child.wait_listening(START_TIMEOUT_S))
        ]
        by_role = {r: ",".join(w["grpc"] for w in workers if w["role"] == r) for r in set(roles)}
        coordinator = ServiceChild(
            "coordinator",
            [
                "--host",
                args.host,
                "--port",
                str(args.port),
                "--metrics-port",
                "0",
                *common[6:],  # --drain-timeout, --health-port
                *(["--model", args.model] if args.model else []),
                *(["--max-model-len", str(args.max_model_len)] if args.max_model_len else []),
                *[f"--{role}-workers={addresses}" for role, addresses in by_role.items()],
                *(["--http-port", str(args.http_port)] if args.http_port is not None else []),
                *(
                    ["--served-model-name", args.served_model_name]
                    if args.served_model_name
                    else []
                ),
                "--tool-call-parser",
                args.tool_call_parser,
            ],
            env={**tls_env, **coordinator_env},
        )
        children.append(coordinator)
        front = coordinator.wait_listening(START_TIMEOUT_S)
        tls = TlsFiles.from_env(tls_env)
        for info in [*workers, front]:
            if "health" in info:
                asyncio.run(wait_healthy(info["health"], START_TIMEOUT_S))
            else:  # a rank of a group, or the plain coordinator
                asyncio.run(
                    wait_healthy(info["grpc"], START_TIMEOUT_S, tls if info is not front else None)
                )
        ready = {
            "event": "ready",
            "coordinator": front["grpc"],
            "metrics": front["metrics"],
            **({"http": front["http"]} if "http" in front else {}),
            "workers": [
                {"role": w["role"], "grpc": w["grpc"], "metrics": w["metrics"]} for w in workers
            ],
        }
        print(json.dumps(ready), flush=True)
        http = f" or POST http://{front['http']}/v1/chat/completions" if "http" in front else ""
        print(f"pdserve is ready: chat with `pdserve chat --address {front['grpc']}`{http}; "
              "Ctrl-C stops every process.", file=sys.stderr, flush=True)  # fmt: skip
        while not stop.wait(0.5):
            dead = [c for c in children if c.proc.poll() is not None]
            if dead:
                print(
                    f"pdserve serve: the {dead[0].role} process exited with code "
                    f"{dead[0].proc.returncode}; stopping the others",
                    file=sys.stderr,
                )
                return 1
        return 0
    finally:
        stop_all(children, args.drain_timeout + 5)

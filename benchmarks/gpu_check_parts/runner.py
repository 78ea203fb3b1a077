"""Runs each part of the GPU check in its own forked process with a deadline, so a part that
crashes (a CUDA error poisons its process), hangs or leaves service processes behind never
hides the others. The parent has imported torch and transformers once (no CUDA touched), so
a fork starts a part in milliseconds; the child makes its own process group, writes its
result as JSON, and whatever is left of the group is killed when the part ends."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_check_parts.common import Context

PARTS = ("environment", "kernels", "engine", "speed", "disaggregation", "expert_parallel")
STATUSES = ("ok", "failed", "skipped")
# Seconds each part may take at most (the run's budget may leave it less).
TIMEOUT_S = {
    "cuda": {"environment": 60, "kernels": 120, "engine": 120, "speed": 180,
             "disaggregation": 150, "expert_parallel": 60},
    "cpu": {"environment": 30, "kernels": 60, "engine": 60, "speed": 60,
            "disaggregation": 90, "expert_parallel": 60},
}  # fmt: skip
LOG_TAIL_CHARS = 2000


def _tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _child(name: str, ctx: Context, result_path: Path, log_path: Path) -> None:
    """In the forked process: run the part, write its result, never return."""
    code = 0
    try:
        os.setpgid(0, 0)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)  # UCX and the services log to stdout: keep the parent's for the JSON
        os.dup2(fd, 2)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        if not ctx.cuda:
            import torch

            torch.set_num_threads(1)  # see common.make_engine
        module = importlib.import_module(f"gpu_check_parts.{name}")
        result: dict[str, Any] = module.run(ctx)
    except BaseException as exc:
        traceback.print_exc()
        result = {
            "status": "failed",
            "reason": f"{type(exc).__name__}: {exc}"[:1000],
            "traceback": traceback.format_exc()[-LOG_TAIL_CHARS:],
        }
    try:
        tmp = result_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, default=str))
        tmp.rename(result_path)
    except BaseException:
        traceback.print_exc()
        code = 3
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@dataclass
class Running:
    name: str
    pid: int
    start: float
    deadline: float
    status: int | None = None  # waitpid's, once the child ended

    def poll(self) -> bool:
        """Whether the child has ended (or was killed at its deadline)."""
        if self.status is None:
            done, code = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.status = code
            elif time.monotonic() >= self.deadline:
                _kill_group(self.pid)
                os.waitpid(self.pid, 0)
                self.status = -1  # timed out
        return self.status is not None


def start_part(name: str, ctx: Context, timeout_s: float) -> Running:
    result_path = ctx.workdir / f"{name}.json"
    log_path = ctx.workdir / f"{name}.log"
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(name, ctx, result_path, log_path)
    # The child's group, made here too, so that killing it never races the child's setpgid.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.setpgid(pid, pid)
    return Running(name, pid, start, start + timeout_s)


def finish_part(run: Running, ctx: Context) -> dict[str, Any]:
    _kill_group(run.pid)  # service processes the part started and left running
    result_path = ctx.workdir / f"{run.name}.json"
    log_path = ctx.workdir / f"{run.name}.log"
    status = run.status or 0
    if result_path.is_file():
        result = json.loads(result_path.read_text())
    elif status == -1:
        result = {"status": "failed", "reason": f"timed out after {run.deadline - run.start:.0f} s"}
    else:
        how = (
            f"signal {os.WTERMSIG(status)}"
            if os.WIFSIGNALED(status)
            else f"code {os.WEXITSTATUS(status)}"
        )
        result = {"status": "failed", "reason": f"the part's process ended with {how}"}
    if result.get("status") not in STATUSES:
        result = {"status": "failed", "reason": f"bad status {result.get('status')!r}", **result}
    result.setdefault("reason", "")
    if result["status"] == "failed" and "log_tail" not in result:
        result["log_tail"] = _tail(log_path)
    result["seconds"] = round(time.monotonic() - run.start, 2)
    return result


def run_all(ctx: Context, parts: list[str], budget_s: float, jobs: int = 1) -> dict[str, Any]:
    """Every part, at most `jobs` at a time (in the order given, except that with several
    jobs the longest, disaggregation, starts first), each within its own timeout and what
    is left of the budget. Results in the order given."""
    results: dict[str, Any] = {}
    end = time.monotonic() + budget_s
    limits = TIMEOUT_S["cuda" if ctx.cuda else "cpu"]
    queue = sorted(parts, key=lambda n: n != "disaggregation") if jobs > 1 else list(parts)
    running: list[Running] = []
    while queue or running:
        while queue and len(running) < jobs:
            name = queue.pop(0)
            left = end - time.monotonic()
            if left < 5:
                results[name] = {
                    "status": "failed",
                    "reason": f"the {budget_s:.0f} s budget ran out",
                }
                continue
            print(f"[gpu_check] {name} ...", file=sys.stderr, flush=True)
            running.append(start_part(name, ctx, min(limits[name], left)))
        for run in [r for r in running if r.poll()]:
            running.remove(run)
            r = results[run.name] = finish_part(run, ctx)
            print(
                f"[gpu_check] {run.name}: {r['status']} ({r['seconds']} s) "
                f"{str(r['reason'])[:200]}",
                file=sys.stderr,
                flush=True,
            )
        time.sleep(0.05)
    return {name: results[name] for name in parts}

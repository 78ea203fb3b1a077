"""Part 'environment': the machine (GPU, driver, CPU), torch / CUDA / triton versions, the
packages pdserve needs and where they came from (what the wrapper installed from the carried
wheels), and whether the imports the other parts need work (ucxx, the gRPC stubs)."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import platform
import subprocess
import sys
from typing import Any

import torch

from gpu_check_parts.common import Context

PACKAGES = (
    "torch",
    "triton",
    "transformers",
    "tokenizers",
    "safetensors",
    "numpy",
    "grpcio",
    "protobuf",
    "ucxx-cu13",
    "ucxx-cu12",
    "libucx-cu13",
    "libucx-cu12",
    "fastapi",
    "uvicorn",
    "pydantic",
    "opentelemetry-sdk",
    "opentelemetry-exporter-otlp-proto-grpc",
    "grpcio-reflection",
    "grpcio-health-checking",
    "gguf",
    "kubernetes",
    "prometheus-client",
    "pdserve",
)
# Set by benchmarks/gpu_check_wrapper.sh: a file listing the wheels it installed.
INSTALLED_ENV = "PDSERVE_GPU_CHECK_INSTALLED"


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _imports() -> dict[str, str]:
    """What the other parts import, each 'ok' or the error."""
    found = {}
    for module in ("ucxx", "pdserve.v1.generate_pb2_grpc", "pdserve.services.cli", "triton"):
        try:
            importlib.import_module(module)
            found[module] = "ok"
        except Exception as exc:
            found[module] = f"{type(exc).__name__}: {exc}"[:300]
    return found


def _cpu() -> dict[str, Any]:
    """The CPU; on CPU runs also the GEMM path each dtype takes (that loads, and may first
    build, the C++ extension: a GPU run does not need it)."""
    from machine import cpu_name

    return {"cpu": cpu_name()}


def run(ctx: Context) -> dict[str, Any]:
    host = _cpu()
    if not ctx.cuda:
        from pdserve.kernels import invariant_gemm

        host = invariant_gemm.describe()
    out: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "host": host,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "packages": {name: _version(name) for name in PACKAGES},
        "imports": _imports(),
    }
    installed = os.environ.get(INSTALLED_ENV)
    if installed and os.path.isfile(installed):
        with open(installed) as f:
            out["installed_from_payload"] = f.read().split()
    if ctx.cuda:
        if not torch.cuda.is_available():
            return {**out, "status": "failed", "reason": "--device cuda, but torch sees no GPU"}
        props = torch.cuda.get_device_properties(0)
        out["gpu"] = {
            "name": props.name,
            "count": torch.cuda.device_count(),
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
            "driver": _driver(),
        }
    broken = [m for m, v in out["imports"].items() if v != "ok"]
    reason = f"imports failing: {', '.join(broken)}" if broken else "all imports work"
    where = out.get("gpu", {}).get("name") or out["host"]["cpu"]
    return {**out, "status": "ok", "reason": f"{where}; {reason}"}

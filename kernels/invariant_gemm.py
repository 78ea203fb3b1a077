"""Batch-invariant dense layers on CPU: `y = x Wᵀ + b` by the C++ kernel in
`csrc/invariant_gemm.cpp`, whose every output element is one reduction over K in a fixed
order (rows tiled, K never split, threads split the columns). A row's bits therefore do not
depend on the batch size, on the other rows, on whether the row is a decode token or part of
a prefill chunk, or on the thread count. Every `Linear` of the model runner (and every expert
matmul) goes through here on CPU.

The instruction-set path is chosen once per process from the CPU's flags, capped by
`ONEDNN_MAX_CPU_ISA` (the same names oneDNN uses, so one variable caps both) or
`PDSERVE_GEMM_ISA`:

* `amx` (bf16 with AMX tiles), `avx512_bf16` (bf16 pairs with VDPBF16PS) — bfloat16 only;
* `avx512`, `avx2` — float32 accumulation with FMA; bf16/fp16 weights are widened exactly, so
  these two give the same bits as each other for a given dtype.

On cuda `gpu_kernels` hands out the Triton kernels of `kernels/triton_invariant.py` instead.

Weights are packed once (`pack`) into the layout the kernel streams; `reference.linear` is
the naive product the tests compare against."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from pdserve.kernels.cpp_build import build_main, cpu_flags, cpuinfo_line, load_extension

EXTENSION_NAME = "pdserve_invariant_gemm"
SOURCE = Path(__file__).parent / "csrc" / "invariant_gemm.cpp"
ISA_ENV = "PDSERVE_GEMM_ISA"
INVARIANT_ENV = "PDSERVE_BATCH_INVARIANT"
ONEDNN_ENV = "ONEDNN_MAX_CPU_ISA"
BLOCK = 16  # output columns per packed block

# Paths from slowest to fastest; the number is the kernel's `isa` argument.
PATHS = ("avx2", "avx512", "avx512_bf16", "amx")
_BF16_ONLY = ("avx512_bf16", "amx")
# ONEDNN_MAX_CPU_ISA values (oneDNN's names) -> the fastest path they allow.
_ONEDNN_CAP = {
    "SSE41": None,
    "AVX": None,
    "AVX2": "avx2",
    "AVX2_VNNI": "avx2",
    "AVX2_VNNI_2": "avx2",
    "AVX512_CORE": "avx512",
    "AVX512_CORE_VNNI": "avx512",
    "AVX512_CORE_BF16": "avx512_bf16",
    "AVX10_1_512": "avx512_bf16",
    "AVX512_CORE_FP16": "avx512_bf16",
    "AVX10_1_512_AMX": "amx",
    "AVX512_CORE_AMX": "amx",
    "AVX512_CORE_AMX_FP16": "amx",
    "AVX10_1_512_AMX_FP16": "amx",
    "AVX10_2_512_AMX_2": "amx",
    "DEFAULT": "amx",
    "ALL": "amx",
}
_NEEDS = {
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "avx512_bf16": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"},
    "amx": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_tile", "amx_bf16"},
}


def load(verbose: bool = False) -> ModuleType | None:
    return load_extension(EXTENSION_NAME, [SOURCE], verbose)


def _cap(env: str, names: dict[str, str | None]) -> int:
    """Index into PATHS of the fastest path `env` allows (len(PATHS) - 1 when unset)."""
    value = os.environ.get(env, "").strip()
    if not value:
        return len(PATHS) - 1
    key = value.upper() if env == ONEDNN_ENV else value.lower()
    if key not in names:
        raise ValueError(f"{env}={value!r}: expected one of {', '.join(sorted(names))}")
    path = names[key]
    return -1 if path is None else PATHS.index(path)


@functools.cache
def host_path() -> str | None:
    """The fastest path this process may use: the CPU's flags, capped by ONEDNN_MAX_CPU_ISA
    and PDSERVE_GEMM_ISA; None where no path runs (not x86-64 with AVX2, or no compiler)."""
    flags = cpu_flags()
    allowed = min(_cap(ONEDNN_ENV, _ONEDNN_CAP), _cap(ISA_ENV, {p: p for p in PATHS}))
    for index in range(allowed, -1, -1):
        path = PATHS[index]
        if not _NEEDS[path] <= flags:
            continue
        ext = load()
        if ext is None:
            return None
        if path == "amx" and not ext.amx_supported():  # the kernel refused the tile state
            continue
        return path
    return None


def enabled() -> bool:
    """Batch-invariant dense layers are the default; `PDSERVE_BATCH_INVARIANT=0` gives the
    GEMM library's fastest path instead (benchmarks compare the two)."""
    return os.environ.get(INVARIANT_ENV, "1") != "0"


def gpu_kernels(x: torch.Tensor) -> ModuleType | None:
    """`kernels.triton_invariant` when it serves `x` (a cuda tensor, invariance on, triton
    installed), else None. Imported on first use only."""
    if x.device.type != "cuda" or not enabled():
        return None
    try:
        from pdserve.kernels import triton_invariant
    except ImportError:
        return None
    return triton_invariant


def path_for(weight: torch.Tensor) -> str | None:
    """The path serving `weight` here (bf16 may use every path; fp32/fp16 the FMA ones), or
    None when the kernel does not serve it (not on CPU, turned off, no path on this CPU)."""
    dtype = weight.dtype
    if weight.device.type != "cpu" or not enabled():
        return None
    path = host_path()
    if path is None or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    if dtype != torch.bfloat16 and path in _BF16_ONLY:
        return "avx512"
    return path


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weight -> the kernel's layout: bf16 [N/16, Kp/2, 16 * 2] (VNNI pairs, K padded to
    a multiple of 32); fp32/fp16 [N/16, K, 16]. N is padded to a multiple of 16 with zeros."""
    n, k = weight.shape
    n_pad = -n % BLOCK
    if weight.dtype == torch.bfloat16:
        k_pad = -k % 32
        w = F.pad(weight, (0, k_pad, 0, n_pad))
        blocks, kp = w.shape[0] // BLOCK, w.shape[1]
        w = w.view(blocks, BLOCK, kp // 2, 2).permute(0, 2, 1, 3)
        return w.reshape(blocks, kp // 2, 2 * BLOCK).contiguous()
    w = F.pad(weight, (0, 0, 0, n_pad))
    return w.view(w.shape[0] // BLOCK, BLOCK, k).permute(0, 2, 1).contiguous()


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The [n, k] weight `pack` made `packed` from."""
    blocks = packed.shape[0]
    if packed.dtype == torch.bfloat16:
        kp = packed.shape[1] * 2
        w = packed.view(blocks, kp // 2, BLOCK, 2).permute(0, 2, 1, 3).reshape(blocks * BLOCK, kp)
    else:
        w = packed.permute(0, 2, 1).reshape(blocks * BLOCK, packed.shape[1])
    return w[:n, :k].contiguous()


@dataclass
class PackedStack:
    """E weight matrices [E, N, K] (a MoE layer's experts), each packed for the kernel.
    `shape` is the unpacked one, so code that reads expert counts and sizes works unchanged;
    `data` [E, ...] is what expert re-placement moves between ranks; `[e]` unpacks one
    (for the reference path)."""

    data: torch.Tensor
    shape: tuple[int, int, int]
    path: str

    @classmethod
    def of(cls, weights: torch.Tensor, path: str) -> PackedStack:
        data = torch.stack([pack(w) for w in weights]) if len(weights) else weights
        return cls(data, tuple(weights.shape), path)  # type: ignore[arg-type]

    def with_data(self, data: torch.Tensor) -> PackedStack:
        return PackedStack(data, (data.shape[0], *self.shape[1:]), self.path)  # type: ignore[arg-type]

    def linear(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return gemm(x, self.data[e], self.shape[1], None, self.path)

    def __getitem__(self, e: int) -> torch.Tensor:
        return unpack(self.data[e], self.shape[1], self.shape[2])

    def unpacked(self) -> torch.Tensor:
        """All E matrices, [E, N, K]."""
        return torch.stack([self[e] for e in range(self.shape[0])])


def gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    bias: torch.Tensor | None,
    path: str,
    out_float32: bool = False,
) -> torch.Tensor:
    """x [M, K] @ the packed weight ᵀ (+ bias, float32) -> [M, n] in x's dtype, or in float32
    (`out_float32`: the accumulators unrounded, e.g. logits)."""
    ext = load()
    assert ext is not None, "path_for() returned a path, so the extension is built"
    return ext.invariant_gemm(x, packed, n, bias, PATHS.index(path), out_float32)


def native_path() -> str | None:
    """The fastest path this CPU's flags allow, before any cap: its host class."""
    flags = cpu_flags()
    return next((p for p in reversed(PATHS) if _NEEDS[p] <= flags), None)


def describe() -> dict[str, object]:
    """This host's CPU, its class, the cap in force and the path each dtype takes."""
    return {
        "cpu": cpuinfo_line("model name").split(":", 1)[-1].strip() or "unknown",
        "isa_class": native_path(),
        ONEDNN_ENV: os.environ.get(ONEDNN_ENV),
        ISA_ENV: os.environ.get(ISA_ENV),
        "batch_invariant": enabled(),
        "paths": {
            str(d).removeprefix("torch."): path_for(torch.empty(0, dtype=d))
            for d in (torch.bfloat16, torch.float32, torch.float16)
        },
    }


if __name__ == "__main__":
    import json
    import sys

    if "--describe" in sys.argv:
        print(json.dumps(describe()))
        raise SystemExit(0)
    raise SystemExit(build_main(EXTENSION_NAME, [SOURCE]))

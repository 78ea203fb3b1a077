"""Decode-sized matmuls on CPU in float32: `y = x Wᵀ + b` for up to `MAX_ROWS` rows, by the
C++ kernel in `csrc/skinny_linear.cpp`, which reads each weight row once and reuses it for
every input row (a decode step is bound by reading the weights; the general GEMM reads them
at a fraction of the memory bandwidth for so few rows). Each output is one dot product in a
fixed order, so a row's result is the same in any batch. `F.linear` is the reference it is
tested against; `PDSERVE_SKINNY_LINEAR=0` turns it off."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import torch

from pdserve.kernels.cpp_build import build_main, load_extension

EXTENSION_NAME = "pdserve_skinny_linear"
SOURCE = Path(__file__).parent / "csrc" / "skinny_linear.cpp"
MAX_ROWS = 16  # past this the GEMM library's blocking wins


def load(verbose: bool = False) -> ModuleType | None:
    return load_extension(EXTENSION_NAME, [SOURCE], verbose)


def serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and os.environ.get("PDSERVE_SKINNY_LINEAR", "1") != "0"
    )


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The product, or None when the extension is unavailable (the caller uses F.linear)."""
    ext = load()
    if ext is None:
        return None
    return ext.skinny_linear(x, weight, bias)


if __name__ == "__main__":
    raise SystemExit(build_main(EXTENSION_NAME, [SOURCE]))

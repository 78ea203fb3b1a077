"""The C++ CPU backend: builds/loads `csrc/paged_attention.cpp` and wraps its kernels.

The model runner calls `write_kv`, `decode_attention` and `prefill_attention` (through
`pdserve.kernels.attention`) for every layer of every step; on CPU they land here when the
extension is available. The extension is compiled with ninja by
`torch.utils.cpp_extension.load` (-O3 -march=native -fopenmp; ``$PDSERVE_CPU_ARCH``
overrides ``native``) into ``$PDSERVE_BUILD_DIR`` (default
``~/.cache/pdserve/torch_extensions``, one subdirectory per CPU kind and target) and reused
while its sources and flags are unchanged;
``python -m pdserve.kernels.cpu_extension`` builds it ahead of time (the Makefile does so at
install), so the first request never waits for the compiler. If the build fails, `load`
logs one warning and returns None, and the dispatcher falls back to the torch backend.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from pdserve.kernels.cpp_build import build_main, load_extension

EXTENSION_NAME = "pdserve_paged_attention"
SOURCES = [Path(__file__).parent / "csrc" / "paged_attention.cpp"]


def load(verbose: bool = False) -> ModuleType | None:
    """The compiled extension (built on first use), or None if it cannot be built."""
    return load_extension(EXTENSION_NAME, SOURCES, verbose)


def _ext() -> ModuleType:
    module = load()
    if module is None:
        raise RuntimeError("the pdserve CPU attention extension could not be built")
    return module


def write_kv(
    kv_cache: Tensor, layer: int, key: Tensor, value: Tensor, slot_mapping: Tensor
) -> None:
    """Store token t's key/value [T, KVH, D] at slot ``slot_mapping[t]`` of `layer`."""
    _ext().write_kv(kv_cache, layer, key, value, slot_mapping.to(torch.long))


def decode_attention(
    query: Tensor,
    kv_cache: Tensor,
    layer: int,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
) -> Tensor:
    """query [B, H, D] at position seq_lens[b]-1, attending straight from the blocks."""
    return _ext().paged_attention(
        query, kv_cache, layer, block_tables.to(torch.int32), seq_lens.to(torch.int32), None, scale
    )


def prefill_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    layer: int,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: Tensor,
    scale: float,
) -> Tensor:
    """Causal chunked prefill read entirely from the blocks (the chunk's K/V are written)."""
    return _ext().paged_attention(
        query,
        kv_cache,
        layer,
        block_tables.to(torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor(query_start_loc, dtype=torch.int32),
        scale,
    )


if __name__ == "__main__":
    sys.exit(build_main(EXTENSION_NAME, SOURCES))

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

import hashlib
import logging
import os
import platform
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

EXTENSION_NAME = "pdserve_paged_attention"
SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
ARCH_ENV = "PDSERVE_CPU_ARCH"


def _arch() -> str:
    return os.environ.get(ARCH_ENV) or "native"


def _cflags() -> list[str]:
    return ["-O3", f"-march={_arch()}", "-fopenmp", "-DNDEBUG"]


_lock = threading.Lock()
_module: ModuleType | None = None
_failed = False


def _cpu_tag() -> str:
    """Short fingerprint of this CPU's instruction sets: a build made with -march=native on
    another machine (say, at image build time) is then rebuilt instead of crashing."""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line for line in info if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1((platform.machine() + flags).encode()).hexdigest()[:10]


def build_dir() -> Path:
    """Where the compiled extension is cached (one directory per CPU kind)."""
    root = os.environ.get("PDSERVE_BUILD_DIR") or "~/.cache/pdserve/torch_extensions"
    return Path(root).expanduser() / f"{EXTENSION_NAME}-{_arch()}-{_cpu_tag()}"


def load(verbose: bool = False) -> ModuleType | None:
    """The compiled extension (built on first use), or None if it cannot be built."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is None and not _failed:
            try:
                from torch.utils import cpp_extension

                directory = build_dir()
                directory.mkdir(parents=True, exist_ok=True)
                _module = cpp_extension.load(
                    name=EXTENSION_NAME,
                    sources=[str(SOURCE)],
                    extra_cflags=_cflags(),
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(directory),
                    verbose=verbose,
                )
            except Exception as exc:  # compiler missing, build error, bad cache dir...
                _failed = True
                first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                logger.warning(
                    "pdserve CPU attention extension unavailable (%s); using the torch path",
                    first_line,
                )
    return _module


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
    logging.basicConfig(level=logging.INFO)
    ok = load(verbose="-v" in sys.argv) is not None
    print(f"{EXTENSION_NAME}: {'built in ' + str(build_dir()) if ok else 'build FAILED'}")
    sys.exit(0 if ok else 1)

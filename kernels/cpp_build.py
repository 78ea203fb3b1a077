"""Building pdserve's C++ CPU extensions: compiled once with ninja through
`torch.utils.cpp_extension.load` (-O3 -march=native -fopenmp; `PDSERVE_CPU_ARCH` overrides
`native`) into `PDSERVE_BUILD_DIR` (default `~/.cache/pdserve/torch_extensions`, one folder
per extension, CPU kind and target), reused while sources and flags are unchanged. The
Makefile builds them at install time, so no request ever waits for the compiler. A failed
build logs one warning and yields None; callers then use their torch path."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

ARCH_ENV = "PDSERVE_CPU_ARCH"
_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}


def cpu_arch() -> str:
    return os.environ.get(ARCH_ENV) or "native"


def cflags(arch: str | None = None) -> list[str]:
    return ["-O3", f"-march={arch or cpu_arch()}", "-fopenmp", "-DNDEBUG"]


def compile_command(
    name: str, source: Path, out: Path, arch: str, extra_cflags: Sequence[str] = ()
) -> list[str]:
    """The compiler line that turns `source` (of extension `name`) into the object file `out`
    for `-march=arch`, with the flags torch's builder gets from `load_extension`. Nothing is
    linked or loaded, so it checks that a kernel compiles for a CPU class this host cannot
    run (tests/integration/test_isa_classes.py)."""
    import sysconfig

    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_path("include", "posix_prefix")]
    return [
        os.environ.get("CXX", "c++"),
        f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
        *(arg for path in includes for arg in ("-isystem", path)),
        "-fPIC", "-std=c++20", *cflags(arch), *extra_cflags,
        "-c", str(source), "-o", str(out),
    ]  # fmt: skip


def cpuinfo_line(key: str) -> str:
    """The first line of /proc/cpuinfo starting with `key` ("flags", "model name"), or ""."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(key)), "")
    except OSError:
        return ""


def cpu_flags() -> set[str]:
    """This CPU's instruction-set flags, as the kernel reports them."""
    return set(cpuinfo_line("flags").split(":", 1)[-1].split())


def cpu_tag() -> str:
    """Short fingerprint of this CPU's instruction sets: a build made with -march=native on
    another machine (say, at image build time) is then rebuilt instead of crashing."""
    return hashlib.sha1((platform.machine() + cpuinfo_line("flags")).encode()).hexdigest()[:10]


def build_dir(name: str) -> Path:
    root = os.environ.get("PDSERVE_BUILD_DIR") or "~/.cache/pdserve/torch_extensions"
    return Path(root).expanduser() / f"{name}-{cpu_arch()}-{cpu_tag()}"


@contextlib.contextmanager
def _build_guard(directory: Path) -> Iterator[None]:
    """Holds an flock on `directory` while torch loads the extension there, and clears a
    lock file torch left behind. torch's own lock (its `FileBaton`, the file `lock`, taken
    for every load, even when nothing needs building) stays if its process is killed
    meanwhile (a worker OOM-killed or timed out at start-up), and every later process then
    waits on it forever. The kernel drops an flock with its process, and every load of this
    folder goes through here, so a `lock` file found while holding it is such a leftover."""
    with open(directory / "pdserve-build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a process killed while loading", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def load_extension(
    name: str, sources: list[Path], verbose: bool = False, extra_cflags: Sequence[str] = ()
) -> ModuleType | None:
    """The compiled extension `name` (built on first use), or None if it cannot be built.
    `extra_cflags` follow the common flags (`cflags()`)."""
    if name in _loaded:
        return _loaded[name]
    with _lock:
        if name not in _loaded:
            module = None
            try:
                from torch.utils import cpp_extension

                directory = build_dir(name)
                directory.mkdir(parents=True, exist_ok=True)
                with _build_guard(directory):
                    module = cpp_extension.load(
                        name=name,
                        sources=[str(s) for s in sources],
                        extra_cflags=[*cflags(), *extra_cflags],
                        extra_ldflags=["-fopenmp"],
                        build_directory=str(directory),
                        verbose=verbose,
                    )
            except Exception as exc:  # compiler missing, build error, bad cache dir...
                first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                logger.warning("pdserve C++ extension %s unavailable (%s)", name, first_line)
            _loaded[name] = module
    return _loaded[name]


def build_main(name: str, sources: list[Path], extra_cflags: Sequence[str] = ()) -> int:
    """`python -m pdserve.kernels.<module>`: build ahead of time (the Makefile's install)."""
    logging.basicConfig(level=logging.INFO)
    ok = load_extension(name, sources, "-v" in sys.argv, extra_cflags) is not None
    print(f"{name}: built in {build_dir(name)}" if ok else f"{name}: build FAILED")
    return 0 if ok else 1

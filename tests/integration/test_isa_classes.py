"""The determinism contract on every CPU class this host can stand in for: each test runs the
op-level invariance tests, the kernels against their references, the decode layer loop
against the per-op path and the end-to-end greedy test again in its own process, with
oneDNN (and with it pdserve's GEMM path choice) capped by ONEDNN_MAX_CPU_ISA and the C++
kernels compiled for that class (PDSERVE_CPU_ARCH), and checks which GEMM path it took.
A cap above the host's own class is skipped: that class is covered on such a host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pdserve.kernels import (
    cpp_build,
    cpu_extension,
    dense_layers,
    fused_ops,
    invariant_gemm,
    shm_collective,
    skinny_linear,
)

ROOT = Path(__file__).resolve().parents[2]
# cap -> (the bf16 GEMM path it must give, the -march the kernels are built for). The
# attention kernels differ by AVX2, AVX-512 and AVX512-BF16 only, so a host that has
# AVX512-BF16 builds the two top classes natively (one build fewer).
CLASSES = {
    "AVX2": ("avx2", "haswell"),
    "AVX512_CORE": ("avx512", "skylake-avx512"),
    "AVX512_CORE_BF16": ("avx512_bf16", "native"),
    "AVX512_CORE_AMX": ("amx", "native"),
}
TESTS = [
    "tests/unit/test_batch_invariance.py",
    "tests/unit/test_attention_invariance.py",
    "tests/unit/test_kernels.py",
    "tests/unit/test_dense_layers.py",  # the decode layer loop against the per-op path
    "tests/integration/test_determinism.py::test_greedy_ids_do_not_depend_on_batch_or_chunking[auto]",
]


def _host_rank() -> int:
    saved = {
        k: os.environ.pop(k, None) for k in (invariant_gemm.ONEDNN_ENV, invariant_gemm.ISA_ENV)
    }
    try:
        invariant_gemm.host_path.cache_clear()
        host = invariant_gemm.host_path()
    finally:
        for k, v in saved.items():
            if v is not None:
                os.environ[k] = v
        invariant_gemm.host_path.cache_clear()
    assert host is not None, "no GEMM path on this host"
    return invariant_gemm.PATHS.index(host)


@pytest.mark.parametrize("cap", list(CLASSES))
def test_contract_holds_under_isa_cap(cap):
    path, arch = CLASSES[cap]
    rank = invariant_gemm.PATHS.index(path)
    if rank > _host_rank():
        pytest.skip(f"this host cannot run {cap}")
    if rank == _host_rank():
        arch = "native"
    env = {**os.environ, invariant_gemm.ONEDNN_ENV: cap, "PDSERVE_CPU_ARCH": arch}
    env.pop(invariant_gemm.ISA_ENV, None)
    probe = subprocess.run(
        [sys.executable, "-m", "pdserve.kernels.invariant_gemm", "--describe"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    described = json.loads(probe.stdout)
    print(cap, described)
    assert described["paths"]["bfloat16"] == path
    assert described["paths"]["float32"] == ("avx2" if path == "avx2" else "avx512")
    run = subprocess.run(
        # Triton (the cuda kernels, interpreted here) does not depend on the CPU class.
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not triton",
         *TESTS],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


# The classes above AVX2 that a host below them cannot run, and the -march that compiles every
# one of their code paths: AVX-512 without BF16 (the `#else` branches), then AVX512-BF16, AMX
# and AVX512-FP16 together.
COMPILE_ONLY = {"AVX512_CORE": "skylake-avx512", "AVX512_CORE_AMX": "sapphirerapids"}


def _extensions() -> list[tuple[str, list[Path], list[str]]]:
    """(name, sources, extra cflags) of every C++ kernel extension, from its module."""
    found = []
    for mod in (cpu_extension, dense_layers, fused_ops, invariant_gemm, shm_collective,
                skinny_linear):  # fmt: skip
        sources = list(getattr(mod, "SOURCES", None) or [mod.SOURCE])
        found.append((mod.EXTENSION_NAME, sources, list(getattr(mod, "CFLAGS", []))))
    return found


@pytest.mark.parametrize("cap", list(COMPILE_ONLY))
def test_every_kernel_compiles_for_a_class_this_host_cannot_run(cap, tmp_path):
    """A host below `cap` never builds the kernels' AVX-512, AVX512-BF16 or AMX code, so a
    change made there could break only the hosts that run it. Each source is compiled (not
    linked, not loaded) for the class's -march with the flags of the real build."""
    if invariant_gemm.PATHS.index(CLASSES[cap][0]) <= _host_rank():
        pytest.skip(f"this host builds and runs {cap}'s kernels natively")
    extensions = _extensions()
    compiled = {src.resolve() for _, sources, _ in extensions for src in sources}
    on_disk = {src.resolve() for src in (ROOT / "kernels" / "csrc").glob("*.cpp")}
    assert compiled == on_disk, "a kernel source no extension module names"
    objects = {src: tmp_path / f"{src.stem}.o" for _, sources, _ in extensions for src in sources}
    jobs = [
        (src, cpp_build.compile_command(name, src, objects[src], COMPILE_ONLY[cap], extra))
        for name, sources, extra in extensions
        for src in sources
    ]

    def compile_one(job: tuple[Path, list[str]]) -> tuple[Path, subprocess.CompletedProcess]:
        src, cmd = job
        return src, subprocess.run(cmd, capture_output=True, text=True, timeout=1200)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(compile_one, jobs))
    failed = [(src.name, run.stderr[-3000:]) for src, run in results if run.returncode]
    assert not failed, failed
    assert all(path.stat().st_size > 0 for path in objects.values())

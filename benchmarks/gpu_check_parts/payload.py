"""The payload that travels to a GPU machine without network (`make gpu-payload`), into
`.gpu-payload/` (git-ignored):

- wheels/: the Python packages pdserve needs that the GPU image lacks (ucxx for CUDA 13,
  which the image's torch is built for; fastapi, uvicorn, pydantic; opentelemetry;
  grpcio-reflection and -health; gguf; kubernetes), with their dependencies, downloaded for
  CPython 3.12 on manylinux x86_64 at the versions installed here; plus grpcio, protobuf and
  typing-extensions, which the image has at versions we do not know: the gRPC stubs
  generated here refuse an older grpcio or protobuf. The UCX wheels are slimmed (static
  archives, headers, fully-versioned duplicates of each library, the perftest tools go):
  libucx alone is 42 MB as published.
- tokenizer/: SmolLM2's tokenizer files from the default model's folder (never its weights;
  the check builds random-weight models).
- stubs/: the pdserve.v1 gRPC stubs `make protos` generated (git ignores them, so the working
  tree that travels lacks them).

Everything that travels, this folder and the working tree together, must stay under 64 MiB:
`size` prints the total and exits 1 above it. Usage:

    python benchmarks/gpu_check_parts/payload.py build [DEST]
    python benchmarks/gpu_check_parts/payload.py size [DEST]
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DEST = REPO / ".gpu-payload"
LIMIT_BYTES = 64 * 2**20  # the device tool's limit on what travels, working tree included
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# Downloaded with their dependencies, at the version installed here (ucxx: the CUDA 13 build
# of the version of ucxx-cu12 installed here).
WANTED = (
    "ucxx-cu13", "fastapi", "uvicorn", "pydantic", "opentelemetry-sdk",
    "opentelemetry-exporter-otlp-proto-grpc", "grpcio-reflection", "grpcio-health-checking",
    "gguf", "kubernetes", "grpcio", "protobuf", "typing-extensions",
)  # fmt: skip
VERSION_FROM = {"ucxx-cu13": "ucxx-cu12"}
# On the GPU image already (its package list, device KINDS.md, 2026-11-17): not carried.
# fmt: off
ON_IMAGE = frozenset({
    "numpy", "cuda-bindings", "cuda-core", "cuda-pathfinder", "nvidia-ml-py", "aiohttp",
    "aiosignal", "aiohappyeyeballs", "attrs", "frozenlist", "multidict", "propcache", "yarl",
    "idna", "certifi", "charset-normalizer", "urllib3", "requests", "pyyaml", "click", "h11",
    "anyio", "tqdm", "python-dateutil", "six", "annotated-doc", "packaging", "jinja2",
    "markupsafe", "filelock", "fsspec", "sympy", "mpmath", "networkx", "setuptools", "wheel",
})
# fmt: on
# Carried although the image has them: versions the stubs and pydantic need.
CARRIED_ANYWAY = frozenset({"grpcio", "protobuf", "typing-extensions"})
LEFT_OUT = {
    "rmm-cu13": "ucxx's Python code never imports it (libucxx loads librmm's library: carried)",
}
# Not carried at all (the check does not import them).
NOT_WANTED = {
    "cryptography": "only `pdserve serve --internal-tls` imports it (not run by the check)",
}
# Slimmed wheels: what goes (the loader finds every library by its .so and .so.N names).
SLIM = {
    "libucx-cu13": ("*.a", "*.la", "libucx/lib/*.so.*.*.*", "libucx/lib/ucx/*.so.*.*.*",
                    "libucx/bin/*", "*perftest*", "*/include/*", "*/cmake/*", "*/pkgconfig/*"),
    "librmm-cu13": ("*/include/*", "*/cmake/*", "*.a"),
    "libucxx-cu13": ("*/include/*", "*/cmake/*", "*.a"),
}  # fmt: skip
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")  # fmt: skip


class PayloadTooLarge(Exception):
    pass


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_project(path: Path) -> str:
    return normalise(path.name.split("-")[0])


def tree_bytes(folder: Path) -> int:
    """Bytes of every file under `folder` (their sizes, as a copy would carry them)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


# Not in what travels (git ignores them): skipped by the walk where there is no git.
_IGNORED_DIRS = {".git", ".venv", "__pycache__", "build", ".pytest_cache", ".ruff_cache"}


def working_tree_bytes(repo: Path = REPO, payload: Path = DEFAULT_DEST) -> int:
    """What the device tool sends besides carried paths: tracked files and untracked ones git
    does not ignore. Where there is no git (the copy on the GPU machine), a walk that leaves
    out the payload and the usual ignored folders."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=repo, capture_output=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        skip = payload.resolve()
        total = 0
        for root, dirs, files in os.walk(repo):
            dirs[:] = [d for d in dirs if d not in _IGNORED_DIRS and not d.endswith(".egg-info")
                       and Path(root, d).resolve() != skip]  # fmt: skip
            total += sum(Path(root, f).stat().st_size for f in files
                         if not Path(root, f).is_symlink())  # fmt: skip
        return total
    files = (repo / name for name in out.decode().split("\0") if name)
    return sum(f.stat().st_size for f in files if f.is_file() and not f.is_symlink())


def check_size(payload: Path, tree: int, limit: int = LIMIT_BYTES) -> str:
    """The size line to print; raises PayloadTooLarge when payload + tree exceed `limit`."""
    carried = tree_bytes(payload) if payload.exists() else 0
    total = carried + tree
    line = (
        f"payload {carried / 2**20:.1f} MiB ({payload}) + working tree {tree / 2**20:.1f} MiB "
        f"= {total / 2**20:.1f} MiB of the {limit / 2**20:.0f} MiB that may travel"
    )
    if total > limit:
        raise PayloadTooLarge(line + f": {(total - limit) / 2**20:.1f} MiB too much")
    return line


def slim_wheel(path: Path, patterns: tuple[str, ...]) -> int:
    """Rewrite the wheel without the members matching `patterns` (and their RECORD lines);
    returns the bytes saved."""
    before = path.stat().st_size
    tmp = path.with_suffix(".slim")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        dropped = {n for n in src.namelist() if any(fnmatch.fnmatch(n, p) for p in patterns)}
        for info in src.infolist():
            if info.filename in dropped:
                continue
            data = src.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                kept = [ln for ln in lines if ln.split(",", 1)[0] not in dropped]
                data = ("\n".join(kept) + "\n").encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    tmp.replace(path)
    return before - path.stat().st_size


def requirements() -> list[str]:
    reqs = []
    for name in WANTED:
        try:
            reqs.append(f"{name}=={md.version(VERSION_FROM.get(name, name))}")
        except md.PackageNotFoundError:
            reqs.append(name)
    return reqs


def download(dest: Path) -> dict[str, object]:
    """The wheels for the GPU machine into dest/wheels; returns what was left out and why."""
    with tempfile.TemporaryDirectory(prefix="gpu-wheels.") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "-d", tmp]  # fmt: skip
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
        subprocess.run([*cmd, *requirements()], check=True)
        wheels = dest / "wheels"
        shutil.rmtree(wheels, ignore_errors=True)
        wheels.mkdir(parents=True)
        skipped: dict[str, str] = {}
        slimmed: dict[str, int] = {}
        for whl in sorted(Path(tmp).glob("*.whl")):
            project = wheel_project(whl)
            if project in LEFT_OUT:
                skipped[project] = LEFT_OUT[project]
                continue
            if project in ON_IMAGE and project not in CARRIED_ANYWAY:
                skipped[project] = "on the GPU image"
                continue
            if project in SLIM:
                slimmed[whl.name] = slim_wheel(whl, SLIM[project])
            shutil.copy(whl, wheels / whl.name)
    return {"skipped": skipped, "not_wanted": NOT_WANTED, "slimmed_bytes_saved": slimmed}


def copy_tokenizer(dest: Path) -> Path:
    from pdserve.common.model_files import resolve_model

    src = resolve_model(None)
    out = dest / "tokenizer"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


def copy_stubs(dest: Path) -> list[str]:
    stubs = sorted((REPO / "protos" / "pdserve" / "v1").glob("*_pb2*.py*"))
    if not stubs:
        raise SystemExit("no generated gRPC stubs in protos/pdserve/v1: run `make protos` first")
    out = dest / "stubs"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for stub in stubs:
        shutil.copy(stub, out / stub.name)
    return [s.name for s in stubs]


def build(dest: Path) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, object] = {"requirements": requirements(), **download(dest)}
    manifest["tokenizer"] = sorted(p.name for p in copy_tokenizer(dest).iterdir())
    manifest["stubs"] = copy_stubs(dest)
    manifest["wheels"] = {p.name: p.stat().st_size for p in sorted((dest / "wheels").iterdir())}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for name, why in {**manifest["skipped"], **NOT_WANTED}.items():  # type: ignore[dict-item]
        print(f"not carried: {name}: {why}")
    return size(dest)


def size(dest: Path) -> int:
    try:
        print(check_size(dest, working_tree_bytes(payload=dest)))
    except PayloadTooLarge as exc:
        print(f"refusing: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["build", "size"])
    p.add_argument("dest", nargs="?", default=os.environ.get("PDSERVE_GPU_PAYLOAD", DEFAULT_DEST))
    args = p.parse_args(argv)
    dest = Path(args.dest)
    return build(dest) if args.command == "build" else size(dest)


if __name__ == "__main__":
    raise SystemExit(main())

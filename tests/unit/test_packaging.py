"""The repository's top-level kernels/ folder is `pdserve.kernels`, and never the `kernels`
that a process started from the repository root imports.

kernels/ has no `__init__.py`: where the working directory is `sys.path[0]` (`python -c`,
`python -m` from the root, as the tests start services), the folder is then only a namespace
portion, and a regular package of that name anywhere on `sys.path` wins (PEP 420), such as
Hugging Face's `kernels`, which transformers imports. `pdserve.kernels` comes from the
editable install's finder or from the wheel, whichever installed pdserve."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels"


def _python(code: str, cwd: Path, pythonpath: Path | None = None) -> str:
    """Run `python -c code` in `cwd` (so `sys.path[0]` is `cwd`); its stdout, stripped."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_an_installed_kernels_package_wins_over_the_folder(tmp_path) -> None:
    # A regular package named `kernels` later on sys.path than the repository root.
    installed = tmp_path / "site" / "kernels"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("")
    found = _python("import kernels; print(kernels.__file__)", ROOT, tmp_path / "site")
    assert Path(found) == installed / "__init__.py"


def _hub_kernels() -> importlib.metadata.Distribution | None:
    try:
        return importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return None


@pytest.mark.skipif(_hub_kernels() is None, reason="Hugging Face's kernels is not installed")
def test_hugging_face_kernels_is_the_kernels_imported_from_the_root() -> None:
    dist = _hub_kernels()
    assert dist is not None
    found = Path(_python("import kernels; print(kernels.__file__)", ROOT))
    assert found.resolve() == Path(dist.locate_file("kernels/__init__.py")).resolve()
    assert not found.resolve().is_relative_to(ROOT / "kernels")  # (.venv may sit in ROOT)


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_pdserve_kernels_imports_with_its_sources(where: str, tmp_path) -> None:
    cwd = ROOT if where == "root" else tmp_path
    source = _python("from pdserve.kernels import dense_layers; print(dense_layers.SOURCE)", cwd)
    assert Path(source).is_file()
    assert Path(source).parent.parent.name == "kernels"


def test_the_wheel_carries_every_kernel_module_and_source(tmp_path) -> None:
    """A regular (non-editable) install gets the folder's modules and C++ sources even
    though the folder has no `__init__.py`."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    junk = shutil.ignore_patterns("__pycache__", "*.so", "*.o")
    for folder in ("common", "kernels", "services", "protos"):
        shutil.copytree(ROOT / folder, src / folder, ignore=junk)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "dist"), str(src)],
        cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("pdserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = [*KERNELS.glob("*.py"), *KERNELS.glob("csrc/*.cpp"), *KERNELS.glob("csrc/*.h")]
    expected = {f"pdserve/kernels/{p.relative_to(KERNELS).as_posix()}" for p in sources}
    assert "pdserve/kernels/dense_layers.py" in expected
    assert expected <= names, sorted(expected - names)

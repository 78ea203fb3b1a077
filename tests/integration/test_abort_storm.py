"""An abort storm on real processes (1 prefill + 1 decode worker and a coordinator):
`benchmarks/abort_storm.py` sends 300 streams within two seconds and cancels each at a phase
drawn at random (before its first token, right after it, or mid-decode). Every phase is
hit, no call ends in an error other than the cancel or an overload refusal, and both
workers are back to every KV block free, no lease held and nothing running within the
prefill worker's lease."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "abort_storm.py"


def test_cancelled_streams_leave_nothing_behind():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--streams", "300", "--storm-seconds", "2",
         "--requests", "0", "--kv-lease", "10"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout)
    storm = result["storm"]
    for phase in ("queued", "first_token", "decoding"):
        assert storm[phase]["reached"] > 0, (phase, storm)
    assert storm["errors"] == {}, storm
    assert result["within_lease"], result
    for name, state in result["workers"].items():
        assert state["blocks_free"] == state["blocks"], (name, state)
        assert state["leases_held"] == 0 and state["running"] == 0, (name, state)

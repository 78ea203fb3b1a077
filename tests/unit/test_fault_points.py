"""The fault kit's points (`common/faults.py`): nothing fires unless armed; each action
does what it says at the named point and on the hit it names; every firing is counted; a bad
`PDSERVE_FAULTS` is refused naming what is wrong, and a service process refuses it at start."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from pdserve.common import faults


@pytest.fixture(autouse=True)
def _disarmed():
    yield
    faults.arm("")


def _count(point: str, action: str) -> float:
    return faults.INJECTED.labels(point, action)._value.get()


def test_nothing_fires_unless_armed():
    for point in faults.POINTS:
        assert faults.hit(point) is None
    faults.arm("decode.before_step=delay:0")
    with pytest.raises(KeyError):  # a point the code names must be a known one
        faults.hit("decode.no_such_point")


def test_actions_fire_at_their_point_and_hit():
    faults.arm(
        "prefill.lease_granted=fail@2;decode.before_landing=corrupt;decode.before_pull=stop@9"
    )
    before = _count("prefill.lease_granted", "fail")
    assert faults.hit("prefill.lease_granted") is None  # the first hit passes
    with pytest.raises(faults.FaultInjected) as fired:
        faults.hit("prefill.lease_granted")
    assert fired.value.point == "prefill.lease_granted"
    assert faults.hit("prefill.lease_granted") is None  # only the second
    assert _count("prefill.lease_granted", "fail") == before + 1
    assert faults.hit("decode.before_landing") == "corrupt"
    assert asyncio.run(faults.ahit("decode.before_landing")) == "corrupt"
    assert asyncio.run(faults.ahit("decode.before_pull")) is None  # the 9th hit only
    assert faults.hit("decode.before_step") is None  # not armed


def test_delay_sleeps_there():
    faults.arm("decode.before_step=delay:0.2")
    start = time.monotonic()
    assert faults.hit("decode.before_step") is None
    assert time.monotonic() - start >= 0.2
    start = time.monotonic()
    assert asyncio.run(faults.ahit("decode.before_step")) is None
    assert time.monotonic() - start >= 0.2


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("decode.nowhere=fail", "decode.nowhere"),
        ("decode.before_step=explode", "explode"),
        ("decode.before_step=delay:soon", "delay:soon"),
        ("decode.before_step=fail@0", "fail@0"),
        ("decode.before_step", "decode.before_step"),
        ("decode.before_step=corrupt", "corrupt"),
    ],
)
def test_bad_specs_are_refused_naming_the_part(spec, named):
    with pytest.raises(ValueError, match=r"PDSERVE_FAULTS") as refused:
        faults.parse(spec)
    assert named in str(refused.value)


@pytest.mark.parametrize("action", ["kill", "stop"])
def test_kill_and_stop_signal_the_process_itself(action):
    code = (
        "from pdserve.common import faults\n"
        "faults.arm_from_env()\n"
        "print('before', flush=True)\n"
        "faults.hit('decode.before_step')\n"
        "print('after', flush=True)\n"
    )
    env = {**os.environ, "PDSERVE_FAULTS": f"decode.before_step={action}"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline() == "before\n"
        if action == "stop":  # stopped, not dead: it goes on once continued
            for _ in range(1000):
                with open(f"/proc/{proc.pid}/stat") as f:
                    if f.read().split(") ", 1)[1].startswith("T"):
                        break
                time.sleep(0.01)
            else:
                pytest.fail("the process never stopped")
            proc.send_signal(signal.SIGCONT)
            assert proc.stdout.readline() == "after\n"
            assert proc.wait() == 0
        else:
            assert proc.wait() == -signal.SIGKILL
            assert proc.stdout.read() == ""
        assert '"point": "decode.before_step"' in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_service_refuses_a_bad_spec_at_start():
    env = {**os.environ, "PDSERVE_FAULTS": "prefill.somewhere=fail"}
    out = subprocess.run(
        [sys.executable, "-P", "-m", "pdserve.services.cli", "coordinator",
         "--prefill-workers=127.0.0.1:1", "--decode-workers=127.0.0.1:2"],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 2
    assert "prefill.somewhere" in out.stderr and "PDSERVE_FAULTS" in out.stderr

"""The GPU check (benchmarks/gpu_check.py) cannot rot between GPU loans: its CPU dry run
(`--device cpu --tiny`) runs every part here, real processes included, and must exit 0 with
every part reporting. And the payload carried to a GPU machine is refused above the 64 MiB
that may travel (benchmarks/gpu_check_parts/payload.py), and slimming a wheel keeps its
RECORD in step."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.append(str(BENCHMARKS))  # after everything else: no module here shadows another

from gpu_check_parts import payload  # noqa: E402

PARTS = ("environment", "kernels", "engine", "speed", "disaggregation", "expert_parallel")
# Parts that may report "skipped" on a CPU host: none. Each runs here (UCX over shared
# memory, expert parallelism over gloo), so a part that silently turns into "skipped" fails.
MAY_SKIP_ON_CPU: dict[str, str] = {}
MUST_BE_OK = ("environment", "kernels", "engine")


@pytest.mark.slow
def test_cpu_dry_run_reports_every_part(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_check.py"), "--device", "cpu", "--tiny",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:] + proc.stdout[-5000:]
    result = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == result
    assert out.with_suffix(".log").is_file()
    for part in PARTS:
        r = result[part]
        assert r["status"] in ("ok", "skipped"), (part, r)
        assert isinstance(r["reason"], str) and r["reason"], (part, r)
        if r["status"] == "skipped":
            assert part in MAY_SKIP_ON_CPU, f"{part} skipped on CPU: {r['reason']}"
    for part in MUST_BE_OK:
        assert result[part]["status"] == "ok", result[part]
    summary = result["summary"]
    assert summary["device"] == "cpu" and summary["tiny"] and summary["failed"] == []
    # The figures each part promises are there.
    assert result["kernels"]["checks"] > 20 and result["kernels"]["failures"] == []
    for arch in ("llama", "qwen2", "mixtral"):
        assert result["engine"][arch]["float32_greedy_exact"] == "5/5", result["engine"][arch]
    assert result["engine"]["determinism"]["ok"]
    speed = result["speed"]
    assert set(speed["decode"]) == {"1", "16", "64", "256"}
    assert speed["prefill"]["tokens_per_s"] > 0 and speed["device_rates"]["copy_gb_per_s"] > 0
    disagg = result["disaggregation"]
    assert all(row["checksum_ok"] for row in disagg["transfer"]["sizes"])
    served = disagg["served"]
    assert served["equal_to_colocated"] == served["requests"] and served["kv_bytes_moved"] > 0
    assert result["expert_parallel"]["backend"] == "gloo"
    # Its wall time (about a minute here) is printed in summary, not asserted: tests never
    # time things.


def _sparse(path: Path, nbytes: int) -> None:
    """A file of `nbytes` that takes no disk space."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(nbytes)


def test_payload_over_64_mib_is_refused(tmp_path, capsys, monkeypatch):
    mib = 2**20
    folder = tmp_path / "payload"
    _sparse(folder / "wheels" / "a.whl", 40 * mib)
    _sparse(folder / "tokenizer" / "tokenizer.json", 20 * mib)
    assert payload.tree_bytes(folder) == 60 * mib
    line = payload.check_size(folder, tree=4 * mib)  # exactly 64 MiB travels
    assert "64.0 MiB of the 64 MiB" in line
    with pytest.raises(payload.PayloadTooLarge, match=r"0\.5 MiB too much"):
        payload.check_size(folder, tree=4 * mib + mib // 2)
    _sparse(folder / "stubs" / "x_pb2.py", 5 * mib)
    with pytest.raises(payload.PayloadTooLarge):
        payload.check_size(folder, tree=0)
    # The command line says so and exits 1.
    monkeypatch.setattr(payload, "working_tree_bytes", lambda **_: 0)
    assert payload.main(["size", str(folder)]) == 1
    assert "refusing: payload 65.0 MiB" in capsys.readouterr().err
    (folder / "stubs" / "x_pb2.py").unlink()
    assert payload.main(["size", str(folder)]) == 0
    assert "60.0 MiB of the 64 MiB" in capsys.readouterr().out


def test_slimming_a_wheel_drops_members_and_their_record_lines(tmp_path):
    whl = tmp_path / "libucx_cu13-1.0-py3-none-any.whl"
    names = ["libucx/lib/libucp.so", "libucx/lib/libucp.so.0", "libucx/lib/libucp.so.0.0.0",
             "libucx/lib/libucp.a", "libucx/include/ucp.h", "libucx/bin/ucx_perftest"]  # fmt: skip
    record = "".join(f"{n},sha256=x,10\n" for n in names) + "libucx_cu13-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(whl, "w") as z:
        for n in names:
            z.writestr(n, b"0123456789" * 1000)
        z.writestr("libucx_cu13-1.0.dist-info/RECORD", record)
    saved = payload.slim_wheel(whl, payload.SLIM["libucx-cu13"])
    assert saved > 0
    with zipfile.ZipFile(whl) as z:
        kept = set(z.namelist())
        lines = z.read("libucx_cu13-1.0.dist-info/RECORD").decode().splitlines()
    assert kept == {"libucx/lib/libucp.so", "libucx/lib/libucp.so.0",
                    "libucx_cu13-1.0.dist-info/RECORD"}  # fmt: skip
    assert [ln.split(",")[0] for ln in lines] == [
        "libucx/lib/libucp.so", "libucx/lib/libucp.so.0", "libucx_cu13-1.0.dist-info/RECORD",
    ]  # fmt: skip

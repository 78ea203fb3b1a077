"""When the UCX KV transport asks UCX for `cma`, its single copy between processes on one host:
the Yama ptrace scope and the process's capabilities decide, and the UCX settings follow.
No UCX is loaded here: these are the decisions taken before it starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.common.kv_transfer import ucx

CAP_SYS_PTRACE = 1 << 19


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Sets this process's view of the host: Yama's scope (None: no Yama) and CapEff."""

    def set_host(scope: str | None, cap_eff: int = 0) -> None:
        scope_file = tmp_path / "ptrace_scope"
        scope_file.unlink(missing_ok=True)
        if scope is not None:
            scope_file.write_text(f"{scope}\n")
        status = tmp_path / "status"
        status.write_text(f"Name:\tpython\nCapInh:\t0000000000000000\nCapEff:\t{cap_eff:016x}\n")
        monkeypatch.setattr(ucx, "YAMA_PTRACE_SCOPE", scope_file)
        monkeypatch.setattr(ucx, "PROC_STATUS", status)

    return set_host


@pytest.mark.parametrize("scope", [None, "0", "1"])
def test_cma_allowed_without_yama_or_at_scopes_0_and_1(host, scope: str | None) -> None:
    host(scope)
    assert ucx.single_copy_refusal() is None
    env = ucx.ucx_env_defaults()
    assert "cma" in env["UCX_TLS"].split(",")
    assert env["UCX_CMA_MEMORY_INVALIDATE"] == "y"  # else UCX leaves cma out of rendezvous


def test_scope_2_needs_cap_sys_ptrace(host) -> None:
    host("2", cap_eff=0x1FFFEFFFFFF & ~CAP_SYS_PTRACE)
    assert "CAP_SYS_PTRACE" in ucx.single_copy_refusal()
    host("2", cap_eff=CAP_SYS_PTRACE)
    assert ucx.single_copy_refusal() is None


@pytest.mark.parametrize("scope", ["3", "2"])
def test_refused_cma_is_left_out_of_the_ucx_settings(host, scope: str) -> None:
    host(scope)
    reason = ucx.single_copy_refusal()
    assert reason is not None and f"ptrace_scope is {scope}" in reason
    env = ucx.ucx_env_defaults()
    assert env["UCX_TLS"].split(",")[:3] == ["posix", "self", "tcp"]
    assert "cma" not in env["UCX_TLS"].split(",")
    assert "UCX_CMA_MEMORY_INVALIDATE" not in env


def test_an_unreadable_status_counts_as_no_capability(host, tmp_path: Path, monkeypatch) -> None:
    host("2")
    monkeypatch.setattr(ucx, "PROC_STATUS", tmp_path / "missing")
    assert "CAP_SYS_PTRACE" in ucx.single_copy_refusal()

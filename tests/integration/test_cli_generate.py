"""`pdserve generate` as a user runs it: a real process, JSONL in and out. Bad lines get a
one-line error naming the line, field and limit; the good lines are unaffected; bad models
and flags fail with a clear message and no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PDSERVE = [sys.executable, "-m", "pdserve.services.cli"]


def run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PDSERVE_THREADS="2")
    return subprocess.run(PDSERVE + args, capture_output=True, text=True, timeout=timeout, env=env)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_help_reads_well():
    out = run(["generate", "--help"])
    assert out.returncode == 0
    for flag in ("--input", "--output", "--model", "--dtype", "--max-tokens", "--temperature",
                 "--seed", "--threads", "PDSERVE_"):  # fmt: skip
        assert flag in out.stdout


def test_generate_mixed_good_and_bad_lines(tmp_path):
    rows = [
        {"prompt": "The capital of France is", "max_tokens": 6},
        {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
        "{not json",
        {"prompt": ""},
        {"token_ids": [1, 2, 3, 4, 5], "max_tokens": 3, "ignore_eos": True},
        {"prompt": "hello", "top_p": 1.5},
        {"prompt": "hello", "top_k": 0},
        {"prompt": "hello", "temperature": -0.5},
        {"prompt": "hello", "max_tokens": 0},
        {"prompt": "word " * 200},
        {"prompt": "hello", "top_k": -2},
        {"prompt": "Count: one, two,", "max_tokens": 8, "stop": [" four"]},
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out_path = tmp_path / "out.jsonl"
    proc = run(["generate", "--input", str(inp), "--output", str(out_path),
                "--max-tokens", "12", "--max-model-len", "128", "--no-progress"])  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    results = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert [r["index"] for r in results] == list(range(len(rows)))

    expected_errors = {
        2: ("line 3", "JSON"),
        3: ("line 4", "prompt"),
        5: ("line 6", "top_p"),
        6: ("line 7", "top_k"),
        7: ("line 8", "temperature"),
        8: ("line 9", "max_tokens"),
        9: ("line 10", "max_model_len (128)"),
        10: ("line 11", "top_k"),
    }
    err_lines = [
        line for line in proc.stderr.splitlines() if line.startswith("pdserve generate: line")
    ]
    assert len(err_lines) == len(expected_errors)
    for i, (where, what) in expected_errors.items():
        assert "error" in results[i] and what in results[i]["error"]
        assert any(where + ":" in line and what in line for line in err_lines), (where, what)

    good = [r for r in results if "error" not in r]
    assert len(good) == 4
    for r in good:
        assert set(r) == {"index", "text", "token_ids", "finish_reason", "prompt_tokens"}
        assert r["finish_reason"] in ("stop", "length")
        assert r["token_ids"] and r["prompt_tokens"] > 0
    assert "Paris" in results[0]["text"] or "Paris" in results[1]["text"]
    assert results[4]["prompt_tokens"] == 5 and len(results[4]["token_ids"]) == 3
    assert results[1]["finish_reason"] == "stop"  # the chat answer ends with EOS
    # Greedy continues "three, four, ..."; the stop string ends the text just before " four".
    assert results[11]["finish_reason"] == "stop"
    assert results[11]["text"] == " three,"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/no/such/model"], "no such folder"),
        (["--dtype", "float64"], "invalid choice"),
        (["--threads", "0"], "threads"),
    ],
)
def test_bad_engine_arguments_fail_clearly(tmp_path, args, message):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    proc = run(["generate", "--input", str(inp), "--output", str(tmp_path / "o.jsonl"), *args])
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unsupported_architecture(tmp_path):
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    proc = run(["generate", "--input", str(inp), "--output", str(tmp_path / "o.jsonl"),
                "--model", str(model)])  # fmt: skip
    assert proc.returncode == 2
    assert "GPT2LMHeadModel" in proc.stderr and "not supported" in proc.stderr
    assert "Traceback" not in proc.stderr

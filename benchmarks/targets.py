"""Where this host stands against pdserve's latency targets, in one command (`make
bench-targets`).

The CPU under pdserve changes from host to host (AVX2 only, AVX-512-BF16, AMX), and the
targets of the README's "Speed" table hold or miss per host class. This program runs, one
after the other on this host, the three benchmarks that measure them, keeps each one's JSON
in `--out-dir` (with its stderr log), and prints one JSON object: every target with its
figure, its bar and whether it is met (null where it was not measured):

- `decode_step_over_floor` at batch 1, 4, 16 and 64: at most 1.5 (`decode_step.py`, in the
  engine's dtype on this host: the step over max(weight-read floor, compute floor), both
  measured in the same run, right after each step; `whole_run_figure`: with the rates the
  run measured once).
- `offline_fraction_of_ceiling`: at least 0.6 (`offline.py --only pdserve`: output tokens/s
  over the ceiling computed from the matmul rates measured in the same run).
- `tight_goodput_over_vllm_loose`: at least 1.5 (`serve.py`, one run: pdserve's best mode's
  goodput at the tight SLO pair, summed over the rates, over vLLM's best at the loose pair).
  vLLM runs when its anchor venv exists (`offline.py --vllm` sets it up); in float32 where
  the engine runs float32, as pdserve does.
- `tpot_p99_s` at `--tpot-rate`, colocated and disaggregated: at most the tight TPOT SLO
  (same run).

The serving defaults are the targets' own: prompts 64-512 tokens, outputs 32-256, Poisson
arrivals at 0.5, 1 and 1.5 req/s for 30 s each, tight SLO TTFT <= 1 s and TPOT <= 50 ms,
loose 2 s and 100 ms; pdserve's workers get the tight pair as their `--ttft-target-ms`,
`--tpot-target-ms` and `--handoff-wait-ms`. A host with a fraction of the compute (e.g. an
AVX2 core with 128-bit FMA units) can be scored at SLOs scaled to it (`--tight 2:0.15
--loose 4:0.3`); the output says which were used.

    .venv/bin/python benchmarks/targets.py > targets.json   # ~30-40 minutes on 2 cores
    .venv/bin/python benchmarks/targets.py --score-only --out-dir DIR   # re-read a run
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from machine import cpu_name
from slo import slo_label, slo_pair

HERE = Path(__file__).resolve().parent
STEP_BAR = 1.5
OFFLINE_BAR = 0.6
GOODPUT_BAR = 1.5
BATCHES = ("1", "4", "16", "64")
PDSERVE_MODES = ("colocated", "disaggregated")
FILES = {"decode_step": "decode_step.json", "offline": "offline.json", "serve": "serve.json"}


def label(pair: tuple[float, float]) -> str:
    return slo_label(*pair)


def isa_class() -> str:
    from pdserve.kernels.invariant_gemm import native_path

    return native_path() or "baseline"


def engine_dtype() -> str:
    from pdserve.common.config import auto_dtype

    return auto_dtype("cpu")


def row(target: str, figure: float | None, bar: float, at_most: bool) -> dict[str, Any]:
    """One target: its figure, its bar (`want`: "<= bar" or ">= bar") and whether it is met
    (None: not measured)."""
    met = None if figure is None else (figure <= bar if at_most else figure >= bar)
    want = f"{'<=' if at_most else '>='} {bar:g}"
    return {"target": target, "figure": figure, "want": want, "met": met}


def score_decode(report: dict | None) -> list[dict]:
    """The invariant path's steps over the floors probed beside each step where the report
    has them (`floors_beside_each_step`), else over the whole run's (`floors`, also given as
    `whole_run_figure`); `dense_floor_figure` is the figure against the dense FLOPs alone
    (the compute floor without attention's, as scored up to the first Zen 3 run of 2026-12-07)."""
    whole = (report or {}).get("floors", {}).get("invariant", {})
    beside = (report or {}).get("floors_beside_each_step") or whole
    rows = []
    for b in BATCHES:
        r = row(
            f"decode_step_over_floor@batch{b}",
            beside.get(b, {}).get("step_over_floor"),
            STEP_BAR,
            at_most=True,
        )
        r["whole_run_figure"] = whole.get(b, {}).get("step_over_floor")
        r["dense_floor_figure"] = beside.get(b, {}).get("step_over_dense_floor")
        rows.append(r)
    return rows


def score_offline(report: dict | None) -> list[dict]:
    figure = (report or {}).get("pdserve_fraction_of_ceiling")
    return [row("offline_fraction_of_ceiling", figure, OFFLINE_BAR, at_most=False)]


def score_serve(
    report: dict | None, tight: tuple[float, float], loose: tuple[float, float], tpot_rate: float
) -> list[dict]:
    report = report or {}
    summary = report.get("summary", {})

    def best(names: list[str], pair: tuple[float, float]) -> tuple[str | None, float | None]:
        sums = [(summary[n]["goodput_sum_rps"].get(label(pair), 0.0), n) for n in names]
        return (max(sums)[1], max(sums)[0]) if sums else (None, None)

    ours, ours_sum = best([n for n in summary if n in PDSERVE_MODES], tight)
    theirs, theirs_sum = best([n for n in summary if n.startswith("vllm")], loose)
    ratio: float | None = None
    met: bool | None = None
    if ours_sum is not None and theirs_sum is not None:
        ratio = round(ours_sum / theirs_sum, 3) if theirs_sum else None
        met = ratio >= GOODPUT_BAR if ratio is not None else ours_sum > 0
    goodput = row("tight_goodput_over_vllm_loose", ratio, GOODPUT_BAR, at_most=False)
    goodput.update(
        met=met,
        pdserve_best=ours,
        pdserve_tight_goodput_sum=ours_sum,
        vllm_best=theirs,
        vllm_loose_goodput_sum=theirs_sum,
    )
    rows = [goodput]
    for mode in PDSERVE_MODES:
        rates = report.get("systems", {}).get(mode, {}).get("rates", [])
        at = next((r for r in rates if abs(r["rate_rps"] - tpot_rate) < 1e-9), None)
        p99 = (at or {}).get("tpot_s", {}).get("p99")
        rows.append(row(f"tpot_p99_s@{tpot_rate:g}rps:{mode}", p99, tight[1], at_most=True))
    return rows


def score(
    reports: dict[str, dict | None],
    tight: tuple[float, float],
    loose: tuple[float, float],
    tpot_rate: float,
) -> list[dict]:
    """Every target's row from the three benchmarks' JSON (None: not run)."""
    return [
        *score_decode(reports.get("decode_step")),
        *score_offline(reports.get("offline")),
        *score_serve(reports.get("serve"), tight, loose, tpot_rate),
    ]


def commands(args: argparse.Namespace, dtype: str, vllm: bool) -> dict[str, list[str]]:
    py = sys.executable
    tight_ms = [round(x * 1000) for x in args.tight]
    systems = [
        *PDSERVE_MODES,
        *(["vllm-2core-fp32" if dtype == "float32" else "vllm-2core"] if vllm else []),
    ]
    return {
        "decode_step": [py, str(HERE / "decode_step.py"), "--dtype", dtype],
        "offline": [py, str(HERE / "offline.py"), "--only", "pdserve", "--skip-fast-path"],
        "serve": [
            py,
            str(HERE / "serve.py"),
            "--systems",
            ",".join(systems),
            "--prompt-len",
            args.prompt_len,
            "--output-len",
            args.output_len,
            "--rates",
            args.rates,
            "--duration",
            str(args.duration),
            "--slo-ttft",
            f"{args.tight[0]:g}",
            "--slo-tpot",
            f"{args.tight[1]:g}",
            "--extra-slo",
            label(args.loose),
            "--out-dir",
            str(args.out_dir),
            f"--serve-arg=--ttft-target-ms={tight_ms[0]}",
            f"--serve-arg=--tpot-target-ms={tight_ms[1]}",
            f"--serve-arg=--handoff-wait-ms={tight_ms[0]}",
        ],
    }


def run(name: str, command: list[str], out_dir: Path) -> dict | None:
    print(f"[targets] {name}: {' '.join(command)}", file=sys.stderr, flush=True)
    out, log = out_dir / FILES[name], out_dir / f"{name}.log"
    with out.open("w") as stdout, log.open("w") as stderr:
        code = subprocess.run(command, stdout=stdout, stderr=stderr, cwd=HERE.parent).returncode
    if code != 0:
        print(f"[targets] {name} exited {code}; its log: {log}", file=sys.stderr, flush=True)
    return read(out)


def read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: .venv/bin/python benchmarks/targets.py --tight 2:0.15 --loose 4:0.3 "
        "--prompt-len 32-128 (SLOs scaled to a compute-poor host)",
    )
    today = datetime.date.today().isoformat()
    p.add_argument(
        "--out-dir",
        type=Path,
        help="where each benchmark's JSON and log go "
        f"(default: benchmarks/results/<isa class>/{today}-targets; the docs cite a run from "
        "benchmarks/results/<host class>/, e.g. avx2-zen3/)",
    )
    p.add_argument(
        "--only",
        choices=sorted(FILES),
        action="append",
        help="run only this benchmark (repeatable); the others are read from --out-dir",
    )
    p.add_argument(
        "--score-only", action="store_true", help="run nothing: score the JSON in --out-dir"
    )
    p.add_argument("--no-vllm", action="store_true", help="serve without vLLM beside pdserve")
    load = p.add_argument_group("serving load and SLOs")
    load.add_argument(
        "--tight",
        type=slo_pair,
        default=(1.0, 0.05),
        metavar="TTFT:TPOT",
        help="the tight SLO pair, seconds; also pdserve's targets (default: 1:0.05)",
    )
    load.add_argument(
        "--loose",
        type=slo_pair,
        default=(2.0, 0.1),
        metavar="TTFT:TPOT",
        help="the loose SLO pair vLLM is scored at (default: 2:0.1)",
    )
    load.add_argument("--rates", default="0.5,1,1.5", help="offered req/s (default: %(default)s)")
    load.add_argument(
        "--tpot-rate",
        type=float,
        default=1.0,
        help="the rate whose TPOT p99 is scored, one of --rates (default: %(default)s)",
    )
    load.add_argument("--prompt-len", default="64-512", help="tokens (default: %(default)s)")
    load.add_argument("--output-len", default="32-256", help="tokens (default: %(default)s)")
    load.add_argument(
        "--duration",
        type=float,
        default=30.0,
        help="seconds of arrivals per rate (default: %(default)s)",
    )
    args = p.parse_args()
    if args.tpot_rate not in [float(r) for r in args.rates.split(",")]:
        p.error(f"--tpot-rate {args.tpot_rate:g} is not one of --rates {args.rates}")
    if args.out_dir is None:
        args.out_dir = HERE / "results" / isa_class() / f"{today}-targets"
    return args


def main() -> int:
    args = parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    dtype = engine_dtype()
    from serve import vllm_set_up  # needs aiohttp (make bench-targets installs it)

    vllm = not args.no_vllm and vllm_set_up()
    planned = commands(args, dtype, vllm)
    ran = {n: c for n, c in planned.items() if not args.score_only and n in (args.only or FILES)}
    reports = {
        name: run(name, ran[name], args.out_dir) if name in ran else read(args.out_dir / file)
        for name, file in FILES.items()
    }
    rows = score(reports, args.tight, args.loose, args.tpot_rate)
    for r in rows:
        verdict = {True: "met", False: "MISSED", None: "not measured"}[r["met"]]
        print(
            f"[targets] {r['target']}: {r['figure']} (want {r['want']}) {verdict}", file=sys.stderr
        )
    print(
        json.dumps(
            {
                "benchmark": "targets",
                "date": datetime.datetime.now().isoformat(timespec="seconds"),
                "cpu": cpu_name(),
                "isa_class": isa_class(),
                "dtype": dtype,
                "slo": {"tight": label(args.tight), "loose": label(args.loose)},
                "out_dir": str(args.out_dir),
                "ran": {
                    n: " ".join(c) for n, c in ran.items()
                },  # the others were read from out_dir
                "targets": rows,
                "met": sum(r["met"] is True for r in rows),
                "missed": sum(r["met"] is False for r in rows),
                "not_measured": sum(r["met"] is None for r in rows),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

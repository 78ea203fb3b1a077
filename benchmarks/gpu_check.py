"""The GPU check: one run that proves pdserve's CUDA path on a GPU in about five minutes,
and dry-runs the same code on a CPU (`--device cpu --tiny`, under a minute) so it cannot rot
between GPU loans. Prints one JSON object (and writes it to $OUT/gpu_check.json when $OUT is
set), one key per part, each {"status": "ok" | "failed" | "skipped", "reason", figures...}:

- environment: GPU, driver, torch / CUDA / triton, the packages and where they came from;
- kernels: Triton paged attention, dense layer, RMSNorm, MoE experts, write_kv against the
  float64 references, and their batch/chunk invariance;
- engine: greedy ids on the device against transformers on the same random weights (tiny
  Llama, Qwen2, Mixtral: float32 exact, bfloat16 >= 95% argmax agreement) and the
  determinism contract (batch, chunking, prefix-cache hits, seeded sampling);
- speed: an 8B-shaped Llama with random bf16 weights built on the device: decode step time
  at batch 1/16/64/256 beside the HBM floor, prefill tokens/s beside the bf16 matmul rate;
- disaggregation: KV blocks pulled over UCX between two processes on the device, GB/s beside
  a device copy of the same blocks; prefill + decode workers serving greedy ids equal to a
  colocated worker's;
- expert_parallel: one MoE layer split over 2 ranks (NCCL on the GPU, gloo on CPU) against
  the single-process experts.

Each part runs in its own forked process with a timeout (benchmarks/gpu_check_parts/
runner.py). On a GPU machine without network, run it through
benchmarks/gpu_check_wrapper.sh, which installs the payload `make gpu-payload` prepared.

    .venv/bin/python benchmarks/gpu_check.py [--device cuda|cpu] [--tiny] [--parts a,b]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when there is one")
    p.add_argument("--tiny", action="store_true", help="small shapes (the CPU dry run)")
    p.add_argument("--parts", help="comma-separated subset of the parts, in order")
    p.add_argument("--budget-s", type=float, help="wall-time budget of all parts together")
    p.add_argument(
        "--jobs",
        type=int,
        help="parts run at once (default: 1 on cuda, where the "
        "figures need the device alone; 2 on cpu)",
    )
    p.add_argument("--tokenizer-dir", help="folder with SmolLM2's tokenizer files")
    p.add_argument("--out", help="write the JSON here too (default: $OUT/gpu_check.json)")
    return p.parse_args(argv)


def gpu_present() -> bool:
    """Whether a CUDA device is there, asked through NVML so this process never initialises
    CUDA (the parts are forked from it and each initialises its own)."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    device = args.device or ("cuda" if gpu_present() else "cpu")
    if args.device is None and device == "cpu" and not args.tiny:
        print("[gpu_check] no GPU here: the CPU dry run (--device cpu --tiny)", file=sys.stderr)
        args.tiny = True
    if device == "cpu":  # Triton runs its kernels through its interpreter on CPU tensors
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    # Imported once here, before the parts are forked (none of it touches CUDA): each part
    # then starts in milliseconds instead of seconds.
    import torch  # noqa: F401
    import transformers.generation.utils
    import transformers.models.llama.modeling_llama
    import transformers.models.mixtral.modeling_mixtral
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401
    from gpu_check_parts.common import Context, find_tokenizer_dir
    from gpu_check_parts.runner import PARTS, run_all
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import pdserve.common.engine
    import pdserve.services.launcher  # noqa: F401

    parts = args.parts.split(",") if args.parts else list(PARTS)
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        print(f"unknown parts {unknown}; the parts are {', '.join(PARTS)}", file=sys.stderr)
        return 2
    # On a GPU: about 5 minutes, so that a rerun fits in the device time of one session.
    budget = args.budget_s or (360.0 if device == "cuda" else 150.0)
    with tempfile.TemporaryDirectory(prefix="gpu_check.") as tmp:
        ctx = Context(device, args.tiny, find_tokenizer_dir(args.tokenizer_dir), Path(tmp))
        results = run_all(ctx, parts, budget, args.jobs or (1 if device == "cuda" else 2))
        logs = "".join(
            f"===== {name} =====\n{(ctx.workdir / f'{name}.log').read_text(errors='replace')}"
            for name in parts
            if (ctx.workdir / f"{name}.log").is_file()
        )
    results["summary"] = {
        "device": device,
        "tiny": args.tiny,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "wall_s": round(time.time() - started, 1),
        **{s: [n for n in parts if results[n]["status"] == s] for s in ("ok", "failed", "skipped")},
    }
    text = json.dumps(results, indent=2, default=str)
    out = args.out or (
        os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None
    )
    if out:
        Path(out).write_text(text + "\n")
        Path(out).with_suffix(".log").write_text(logs)
    print(text, flush=True)
    return 1 if results["summary"]["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Engine flags shared by every command that runs an engine (`generate`, `demo`, `prefill`,
`decode`, `colocated`), each also read from a `PDSERVE_<FLAG>` environment variable (for
containers); a flag on the command line wins."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from pdserve.common.config import DTYPE_NAMES, EngineConfig
from pdserve.common.errors import ModelLoadError, PdserveError

if TYPE_CHECKING:
    from pdserve.common.engine import LLMEngine


def env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"PDSERVE_{name.upper()}", default)


def flag_env(name: str) -> bool:
    """A switch's default from PDSERVE_<NAME>: on unless unset, empty, 0 or false."""
    return env(name, "0") not in ("0", "", "false")


def add_engine_args(p: argparse.ArgumentParser, tpot_target_ms: str = "50") -> None:
    """The engine's flags; `tpot_target_ms` is the command's default TPOT target (offline
    generation has no stream to keep within one: 0)."""
    g = p.add_argument_group("engine (each also read from PDSERVE_<NAME>)")
    g.add_argument(
        "--model",
        default=env("model"),
        help="local Hugging Face model folder (default: the embedded SmolLM2-135M-Instruct)",
    )
    g.add_argument(
        "--dtype",
        default=env("dtype", "auto"),
        choices=["auto", *DTYPE_NAMES],
        help="weights, activations and KV cache dtype; auto is bfloat16 on GPUs and CPUs with "
        "native bf16 (AVX512-BF16, AMX), float32 elsewhere (default: %(default)s)",
    )
    g.add_argument(
        "--device", default=env("device", "cpu"), help="cpu or cuda[:N] (default: %(default)s)"
    )
    g.add_argument(
        "--threads",
        type=int,
        default=int_env("threads"),
        help="torch threads (default: every core this process may use)",
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=int_env("block_size", 16),
        help="tokens per KV block (default: %(default)s)",
    )
    g.add_argument(
        "--kv-cache-gb",
        type=float,
        default=float(env("kv_cache_gb", "2")),
        help="KV cache size in GiB (default: %(default)s)",
    )
    g.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=int_env("kv_cache_tokens"),
        help="KV cache size in tokens (overrides --kv-cache-gb)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=int_env("max_num_seqs", 128),
        help="most requests in one batch (default: %(default)s)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=int_env("max_num_batched_tokens", 2048),
        help="token budget of one step; longer prompts are prefilled in chunks "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--tpot-target-ms",
        type=float,
        default=float(env("tpot_target_ms", tpot_target_ms)),
        help="while streams decode, a step takes only the prompt tokens that keep it within "
        "this time per output token, by measured step costs; 0: the token budget alone "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=int_env("max_model_len"),
        help="longest prompt + output (default: the model's limit)",
    )
    g.add_argument(
        "--expert-parallel",
        type=int,
        metavar="N",
        default=int_env("expert_parallel", 1),
        help="mixture-of-experts models: run N rank processes, each holding num_experts/N "
        "experts and its own share of the requests (default: %(default)s)",
    )
    g.add_argument(
        "--tensor-parallel",
        type=int,
        metavar="N",
        default=int_env("tensor_parallel", 1),
        help="split every layer of a dense model over N rank processes (attention by "
        "heads, the MLP by rows; gloo on CPU, NCCL on GPU); the group is one worker "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--redundant-experts",
        type=int,
        metavar="K",
        default=int_env("redundant_experts", 0),
        help="with --expert-parallel: K extra expert slots that hold copies of the hottest "
        "experts, re-placed as the load shifts (default: %(default)s)",
    )
    g.add_argument(
        "--eplb-interval",
        type=int,
        metavar="STEPS",
        default=int_env("eplb_interval", 64),
        help="model steps between two re-placements of the redundant experts "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--kv-offload-dir",
        metavar="DIR",
        default=env("kv_offload_dir"),
        help="a local-disk tier below the KV cache: evicted prefix blocks are written here "
        "and read back when a later prompt shares them (default: off)",
    )
    g.add_argument(
        "--kv-offload-gb",
        type=float,
        metavar="GB",
        default=float(env("kv_offload_gb", "4")),
        help="size of the --kv-offload-dir tier in GiB; least recently used blocks go first "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--kv-host-offload-gb",
        type=float,
        metavar="GB",
        default=float(env("kv_host_offload_gb", "0")),
        help="host memory (pinned on GPUs) between the KV cache and --kv-offload-dir: evicted "
        "prefix blocks go here first and come back at memory speed (default: 0, none)",
    )
    g.add_argument(
        "--kv-shared-dir",
        metavar="DIR",
        default=env("kv_shared_dir"),
        help="a KV tier shared by workers of the same model (e.g. a ReadWriteMany volume): "
        "every cached prefix block is written through to it and any worker reads it back, "
        "so a conversation moved to another worker keeps its cache (default: off)",
    )
    g.add_argument(
        "--kv-shared-gb",
        type=float,
        metavar="GB",
        default=float(env("kv_shared_gb", "16")),
        help="how much of --kv-shared-dir this worker fills before deleting the least "
        "recently used blocks it knows of (default: %(default)s)",
    )
    g.add_argument("--no-prefix-caching", action="store_true",
                   default=flag_env("no_prefix_caching"),
                   help="turn off automatic prefix caching")  # fmt: skip
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        default=flag_env("enforce_eager"),
        help="GPUs: run decode steps eagerly instead of replaying them as CUDA graphs "
        "(captured at start for batch sizes up to --max-num-seqs)",
    )


SERVICE_ROLES = ("prefill", "decode", "colocated")
TENSOR_PARALLEL_COMMANDS = ("generate", *SERVICE_ROLES)


def int_env(name: str, default: int | None = None) -> int | None:
    value = env(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise SystemExit(
            f"pdserve: error: PDSERVE_{name.upper()} must be an integer, got {value!r}"
        ) from None


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        block_size=args.block_size,
        kv_cache_gb=args.kv_cache_gb,
        kv_cache_tokens=args.kv_cache_tokens,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        tpot_target_ms=args.tpot_target_ms,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_offload_dir=args.kv_offload_dir,
        kv_offload_gb=args.kv_offload_gb,
        kv_host_offload_gb=args.kv_host_offload_gb,
        kv_shared_dir=args.kv_shared_dir,
        kv_shared_gb=args.kv_shared_gb,
        expert_parallel=args.expert_parallel,
        redundant_experts=args.redundant_experts,
        eplb_interval=args.eplb_interval,
        tensor_parallel=args.tensor_parallel,
        enforce_eager=args.enforce_eager,
    )


def load_engine(args: argparse.Namespace) -> LLMEngine:
    from pdserve.common.engine import LLMEngine

    if args.expert_parallel != 1:
        if getattr(args, "command", "generate") not in ("generate", *SERVICE_ROLES):
            raise PdserveError(
                f"--expert-parallel: runs with generate, {', '.join(SERVICE_ROLES)}, serve"
            )
        from pdserve.services.expert_parallel import join_expert_parallel_group

        engine_config(args).validate()  # bad flags fail here, before any rank starts
        join_expert_parallel_group(args, engine_argv(args))
    elif args.tensor_parallel != 1:
        command = getattr(args, "command", "generate")
        if command not in TENSOR_PARALLEL_COMMANDS:
            raise PdserveError(
                f"--tensor-parallel: runs with {', '.join(TENSOR_PARALLEL_COMMANDS)} "
                "(serve takes --prefill-tensor-parallel / --decode-tensor-parallel)"
            )
        from pdserve.services.rank_group import RANK_ENV, join_rank_group

        engine_config(args).validate()
        if os.environ.get(RANK_ENV) is None:
            check_tensor_parallel(args.model, args.tensor_parallel)
        join_rank_group(args, engine_argv(args), args.tensor_parallel, "tensor")
    try:
        config = engine_config(args)
        # A serving worker exports its MoE routing (one bincount per MoE layer and step).
        config.count_expert_tokens = getattr(args, "command", None) in SERVICE_ROLES
        return LLMEngine(config)
    except (OSError, KeyError) as exc:
        raise ModelLoadError(
            f"model: cannot load {args.model or 'the default model'}: {exc}"
        ) from exc


def check_tensor_parallel(model: str | None, world_size: int) -> None:
    """A clear error before any rank starts: a model N ranks cannot split."""
    from transformers import AutoConfig

    from pdserve.common.model_files import resolve_model
    from pdserve.common.models.families import family_for
    from pdserve.common.models.tensor_parallel import check_model

    config = AutoConfig.from_pretrained(resolve_model(model))
    family = family_for(config)
    try:
        check_model(config, family.name, family.moe is not None, family.qk_norm, world_size)
    except ValueError as exc:
        raise PdserveError(f"--{exc}".replace("tensor_parallel:", "tensor-parallel:")) from None


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of `args` as a command line, to hand to a child process."""
    argv: list[str] = []
    for flag, value in [
        ("--model", args.model),
        ("--dtype", args.dtype),
        ("--device", args.device),
        ("--threads", args.threads),
        ("--block-size", args.block_size),
        ("--kv-cache-gb", args.kv_cache_gb),
        ("--kv-cache-tokens", args.kv_cache_tokens),
        ("--max-num-seqs", args.max_num_seqs),
        ("--max-num-batched-tokens", args.max_num_batched_tokens),
        ("--tpot-target-ms", args.tpot_target_ms),
        ("--max-model-len", args.max_model_len),
        ("--kv-offload-dir", args.kv_offload_dir),
        ("--kv-offload-gb", args.kv_offload_gb if args.kv_offload_dir else None),
        ("--kv-host-offload-gb", args.kv_host_offload_gb or None),
        ("--kv-shared-dir", args.kv_shared_dir),
        ("--kv-shared-gb", args.kv_shared_gb if args.kv_shared_dir else None),
        ("--expert-parallel", args.expert_parallel if args.expert_parallel != 1 else None),
        ("--redundant-experts", args.redundant_experts or None),
        ("--eplb-interval", args.eplb_interval if args.eplb_interval != 64 else None),
        ("--tensor-parallel", args.tensor_parallel if args.tensor_parallel != 1 else None),
    ]:
        if value is not None:
            argv += [flag, str(value)]
    if args.no_prefix_caching:
        argv.append("--no-prefix-caching")
    if args.enforce_eager:
        argv.append("--enforce-eager")
    return argv
